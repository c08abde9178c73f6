"""Tensors on the wire: raw row-major little-endian bytes with a dtype and a shape.

The encoders and decoders here round exactly as the server's wire codec does
(``gradwire/wire/codec.h``): 16-bit floats by round to nearest even, FP8 with a current-scaling
scale of the tensor's own (its amax maps to the format's largest value, margin 0) and the
reference rounding of ``kernels::EncodeFp8``. ``tests/test_fp8_wire.py`` checks that bit for bit
against a running server.
"""

from typing import Dict, Tuple

import torch

from gradwire.v1 import tensor_pb2

F32 = tensor_pb2.F32
BF16 = tensor_pb2.BF16
F16 = tensor_pb2.F16
FP8_E4M3 = tensor_pb2.FP8_E4M3
FP8_E5M2 = tensor_pb2.FP8_E5M2

# Wire dtype name -> (proto enum of activations, proto enum of gradients). "fp8" sends
# activations as E4M3 and gradients as E5M2, as the server's FP8 recipe casts them.
WIRE_DTYPES: Dict[str, Tuple[int, int]] = {
    "f32": (F32, F32),
    "bf16": (BF16, BF16),
    "f16": (F16, F16),
    "fp8": (FP8_E4M3, FP8_E5M2),
}

_ELEMENT_SIZE = {F32: 4, BF16: 2, F16: 2, FP8_E4M3: 1, FP8_E5M2: 1}

# Per FP8 format: mantissa bits, exponent bias, exponent of the smallest normal, code of the
# largest finite value, the largest finite value.
_FP8 = {
    FP8_E4M3: (3, 7, -6, 0x7E, 448.0),
    FP8_E5M2: (2, 15, -14, 0x7B, 57344.0),
}
_NAN_CODE = 0x7F
_FLT_MAX = 3.4028234663852886e38


def element_size(dtype: int) -> int:
    """Bytes of one element of a wire dtype (0 for an unknown one)."""
    return _ELEMENT_SIZE.get(dtype, 0)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, exactly, for integer k in the normal range (built from its bits)."""
    return ((k + 127).to(torch.int32) << 23).view(torch.float32)


def fp8_scale(amax: torch.Tensor, dtype: int) -> torch.Tensor:
    """The scale (float32, 0-dim) a tensor of this amax is encoded with: the format's largest
    value over amax; 1 for an amax that is 0 or not finite; FLT_MAX past float32's range."""
    fmax = torch.tensor(_FP8[dtype][4], dtype=torch.float32)
    amax = amax.to(torch.float32)
    if not bool(amax > 0) or not bool(torch.isfinite(amax)):
        return torch.tensor(1.0, dtype=torch.float32)
    scale = fmax / amax
    if not bool(torch.isfinite(scale)):
        return torch.tensor(_FLT_MAX, dtype=torch.float32)
    return scale


def fp8_encode(y: torch.Tensor, dtype: int) -> torch.Tensor:
    """FP8 codes (uint8) of already scaled float32 values: round half to even, finite overflow
    and infinities saturate to the largest finite code, NaN to the NaN code."""
    mbits, bias, min_exp, max_code, fmax = _FP8[dtype]
    y = y.to(torch.float32).contiguous()
    bits = y.view(torch.int32)
    sign = (bits >> 24) & 0x80
    a = y.abs()
    exp = ((bits >> 23) & 0xFF) - 127
    exp = torch.clamp(exp, min=min_exp)
    # a / quantum is exact (a power of two); torch.round rounds half to even.
    big = a >= fmax
    safe_exp = torch.where(big, torch.zeros_like(exp), exp)
    steps = torch.round(torch.where(big, torch.zeros_like(a), a) * _pow2(mbits - safe_exp))
    mant = steps.to(torch.int32)
    implicit = 1 << mbits
    up = mant >= 2 * implicit
    mant = torch.where(up, mant >> 1, mant)
    exp = exp + up.to(torch.int32)
    normal = mant >= implicit
    code = torch.where(normal, ((exp + bias) << mbits) | (mant - implicit), mant)
    code = torch.where(big, torch.full_like(code, max_code), code)
    code = torch.where(torch.isnan(y), torch.full_like(code, _NAN_CODE), code)
    return (code | sign).to(torch.uint8)


