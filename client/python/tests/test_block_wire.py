"""Block-scaled FP8 on the wire, without a server: the client's block cast against a float64
model written here from the definition (docs/block-scaling.md, "Exact definitions"), the decoding
of block-scaled tensors (a columnwise copy ignored, malformed scales refused), and the forms the
client picks for each tensor under each recipe. The same forms against a running server are in
test_exact_wire.py (bit for bit with the F32 wire) and test_fp8_wire.py (an outlier)."""

import functools
import math
import os

import numpy as np
import pytest
import torch

import gradwire
from gradwire import kinds, tensor_messages, wire
from gradwire.client import Client, _assemble
from gradwire.shared_memory import _RegionIO
from gradwire.v1 import module_pb2, service_pb2, tensor_pb2

FORMATS = [wire.FP8_E4M3, wire.FP8_E5M2]
FORMAT_IDS = ["e4m3", "e5m2"]
# Per format: mantissa bits, exponent bias, largest finite value, its code.
FORMAT = {wire.FP8_E4M3: (3, 7, 448.0, 0x7E), wire.FP8_E5M2: (2, 15, 57344.0, 0x7B)}


def fresh_seed():
    return int.from_bytes(os.urandom(4), "little")


# --- the float64 model of the definition


def model_exponent(amax, dtype):
    """The smallest integer e with amax <= fp8_max * 2^e (every fp8_max * 2^e is exact in float64
    and math.ldexp is exact), clamped to [-50, 50]; 0 for amax 0."""
    fmax = FORMAT[dtype][2]
    if amax == 0:
        return 0
    assert math.isfinite(amax) and amax > 0
    e = math.ceil(math.log2(amax / fmax))  # a first guess, settled by exact comparisons
    while amax > math.ldexp(fmax, e):
        e += 1
    while amax <= math.ldexp(fmax, e - 1):
        e -= 1
    return max(-50, min(50, e))


@functools.lru_cache(maxsize=None)
def fp8_grid(dtype):
    """(values, codes) of every non-negative finite FP8 value, ascending, from the format's
    definition: subnormals m 2^(1 - bias - mbits), normals (1 + m / 2^mbits) 2^(exp - bias)."""
    mbits, bias, _, max_code = FORMAT[dtype]
    values, codes = [], []
    for code in range(max_code + 1):
        exp, man = code >> mbits, code & ((1 << mbits) - 1)
        if exp == 0:
            v = math.ldexp(man, 1 - bias - mbits)
        else:
            v = math.ldexp((1 << mbits) + man, exp - bias - mbits)
        values.append(v)
        codes.append(code)
    return np.array(values), np.array(codes)


def model_encode(v, dtype):
    """The FP8 code of the float64 value v: round to nearest, ties to the even code, saturate
    past the largest finite value (infinities too), NaN to 0x7F; the sign bit kept (-0 too)."""
    values, codes = fp8_grid(dtype)
    sign = 0x80 if math.copysign(1.0, v) < 0 else 0
    if math.isnan(v):
        return 0x7F | sign
    a = abs(v)
    if a >= values[-1]:
        return int(codes[-1]) | sign
    hi = int(np.searchsorted(values, a, side="left"))
    if values[hi] == a:
        return int(codes[hi]) | sign
    lo = hi - 1
    below, above = a - values[lo], values[hi] - a
    if below < above or (below == above and codes[lo] % 2 == 0):
        return int(codes[lo]) | sign
    return int(codes[hi]) | sign


def model_value(code, dtype):
    """The float64 value of an FP8 code (finite codes only)."""
    values, codes = fp8_grid(dtype)
    v = float(values[code & 0x7F]) if (code & 0x7F) <= codes[-1] else float("nan")
    return -v if code & 0x80 else v


