"""Tensors on the wire: raw row-major little-endian bytes with a dtype and a shape."""

import torch

from gradwire.v1 import tensor_pb2

# Wire dtype name -> (proto enum, torch dtype of the bytes)
WIRE_DTYPES = {
    "f32": (tensor_pb2.F32, torch.float32),
    "bf16": (tensor_pb2.BF16, torch.bfloat16),
    "f16": (tensor_pb2.F16, torch.float16),
}

_E4M3 = tensor_pb2.FP8_E4M3
_E5M2 = tensor_pb2.FP8_E5M2


def to_wire(t: torch.Tensor, dtype: str = "f32") -> tensor_pb2.Tensor:
    """A CPU copy of ``t`` in the wire dtype ``dtype`` ("f32", "bf16" or "f16")."""
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {dtype!r}")
    enum, torch_dtype = WIRE_DTYPES[dtype]
    c = t.detach().to(device="cpu", dtype=torch_dtype).contiguous()
    # Reinterpret as bytes: 16-bit floats through int16 (numpy has no bfloat16).
    raw = c.view(torch.int16) if c.element_size() == 2 else c
    return tensor_pb2.Tensor(dtype=enum, shape=list(c.shape), data=raw.numpy().tobytes())


def _decode_fp8(codes: torch.Tensor, exponent_bits: int, mantissa_bits: int) -> torch.Tensor:
    bias = (1 << (exponent_bits - 1)) - 1
    sign = torch.where(codes & 0x80 != 0, -1.0, 1.0).double()
    exponent = ((codes >> mantissa_bits) & ((1 << exponent_bits) - 1)).long()
    mantissa = (codes & ((1 << mantissa_bits) - 1)).double()
    normal = (1 + mantissa / (1 << mantissa_bits)) * torch.pow(2.0, (exponent - bias).double())
    subnormal = mantissa / (1 << mantissa_bits) * 2.0 ** (1 - bias)
    value = torch.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << exponent_bits) - 1
    if exponent_bits == 5:  # E5M2: IEEE-like infinities and NaNs
        value = torch.where(top & (mantissa == 0), torch.tensor(float("inf"), dtype=torch.float64), value)
        value = torch.where(top & (mantissa != 0), torch.tensor(float("nan"), dtype=torch.float64), value)
    else:  # E4M3 "fn": only S.1111.111 is NaN
        value = torch.where(top & (mantissa == 7), torch.tensor(float("nan"), dtype=torch.float64), value)
    return sign * value


def from_wire(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """A float32 CPU tensor from a wire tensor of any dtype."""
    shape = list(msg.shape)
    buf = bytearray(msg.data)
    if msg.dtype == tensor_pb2.F32:
        return torch.frombuffer(buf, dtype=torch.float32).reshape(shape).clone()
    if msg.dtype in (tensor_pb2.BF16, tensor_pb2.F16):
        bits = torch.frombuffer(buf, dtype=torch.int16)
        half = bits.view(torch.bfloat16 if msg.dtype == tensor_pb2.BF16 else torch.float16)
        return half.float().reshape(shape)
    if msg.dtype in (_E4M3, _E5M2):
        codes = torch.frombuffer(buf, dtype=torch.uint8).long()
        e, m = (4, 3) if msg.dtype == _E4M3 else (5, 2)
        return (_decode_fp8(codes, e, m) * msg.scale_inv).float().reshape(shape)
    raise ValueError(f"unknown wire dtype {msg.dtype}")
