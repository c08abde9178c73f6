#!/usr/bin/env python3
"""How the Python client turns a tensor into the bytes it hands to gRPC, and a response's bytes
back into a tensor: the generic protobuf path (the tensor's bytes copied into the message, the
message serialized; the response parsed, its bytes read out of it) against the client's own
(gradwire.tensor_messages: the message encoded around the tensor's memory, the response's
tensor decoded where it lies in the received bytes), side by side in one run.

No server and no gRPC: only what the client does to the bytes before gRPC takes them and after
gRPC hands them over. gRPC's own copies (the message copied into a slice to send; the received
slices gathered into one bytes object) are the same for both and not counted.

  PYTHONPATH=client/python python3 tests/bench/python_serialize.py [--sizes 1,16,64]
      [--dtypes f32,bf16] [--repeat 5] [--json out.json]

Sizes are MiB of tensor data on the wire. For a dtype, the tensor is of that dtype and travels
as it (as the f32 client sends a bfloat16 tensor); "fp8" encodes a float32 tensor as E4M3, which
costs the same on both paths. Prints a table and writes JSON with the machine it ran on.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
from machine import describe  # noqa: E402

from gradwire import tensor_messages, wire  # noqa: E402
from gradwire.client import Client, _assemble, chunked_parts  # noqa: E402
from gradwire.train_stream import train_request, train_request_pieces  # noqa: E402
from gradwire.v1 import service_pb2, tensor_pb2  # noqa: E402

CHUNK = 4 << 20  # the server's default --chunk-kib
TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "fp8": torch.float32}
WIRE = {"f32": wire.F32, "bf16": wire.BF16, "fp8": wire.FP8_E4M3}

# Full copies of the tensor's bytes each path makes (conversions between dtypes not counted).
COPIES = {
    # before: tobytes(); into Tensor.data; Tensor into ForwardRequest.input; Client.forward
    # read len(req.input.data) twice (each read makes a new bytes); SerializeToString().
    # after: the one join of the encoding's pieces.
    "Forward request": (6, 1),
    # before: tobytes(); Tensor.data; ForwardRequest.input; CopyFrom into TrainRequest;
    # SerializeToString(). after: the join.
    "Train.Forward request": (5, 1),
    # before: as Forward up to the length reads (5); the header's data read out (1); each
    # chunk sliced into bytes (1), into TensorChunk.data (1), into the part (1), the part
    # serialized (1). after: each part's join.
    "ForwardChunked request": (10, 1),
    # before: FromString; reading output.data; bytearray(); clone() (F32 only: the others
    # are converted out of the bytearray). after: F32 copied once into a tensor of its own
    # (received bytes are immutable); 16-bit and FP8 converted straight from the received
    # bytes.
    "Forward response": {"f32": (4, 1), "other": (3, 0)},
    # before: each part parsed (1); chunk.data read (1); into the assembly buffer (1);
    # bytes(buffer) (1); into the header's Tensor.data (1); then from_wire: .data (1),
    # bytearray() (1), clone() (F32: 1). after: each chunk's bytes into the assembly buffer,
    # which the decoded tensor keeps (F32) or is converted from.
    "ForwardChunked response": {"f32": (8, 1), "other": (7, 1)},
}


def copies(path, name):
    c = COPIES[path]
    return c if isinstance(c, tuple) else c["f32" if name == "f32" else "other"]


# --- the generic protobuf path, as the client did it before


def old_to_wire(t, dtype):
    x = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if dtype == wire.FP8_E4M3:
        scale = wire.fp8_scale(x.abs().max(), dtype)
        codes = wire.fp8_encode(x * scale, dtype)
        scale_inv = float(torch.tensor(1.0, dtype=torch.float32) / scale)
        return tensor_pb2.Tensor(dtype=dtype, shape=list(x.shape), data=codes.numpy().tobytes(),
                                 scale_inv=scale_inv)
    c = x.to({wire.F32: torch.float32, wire.BF16: torch.bfloat16}[dtype])
    raw = c.view(torch.int16) if c.element_size() == 2 else c
    return tensor_pb2.Tensor(dtype=dtype, shape=list(c.shape), data=raw.numpy().tobytes())


def old_from_wire(msg):
    shape = list(msg.shape)
    buf = bytearray(msg.data)
    if msg.dtype == wire.F32:
        return torch.frombuffer(buf, dtype=torch.float32).reshape(shape).clone()
    if msg.dtype == wire.BF16:
        return torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16).float() \
            .reshape(shape)
    codes = torch.frombuffer(buf, dtype=torch.uint8)
    scale_inv = torch.tensor(msg.scale_inv, dtype=torch.float32)
    return (wire.fp8_decode(codes, msg.dtype) * scale_inv).reshape(shape)


def old_forward_request(x, dtype):
    req = service_pb2.ForwardRequest(module_id="m", input=old_to_wire(x, dtype), training=True,
                                     output_dtype=dtype)
    len(req.input.data)  # Client.forward's size checks
    len(req.input.data)
    return req


def old_chunked_parts(x, dtype):
    header = old_forward_request(x, dtype)
    datas = [t.data for t in [header.input]]
    for t in [header.input]:
        t.data = b""
    out = [service_pb2.ForwardRequestPart(header=header).SerializeToString()]
    for i, data in enumerate(datas):
        view = memoryview(data)
        for off in range(0, len(data), CHUNK):
            out.append(service_pb2.ForwardRequestPart(chunk=service_pb2.TensorChunk(
                tensor=i, offset=off, data=bytes(view[off:off + CHUNK]))).SerializeToString())
    return out


def old_assemble(parts):
    header, buffers, sizes, index, offset = None, [], [], 0, 0
    for raw in parts:
        part = service_pb2.ForwardResponsePart.FromString(raw)
        if part.HasField("header"):
            header = service_pb2.ForwardResponse()
            header.CopyFrom(part.header)
            t = header.output
            n = 1
            for d in t.shape:
                n *= d
            sizes.append(n * wire.element_size(t.dtype))
            buffers.append(bytearray(sizes[-1]))
            continue
        c = part.chunk
        while index < len(sizes) and offset >= sizes[index]:
            index, offset = index + 1, 0
        buffers[index][offset:offset + len(c.data)] = c.data
        offset += len(c.data)
    header.output.data = bytes(buffers[0])
    return header


# --- the cases


def response_bytes(y, dtype):
    """A ForwardResponse carrying ``y`` as the server would send it: unary, and chunked."""
    out = old_to_wire(y, dtype)
    unary = service_pb2.ForwardResponse(output=out, context_id="c", weight_version=3,
                                        server_seconds=0.001).SerializeToString()
    data = out.data
    out.data = b""
    parts = [service_pb2.ForwardResponsePart(header=service_pb2.ForwardResponse(
        output=out, context_id="c", weight_version=3)).SerializeToString()]
    for off in range(0, len(data), CHUNK):
        parts.append(service_pb2.ForwardResponsePart(chunk=service_pb2.TensorChunk(
            tensor=0, offset=off, data=data[off:off + CHUNK])).SerializeToString())
    return unary, parts


def cases(client, name, mib):
    dtype = WIRE[name]
    n = (mib << 20) // wire.element_size(dtype)
    x = torch.randn(n // 1024, 1024).to(TORCH[name])
    y = torch.randn(n // 1024, 1024)
    unary, parts = response_bytes(y, dtype)
    reader = tensor_messages.reader(service_pb2.ForwardResponsePart)

    def new_forward():
        req = client.forward_request("m", x, True, dtype)
        req.nbytes
        return req.SerializeToString()

    def new_train():
        return train_request(1, train_request_pieces(
            "forward", client.forward_request("m", x, True, dtype)))

    def old_train():
        req = service_pb2.TrainRequest(request_id=1)
        req.forward.CopyFrom(service_pb2.ForwardRequest(
            module_id="m", input=old_to_wire(x, dtype), training=True, output_dtype=dtype))
        return req.SerializeToString()

    def new_chunked():
        return list(chunked_parts(client.forward_request("m", x, True, dtype),
                                  service_pb2.ForwardRequestPart, CHUNK))

    return {
        "Forward request": (lambda: old_forward_request(x, dtype).SerializeToString(),
                            new_forward),
        "Train.Forward request": (old_train, new_train),
        "ForwardChunked request": (lambda: old_chunked_parts(x, dtype), new_chunked),
        "Forward response": (
            lambda: old_from_wire(service_pb2.ForwardResponse.FromString(unary).output),
            lambda: Client.forward_result(tensor_messages.parse(service_pb2.ForwardResponse,
                                                                unary))[0]),
        "ForwardChunked response": (
            lambda: old_from_wire(old_assemble(parts).output),
            lambda: Client.forward_result(_assemble(
                "ForwardChunked", (reader(p) for p in parts), service_pb2.ForwardResponse))[0]),
    }


def timed(fn, repeat):
    fn()  # warm: tables, first-touch of the allocator's pages
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1,16,64", help="comma-separated MiB on the wire")
    p.add_argument("--dtypes", default="f32,bf16", help="comma-separated: f32, bf16, fp8")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    client = Client("127.0.0.1:1")  # builds requests only; never connects
    rows = []
    print(f"{'path':<24} {'dtype':<5} {'MiB':>4} | {'before ms':>10} {'after ms':>9} "
          f"{'speedup':>8} | copies before -> after", flush=True)
    for name in args.dtypes.split(","):
        for mib in (int(s) for s in args.sizes.split(",")):
            for path, (before, after) in cases(client, name, mib).items():
                # Both paths must give the same result before either is timed.
                a, b = before(), after()
                if isinstance(a, torch.Tensor):
                    assert torch.equal(a.view(torch.int32), b.view(torch.int32)), path
                else:
                    assert a == b, path
                del a, b
                t_before, t_after = timed(before, args.repeat), timed(after, args.repeat)
                made = copies(path, name)
                rows.append({"path": path, "dtype": name, "mib": mib, "before_ms": t_before,
                             "after_ms": t_after, "copies_before": made[0],
                             "copies_after": made[1]})
                print(f"{path:<24} {name:<5} {mib:>4} | {t_before:>10.2f} {t_after:>9.2f} "
                      f"{t_before / t_after:>7.1f}x | {made[0]} -> {made[1]}", flush=True)
    client.close()
    print("copies: full copies of the tensor's bytes in the client (gRPC's own not counted). "
          "Before, a bf16 tensor was also converted to float32 and back before its bytes were "
          "taken (two passes); now it is sent as it is.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": describe(), "threads": torch.get_num_threads(),
                       "chunk_bytes": CHUNK, "repeat": args.repeat,
                       "statistic": "median ms", "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