def model_row_blocks(x, dtype, block):
    """The block cast of the matrix x [rows, cols] (float32 values as a numpy float64 array)
    with 1 x block blocks: (codes [rows, cols], scale_inv [rows, ceil(cols / block)])."""
    rows, cols = x.shape
    grid = -(-cols // block)
    codes = np.zeros((rows, cols), dtype=np.int64)
    scales = np.zeros((rows, grid), dtype=np.float64)
    for r in range(rows):
        for j in range(grid):
            part = x[r, j * block:(j + 1) * block]
            finite = part[np.isfinite(part)]
            amax = float(np.abs(finite).max()) if finite.size else 0.0
            e = model_exponent(amax, dtype)
            scales[r, j] = math.ldexp(1.0, e)
            for c, v in enumerate(part):
                codes[r, j * block + c] = model_encode(math.ldexp(float(v), -e), dtype)
    return codes, scales


def model_decode(codes, scales, br, bc, dtype):
    """Each code's value times its block's scale, the exact product rounded once to float32."""
    rows, cols = codes.shape
    out = np.zeros((rows, cols), dtype=np.float32)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = np.float32(model_value(int(codes[r, c]), dtype) * scales[r // br, c // bc])
    return out


def varied(rows, cols, block, seed, nonfinite=False):
    """Random float32 values whose blocks differ in magnitude by many binades (some beyond the
    exponent range), with an all-zero block, a -0, and optionally NaN and infinities."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    grid = -(-cols // block)
    binades = torch.randint(-70, 70, (rows, grid), generator=g).double()
    binades[0, 0] = 72  # past 448 * 2^50 in E4M3: saturates on e = 50
    if rows > 1:
        binades[1, 0] = -80  # below 448 * 2^-50: rounds on e = -50's grid
    scale = torch.pow(2.0, binades).repeat_interleave(block, dim=1)[:, :cols]
    x = (x * scale).float()
    # Also values that sit exactly on fp8_max * 2^k and just past it.
    x[-1, 0] = 448.0 * 2.0 ** -3
    if cols > 1:
        x[-1, 1] = float(np.nextafter(np.float32(448.0 * 2.0 ** 5), np.float32(np.inf)))
    if rows > 2:
        x[2, :min(cols, block)] = 0.0  # an all-zero block
        x[2, 0] = -0.0
    if nonfinite and rows > 3 and cols > 2:
        x[3, 1] = float("nan")
        x[3, 2] = float("inf")
        x[rows - 1, cols - 1] = float("-inf")
        x[0, cols - 1] = float("nan")
    assert bool((x != 0).any())
    return x


# --- the cast


def test_exponents_are_the_smallest_that_fit():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    for dtype in FORMATS:
        fmax = FORMAT[dtype][2]
        mags = torch.rand(4000, generator=g, dtype=torch.float64) * 2 ** torch.randint(
            -160, 128, (4000,), generator=g).double()
        edges = [fmax * 2.0 ** k for k in range(-60, 60)]
        near = []
        for v in edges:
            f = np.float32(v)
            near += [float(f), float(np.nextafter(f, np.float32(np.inf))),
                     float(np.nextafter(f, np.float32(0)))]
        amax = torch.cat([mags.float(), torch.tensor(near, dtype=torch.float32),
                          torch.tensor([0.0, 1.4e-45, 1.17549435e-38, 3.4028235e38])])
        amax = amax[torch.isfinite(amax)]
        got = wire.block_scale_exponents(amax, dtype).tolist()
        want = [model_exponent(float(a), dtype) for a in amax.double()]
        assert got == want, f"seed {seed}"
        special = torch.tensor([0.0, float("inf"), float("nan")])
        assert wire.block_scale_exponents(special, dtype).tolist() == [0, 50, 0]


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("rows,cols,block", [(5, 300, 128), (6, 70, 32), (4, 33, 32),
                                             (3, 128, 128), (7, 19, 4), (1, 1, 32)])
def test_block_cast_is_the_definitions(dtype, rows, cols, block):
    seed = fresh_seed()
    x = varied(rows, cols, block, seed, nonfinite=True)
    codes, scale_inv = wire.encode_row_blocks(x, dtype, block)
    want_codes, want_scales = model_row_blocks(x.double().numpy(), dtype, block)
    assert codes.dtype == torch.uint8 and scale_inv.dtype == torch.float32
    assert codes.shape == (rows, cols) and scale_inv.shape == want_scales.shape
    assert np.array_equal(codes.numpy().astype(np.int64), want_codes), f"seed {seed}"
    assert np.array_equal(scale_inv.double().numpy(), want_scales), f"seed {seed}"


@pytest.mark.parametrize("block", [128, 32])
def test_the_columnwise_copy_is_the_transposes_cast(block):
    """rows not a multiple of the block: the transpose's rows end in a partial block."""
    seed = fresh_seed()
    rows, cols = block + block // 2 + 3, 40
    x = varied(rows, cols, block, seed, nonfinite=True)
    enc = wire.encode_blocks(x, wire.FP8_E4M3, block, columnwise=True)
    h = enc.header
    assert h.dtype == wire.FP8_E4M3 and list(h.shape) == [rows, cols] and h.scale_inv == 0
    assert (h.block_scales.block_rows, h.block_scales.block_cols) == (1, block)
    assert (h.columnwise_scales.block_rows, h.columnwise_scales.block_cols) == (1, block)
    data = np.frombuffer(enc.data, dtype=np.uint8).astype(np.int64)
    assert data.size == 2 * rows * cols
    want, want_scales = model_row_blocks(x.double().numpy(), wire.FP8_E4M3, block)
    want_t, want_scales_t = model_row_blocks(x.double().numpy().T.copy(), wire.FP8_E4M3, block)
    assert want_scales_t.shape == (cols, -(-rows // block))
    assert np.array_equal(data[:rows * cols].reshape(rows, cols), want), f"seed {seed}"
    assert np.array_equal(data[rows * cols:].reshape(cols, rows), want_t), f"seed {seed}"
    scales = np.frombuffer(h.block_scales.scale_inv, dtype="<f4").astype(np.float64)
    scales_t = np.frombuffer(h.columnwise_scales.scale_inv, dtype="<f4").astype(np.float64)
    assert np.array_equal(scales, want_scales.reshape(-1))
    assert np.array_equal(scales_t, want_scales_t.reshape(-1))


def test_a_tensor_of_more_dimensions_reads_as_its_rows():
    seed = fresh_seed()
    x = varied(12, 50, 32, seed).reshape(2, 6, 50)
    enc = wire.encode(x, wire.FP8_E5M2, 32)
    assert list(enc.header.shape) == [2, 6, 50]
    want, want_scales = model_row_blocks(x.reshape(12, 50).double().numpy(), wire.FP8_E5M2, 32)
    assert np.array_equal(np.frombuffer(enc.data, dtype=np.uint8).reshape(12, 50), want)
    assert len(enc.header.block_scales.scale_inv) == 4 * 12 * 2
    one = wire.encode(x[0, 0], wire.FP8_E4M3, 32)  # one dimension: one row
    assert len(one.header.block_scales.scale_inv) == 4 * 2


def test_exact_block_input():
    seed = fresh_seed()
    x = varied(9, 100, 32, seed)
    for block, columnwise in ((128, True), (128, False), (32, True), (32, False)):
        enc = wire.encode_exact_block_input(x, block, columnwise)
        assert enc.header.dtype == wire.FP8_E4M3 and enc.header.scale_inv == 0
        assert enc.header.block_scales.block_cols == block
        assert enc.header.HasField("columnwise_scales") == columnwise
        assert enc.data.nbytes == x.numel() * (2 if columnwise else 1)
        same = wire.encode_blocks(x, wire.FP8_E4M3, block, columnwise)
        assert bytes(enc.data) == bytes(same.data) and enc.header == same.header
    # bfloat16 and float64 inputs: their float32 values (as the F32 wire sends them).
    h = x.to(torch.bfloat16)
    assert bytes(wire.encode_exact_block_input(h, 32, True).data) == \
        bytes(wire.encode_blocks(h.float(), wire.FP8_E4M3, 32, True).data)
    d = x.double() * (1 + 2 ** -40)
    assert bytes(wire.encode_exact_block_input(d, 32, False).data) == \
        bytes(wire.encode_blocks(d.float(), wire.FP8_E4M3, 32).data)
    # A value that is not finite, an empty or 0-dim input: the input crosses as itself.
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[4, 17] = bad
        assert wire.encode_exact_block_input(y, 128, True) is None
    assert wire.encode_exact_block_input(torch.zeros(0, 64), 128, True) is None
    assert wire.encode_exact_block_input(torch.tensor(3.0), 128, True) is None


def test_fast_enough_for_a_large_batch():
    import time
    x = torch.randn(4096, 1024)
    start = time.monotonic()
    enc = wire.encode_exact_block_input(x, 128, True)
    elapsed = time.monotonic() - start
    assert enc.data.nbytes == 2 * x.numel()
    assert elapsed < 10, elapsed  # vectorised: well under a second on one core


# --- decoding


def block_message(codes, scales, br, bc, dtype, shape, columnwise=None):
    t = tensor_pb2.Tensor(dtype=dtype, shape=list(shape), data=codes.astype(np.uint8).tobytes())
    t.block_scales.CopyFrom(tensor_pb2.BlockScales(
        block_rows=br, block_cols=bc, scale_inv=scales.astype("<f4").tobytes()))
    if columnwise is not None:
        codes_t, scales_t = columnwise
        t.data += codes_t.astype(np.uint8).tobytes()
        t.columnwise_scales.CopyFrom(tensor_pb2.BlockScales(
            block_rows=1, block_cols=bc, scale_inv=scales_t.astype("<f4").tobytes()))
    return t


def finite_random_codes(rows, cols, dtype, g):
    codes = torch.randint(0, 256, (rows, cols), generator=g).numpy()
    finite = np.array([math.isfinite(model_value(int(c), dtype)) for c in range(256)])
    codes[~finite[codes]] = 0x11
    return codes


@pytest.mark.parametrize("dtype", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("br,bc", [(1, 128), (1, 32), (128, 128), (3, 5), (2, 1)])
def test_block_tensors_decode_as_the_definition(dtype, br, bc):
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    rows, cols = 131, 150  # partial blocks at the bottom and the right
    codes = finite_random_codes(rows, cols, dtype, g)
    grid = (-(-rows // br), -(-cols // bc))
    e = torch.randint(-50, 51, grid, generator=g).numpy()
    scales = np.ldexp(np.ones(grid), e)
    msg = block_message(codes, scales, br, bc, dtype, (rows, cols))
    got = wire.from_wire(msg)
    want = model_decode(codes, scales, br, bc, dtype)
    assert got.dtype == torch.float32 and got.shape == (rows, cols)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), f"seed {seed}"
    # Not powers of two: the product rounds once to float32.
    odd = scales * 3.0 / 7.0
    got = wire.from_wire(block_message(codes, odd, br, bc, dtype, (rows, cols)))
    want = model_decode(codes, odd.astype(np.float32).astype(np.float64), br, bc, dtype)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), f"seed {seed}"


def test_encode_then_decode_is_the_dequantized_values():
    seed = fresh_seed()
    x = varied(10, 200, 32, seed)
    for dtype in FORMATS:
        enc = wire.encode(x, dtype, 32)
        got = wire.decode(enc.header, enc.data)
        codes, scales = model_row_blocks(x.double().numpy(), dtype, 32)
        want = model_decode(codes, scales, 1, 32, dtype)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), f"seed {seed}"


def test_the_columnwise_copy_is_ignored_on_decode():
    seed = fresh_seed()
    x = varied(70, 48, 32, seed)
    enc = wire.encode_blocks(x, wire.FP8_E4M3, 32, columnwise=True)
    first = wire.decode(enc.header, enc.data)
    alone = wire.encode_blocks(x, wire.FP8_E4M3, 32)
    assert torch.equal(first.view(torch.int32), wire.decode(*alone).view(torch.int32))
    # Whatever the second copy holds, the values are the first copy's.
    data = bytearray(enc.data)
    n = x.numel()
    data[n:] = os.urandom(n)
    assert torch.equal(wire.decode(enc.header, data).view(torch.int32), first.view(torch.int32))
    # But its bytes must be there: numel or 2 * numel, as the header says.
    with pytest.raises(ValueError, match="columnwise"):
        wire.decode(enc.header, bytes(enc.data)[:n])
    with pytest.raises(ValueError, match="bytes"):
        wire.decode(alone.header, bytes(enc.data))


def test_malformed_scales_are_refused():
    g = torch.Generator().manual_seed(fresh_seed())
    codes = finite_random_codes(4, 70, wire.FP8_E4M3, g)
    scales = np.ones((4, 3))

    def msg(**change):
        m = block_message(codes, scales, 1, 32, wire.FP8_E4M3, (4, 70))
        for k, v in change.items():
            setattr(m.block_scales, k, v)
        return m

    assert wire.from_wire(msg()).shape == (4, 70)
    for br, bc in ((0, 32), (1, 0), (-1, 32)):
        with pytest.raises(ValueError, match="must be >= 1"):
            wire.from_wire(msg(block_rows=br, block_cols=bc))
    with pytest.raises(ValueError, match="grid \\[4, 3\\].*48 bytes"):
        wire.from_wire(msg(scale_inv=scales.astype("<f4").tobytes()[:-4]))
    with pytest.raises(ValueError, match="scale_inv"):
        wire.from_wire(msg(block_cols=16))  # a grid [4, 5] needs 80 bytes
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        s = scales.copy()
        s[2, 1] = bad
        with pytest.raises(ValueError, match="finite and > 0"):
            wire.from_wire(msg(scale_inv=s.astype("<f4").tobytes()))
    # The columnwise copy's scales are checked too (over [cols, rows]).
    m = block_message(codes, scales, 1, 32, wire.FP8_E4M3, (4, 70),
                      columnwise=(codes.T.copy(), np.ones((70, 1))))
    assert wire.from_wire(m).shape == (4, 70)
    m.columnwise_scales.scale_inv = b"\x00\x00\x80\x3f" * 3
    with pytest.raises(ValueError, match="columnwise_scales"):
        wire.from_wire(m)
    # A columnwise copy needs block scales; block scales need an FP8 dtype and a dimension.
    m = tensor_pb2.Tensor(dtype=wire.FP8_E4M3, shape=[2], data=b"\x01\x02" * 2, scale_inv=1.0)
    m.columnwise_scales.CopyFrom(tensor_pb2.BlockScales(block_rows=1, block_cols=32,
                                                        scale_inv=b"\x00\x00\x80\x3f" * 2))
    with pytest.raises(ValueError, match="without block_scales"):
        wire.from_wire(m)
    m = wire.to_wire(torch.randn(2, 3))
    m.block_scales.CopyFrom(tensor_pb2.BlockScales(block_rows=1, block_cols=32,
                                                   scale_inv=b"\x00\x00\x80\x3f" * 2))
    with pytest.raises(ValueError, match="FP8"):
        wire.from_wire(m)
    m = tensor_pb2.Tensor(dtype=wire.FP8_E4M3, shape=[], data=b"\x01")
    m.block_scales.CopyFrom(tensor_pb2.BlockScales(block_rows=1, block_cols=1,
                                                   scale_inv=b"\x00\x00\x80\x3f"))
    with pytest.raises(ValueError, match="dimension"):
        wire.from_wire(m)


def test_empty_block_tensors_decode():
    for shape in ((0, 64), (3, 0), (0,)):
        m = tensor_pb2.Tensor(dtype=wire.FP8_E5M2, shape=list(shape))
        m.block_scales.CopyFrom(tensor_pb2.BlockScales(block_rows=1, block_cols=32))
        assert wire.from_wire(m).shape == shape
    # An empty tensor sent as FP8 to a block module keeps its one scale.
    assert not wire.encode(torch.zeros(0, 64), wire.FP8_E4M3, 32).header.HasField("block_scales")


# --- messages: requests keep protobuf's encoding, responses parse and assemble


def test_block_requests_are_protobufs_encoding():
    x = varied(6, 70, 32, fresh_seed())
    enc = wire.encode_blocks(x, wire.FP8_E4M3, 32, columnwise=True)
    req = tensor_messages.Outgoing(service_pb2.ForwardRequest(
        module_id="m", input=enc.header, training=True),
        {(service_pb2.ForwardRequest.DESCRIPTOR.fields_by_name["input"].number,
          tensor_messages.DATA): enc.data})
    whole = service_pb2.ForwardRequest(module_id="m", training=True)
    whole.input.CopyFrom(enc.header)
    whole.input.data = bytes(enc.data)
    assert req.SerializeToString() == whole.SerializeToString()
    assert req.nbytes == 2 * x.numel()


@pytest.mark.parametrize("chunk_bytes", [1, 97, 1 << 20])
def test_block_responses_parse_and_assemble(chunk_bytes):
    x, ln = varied(5, 300, 128, fresh_seed()), varied(5, 40, 32, fresh_seed())
    out = wire.to_wire(x, wire.FP8_E4M3, 128)
    enc = wire.encode_blocks(ln, wire.FP8_E4M3, 32, columnwise=True)  # with a second copy
    ln_msg = tensor_pb2.Tensor()
    ln_msg.CopyFrom(enc.header)
    ln_msg.data = bytes(enc.data)
    whole = service_pb2.ForwardResponse(output=out, context_id="c", layernorm_output=ln_msg)
    want_y = wire.from_wire(out)
    want_ln = wire.from_wire(ln_msg)
    received = tensor_messages.parse(service_pb2.ForwardResponse, whole.SerializeToString())
    y, _, got_ln = Client.forward_result(received)
    assert torch.equal(y.view(torch.int32), want_y.view(torch.int32))
    assert torch.equal(got_ln.view(torch.int32), want_ln.view(torch.int32))
    # Chunked: the header's sizes count the columnwise copy's codes.
    header = service_pb2.ForwardResponse()
    header.CopyFrom(whole)
    header.output.data = b""
    header.layernorm_output.data = b""
    raw = [service_pb2.ForwardResponsePart(header=header).SerializeToString()]
    for i, t in enumerate([whole.output, whole.layernorm_output]):
        for off in range(0, len(t.data), chunk_bytes):
            raw.append(service_pb2.ForwardResponsePart(chunk=service_pb2.TensorChunk(
                tensor=i, offset=off, data=t.data[off:off + chunk_bytes])).SerializeToString())
    parts = [tensor_messages.reader(service_pb2.ForwardResponsePart)(b) for b in raw]
    received = _assemble("ForwardChunked", parts, service_pb2.ForwardResponse)
    y, _, got_ln = Client.forward_result(received)
    assert torch.equal(y.view(torch.int32), want_y.view(torch.int32))
    assert torch.equal(got_ln.view(torch.int32), want_ln.view(torch.int32))
    assert wire.data_bytes(whole.layernorm_output) == 2 * ln.numel()


class _Memory(_RegionIO):
    """A region in this process's memory: what a shared-memory region holds, without a server."""

    def __init__(self, size):
        self.name = "mem"
        self.size = size
        self._buf = memoryview(bytearray(size))

    @property
    def buffer(self):
        return self._buf


def test_a_region_holds_the_codes_and_the_header_the_scales():
    x = varied(9, 200, 32, fresh_seed())
    region = _Memory(1 << 16)
    enc = wire.encode_exact_block_input(x, 32, True)
    header = region.write_encoded(64, enc)
    assert header.shared_memory.offset == 64 and header.shared_memory.byte_size == 2 * x.numel()
    assert header.HasField("block_scales") and header.HasField("columnwise_scales")
    assert not header.data
    assert bytes(region.buffer[64:64 + 2 * x.numel()]) == bytes(enc.data)
    want = wire.decode(enc.header, enc.data)
    assert torch.equal(region.read(header).view(torch.int32), want.view(torch.int32))
    g = region.write(0, x, wire.FP8_E5M2, 32)
    assert g.block_scales.block_cols == 32 and g.shared_memory.byte_size == x.numel()
    assert torch.equal(region.read(g).view(torch.int32),
                       wire.from_wire(wire.to_wire(x, wire.FP8_E5M2, 32)).view(torch.int32))


# --- the forms the client picks


def spec_of(kind, recipe, in_features=80, out_features=48):
    spec = module_pb2.ModuleSpec(kind=kind, in_features=in_features, out_features=out_features,
                                 ffn_features=64 if kind == module_pb2.LAYERNORM_MLP else 0)
    spec.recipe.scaling = recipe
    return spec


@pytest.fixture
def offline():
    """Clients that only build requests (nothing listens at their address), told the specs of
    their modules as the server would (create_module, module_info)."""
    made = []

    def make(wire_dtype):
        c = gradwire.Client("127.0.0.1:1", wire_dtype=wire_dtype)
        for name, kind, recipe in (("current", module_pb2.LINEAR, module_pb2.CURRENT),
                                   ("delayed", module_pb2.LINEAR, module_pb2.DELAYED),
                                   ("block", module_pb2.LINEAR, module_pb2.BLOCK),
                                   ("mxfp8", module_pb2.LINEAR, module_pb2.MXFP8),
                                   ("ln-block", module_pb2.LAYERNORM_LINEAR, module_pb2.BLOCK),
                                   ("mlp-mxfp8", module_pb2.LAYERNORM_MLP, module_pb2.MXFP8)):
            c._modules[name] = spec_of(kind, recipe)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_kinds_name_the_block_and_the_exact_input():
    for recipe, block in ((module_pb2.BLOCK, 128), (module_pb2.MXFP8, 32),
                          (module_pb2.CURRENT, 0), (module_pb2.DELAYED, 0), (0, 0)):
        assert kinds.block_size(spec_of(module_pb2.LINEAR, recipe)) == block
        assert kinds.block_size(spec_of(module_pb2.LAYERNORM_MLP, recipe)) == block
    for recipe in (module_pb2.BLOCK, module_pb2.MXFP8, module_pb2.CURRENT, 0):
        assert kinds.exact_fp8_input(spec_of(module_pb2.LINEAR, recipe))
        assert not kinds.exact_fp8_input(spec_of(module_pb2.LAYERNORM_LINEAR, recipe))
    assert not kinds.exact_fp8_input(spec_of(module_pb2.LINEAR, module_pb2.DELAYED))


def test_the_exact_wire_sends_a_block_linears_input_as_its_cast(offline):
    c = offline("exact")
    x = torch.randn(37, 80)
    for m, block in (("block", 128), ("mxfp8", 32)):
        assert c.exact_fp8_input(m) and c.fp8_block(m) == block
        for training in (True, False):
            req = c.forward_request(m, x, training)
            t = req.message.input
            assert t.dtype == wire.FP8_E4M3 and t.scale_inv == 0
            assert (t.block_scales.block_rows, t.block_scales.block_cols) == (1, block)
            # The columnwise copy in training only (the weight gradient's).
            assert t.HasField("columnwise_scales") == training
            assert req.nbytes == x.numel() * (2 if training else 1)
            assert req.message.output_dtype == wire.F32
            want = wire.encode_exact_block_input(x, block, training)
            assert bytes(next(iter(req.data.values()))) == bytes(want.data)
            assert c._input_bytes(m, x, wire.F32, training) == req.nbytes
        # bfloat16 input: the cast of its values, the output asked for in bfloat16.
        req = c.forward_request(m, x.to(torch.bfloat16), True, wire.BF16)
        assert req.message.input.dtype == wire.FP8_E4M3
        assert req.message.input.block_scales.block_cols == block
        assert req.message.output_dtype == wire.BF16
        # A non-finite value: the input as itself.
        y = x.clone()
        y[3, 3] = float("nan")
        assert c.forward_request(m, y, True).message.input.dtype == wire.F32
        # grad_output crosses as the module's own E4M3 block cast with the columnwise copy
        # (its spec has no bias: no column sums); grad_input comes back as F32.
        c._note_context("ctx-" + m, m)
        dy = torch.randn(37, 48)
        bwd = c.backward_request("ctx-" + m, dy)
        g = bwd.message.grad_output
        assert c.exact_grad_output(m) == wire.FP8_E4M3
        assert g.dtype == wire.FP8_E4M3 and g.block_scales.block_cols == block
        assert g.columnwise_scales.block_cols == block
        assert bwd.nbytes == 2 * dy.numel() and not bwd.message.grad_output_column_sums
        assert bwd.message.grad_input_dtype == wire.F32
        want = wire.encode_blocks(dy, wire.FP8_E4M3, block, columnwise=True)
        assert bytes(next(iter(bwd.data.values()))) == bytes(want.data)
    current = c.forward_request("current", x, True).message.input
    assert current.dtype == wire.FP8_E4M3 and current.scale_inv > 0
    assert not current.HasField("block_scales")
    for m in ("delayed", "ln-block", "mlp-mxfp8"):
        assert c.forward_request(m, x, True).message.input.dtype == wire.F32


def test_the_fp8_wire_sends_block_scales_to_a_block_module(offline):
    c = offline("fp8")
    x = torch.randn(37, 80)
    for m, block in (("block", 128), ("mxfp8", 32), ("ln-block", 128), ("mlp-mxfp8", 32)):
        req = c.forward_request(m, x, True)
        t = req.message.input
        assert t.dtype == wire.FP8_E4M3 and t.block_scales.block_cols == block
        assert not t.HasField("columnwise_scales")  # no columnwise copy, training or not
        assert req.message.output_dtype == wire.FP8_E4M3
        assert req.nbytes == x.numel()
        c._note_context("ctx-" + m, m)
        dy, dln = torch.randn(37, 48), torch.randn(37, 80)
        bwd = c.backward_request("ctx-" + m, dy, grad_layernorm_output=dln)
        for g in (bwd.message.grad_output, bwd.message.grad_layernorm_output):
            assert g.dtype == wire.FP8_E5M2 and g.scale_inv == 0
            assert (g.block_scales.block_rows, g.block_scales.block_cols) == (1, block)
        assert bwd.message.grad_input_dtype == wire.FP8_E5M2
        assert bwd.to_message().grad_output.data == wire.to_wire(dy, wire.FP8_E5M2, block).data
        # The module named: a context this client did not make.
        other = c.backward_request("someone-elses", dy, module_id=m)
        assert other.message.grad_output.block_scales.block_cols == block
    # Per-tensor recipes (and a context whose module is unknown): one scale per tensor.
    for m in ("current", "delayed"):
        t = c.forward_request(m, x, True).message.input
        assert t.dtype == wire.FP8_E4M3 and t.scale_inv > 0 and not t.HasField("block_scales")
        c._note_context("ctx-" + m, m)
        g = c.backward_request("ctx-" + m, torch.randn(37, 48)).message.grad_output
        assert g.scale_inv > 0 and not g.HasField("block_scales")
    c._modules.pop("nowhere", None)
    g = c.backward_request("unknown-context", torch.randn(37, 48)).message.grad_output
    assert g.dtype == wire.FP8_E5M2 and not g.HasField("block_scales")
