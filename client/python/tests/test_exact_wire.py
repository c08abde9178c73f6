"""The exact wire, the default: a forward's input to a module that casts it to E4M3 first in a
way the client repeats bit for bit (a Linear under CURRENT with margin 0, BLOCK or MXFP8) crosses
as that cast: codes and scale_inv under CURRENT, codes and block scales (1 x 128 under BLOCK,
1 x 32 under MXFP8) with the columnwise copy in training under the block recipes. A backward's
grad_output crosses as the module's own FP8 cast of it (every kind: E5M2 with one scale under
CURRENT, E4M3 or, with the HYBRID format, E5M2 with block scales and the columnwise copy under
BLOCK, E4M3 under MXFP8), with its column sums beside it for a module with a bias (the bias
gradient, from a server that sums columns in row order). Everything else crosses as "f32" sends
it. Every kind and recipe gives "f32"'s results bit for bit: outputs, input gradients, weight and
bias gradients and the weights after optimizer steps."""

import numpy as np
import pytest
import torch

import gradwire
from gradwire import kinds, wire
from gradwire.v1 import module_pb2


def spec_of(kind, recipe, margin=0, bias=True, seed=0, ln_output=False, activation=None,
            fmt=0, out_features=None):
    spec = module_pb2.ModuleSpec(kind=kind, in_features=80, out_features=48, bias=bias,
                                 seed=seed)
    spec.recipe.scaling = recipe
    spec.recipe.margin = margin
    spec.recipe.format = fmt
    if kind == module_pb2.LAYERNORM_MLP:
        spec.out_features = 80
        spec.ffn_features = 64
        spec.activation = activation or module_pb2.GELU
    if out_features is not None:
        spec.out_features = out_features
    if ln_output:
        spec.return_layernorm_output = True
    return spec


E4M3, E5M2 = wire.FP8_E4M3, wire.FP8_E5M2
RECIPES = [module_pb2.CURRENT, module_pb2.DELAYED, module_pb2.BLOCK, module_pb2.MXFP8]
# The recipes by name as RemoteModule takes them: (scaling, format), and the FP8 dtype of the
# exact wire's grad_output under each (None: F32).
GRAD_RECIPES = {
    "current": (module_pb2.CURRENT, 0, E5M2),
    "delayed": (module_pb2.DELAYED, 0, None),
    "block": (module_pb2.BLOCK, 0, E4M3),
    "block-hybrid": (module_pb2.BLOCK, module_pb2.HYBRID, E5M2),
    "mxfp8": (module_pb2.MXFP8, 0, E4M3),
}
KIND_NAMES = {module_pb2.LINEAR: "linear", module_pb2.LAYERNORM_LINEAR: "layernorm-linear",
              module_pb2.LAYERNORM_MLP: "layernorm-mlp"}
# (name, spec, whether the input crosses as FP8, grad_output's FP8 dtype or None). The server
# of the suite sums bias gradients in row order (the CPU backend: row_order_bias_sums), so a
# module with a bias takes FP8 grad_output too.
CASES = [
    ("linear-current", spec_of(module_pb2.LINEAR, module_pb2.CURRENT, seed=1), True, E5M2),
    ("linear-unspecified-nobias", spec_of(module_pb2.LINEAR, 0, bias=False, seed=2), True, E5M2),
    ("linear-current-margin", spec_of(module_pb2.LINEAR, module_pb2.CURRENT, 1, seed=3), False,
     None),
    ("linear-delayed", spec_of(module_pb2.LINEAR, module_pb2.DELAYED, seed=4), False, None),
    ("linear-block", spec_of(module_pb2.LINEAR, module_pb2.BLOCK, seed=5), True, E4M3),
    ("linear-mxfp8", spec_of(module_pb2.LINEAR, module_pb2.MXFP8, seed=6), True, E4M3),
] + [
    (f"layernorm-linear-{module_pb2.ScalingRecipe.Name(r).lower()}",
     spec_of(module_pb2.LAYERNORM_LINEAR, r, seed=7, ln_output=True), False,
     {module_pb2.CURRENT: E5M2, module_pb2.DELAYED: None}.get(r, E4M3)) for r in RECIPES
] + [
    (f"layernorm-mlp-{module_pb2.ScalingRecipe.Name(r).lower()}",
     spec_of(module_pb2.LAYERNORM_MLP, r, seed=8, activation=module_pb2.SWIGLU), False,
     {module_pb2.CURRENT: E5M2, module_pb2.DELAYED: None}.get(r, E4M3)) for r in RECIPES
] + [
    # Every kind under every recipe, with and without a bias, 300 wide: the last block of a row
    # of grad_output (and its column sums' count) not a whole one under BLOCK and MXFP8.
    (f"{KIND_NAMES[k]}-{r}-{'bias' if bias else 'nobias'}-300",
     spec_of(k, GRAD_RECIPES[r][0], bias=bias, seed=40 + i, fmt=GRAD_RECIPES[r][1],
             out_features=300, ln_output=k == module_pb2.LAYERNORM_LINEAR and bias),
     k == module_pb2.LINEAR and r != "delayed", GRAD_RECIPES[r][2])
    for i, (k, r, bias) in enumerate(
        (k, r, bias) for k in KIND_NAMES for r in GRAD_RECIPES for bias in (True, False))
]


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


