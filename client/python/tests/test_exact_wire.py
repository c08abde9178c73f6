"""The exact wire, the default: a forward's input to a module that casts it to E4M3 first in a
way the client repeats bit for bit (a Linear under CURRENT with margin 0, BLOCK or MXFP8) crosses
as that cast: codes and scale_inv under CURRENT, codes and block scales (1 x 128 under BLOCK,
1 x 32 under MXFP8) with the columnwise copy in training under the block recipes; everything else
as "f32" sends it. Every kind and recipe gives "f32"'s results bit for bit: outputs, input
gradients, weight gradients and the weights after optimizer steps."""

import pytest
import torch

import gradwire
from gradwire import kinds, wire
from gradwire.v1 import module_pb2


def spec_of(kind, recipe, margin=0, bias=True, seed=0, ln_output=False, activation=None):
    spec = module_pb2.ModuleSpec(kind=kind, in_features=80, out_features=48, bias=bias,
                                 seed=seed)
    spec.recipe.scaling = recipe
    spec.recipe.margin = margin
    if kind == module_pb2.LAYERNORM_MLP:
        spec.out_features = 80
        spec.ffn_features = 64
        spec.activation = activation or module_pb2.GELU
    if ln_output:
        spec.return_layernorm_output = True
    return spec


RECIPES = [module_pb2.CURRENT, module_pb2.DELAYED, module_pb2.BLOCK, module_pb2.MXFP8]
CASES = [
    ("linear-current", spec_of(module_pb2.LINEAR, module_pb2.CURRENT, seed=1), True),
    ("linear-unspecified-nobias", spec_of(module_pb2.LINEAR, 0, bias=False, seed=2), True),
    ("linear-current-margin", spec_of(module_pb2.LINEAR, module_pb2.CURRENT, 1, seed=3), False),
    ("linear-delayed", spec_of(module_pb2.LINEAR, module_pb2.DELAYED, seed=4), False),
    ("linear-block", spec_of(module_pb2.LINEAR, module_pb2.BLOCK, seed=5), True),
    ("linear-mxfp8", spec_of(module_pb2.LINEAR, module_pb2.MXFP8, seed=6), True),
] + [
    (f"layernorm-linear-{module_pb2.ScalingRecipe.Name(r).lower()}",
     spec_of(module_pb2.LAYERNORM_LINEAR, r, seed=7, ln_output=True), False) for r in RECIPES
] + [
    (f"layernorm-mlp-{module_pb2.ScalingRecipe.Name(r).lower()}",
     spec_of(module_pb2.LAYERNORM_MLP, r, seed=8, activation=module_pb2.SWIGLU), False)
    for r in RECIPES
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


@pytest.mark.parametrize("name,spec,fp8_input", CASES, ids=[c[0] for c in CASES])
def test_every_kind_and_recipe_gives_the_f32_wires_bits(pair, block_casts, name, spec,
                                                        fp8_input):
    exact, f32 = pair
    assert kinds.exact_fp8_input(spec) == fp8_input
    a = exact.create_module(spec).module_id
    b = f32.create_module(spec).module_id
    assert exact.exact_fp8_input(a) == fp8_input
    assert not f32.exact_fp8_input(b)
    # The server names the recipe the module got: the block length comes from it.
    assert exact.fp8_block(a) == BLOCKS.get(spec.recipe.scaling, 0)
    block_input = fp8_input and spec.recipe.scaling in BLOCKS
    ln = spec.return_layernorm_output
    for step in range(3):
        rows = 5 + 11 * step
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
        dy = torch.randn_like(ya)
        dln = torch.randn(rows, spec.in_features) if ln else None
        ga = exact.backward(ca, dy, grad_layernorm_output=dln)
        gb = f32.backward(cb, dy, grad_layernorm_output=dln)
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


@pytest.mark.parametrize("recipe", [None, "block", "mxfp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_remote_modules_train_with_the_f32_wires_bits(pair, block_casts, dtype, recipe):
    """Through RemoteLinear and autograd (the Train stream), bfloat16 and float16 inputs
    included: their output comes back in their own dtype (as with "f32"), the input as E4M3
    codes: with one scale (the fixture server's default, CURRENT), or with block scales and the
    columnwise copy under BLOCK and MXFP8."""
    exact, f32 = pair
    la = gradwire.RemoteLinear(exact, 64, 40, seed=21, recipe=recipe)
    lb = gradwire.RemoteLinear(f32, 64, 40, seed=21, recipe=recipe)
    assert exact.exact_fp8_input(la.module_id)
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
    dy = torch.randn_like(ya)
    assert same_bits(exact.backward(ca, dy), f32.backward(cb, dy))
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
