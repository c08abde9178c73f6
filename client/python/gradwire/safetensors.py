"""Minimal safetensors reading and writing for float tensors (F32/BF16/F16)."""

import json
import os
import struct

import torch

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_NAMES = {v: k for k, v in _DTYPES.items()}


def save(tensors: dict, path: str, metadata: dict = None) -> None:
    """Writes ``tensors`` (name -> tensor) to ``path`` atomically (temporary file + rename)."""
    header, chunks, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        c = t.detach().cpu().contiguous()
        if c.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {c.dtype} is not one of F32, BF16, F16")
        raw = (c.view(torch.int16) if c.element_size() == 2 else c).numpy().tobytes()
        header[name] = {"dtype": _NAMES[c.dtype], "shape": list(c.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # data section 8-byte aligned
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in chunks:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str):
    """Returns (tensors as name -> float tensor of the stored dtype, metadata dict)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > len(blob) - 8:
        raise ValueError(f"{path}: header length {n} beyond the file")
    header = json.loads(blob[8:8 + n])
    data = memoryview(blob)[8 + n:]
    metadata = header.pop("__metadata__", {})
    tensors = {}
    for name, entry in header.items():
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor {name}: dtype {entry.get('dtype')} not supported")
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= len(data):
            raise ValueError(f"{path}: tensor {name}: data_offsets out of range")
        raw = bytearray(data[begin:end])
        elem = 4 if dtype == torch.float32 else 2
        count = 1
        for d in entry["shape"]:
            count *= d
        if count * elem != end - begin:
            raise ValueError(f"{path}: tensor {name}: {end - begin} bytes for shape {entry['shape']}")
        if dtype == torch.float32:
            t = torch.frombuffer(raw, dtype=torch.float32) if raw else torch.empty(0)
        else:
            t = (torch.frombuffer(raw, dtype=torch.int16) if raw else torch.empty(0, dtype=torch.int16)).view(dtype)
        tensors[name] = t.reshape(entry["shape"]).clone()
    return tensors, metadata