BLOCKS = {module_pb2.BLOCK: 128, module_pb2.MXFP8: 32}


def check_input_form(req, spec, fp8_input, training):
    """The ForwardRequest's input is in the form the exact wire gives ``spec``'s module: F32, or
    E4M3 with one scale (CURRENT), or E4M3 with block scales of 1 x the recipe's block length and,
    in training, the columnwise copy (BLOCK, MXFP8)."""
    t = req.message.input
    n = 1
    for d in t.shape:
        n *= d
    if not fp8_input:
        assert t.dtype == wire.F32 and not t.HasField("block_scales")
        return
    assert t.dtype == wire.FP8_E4M3
    block = BLOCKS.get(spec.recipe.scaling, 0)
    if not block:
        assert t.scale_inv > 0 and not t.HasField("block_scales")
        assert req.nbytes == n
        return
    assert t.scale_inv == 0
    assert (t.block_scales.block_rows, t.block_scales.block_cols) == (1, block)
    assert t.HasField("columnwise_scales") == training
    if training:
        assert (t.columnwise_scales.block_rows, t.columnwise_scales.block_cols) == (1, block)
    assert req.nbytes == n * (2 if training else 1)


def check_grad_form(req, spec, grad_form, dy):
    """The BackwardRequest's grad_output is in the form the exact wire gives ``spec``'s module:
    F32 without column sums (``grad_form`` None), or the module's own cast of ``dy`` in
    ``grad_form`` (one scale under CURRENT; 1 x block blocks and the columnwise copy under BLOCK
    and MXFP8), with ``dy``'s column sums for a module with a bias; grad_layernorm_output F32
    and grad_input asked for as F32 either way."""
    msg = req.message
    t = msg.grad_output
    assert msg.grad_input_dtype == wire.F32
    if msg.HasField("grad_layernorm_output"):
        assert msg.grad_layernorm_output.dtype == wire.F32
    if grad_form is None:
        assert t.dtype == wire.F32 and not t.HasField("block_scales")
        assert len(msg.grad_output_column_sums) == 0
        return
    assert t.dtype == grad_form
    block = BLOCKS.get(spec.recipe.scaling, 0)
    data = req.to_message().grad_output.data
    if block:
        want = wire.encode_blocks(dy, grad_form, block, columnwise=True)
        assert t.scale_inv == 0
        assert (t.block_scales.block_rows, t.block_scales.block_cols) == (1, block)
        assert (t.columnwise_scales.block_rows, t.columnwise_scales.block_cols) == (1, block)
        assert t.block_scales == want.header.block_scales
        assert t.columnwise_scales == want.header.columnwise_scales
        assert data == bytes(want.data) and len(data) == 2 * dy.numel()
    else:
        want = wire.to_wire(dy, grad_form)
        assert t.scale_inv == want.scale_inv > 0 and not t.HasField("block_scales")
        assert data == want.data and len(data) == dy.numel()
    if spec.bias:
        sums = torch.tensor(list(msg.grad_output_column_sums), dtype=torch.float32)
        assert same_bits(sums, row_by_row_sums(dy))
    else:
        assert len(msg.grad_output_column_sums) == 0


