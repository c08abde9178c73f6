"""Tensors on the wire: raw row-major little-endian bytes with a dtype and a shape.

The encoders and decoders here round exactly as the server's wire codec does
(``gradwire/wire/codec.h``): 16-bit floats by round to nearest even, FP8 with a current-scaling
scale of the tensor's own (its amax maps to the format's largest value, margin 0) or with block
scales (a power-of-two scale for each run of ``block`` elements of a row, as the BLOCK and MXFP8
recipes cast: docs/block-scaling.md, "Exact definitions"), and the reference rounding of
``kernels::EncodeFp8``. ``tests/test_fp8_wire.py`` checks that bit for bit against a running
server, ``tests/test_block_wire.py`` against a float64 model of the block definition.
"""

import math
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch

from gradwire.v1 import tensor_pb2

F32 = tensor_pb2.F32
BF16 = tensor_pb2.BF16
F16 = tensor_pb2.F16
FP8_E4M3 = tensor_pb2.FP8_E4M3
FP8_E5M2 = tensor_pb2.FP8_E5M2

# Wire dtype name -> (proto enum of activations, proto enum of gradients). "fp8" sends
# activations as E4M3 and gradients as E5M2, as the server's FP8 recipe casts them (with block
# scales of the recipe's block length for a module under BLOCK or MXFP8). "exact" (the clients'
# default) is F32, except that a forward's input to a module that casts it to E4M3 first in a way
# the client can repeat (``gradwire.kinds.exact_fp8_input``) crosses as that cast, codes and
# scales bit for bit (``encode_exact_input``, ``encode_exact_block_input``), and so does a
# backward's grad_output to a module that casts it to FP8 first (``gradwire.kinds.
# exact_grad_output``), with its column sums for a module with a bias
# (``encode_exact_gradient``): the F32 wire's results, bit for bit.
WIRE_DTYPES: Dict[str, Tuple[int, int]] = {
    "exact": (F32, F32),
    "f32": (F32, F32),
    "bf16": (BF16, BF16),
    "f16": (F16, F16),
    "fp8": (FP8_E4M3, FP8_E5M2),
}

_ELEMENT_SIZE = {F32: 4, BF16: 2, F16: 2, FP8_E4M3: 1, FP8_E5M2: 1}
_TORCH_DTYPES = {F32: torch.float32, BF16: torch.bfloat16, F16: torch.float16}

# Per FP8 format: mantissa bits, exponent bias, exponent of the smallest normal, code of the
# largest finite value, the largest finite value.
_FP8 = {
    FP8_E4M3: (3, 7, -6, 0x7E, 448.0),
    FP8_E5M2: (2, 15, -14, 0x7B, 57344.0),
}
_NAN_CODE = 0x7F
_FLT_MAX = 3.4028234663852886e38
# The block recipes' scale exponents: 2^e with e in [-50, 50] (docs/block-scaling.md).
BLOCK_EXPONENT_MIN = -50
BLOCK_EXPONENT_MAX = 50