def fp8_decode(codes: torch.Tensor, dtype: int) -> torch.Tensor:
    """The float32 value of each FP8 code (unscaled): E4M3 has only S.1111.111 as NaN; E5M2 has
    IEEE-like infinities and NaNs."""
    mbits, bias, min_exp, _, _ = _FP8[dtype]
    ebits = 4 if dtype == FP8_E4M3 else 5
    codes = codes.to(torch.int64)
    sign = torch.where(codes & 0x80 != 0, -1.0, 1.0).double()
    exponent = (codes >> mbits) & ((1 << ebits) - 1)
    mantissa = (codes & ((1 << mbits) - 1)).double()
    normal = (1 + mantissa / (1 << mbits)) * torch.pow(2.0, (exponent - bias).double())
    subnormal = mantissa / (1 << mbits) * 2.0 ** min_exp
    value = torch.where(exponent == 0, subnormal, normal)
    top = exponent == (1 << ebits) - 1
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    if dtype == FP8_E5M2:
        value = torch.where(top & (mantissa == 0), inf, value)
        value = torch.where(top & (mantissa != 0), nan, value)
    else:
        value = torch.where(top & (mantissa == (1 << mbits) - 1), nan, value)
    return (sign * value).float()


def to_wire(t: torch.Tensor, dtype: int = F32) -> tensor_pb2.Tensor:
    """A CPU copy of ``t`` as a wire tensor of proto dtype ``dtype`` (F32, BF16, F16, FP8_E4M3 or
    FP8_E5M2; FP8 carries the scale_inv of its own current-scaling scale)."""
    if dtype not in _ELEMENT_SIZE:
        raise ValueError(f"unknown wire dtype {dtype}")
    x = t.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if dtype in _FP8:
        scale = fp8_scale(x.abs().max() if x.numel() else torch.tensor(0.0), dtype)
        codes = fp8_encode(x * scale, dtype)
        scale_inv = float(torch.tensor(1.0, dtype=torch.float32) / scale)
        return tensor_pb2.Tensor(dtype=dtype, shape=list(x.shape), data=codes.numpy().tobytes(),
                                 scale_inv=scale_inv)
    torch_dtype = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}[dtype]
    c = x.to(torch_dtype)
    # Reinterpret as bytes: 16-bit floats through int16 (numpy has no bfloat16).
    raw = c.view(torch.int16) if c.element_size() == 2 else c
    return tensor_pb2.Tensor(dtype=dtype, shape=list(c.shape), data=raw.numpy().tobytes())


def from_wire(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """A float32 CPU tensor from a wire tensor of any dtype."""
    shape = list(msg.shape)
    size = element_size(msg.dtype)
    if size == 0:
        raise ValueError(f"unknown wire dtype {msg.dtype}")
    n = 1
    for d in shape:
        n *= d
    if len(msg.data) != n * size:
        raise ValueError(f"wire tensor has {len(msg.data)} bytes; its shape {shape} needs "
                         f"{n * size}")
    buf = bytearray(msg.data)
    if n == 0:
        return torch.zeros(shape, dtype=torch.float32)
    if msg.dtype == F32:
        return torch.frombuffer(buf, dtype=torch.float32).reshape(shape).clone()
    if msg.dtype in (BF16, F16):
        bits = torch.frombuffer(buf, dtype=torch.int16)
        half = bits.view(torch.bfloat16 if msg.dtype == BF16 else torch.float16)
        return half.float().reshape(shape)
    codes = torch.frombuffer(buf, dtype=torch.uint8)
    # One float32 multiply, as the server decodes (the exact product rounded once).
    scale_inv = torch.tensor(msg.scale_inv, dtype=torch.float32)
    return (fp8_decode(codes, msg.dtype) * scale_inv).reshape(shape)