def row_by_row_sums(t):
    """The column sums of ``t`` in float32, row after row from 0.0 (torch's own additions)."""
    m = t.detach().float().reshape(-1, t.shape[-1])
    s = torch.zeros(m.shape[1], dtype=torch.float32)
    for r in range(m.shape[0]):
        s = s + m[r]
    return s


def loop_column_sums(t):
    """The column sums of ``t`` by definition: float32, row by row from 0.0, one float32
    addition per element (numpy float32 scalars)."""
    m = t.detach().float().reshape(-1, t.shape[-1]).numpy()
    out = []
    for c in range(m.shape[1]):
        s = np.float32(0.0)
        for r in range(m.shape[0]):
            s = np.float32(s + m[r, c])
        out.append(s)
    return np.array(out, dtype=np.float32)


def awkward(rows, cols, seed):
    """Gradient values over many binades, both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    return x * torch.pow(10.0, torch.randint(-4, 4, (rows, cols), generator=g).float())


@pytest.fixture
def block_casts(monkeypatch):
    """Counts the exact block casts the client sends (``wire.encode_exact_block_input`` calls
    that gave codes), training ones and inference ones apart."""
    counts = {True: 0, False: 0}
    encode = wire.encode_exact_block_input

    def counted(t, block, columnwise):
        out = encode(t, block, columnwise)
        if out is not None:
            counts[columnwise] += 1
        return out

    monkeypatch.setattr(wire, "encode_exact_block_input", counted)
    return counts


@pytest.fixture
def pair(server):
    exact = gradwire.Client(server)
    f32 = gradwire.Client(server, wire_dtype="f32")
    yield exact, f32
    exact.close()
    f32.close()


def test_exact_is_the_default(server):
    with gradwire.Client(server) as c:
        assert c.wire_dtype == "exact"
    with pytest.raises(ValueError):
        gradwire.Client(server, wire_dtype="exactly")


@pytest.mark.parametrize("name,spec,fp8_input,grad_form", CASES, ids=[c[0] for c in CASES])
def test_every_kind_and_recipe_gives_the_f32_wires_bits(pair, block_casts, name, spec,
                                                        fp8_input, grad_form):
    exact, f32 = pair
    assert kinds.exact_fp8_input(spec) == fp8_input
    info = exact.create_module(spec)
    a = info.module_id
    b = f32.create_module(spec).module_id
    # The suite's server (the CPU backend) sums bias gradients in row order.
    assert info.row_order_bias_sums
    assert kinds.exact_grad_output(info.spec, True) == grad_form
    assert exact.exact_fp8_input(a) == fp8_input
    assert exact.exact_grad_output(a) == grad_form
    assert not f32.exact_fp8_input(b) and f32.exact_grad_output(b) is None
    # The server names the recipe the module got: the block length comes from it.
    assert exact.fp8_block(a) == BLOCKS.get(spec.recipe.scaling, 0)
    block_input = fp8_input and spec.recipe.scaling in BLOCKS
    ln = spec.return_layernorm_output
    # The third step's 150 rows: a whole block of 128 rows and part of one for the columnwise
    # copies; its tensors go through shared memory (over 64 KiB), the others over the wire.
    for step, rows in enumerate((5, 16, 150)):
        x = torch.randn(rows, spec.in_features)
        req = exact.forward_request(a, x, True)
        check_input_form(req, spec, fp8_input, True)
        assert req.message.output_dtype == wire.F32
        before = block_casts[True]
        ya, ca, la = exact.forward(a, x, True)
        # The forward itself sent the block cast, with the columnwise copy.
        assert block_casts[True] == before + (1 if block_input else 0)
        yb, cb, lb = f32.forward(b, x, True)
        assert same_bits(ya, yb)
        if ln:
            assert same_bits(la, lb)
        dy = torch.randn_like(ya) if step == 0 else awkward(rows, spec.out_features, step)
        dln = torch.randn(rows, spec.in_features) if ln else None
        check_grad_form(exact.backward_request(ca, dy, retain=True, grad_layernorm_output=dln),
                        info.spec, grad_form, dy)
        sent = exact.exact_fp8_gradients
        ga = exact.backward(ca, dy, grad_layernorm_output=dln)
        gb = f32.backward(cb, dy, grad_layernorm_output=dln)
        assert exact.exact_fp8_gradients == sent + (grad_form is not None)
        assert f32.exact_fp8_gradients == 0
        assert same_bits(ga, gb)
        da, db = exact.get_gradients(a), f32.get_gradients(b)
        assert da.keys() == db.keys()
        for k in da:
            assert same_bits(da[k], db[k]), k
        exact.apply_gradients(a)
        f32.apply_gradients(b)
    x = torch.randn(3, spec.in_features)
    check_input_form(exact.forward_request(a, x, False), spec, fp8_input, False)
    before = block_casts[False]
    assert same_bits(exact.forward(a, x, False)[0], f32.forward(b, x, False)[0])
    # An inference forward sends the block cast without the columnwise copy.
    assert block_casts[False] == before + (1 if block_input else 0)
    wa, wb = exact.get_weights(a), f32.get_weights(b)
    for k in wa:
        assert same_bits(wa[k], wb[k]), k
    exact.delete_module(a)
    f32.delete_module(b)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_input_crosses_as_itself_and_is_refused_alike(pair, bad):
    exact, f32 = pair
    spec = spec_of(module_pb2.LINEAR, module_pb2.CURRENT, seed=9)
    a = exact.create_module(spec).module_id
    b = f32.create_module(spec).module_id
    x = torch.randn(4, spec.in_features)
    x[2, 7] = bad
    assert wire.encode_exact_input(x) is None
    assert exact.forward_request(a, x, True).message.input.dtype == wire.F32
    errors = []
    for c, m in ((exact, a), (f32, b)):
        with pytest.raises(gradwire.GradwireError) as e:
            c.forward(m, x, True)
        errors.append((e.value.code, e.value.message.split(" [request ")[0]))
    assert errors[0] == errors[1]


def outcome(c, m, x, training):
    """What a forward gives: ("ok", the output's bits) or ("error", code, message)."""
    try:
        y = c.forward(m, x, training)[0]
    except gradwire.GradwireError as e:
        return ("error", e.code, e.message.split(" [request ")[0])
    return ("ok", y.view(torch.int32))


@pytest.mark.parametrize("recipe", [module_pb2.BLOCK, module_pb2.MXFP8], ids=["block", "mxfp8"])
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_a_non_finite_input_to_a_block_linear_crosses_as_itself(pair, recipe, bad):
    """Under BLOCK and MXFP8 too: the server sees the value and answers as on the F32 wire."""
    exact, f32 = pair
    spec = spec_of(module_pb2.LINEAR, recipe, seed=10)
    a = exact.create_module(spec).module_id
    b = f32.create_module(spec).module_id
    x = torch.randn(4, spec.in_features)
    x[2, 7] = bad
    assert wire.encode_exact_block_input(x, BLOCKS[recipe], True) is None
    for training in (True, False):
        assert exact.forward_request(a, x, training).message.input.dtype == wire.F32
        got, want = outcome(exact, a, x, training), outcome(f32, b, x, training)
        assert got[0] == want[0], (got, want)
        if got[0] == "ok":
            assert torch.equal(got[1], want[1])
        else:
            assert got == want


@pytest.mark.parametrize("recipe", [None, "block", "block-hybrid", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_remote_modules_train_with_the_f32_wires_bits(pair, block_casts, dtype, recipe):
    """Through RemoteLinear and autograd (the Train stream), bfloat16 and float16 inputs
    included: their output comes back in their own dtype (as with "f32"), the input as E4M3
    codes: with one scale (the fixture server's default, CURRENT), or with block scales and the
    columnwise copy under BLOCK and MXFP8; grad_output (a 16-bit one as its float32 values) as
    the module's FP8 cast with its column sums (the Linear has a bias)."""
    exact, f32 = pair
    la = gradwire.RemoteLinear(exact, 64, 40, seed=21, recipe=recipe)
    lb = gradwire.RemoteLinear(f32, 64, 40, seed=21, recipe=recipe)
    assert exact.exact_fp8_input(la.module_id)
    assert exact.exact_grad_output(la.module_id) == GRAD_RECIPES[recipe or "current"][2]
    for step in range(2):
        x = torch.randn(12, 64).to(dtype)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = la(xa), lb(xb)
        assert ya.dtype == dtype
        assert same_bits(ya, yb)
        dy = torch.randn_like(ya)
        (ya.float() * dy.float()).sum().backward()
        (yb.float() * dy.float()).sum().backward()
        assert same_bits(xa.grad, xb.grad)
        ga, gb = la.get_gradients(zero=True), lb.get_gradients(zero=True)
        for k in ga:
            assert same_bits(ga[k], gb[k]), k
        assert block_casts[True] >= step + 1 if recipe else block_casts[True] == 0
        # Each backward's grad_output crossed as its FP8 cast (on the Train stream).
        assert exact.exact_fp8_gradients == step + 1


@pytest.mark.parametrize("recipe", [module_pb2.CURRENT, module_pb2.BLOCK, module_pb2.MXFP8],
                         ids=["current", "block", "mxfp8"])
def test_large_inputs_through_shared_memory_keep_the_bits(pair, block_casts, recipe):
    """Through the client's shared-memory region: the codes (both copies in training under the
    block recipes) lie in the region, the scales in the request's header."""
    exact, f32 = pair
    spec = spec_of(module_pb2.LINEAR, recipe, seed=31)
    spec.in_features = spec.out_features = 256
    a = exact.create_module(spec).module_id
    b = f32.create_module(spec).module_id
    x = torch.randn(300, 256)
    before = exact.shared_memory_calls
    ya, ca, _ = exact.forward(a, x, True)
    yb, cb, _ = f32.forward(b, x, True)
    assert same_bits(ya, yb)
    dy = awkward(300, 256, 32)
    sent = exact.shared_memory_calls
    assert same_bits(exact.backward(ca, dy), f32.backward(cb, dy))
    # grad_output's FP8 cast (both copies under the block recipes) lay in the region, its column
    # sums in the request.
    assert exact.exact_fp8_gradients == 1
    if not exact._shm.off:
        assert exact.shared_memory_calls == sent + 1
    ga, gb = exact.get_gradients(a), f32.get_gradients(b)
    for k in ga:
        assert same_bits(ga[k], gb[k]), k
    x = torch.randn(300, 256)
    assert same_bits(exact.forward(a, x, False)[0], f32.forward(b, x, False)[0])
    if recipe in BLOCKS:
        # Encoded once per forward (twice where a region could not be had and it went over the
        # wire after all).
        assert block_casts[True] >= 1 and block_casts[False] >= 1
    if not exact._shm.off:
        assert exact.shared_memory_calls >= before + 3


# --- grad_output under the exact wire: the rule, the column sums, the encoding


def info_of(module_id, spec, row_order_bias_sums):
    return module_pb2.ModuleInfo(module_id=module_id, spec=spec,
                                 row_order_bias_sums=row_order_bias_sums)


def test_the_rule_of_grad_outputs_form():
    """kinds.exact_grad_output: every kind (KindDescription.fp8_grad_output); E5M2 under CURRENT
    and unspecified with margin 0, E4M3 under BLOCK (E5M2 with HYBRID) and MXFP8; F32 under
    DELAYED, with a margin, and for a module with a bias whose server does not sum columns in
    row order."""
    for kind in KIND_NAMES:
        assert kinds.describe(kind).fp8_grad_output
        for bias in (True, False):
            for row_order in (True, False):
                for name, (scaling, fmt, want) in GRAD_RECIPES.items():
                    spec = spec_of(kind, scaling, bias=bias, fmt=fmt)
                    got = kinds.exact_grad_output(spec, row_order)
                    assert got == (want if row_order or not bias else None), (kind, name)
                unspecified = spec_of(kind, 0, bias=bias)
                assert kinds.exact_grad_output(unspecified, row_order) == \
                    (E5M2 if row_order or not bias else None)
                margin = spec_of(kind, module_pb2.CURRENT, margin=1, bias=bias)
                assert kinds.exact_grad_output(margin, row_order) is None


SUM_SHAPES = [(1, 1), (1, 5), (2, 1), (7, 3), (300, 1), (129, 127), (129, 128), (200, 300),
              (3, 5, 7), (2, 64, 130)]


def sum_values(shape, seed):
    """Awkward values for sums: magnitudes from 1e-38 to 1e30 (subnormals included), exact
    cancellations (a value and its negation further down), -0.0 columns and columns of one
    huge value among small ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x = x * torch.pow(10.0, torch.randint(-38, 30, shape, generator=g).float())
    m = x.reshape(-1, shape[-1])
    rows, cols = m.shape
    if rows >= 2:
        m[rows // 2:rows // 2 * 2] = -m[:rows // 2]  # each value cancelled later
        m[-1, ::3] += 1.0
    if cols >= 2:
        m[:, 1] = -0.0
    if cols >= 3:
        m[:, 2] = torch.randn(rows, generator=g) * 1e-3
        m[rows // 3, 2] = 3e30
    m[0, 0] = 1e-45  # the smallest subnormal
    return x


@pytest.mark.parametrize("shape", SUM_SHAPES, ids=[str(s) for s in SUM_SHAPES])
@pytest.mark.parametrize("tile", [None, 64])
def test_column_sums_are_the_float32_loops_bit_for_bit(monkeypatch, shape, tile):
    """wire.column_sums equals the definition (a float32 loop down each column from 0.0) bit for
    bit: both of its ways (a numpy add per row for wide matrices, running sums for narrow ones,
    with tiles of rows made small here so that narrow matrices take several)."""
    if tile is not None:
        monkeypatch.setattr(wire, "_TILE", tile)
    for seed in range(3):
        x = sum_values(shape, seed)
        got = wire.column_sums(x)
        assert got.dtype == np.float32 and got.shape == (shape[-1],)
        want = loop_column_sums(x)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (got, want)
        # Through torch's row-by-row additions too.
        assert same_bits(torch.from_numpy(got), row_by_row_sums(x))
        # A view that is not contiguous: the same sums as its copy's.
        t = x.reshape(-1, shape[-1]).t().contiguous().t()
        assert np.array_equal(wire.column_sums(t).view(np.uint32), want.view(np.uint32))


def test_column_sums_of_zeros_and_16_bit_values():
    # -0.0 everywhere: 0.0 + -0.0 is +0.0, as the loop gives (numpy's sum would keep -0.0).
    z = torch.full((4, 3), -0.0)
    assert np.array_equal(wire.column_sums(z).view(np.uint32), np.zeros(3, dtype=np.uint32))
    # A 16-bit tensor: its float32 values (exact widenings) summed.
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(50, 200).to(dtype)
        assert np.array_equal(wire.column_sums(x).view(np.uint32),
                              wire.column_sums(x.float()).view(np.uint32))
    # Overflow: two 3e38 in one column give +inf.
    o = torch.zeros(3, 4)
    o[0, 1] = o[2, 1] = 3e38
    assert np.isposinf(wire.column_sums(o)[1])
    assert wire.column_sums(torch.zeros(0, 5)).tolist() == [0.0] * 5


def test_column_sums_lose_what_the_loop_loses():
    """1.0 and then many values below half its ulp: the loop loses each of them against the
    running sum (a pairwise sum, numpy's along a contiguous axis, would keep most of them)."""
    for cols in (1, 2, 200):
        x = torch.full((8192, cols), 1e-8)
        x[0] = 1.0
        got = wire.column_sums(x)
        assert np.array_equal(got.view(np.uint32), loop_column_sums(x).view(np.uint32))
        assert (got == np.float32(1.0)).all()


@pytest.mark.parametrize("form,block", [(E5M2, 0), (E4M3, 128), (E5M2, 128), (E4M3, 32)])
def test_the_exact_gradient_is_the_casts_codes(form, block):
    x = awkward(150, 300, 5)
    got = wire.encode_exact_gradient(x, form, block, True)
    want = wire.encode_blocks(x, form, block, columnwise=True) if block else \
        wire.encode(x, form)
    assert got.encoded.header == want.header
    assert bytes(got.encoded.data) == bytes(want.data)
    assert np.array_equal(got.column_sums.view(np.uint32), wire.column_sums(x).view(np.uint32))
    assert wire.encode_exact_gradient(x, form, block, False).column_sums is None
    # A NaN or an infinity anywhere, with sums or without: None (it crosses as F32).
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[149, 299] = bad
        assert wire.encode_exact_gradient(y, form, block, True) is None
        assert wire.encode_exact_gradient(y, form, block, False) is None
    # A column whose sum overflows: None with sums; its codes without.
    y = x.clone()
    y[0, 7] = y[1, 7] = 3e38
    assert wire.encode_exact_gradient(y, form, block, True) is None
    assert wire.encode_exact_gradient(y, form, block, False) is not None
    # Nothing to cast.
    assert wire.encode_exact_gradient(torch.zeros(0, 300), form, block, True) is None
    assert wire.encode_exact_gradient(torch.tensor(1.0), form, block, True) is None


@pytest.fixture
def offline():
    """An exact-wire client that only builds requests (nothing listens at its address), told its
    modules' ModuleInfo as the server would (create_module, module_info)."""
    c = gradwire.Client("127.0.0.1:1")
    yield c
    c.close()


def test_the_exact_wire_sends_grad_output_as_the_modules_cast(offline):
    c = offline
    dy = awkward(37, 300, 6)
    for name, (scaling, fmt, want) in GRAD_RECIPES.items():
        for bias in (True, False):
            for row_order in (True, False):
                spec = spec_of(module_pb2.LAYERNORM_LINEAR, scaling, bias=bias, fmt=fmt,
                               out_features=300, ln_output=True)
                m = f"{name}-{bias}-{row_order}"
                c._remember(info_of(m, spec, row_order))
                c._note_context("ctx-" + m, m)
                form = want if row_order or not bias else None
                assert c.exact_grad_output(m) == form
                dln = torch.randn(37, 80)
                req = c.backward_request("ctx-" + m, dy, grad_layernorm_output=dln)
                check_grad_form(req, spec, form, dy)
                # The module named: a context this client did not make.
                other = c.backward_request("someone-elses", dy, module_id=m)
                assert other.message.grad_output.dtype == (form or wire.F32)
    m = "block-True-True"
    # A 16-bit grad_output: the cast of its float32 values; grad_input asked for in its dtype.
    for dtype, code in ((torch.bfloat16, wire.BF16), (torch.float16, wire.F16)):
        low = dy.to(dtype)
        req = c.backward_request("ctx-" + m, low, dtype=code)
        assert req.message.grad_input_dtype == code
        assert req.message.grad_output.dtype == E4M3
        assert req.to_message().grad_output.data == \
            c.backward_request("ctx-" + m, low.float()).to_message().grad_output.data
        assert list(req.message.grad_output_column_sums) == \
            wire.column_sums(low.float()).tolist()
    # An FP8 dtype asked for: the fp8 wire's form (E5M2 with the recipe's row blocks, no
    # columnwise copy, no sums).
    req = c.backward_request("ctx-" + m, dy, dtype=E5M2)
    g = req.message.grad_output
    assert g.dtype == E5M2 and g.block_scales.block_cols == 128
    assert not g.HasField("columnwise_scales") and not req.message.grad_output_column_sums
    # Not the module's width, not finite, or a sum past float32: F32, without sums (the server
    # answers as on the F32 wire).
    for bad in (torch.randn(37, 299), dy.clone().fill_(float("nan"))):
        req = c.backward_request("ctx-" + m, bad)
        assert req.message.grad_output.dtype == wire.F32
        assert not req.message.grad_output_column_sums
    over = dy.clone()
    over[3, 17] = over[30, 17] = 3e38
    req = c.backward_request("ctx-" + m, over)
    assert req.message.grad_output.dtype == wire.F32
    assert not req.message.grad_output_column_sums
    # Building a request sends nothing, so counts nothing.
    assert c.exact_fp8_gradients == 0
    # Other wires: grad_output as their dtype.
    f32 = gradwire.Client("127.0.0.1:1", wire_dtype="f32")
    try:
        f32._remember(info_of(m, c._modules[m], True))
        assert f32.exact_grad_output(m) is None
        assert f32.backward_request("x", dy, module_id=m).message.grad_output.dtype == wire.F32
    finally:
        f32.close()


def backward_outcome(c, m, x, dy):
    """What a training forward of ``x`` and a backward of ``dy`` give: ("ok", grad_input's and
    the gradients' bits) or ("error", code, message)."""
    _, ctx, _ = c.forward(m, x, True)
    try:
        g = c.backward(ctx, dy)
    except gradwire.GradwireError as e:
        try:
            c.release_context(ctx)  # refused before it ran: the context is still there
        except gradwire.GradwireError:
            pass
        c.get_gradients(m, zero=True)
        return ("error", e.code, e.message.split(" [request ")[0].replace(ctx, "<context>"))
    grads = c.get_gradients(m, zero=True)
    return ("ok", g.view(torch.int32), {k: v.view(torch.int32) for k, v in grads.items()})


def same_outcome(got, want):
    assert got[0] == want[0], (got, want)
    if got[0] == "error":
        assert got == want
        return
    assert torch.equal(got[1], want[1])
    assert got[2].keys() == want[2].keys()
    for k in got[2]:
        assert torch.equal(got[2][k], want[2][k]), k


@pytest.mark.parametrize("recipe", ["current", "block", "block-hybrid", "mxfp8"])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf", "overflow"])
@pytest.mark.parametrize("kind", [module_pb2.LINEAR, module_pb2.LAYERNORM_MLP],
                         ids=["linear", "layernorm-mlp"])
def test_a_non_finite_grad_output_crosses_as_itself(pair, kind, recipe, bad):
    """A grad_output with a NaN or an infinity, or whose column sum overflows float32 (two 3e38
    in one column), crosses as F32 without column sums, and the server answers it as on the F32
    wire: the same error, or the same gradients."""
    exact, f32 = pair
    scaling, fmt, _ = GRAD_RECIPES[recipe]
    spec = spec_of(kind, scaling, fmt=fmt, seed=50, out_features=300)
    a = exact.create_module(spec).module_id
    b = f32.create_module(spec).module_id
    x = torch.randn(6, spec.in_features)
    dy = torch.randn(6, 300)
    if bad == "overflow":
        dy[1, 7] = dy[4, 7] = 3e38
    else:
        dy[2, 7] = float(bad)
    req = exact.backward_request("ctx", dy, module_id=a)
    assert req.message.grad_output.dtype == wire.F32
    assert not req.message.grad_output_column_sums
    same_outcome(backward_outcome(exact, a, x, dy), backward_outcome(f32, b, x, dy))
    assert exact.exact_fp8_gradients == 0
    # The next, finite backward: its FP8 cast again, and the F32 wire's bits.
    dy = torch.randn(6, 300)
    same_outcome(backward_outcome(exact, a, x, dy), backward_outcome(f32, b, x, dy))
    assert exact.exact_fp8_gradients == 1
    exact.delete_module(a)
    f32.delete_module(b)


@pytest.mark.parametrize("recipe", ["current", "block-hybrid", "mxfp8"])
def test_chunked_backwards_keep_the_bits(server, recipe):
    """Backwards on the chunked calls: the FP8 codes (both copies) in chunks, the column sums in
    the header."""
    exact = gradwire.Client(server, chunking="always", shared_memory="off")
    f32 = gradwire.Client(server, wire_dtype="f32", chunking="always", shared_memory="off")
    try:
        scaling, fmt, _ = GRAD_RECIPES[recipe]
        spec = spec_of(module_pb2.LAYERNORM_LINEAR, scaling, fmt=fmt, seed=60, out_features=300,
                       ln_output=True)
        a = exact.create_module(spec).module_id
        b = f32.create_module(spec).module_id
        for rows in (9, 140):
            x = torch.randn(rows, spec.in_features)
            ya, ca, la = exact.forward(a, x, True)
            yb, cb, lb = f32.forward(b, x, True)
            assert same_bits(ya, yb) and same_bits(la, lb)
            dy, dln = awkward(rows, 300, rows), torch.randn(rows, spec.in_features)
            calls = exact.chunked_calls
            assert same_bits(exact.backward(ca, dy, grad_layernorm_output=dln),
                             f32.backward(cb, dy, grad_layernorm_output=dln))
            assert exact.chunked_calls == calls + 1
            ga, gb = exact.get_gradients(a, zero=True), f32.get_gradients(b, zero=True)
            for k in ga:
                assert same_bits(ga[k], gb[k]), k
        assert exact.exact_fp8_gradients == 2
        exact.delete_module(a)
        f32.delete_module(b)
    finally:
        exact.close()
        f32.close()