def element_size(dtype: int) -> int:
    """Bytes of one element of a wire dtype (0 for an unknown one)."""
    return _ELEMENT_SIZE.get(dtype, 0)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as float32, exactly, for integer k in the normal range (built from its bits)."""
    return ((k + 127).to(torch.int32) << 23).view(torch.float32)


def _pow2_double(k: torch.Tensor) -> torch.Tensor:
    """2**k as float64, exactly, for integer k in [-1022, 1023] (built from its bits)."""
    return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)


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


def _fp8_encode_reference(y: torch.Tensor, dtype: int) -> torch.Tensor:
    """``fp8_encode`` computed step by step in torch (any device): the definition the code tables
    of the CPU encoders are made from."""
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


# The CPU encoders look each code up in a table of 2^17 codes per format, indexed by a float32's
# high 16 bits and one bit more: whether its low 16 bits are not all zero. That pair settles the
# code: the bit of half a quantum lies at bit 16 of the float32 or above (bit 19 for an E4M3
# normal, 20 for E5M2, higher for their subnormals), so the low 16 bits only tell an exact tie
# from a value past it (and a NaN from an infinity). Each table holds the reference's code of
# one float32 of each index, the low 16 bits 0 or 1.
_CODE_TABLES: Dict[int, np.ndarray] = {}
# Elements per tile of the CPU encoders: few enough that their temporaries stay small (in the
# CPU's caches), enough that the per-tile Python overhead stays small too.
_TILE = 1 << 18
_INF_BITS = 0x7F800000


def _code_table(dtype: int) -> np.ndarray:
    table = _CODE_TABLES.get(dtype)
    if table is None:
        index = np.arange(1 << 17, dtype=np.uint32)
        bits = ((index >> 1) << 16) | (index & 1)
        table = _fp8_encode_reference(torch.from_numpy(bits.view(np.float32)), dtype).numpy()
        _CODE_TABLES[dtype] = table
    return table


def _codes_into(y: np.ndarray, out: np.ndarray, table: np.ndarray, scratch: np.ndarray) -> None:
    """``out`` (uint8, ``y``'s shape) = the codes of the float32 array ``y`` (C-contiguous) from
    ``table``; ``scratch`` holds at least ``y.size`` uint32."""
    b = y.view(np.uint32)
    v = scratch[:b.size].reshape(b.shape)
    np.bitwise_and(b, 0x7FFF, out=v)
    np.add(v, 0x7FFF, out=v)  # bit 15 set: the low 15 bits are not all zero
    np.bitwise_or(v, b, out=v)  # bit 15 set: the low 16 bits are not all zero
    np.right_shift(v, 15, out=v)
    if out.flags.c_contiguous:
        np.take(table, v, out=out, mode="clip")
    else:
        out[...] = np.take(table, v, mode="clip")


def _encode_flat(x: np.ndarray, dtype: int, scale=None) -> np.ndarray:
    """The codes (uint8) of the flat float32 array ``x``, each first multiplied in float32 by
    ``scale`` (a float32) when one is given, tile by tile."""
    table = _code_table(dtype)
    n = x.shape[0]
    out = np.empty(n, dtype=np.uint8)
    size = min(n, _TILE)
    scratch = np.empty(size, dtype=np.uint32)
    y = np.empty(size, dtype=np.float32) if scale is not None else None
    for start in range(0, n, _TILE):
        stop = min(n, start + _TILE)
        part = x[start:stop]
        if scale is not None:
            part = np.multiply(part, scale, out=y[:stop - start])
        _codes_into(part, out[start:stop], table, scratch)
    return out


def _amax_bits(x: np.ndarray) -> int:
    """The float32 bits of max |value| over the flat float32 array ``x`` (not empty): above those
    of infinity where a value is NaN, infinity's where one is infinite and none is NaN (the
    bits of non-negative floats order as their values, NaNs above infinity)."""
    bits = x.view(np.uint32)
    n = bits.shape[0]
    buf = np.empty(min(n, _TILE), dtype=np.uint32)
    best = 0
    for start in range(0, n, _TILE):
        stop = min(n, start + _TILE)
        part = np.bitwise_and(bits[start:stop], 0x7FFFFFFF, out=buf[:stop - start])
        best = max(best, int(part.max()))
    return best


def _amax_tensor(x: np.ndarray) -> torch.Tensor:
    """max |value| of the flat float32 array ``x`` as a 0-dim float32 tensor, as
    ``x.abs().max()`` gives it (NaN where a value is NaN; 0 for an empty ``x``)."""
    bits = _amax_bits(x) if x.shape[0] else 0
    return torch.from_numpy(np.array([bits], dtype=np.uint32).view(np.float32)).reshape(())


def fp8_encode(y: torch.Tensor, dtype: int) -> torch.Tensor:
    """FP8 codes (uint8) of already scaled float32 values: round half to even, finite overflow
    and infinities saturate to the largest finite code, NaN to the NaN code."""
    y = y.detach().to(torch.float32)
    if y.device.type != "cpu":
        return _fp8_encode_reference(y, dtype)
    y = y.contiguous()
    codes = _encode_flat(y.numpy().reshape(-1), dtype)
    return torch.from_numpy(codes).reshape(y.shape)


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


def block_scale_exponents(amax: torch.Tensor, dtype: int) -> torch.Tensor:
    """The scale exponent e (int64) of each block of this amax (the largest |value| of the
    block's finite elements): the smallest integer with amax <= fp8_max * 2^e, clamped to
    [-50, 50]; 0 for an amax of 0 (and NaN), 50 for an infinite one. Exact: amax and
    fp8_max * 2^e compare in float64, where both are exact."""
    a = amax.to(torch.float64)
    fmax = _FP8[dtype][4]
    positive = a > 0
    finite = torch.isfinite(a)
    ordinary = positive & finite
    # a = m 2^k with m in [0.5, 1): k less fp8_max's own k is e or e - 1; the comparisons settle
    # it (each fp8_max * 2^e is exact in float64).
    safe = torch.where(ordinary, a, torch.ones_like(a))
    e = torch.frexp(safe)[1].to(torch.int64) - math.frexp(fmax)[1]
    e = e + (safe > _pow2_double(e) * fmax).to(torch.int64)
    e = e - (safe <= _pow2_double(e - 1) * fmax).to(torch.int64)
    e = torch.clamp(e, BLOCK_EXPONENT_MIN, BLOCK_EXPONENT_MAX)
    e = torch.where(ordinary, e, torch.zeros_like(e))
    return torch.where(positive & ~finite, torch.full_like(e, BLOCK_EXPONENT_MAX), e)


def _block_exponents(amax_bits: np.ndarray, dtype: int) -> np.ndarray:
    """``block_scale_exponents`` (int32) of finite amaxes given by their float32 bits. With
    fp8_max = 1.m_f 2^k_f and amax = 1.m 2^k (normal), e is k - k_f, plus 1 where m > m_f: the
    exponent field of amax's bits plus (2^23 - 1 - m_f's field) less that of fp8_max's. A
    subnormal amax gives far below -50, as its exponent is."""
    fbits = int(np.float32(_FP8[dtype][4]).view(np.uint32))
    a = amax_bits.astype(np.int64)
    e = ((a + (0x7FFFFF - (fbits & 0x7FFFFF))) >> 23) - (fbits >> 23)
    np.clip(e, BLOCK_EXPONENT_MIN, BLOCK_EXPONENT_MAX, out=e)
    e[a == 0] = 0
    return e.astype(np.int32)


def _pow2_np(e: np.ndarray) -> np.ndarray:
    """2**e as float32, exactly, for an int array e in the normal range."""
    return ((e.astype(np.int32) + 127) << 23).astype(np.uint32).view(np.float32)


def _whole_blocks_of_rows(a: np.ndarray, block: int) -> np.ndarray:
    """The whole runs of ``block`` elements of each row of the 2-D ``a``: a view [rows, n,
    block]."""
    rows, cols = a.shape
    return np.lib.stride_tricks.as_strided(
        a, shape=(rows, cols // block, block),
        strides=(a.strides[0], block * a.strides[1], a.strides[1]))


def _whole_blocks_of_cols(a: np.ndarray, block: int) -> np.ndarray:
    """The whole runs of ``block`` rows of the 2-D ``a``: a view [n, block, cols]."""
    rows, cols = a.shape
    return np.lib.stride_tricks.as_strided(
        a, shape=(rows // block, block, cols),
        strides=(block * a.strides[0], a.strides[0], a.strides[1]))


def _row_amax(u: np.ndarray, block: int) -> np.ndarray:
    """The largest of each 1 x ``block`` run of each row of ``u`` (uint32 below 2^31, 2-D), the
    last run of a row what is left of it: int64 [rows, ceil(cols / block)]."""
    rows, cols = u.shape
    full = cols // block
    out = np.empty((rows, -(-cols // block)), dtype=np.int64)
    if full:
        whole = torch.from_numpy(_whole_blocks_of_rows(u, block).view(np.int32))
        out[:, :full] = whole.amax(dim=2).numpy()
    if full * block < cols:
        out[:, full] = u[:, full * block:].max(axis=1)
    return out


def _col_amax(u: np.ndarray, block: int) -> np.ndarray:
    """The largest of each ``block`` x 1 run of each column of ``u`` (2-D), the last run what is
    left of the column: int64 [ceil(rows / block), cols]."""
    rows, cols = u.shape
    full = rows // block
    out = np.empty((-(-rows // block), cols), dtype=np.int64)
    if full:
        out[:full] = _whole_blocks_of_cols(u, block).max(axis=1)
    if full * block < rows:
        out[full] = u[full * block:].max(axis=0)
    return out


def _block_cast(x: np.ndarray, dtype: int, block: int, columnwise: bool,
                exact: bool) -> Optional[Tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]]:
    """The block cast of the C-contiguous float32 matrix ``x`` [rows, cols] (``encode_row_blocks``)
    and with ``columnwise`` that of its transpose, tile by tile: (data, uint8: the codes [rows,
    cols], then with ``columnwise`` those of the transpose [cols, rows]; the scale exponents
    [rows, ceil(cols / block)], int32; with ``columnwise`` the transpose's [ceil(rows / block),
    cols], transposed, else None). With ``exact``, None as soon as a value is not finite."""
    rows, cols = x.shape
    n = rows * cols
    data = np.empty(2 * n if columnwise else n, dtype=np.uint8)
    codes = data[:n].reshape(rows, cols)
    codes_t = data[n:].reshape(cols, rows) if columnwise else None
    e_rows = np.zeros((rows, -(-cols // block)), dtype=np.int32)
    e_cols = np.zeros((-(-rows // block), cols), dtype=np.int32) if columnwise else None
    if n == 0:
        return data, e_rows, e_cols
    table = _code_table(dtype)
    # Tiles of whole blocks: a width of whole rows' blocks (or the rows themselves), and with
    # the columnwise copy a height of whole blocks of rows.
    unit = block if columnwise else 1
    width = min(cols, max(block, _TILE // unit // block * block))
    height = min(rows, max(unit, _TILE // width // unit * unit))
    size = width * height
    u_buf = np.empty(size, dtype=np.uint32)
    y_buf = np.empty(size, dtype=np.float32)
    c_buf = np.empty(size, dtype=np.uint8)
    scratch = np.empty(size, dtype=np.uint32)
    bits = x.view(np.uint32)
    for r0 in range(0, rows, height):
        r1 = min(rows, r0 + height)
        for c0 in range(0, cols, width):
            c1 = min(cols, c0 + width)
            shape = (r1 - r0, c1 - c0)
            count = shape[0] * shape[1]
            xt = x[r0:r1, c0:c1]
            u = np.bitwise_and(bits[r0:r1, c0:c1], 0x7FFFFFFF, out=u_buf[:count].reshape(shape))
            y = y_buf[:count].reshape(shape)
            c = c_buf[:count].reshape(shape)
            amax = _row_amax(u, block)
            if int(amax.max()) >= _INF_BITS:
                if exact:
                    return None
                # The amax of a block is over its finite values only.
                u = np.where(u >= _INF_BITS, np.uint32(0), u)
                amax = _row_amax(u, block)
            e = _block_exponents(amax, dtype)
            g0 = c0 // block
            e_rows[r0:r1, g0:g0 + e.shape[1]] = e
            scale = _pow2_np(-e)
            full = shape[1] // block
            if full:
                np.multiply(_whole_blocks_of_rows(xt, block), scale[:, :full, None],
                            out=_whole_blocks_of_rows(y, block))
            if full * block < shape[1]:
                np.multiply(xt[:, full * block:], scale[:, full:], out=y[:, full * block:])
            _codes_into(y, codes[r0:r1, c0:c1], table, scratch)
            if not columnwise:
                continue
            e = _block_exponents(_col_amax(u, block), dtype)
            g0 = r0 // block
            e_cols[g0:g0 + e.shape[0], c0:c1] = e
            scale = _pow2_np(-e)
            full = shape[0] // block
            if full:
                np.multiply(_whole_blocks_of_cols(xt, block), scale[:full, None, :],
                            out=_whole_blocks_of_cols(y, block))
            if full * block < shape[0]:
                np.multiply(xt[full * block:], scale[full:], out=y[full * block:])
            _codes_into(y, c, table, scratch)
            codes_t[c0:c1, r0:r1] = c.T
    return data, e_rows, e_cols


def encode_row_blocks(x: torch.Tensor, dtype: int, block: int) -> Tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """The block cast of the matrix ``x`` [rows, cols] (float32) with blocks of 1 x ``block``
    along each row: (codes, uint8 [rows, cols]; scale_inv, float32 [rows, ceil(cols / block)]).
    Per block: amax of its finite elements, e from ``block_scale_exponents``, scale_inv = 2^e,
    codes = ``fp8_encode(x * 2^-e)`` (the product in float32); the last block of a row holds what
    is left of it, scaled from its own elements."""
    if block < 1:
        raise ValueError(f"block length must be >= 1, got {block}")
    x = x.detach().to(device="cpu", dtype=torch.float32).contiguous()
    rows, cols = x.shape
    data, e_rows, _ = _block_cast(x.numpy(), dtype, block, False, False)
    return torch.from_numpy(data.reshape(rows, cols)), torch.from_numpy(_pow2_np(e_rows))


def _scales_bytes(scale_inv: np.ndarray) -> bytes:
    return np.ascontiguousarray(scale_inv).astype("<f4", copy=False).tobytes()


def encode_blocks(t: torch.Tensor, dtype: int, block: int,
                  columnwise: bool = False) -> "Encoded":
    """``t`` (at least one dimension) as FP8 ``dtype`` with block scales of 1 x ``block`` over
    the matrix [rows, cols] it reads as (cols its last dimension): ``encode_row_blocks``. With
    ``columnwise``, the data also holds the codes of the transpose [cols, rows] cast the same way
    (the columnwise copy: ``block`` x 1 blocks of ``t``), and the header its scales."""
    return _encode_blocks(t, dtype, block, columnwise, False)


def _encode_blocks(t: torch.Tensor, dtype: int, block: int, columnwise: bool,
                   exact: bool) -> Optional["Encoded"]:
    """``encode_blocks``; with ``exact``, None where a value is not finite."""
    if dtype not in _FP8:
        raise ValueError(f"block scales are for FP8 dtypes only, not {dtype}")
    x = t.detach().to(device="cpu", dtype=torch.float32)
    if x.dim() == 0:
        raise ValueError("a block-scaled tensor needs at least one dimension")
    if block < 1:
        if exact and not bool(torch.isfinite(x).all()):
            return None
        raise ValueError(f"block length must be >= 1, got {block}")
    shape = list(x.shape)
    cols = shape[-1]
    rows = x.numel() // cols if cols else math.prod(shape[:-1])
    m = x.reshape(rows, cols).contiguous().numpy()
    cast = _block_cast(m, dtype, block, columnwise, exact)
    if cast is None:
        return None
    data, e_rows, e_cols = cast
    header = tensor_pb2.Tensor(dtype=dtype, shape=shape)
    header.block_scales.CopyFrom(tensor_pb2.BlockScales(
        block_rows=1, block_cols=block, scale_inv=_scales_bytes(_pow2_np(e_rows))))
    if columnwise:
        header.columnwise_scales.CopyFrom(tensor_pb2.BlockScales(
            block_rows=1, block_cols=block, scale_inv=_scales_bytes(_pow2_np(e_cols.T))))
    return Encoded(header, memoryview(data).cast("B"))


class Encoded(NamedTuple):
    """A tensor ready for the wire: ``header`` (a Tensor message with dtype, shape and scales:
    scale_inv or block scales, its ``data`` left empty) and ``data``, its bytes (for a
    block-scaled FP8 tensor with a columnwise copy, both copies' codes): a memoryview of the
    encoded tensor's own memory, which the view keeps alive. For an F32 tensor that is already
    contiguous float32 on the CPU, or a BF16/F16 one already in that dtype, that memory is the
    caller's tensor itself: nothing is copied, so the tensor must not change until the request
    is serialized."""

    header: tensor_pb2.Tensor
    data: memoryview


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (16-bit floats through int16: numpy
    has no bfloat16)."""
    if t.element_size() == 2:
        t = t.view(torch.int16)
    return memoryview(t.reshape(-1).numpy()).cast("B")


def encode(t: torch.Tensor, dtype: int = F32, block: int = 0) -> Encoded:
    """``t`` as a wire tensor of proto dtype ``dtype`` (F32, BF16, F16, FP8_E4M3 or FP8_E5M2;
    FP8 carries the scale_inv of its own current-scaling scale, or with ``block`` > 0 block
    scales of 1 x ``block`` along each row, ``encode_blocks``, where ``t`` has a dimension and an
    element), its bytes apart from the message (see ``Encoded``)."""
    if dtype not in _ELEMENT_SIZE:
        raise ValueError(f"unknown wire dtype {dtype}")
    t = t.detach()
    if dtype in _FP8 and block > 0 and t.dim() > 0 and t.numel() > 0:
        return encode_blocks(t, dtype, block)
    if dtype in _FP8:
        x = t.to(device="cpu", dtype=torch.float32).contiguous()
        flat = x.numpy().reshape(-1)
        scale = fp8_scale(_amax_tensor(flat), dtype)
        codes = _encode_flat(flat, dtype, scale.numpy())
        scale_inv = float(torch.tensor(1.0, dtype=torch.float32) / scale)
        return Encoded(tensor_pb2.Tensor(dtype=dtype, shape=list(x.shape), scale_inv=scale_inv),
                       memoryview(codes).cast("B"))
    torch_dtype = _TORCH_DTYPES[dtype]
    if t.dtype != torch_dtype:
        # Through float32, as the server rounds: a float64 tensor is rounded once to float32
        # and then to the 16-bit format.
        t = t.to(device="cpu", dtype=torch.float32).to(torch_dtype)
    c = t.to("cpu").contiguous()
    return Encoded(tensor_pb2.Tensor(dtype=dtype, shape=list(c.shape)), _bytes_of(c))


def encode_exact_input(t: torch.Tensor) -> Optional[Encoded]:
    """``t`` as the E4M3 codes and scale_inv the server's current-scaling cast (margin 0) makes of
    it, bit for bit: what the exact wire sends a Linear under CURRENT scaling in place of its
    input. None when a value is not finite (NaN, an infinity) or ``t`` is empty: the input then
    crosses as itself, and the server answers as it does to it on the F32 wire."""
    return _encode_exact_per_tensor(t, FP8_E4M3)


def _encode_exact_per_tensor(t: torch.Tensor, dtype: int) -> Optional[Encoded]:
    """``t`` as FP8 ``dtype`` codes with one current-scaling scale (margin 0), or None where a
    value is not finite or ``t`` is empty."""
    t = t.detach()
    if t.numel() == 0:
        return None
    x = t.to(device="cpu", dtype=torch.float32).contiguous()
    flat = x.numpy().reshape(-1)
    amax = _amax_tensor(flat)
    if not bool(torch.isfinite(amax)):
        return None
    scale = fp8_scale(amax, dtype)
    codes = _encode_flat(flat, dtype, scale.numpy())
    scale_inv = float(torch.tensor(1.0, dtype=torch.float32) / scale)
    return Encoded(tensor_pb2.Tensor(dtype=dtype, shape=list(x.shape), scale_inv=scale_inv),
                   memoryview(codes).cast("B"))


def encode_exact_block_input(t: torch.Tensor, block: int,
                             columnwise: bool) -> Optional[Encoded]:
    """``t`` as the E4M3 codes and block scales the server's BLOCK (``block`` 128) or MXFP8
    (32) cast makes of a Linear's input, bit for bit: 1 x ``block`` blocks along each row, and
    with ``columnwise`` (a training forward) the columnwise copy its weight gradient takes. What
    the exact wire sends such a Linear in place of its input. None when a value is not finite
    (NaN, an infinity), ``t`` is empty or has no dimension: the input then crosses as itself."""
    t = t.detach()
    if t.numel() == 0 or t.dim() == 0:
        return None
    return _encode_blocks(t, FP8_E4M3, block, columnwise, True)


# Columns at and above which ``column_sums`` adds whole rows (one numpy add per row); below it,
# a running sum down each column (``np.add.accumulate``), which is faster for narrow matrices.
_ROW_ADD_MIN_COLS = 128


def column_sums(t: torch.Tensor) -> np.ndarray:
    """Each column's sum of ``t`` (the columns its last dimension, the rows every other one),
    as float32 [cols]: summed in float32 in row order starting from 0.0, bit for bit
    ``s = 0; for row in rows: s += row`` (each step one IEEE float32 addition). The bias gradient
    as a server with ``ModuleInfo.row_order_bias_sums`` sums it; what the exact wire sends
    beside an FP8 grad_output (``BackwardRequest.grad_output_column_sums``). A 16-bit ``t``
    is summed as its float32 values (exact widenings). Not numpy's ``sum``/``add.reduce``,
    whose order is not row order (pairwise along a contiguous axis)."""
    x = t.detach().to(device="cpu", dtype=torch.float32)
    if x.dim() == 0:
        raise ValueError("column sums need a tensor with at least one dimension")
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    sums = np.zeros(cols, dtype=np.float32)
    if rows == 0 or cols == 0:
        return sums
    m = x.contiguous().numpy().reshape(rows, cols)
    # An overflow (or inf - inf) is the caller's to see in the sums, not a warning.
    with np.errstate(over="ignore", invalid="ignore"):
        _column_sums_into(m, sums)
    return sums


def _column_sums_into(m: np.ndarray, sums: np.ndarray) -> None:
    """``column_sums`` of the C-contiguous float32 matrix ``m`` [rows, cols], added to ``sums``
    (zeros, float32 [cols])."""
    rows, cols = m.shape
    if cols >= _ROW_ADD_MIN_COLS:
        for r in range(rows):
            np.add(sums, m[r], out=sums)
        return
    # Tiles of rows: the running sums of a tile whose first row has the sums so far added to it
    # (0.0 + row 0 for the first: one float32 addition, as the loop's first step); the tile's
    # last running sum carries on. add.accumulate along axis 0 is sequential by definition
    # (out[i] = out[i - 1] + in[i]).
    height = max(1, _TILE // cols)
    buf = np.empty((min(height, rows), cols), dtype=np.float32)
    for r0 in range(0, rows, height):
        r1 = min(rows, r0 + height)
        b = buf[:r1 - r0]
        np.add(m[r0], sums, out=b[0])
        b[1:] = m[r0 + 1:r1]
        np.add.accumulate(b, axis=0, out=b)
        sums[:] = b[-1]


class ExactGradient(NamedTuple):
    """A backward's grad_output as the exact wire sends it: ``encoded``, the FP8 cast the
    module's backward would make of it, and ``column_sums`` (float32 [out_features], or None
    for a module without bias), the bias gradient the server takes beside it."""

    encoded: Encoded
    column_sums: Optional[np.ndarray]


def encode_exact_gradient(t: torch.Tensor, dtype: int, block: int,
                          sums: bool) -> Optional[ExactGradient]:
    """``t``, a backward's grad_output, as the FP8 ``dtype`` (``gradwire.kinds.
    exact_grad_output``) codes and scales the module's own grad_output cast makes of it, bit for
    bit: with ``block`` 0 one current-scaling scale (margin 0: CURRENT), else 1 x ``block``
    blocks along each row with the columnwise copy (BLOCK 128, MXFP8 32); with ``sums`` (the
    module has a bias) its ``column_sums`` too. None where a value is not finite (NaN, an
    infinity), a column sum overflows, or ``t`` is empty or has no dimension: grad_output then
    crosses as itself (F32), and the server answers as on the F32 wire."""
    if dtype not in _FP8:
        raise ValueError(f"an FP8 gradient is E4M3 or E5M2, not {dtype}")
    t = t.detach()
    if t.numel() == 0 or t.dim() == 0:
        return None
    x = t.to(device="cpu", dtype=torch.float32).contiguous()
    column = None
    if sums:
        # Before the cast: a NaN or an infinity makes its column's sum NaN or infinite too.
        column = column_sums(x)
        if not bool(np.isfinite(column).all()):
            return None
    encoded = (_encode_blocks(x, dtype, block, True, True) if block > 0
               else _encode_exact_per_tensor(x, dtype))
    if encoded is None:
        return None
    return ExactGradient(encoded, column)


def to_wire(t: torch.Tensor, dtype: int = F32, block: int = 0) -> tensor_pb2.Tensor:
    """A CPU copy of ``t`` as a whole wire tensor message of proto dtype ``dtype`` (the bytes
    copied into it; ``encode`` keeps them apart)."""
    header, data = encode(t, dtype, block)
    header.data = data.tobytes()
    return header


# Decoding tables, built on first use by torch's own conversions so that a table lookup gives
# exactly what converting with torch gives: float16 -> float32 for every 16-bit pattern, and
# each FP8 code's value.
_TABLES: Dict[int, torch.Tensor] = {}
_BLOCK = 1 << 20  # elements per lookup: numpy indexes through an int64 copy of the codes


def _table(dtype: int) -> torch.Tensor:
    table = _TABLES.get(dtype)
    if table is None:
        if dtype == F16:
            bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
            table = bits.view(torch.float16).float()
        else:
            table = fp8_decode(torch.arange(256, dtype=torch.int32).to(torch.uint8), dtype)
        _TABLES[dtype] = table
    return table


def _lookup(table: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``table[codes]`` in blocks, so that the index copy numpy makes stays small. Every code
    indexes the table (it has an entry per code), so "clip" clips nothing; it only spares the
    bounds check and the buffering that mode="raise" adds."""
    out = np.empty(codes.shape[0], dtype=np.float32)
    for s in range(0, codes.shape[0], _BLOCK):
        np.take(table, codes[s:s + _BLOCK], out=out[s:s + _BLOCK], mode="clip")
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _matrix(shape) -> Tuple[int, int]:
    """(rows, cols) of the matrix a tensor of ``shape`` reads as for its block scales: cols its
    last dimension, rows the product of the others."""
    if not shape:
        raise ValueError("a block-scaled tensor needs at least one dimension")
    rows = 1
    for d in shape[:-1]:
        rows *= d
    return rows, shape[-1]


def _block_grid(scales: tensor_pb2.BlockScales, rows: int, cols: int,
                what: str) -> np.ndarray:
    """The scale grid [ceil(rows / block_rows), ceil(cols / block_cols)] of ``scales``
    (float32), checked: blocks of at least 1 x 1, one finite scale > 0 per block."""
    br, bc = scales.block_rows, scales.block_cols
    if br < 1 or bc < 1:
        raise ValueError(f"{what}: blocks of {br} x {bc} elements; block_rows and block_cols "
                         "must be >= 1")
    grid = (-(-rows // br), -(-cols // bc))
    want = 4 * grid[0] * grid[1]
    if len(scales.scale_inv) != want:
        raise ValueError(f"{what}: {len(scales.scale_inv)} bytes of scale_inv; blocks of "
                         f"{br} x {bc} over [{rows}, {cols}] make a grid [{grid[0]}, {grid[1]}] "
                         f"of float32, {want} bytes")
    s = np.frombuffer(scales.scale_inv, dtype="<f4").astype(np.float32).reshape(grid)
    if s.size and not bool(np.all(np.isfinite(s) & (s > 0))):
        raise ValueError(f"{what}: every scale_inv must be finite and > 0")
    return s


def data_bytes(header: tensor_pb2.Tensor) -> int:
    """The bytes a wire tensor's data holds: numel elements of its dtype, and for a block-scaled
    FP8 tensor with a columnwise copy, numel more (0 for an unknown dtype)."""
    n = _numel(header.shape) * element_size(header.dtype)
    if header.dtype in _FP8 and header.HasField("columnwise_scales"):
        n *= 2
    return n


def _scaled_blocks(values: np.ndarray, scales: np.ndarray, br: int, bc: int) -> None:
    """Multiplies ``values`` [rows, cols] (float32) in place by the scale of each element's
    block: one float32 multiply per element, the exact product rounded once."""
    rows, cols = values.shape
    if br > 1:
        scales = scales[np.arange(rows) // br]
    full = cols // bc
    if full:
        # The whole blocks of each row, [rows, full, bc], as a view of ``values`` (a reshape of
        # the first full * bc columns would be a copy when a partial block follows them).
        step = values.strides[1]
        head = np.lib.stride_tricks.as_strided(values, shape=(rows, full, bc),
                                               strides=(values.strides[0], bc * step, step))
        head *= scales[:, :full, None]
    if full * bc < cols:
        values[:, full * bc:] *= scales[:, full:full + 1]


def decode(header: tensor_pb2.Tensor, data, owned: bool = False) -> torch.Tensor:
    """A float32 CPU tensor from a wire tensor: ``header`` gives dtype, shape and scales,
    ``data`` (any buffer: a view of the received message, say) the bytes.

    The bytes are read where they lie: 16-bit and FP8 values are converted straight out of them
    into the result. An F32 result is the bytes themselves only when ``owned`` (``data`` is
    writable and nothing else refers to it); otherwise it is one copy of them, because received
    bytes are immutable and the caller may write into the result (autograd accumulates
    gradients in place).

    A block-scaled FP8 tensor (``block_scales``) decodes each code times its block's scale_inv;
    the columnwise copy that may follow its codes (``columnwise_scales``) is checked for size and
    otherwise ignored: the tensor's values are those of the first copy. Malformed scales raise
    ValueError."""
    shape = list(header.shape)
    size = element_size(header.dtype)
    if size == 0:
        raise ValueError(f"unknown wire dtype {header.dtype}")
    blocks = header.HasField("block_scales")
    columnwise = header.HasField("columnwise_scales")
    if (blocks or columnwise) and header.dtype not in _FP8:
        raise ValueError(f"wire tensor of dtype {header.dtype} has block scales: they are for FP8 "
                         "dtypes only")
    if columnwise and not blocks:
        raise ValueError("wire tensor has columnwise_scales without block_scales")
    n = _numel(shape)
    nbytes = memoryview(data).nbytes
    want = data_bytes(header)
    if nbytes != want:
        copies = " (its codes and those of the columnwise copy)" if columnwise else ""
        raise ValueError(f"wire tensor has {nbytes} bytes; its shape {shape} needs {want}"
                         f"{copies}")
    if blocks:
        rows, cols = _matrix(shape)
        scales = _block_grid(header.block_scales, rows, cols, "block_scales")
        if columnwise:
            _block_grid(header.columnwise_scales, cols, rows, "columnwise_scales")
    if n == 0:
        return torch.zeros(shape, dtype=torch.float32)
    if header.dtype == F32:
        if owned:
            return torch.from_numpy(np.frombuffer(data, dtype="<f4")).reshape(shape)
        return torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(shape)
    if header.dtype == BF16:
        # bfloat16 is the high half of a float32: widening is a shift, exactly torch's.
        bits = np.left_shift(np.frombuffer(data, dtype="<u2"), 16, dtype=np.uint32)
        return torch.from_numpy(bits.view(np.float32)).reshape(shape)
    if header.dtype == F16:
        codes = np.frombuffer(data, dtype="<u2")
        return torch.from_numpy(_lookup(_table(F16).numpy(), codes)).reshape(shape)
    codes = np.frombuffer(data, dtype=np.uint8, count=n)
    if blocks:
        values = _lookup(_table(header.dtype).numpy(), codes).reshape(rows, cols)
        _scaled_blocks(values, scales, header.block_scales.block_rows,
                       header.block_scales.block_cols)
        return torch.from_numpy(values).reshape(shape)
    # One float32 multiply per code, as the server decodes (the exact product rounded once):
    # the 256 products are the table.
    scale_inv = torch.tensor(header.scale_inv, dtype=torch.float32)
    table = (_table(header.dtype) * scale_inv).numpy()
    return torch.from_numpy(_lookup(table, codes)).reshape(shape)


def from_wire(msg: tensor_pb2.Tensor) -> torch.Tensor:
    """A float32 CPU tensor from a whole wire tensor message of any dtype."""
    return decode(msg, msg.data)
