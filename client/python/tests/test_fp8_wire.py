"""FP8 (and 16-bit) on the wire: the client's encoder and decoder agree bit for bit with the
server's codec, on every FP8 code and on fresh random tensors; training with wire_dtype="fp8"."""

import os

import pytest
import torch

import gradwire
from gradwire import wire
from gradwire.v1 import module_pb2, service_pb2

FORMATS = [wire.FP8_E4M3, wire.FP8_E5M2]


def finite_codes(dtype):
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    values = wire.fp8_decode(codes, dtype)
    return codes[torch.isfinite(values)]


def random_values(n, seed):
    """Values over many binades, both signs, some in the FP8 subnormal range after scaling."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    magnitudes = torch.pow(10.0, torch.randint(-6, 4, (n,), generator=g).float())
    return (x * magnitudes).float()


@pytest.mark.parametrize("dtype", FORMATS)
def test_every_finite_code_decodes_as_the_server_does(client, dtype):
    codes = finite_codes(dtype)
    n = codes.numel()  # 254 for E4M3, 248 for E5M2
    rows = 2 if dtype == wire.FP8_E4M3 else 8
    layer = gradwire.RemoteLinear(client, n // rows, rows, bias=False)
    scale_inv = 0.0078125 * 3  # not a power of two: the multiply rounds
    req = service_pb2.SetWeightsRequest(module_id=layer.module_id)
    req.parameters.add(name="weight", tensor=wire.tensor_pb2.Tensor(
        dtype=dtype, shape=[rows, n // rows], data=codes.numpy().tobytes(), scale_inv=scale_inv))
    client.set_weights_message(req)
    server = client.get_weights(layer.module_id)["weight"].flatten()
    ours = wire.from_wire(req.parameters[0].tensor).flatten()
    assert torch.equal(server.view(torch.int32), ours.view(torch.int32))
    # And the encoder takes every decoded value back to its code.
    assert torch.equal(wire.fp8_encode(wire.fp8_decode(codes, dtype), dtype), codes)


@pytest.mark.parametrize("dtype", FORMATS)
def test_nan_and_inf_codes_are_refused(client, dtype):
    layer = gradwire.RemoteLinear(client, 4, 1, bias=False)
    bad = 0x7F if dtype == wire.FP8_E4M3 else 0x7C  # NaN / +inf
    req = service_pb2.SetWeightsRequest(module_id=layer.module_id)
    req.parameters.add(name="weight", tensor=wire.tensor_pb2.Tensor(
        dtype=dtype, shape=[1, 4], data=bytes([1, 2, bad, 3]), scale_inv=1.0))
    with pytest.raises(gradwire.GradwireError) as e:
        client.set_weights_message(req)
    assert e.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("dtype", FORMATS + [wire.BF16, wire.F16])
def test_random_tensors_encode_as_the_server_does(client, dtype):
    seed = int.from_bytes(os.urandom(4), "little")
    layer = gradwire.RemoteLinear(client, 97, 31, bias=True)
    w = {"weight": random_values(97 * 31, seed).reshape(31, 97),
         "bias": random_values(31, seed + 1) * 1e-3}
    client.set_weights(layer.module_id, w)  # F32: exact
    resp = client.get_weights_message(layer.module_id, dtype)
    for p in resp.parameters:
        ours = wire.to_wire(w[p.name], dtype)
        assert p.tensor.dtype == dtype
        assert ours.data == p.tensor.data, f"{p.name} (seed {seed})"
        assert ours.scale_inv == p.tensor.scale_inv


def test_fp8_wire_trains(server):
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    fp8 = gradwire.Client(server, wire_dtype="fp8")
    f32 = gradwire.Client(server)
    try:
        a = gradwire.RemoteLinear(fp8, 32, 16, seed=9)
        b = gradwire.RemoteLinear(f32, 32, 16, seed=9)
        x = torch.randn(8, 32)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = a(xa), b(xb)
        # The Linear uses the E4M3 codes it was sent, as the f32 client's server-side cast does
        # (same current scaling): the outputs agree to fp32 rounding, returned in E4M3.
        assert torch.allclose(ya, yb, rtol=0.07, atol=0.07 * yb.abs().max().item())
        dy = torch.randn(8, 16)
        ya.backward(dy)
        yb.backward(dy)
        assert torch.allclose(xa.grad, xb.grad, rtol=0.3, atol=0.3 * xb.grad.abs().max().item())
        # optimizer="local": each backward moved the server's weight gradients into .grad.
        ga, gb = a.weight.grad, b.weight.grad
        assert gb.abs().sum() > 0
        assert torch.allclose(ga, gb, rtol=1e-5, atol=1e-5 * gb.abs().max().item())
    finally:
        fp8.close()
        f32.close()


def worst_row_error(y, ref, rows):
    """The largest, over ``rows``, of a row's largest |y - ref| over its largest |ref|."""
    errors = [((y[r] - ref[r]).abs().max() / ref[r].abs().max()).item() for r in rows]
    return max(errors)


@pytest.mark.parametrize("recipe,block", [(module_pb2.BLOCK, 128), (module_pb2.MXFP8, 32)],
                         ids=["block", "mxfp8"])
def test_fp8_wire_block_scales_keep_an_outlier_to_its_row(server, recipe, block):
    """wire_dtype="fp8" to a module under a block recipe: its input and output gradient cross as
    E4M3 / E5M2 with block scales of 1 x the recipe's block length, and the server answers the
    output and grad_input in the same form. One outlier of 3e6 in row 0 (of the input, then of
    the output gradient) leaves rows 1..31 as close to the F32 wire's result as a clean batch's
    rows are: with one scale per tensor they would round to zero."""
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    fp8 = gradwire.Client(server, wire_dtype="fp8")
    f32 = gradwire.Client(server, wire_dtype="f32")
    try:
        spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=256, out_features=128,
                                     bias=True, seed=int.from_bytes(os.urandom(2), "little"))
        spec.recipe.scaling = recipe
        m = f32.create_module(spec).module_id
        assert fp8.fp8_block(m) == block
        x = torch.randn(32, 256)
        dirty = x.clone()
        dirty[0, 7] = 3e6
        rest = range(1, 32)

        # The forms on the wire, both ways.
        req = fp8.forward_request(m, dirty, False)
        assert req.message.input.dtype == wire.FP8_E4M3
        assert (req.message.input.block_scales.block_rows,
                req.message.input.block_scales.block_cols) == (1, block)
        assert not req.message.input.HasField("columnwise_scales")
        resp = fp8._call("Forward", req.to_message(), m)
        assert resp.output.dtype == wire.FP8_E4M3 and resp.output.scale_inv == 0
        assert resp.output.block_scales.block_cols == block
        assert len(resp.output.block_scales.scale_inv) == 4 * 32 * (-(-128 // block))

        # Forward: inference and training alike.
        def forward(c, t, training):
            y, ctx, _ = c.forward(m, t, training)
            if ctx:
                c.release_context(ctx)
            return y

        for training in (False, True):
            clean = forward(fp8, x, training)
            ref = forward(f32, x, training)
            y = forward(fp8, dirty, training)
            ref_dirty = forward(f32, dirty, training)
            assert torch.equal(ref_dirty[1:], ref[1:])  # the server's own rows are apart
            clean_error = worst_row_error(clean, ref, rest)
            assert 0 < clean_error < 0.1
            assert worst_row_error(y, ref_dirty, rest) <= 1.5 * clean_error

        # Backward: an outlier in the output gradient's row 0.
        _, ctx_fp8, _ = fp8.forward(m, x, True)
        _, ctx_f32, _ = f32.forward(m, x, True)
        dy = torch.randn(32, 128)
        dirty_dy = dy.clone()
        dirty_dy[0, 5] = 3e6
        bwd = fp8.backward_request(ctx_fp8, dirty_dy, retain=True)
        assert bwd.message.grad_output.dtype == wire.FP8_E5M2
        assert bwd.message.grad_output.block_scales.block_cols == block
        answer = fp8._call("Backward", bwd.to_message(), ctx_fp8)
        assert answer.grad_input.dtype == wire.FP8_E5M2
        assert answer.grad_input.block_scales.block_cols == block
        clean = fp8.backward(ctx_fp8, dy, retain=True)
        ref = f32.backward(ctx_f32, dy, retain=True)
        g = fp8.backward(ctx_fp8, dirty_dy)
        ref_dirty = f32.backward(ctx_f32, dirty_dy)
        clean_error = worst_row_error(clean, ref, rest)
        assert 0 < clean_error < 0.5
        assert worst_row_error(g, ref_dirty, rest) <= 1.5 * clean_error
        # With one scale per tensor (a CURRENT module of the same weights), the outlier's scale
        # takes the other rows: what the block scales spare them.
        per_tensor = module_pb2.ModuleSpec()
        per_tensor.CopyFrom(spec)
        per_tensor.recipe.scaling = module_pb2.CURRENT
        c = f32.create_module(per_tensor).module_id
        f32.set_weights(c, f32.get_weights(m))
        y = fp8.forward(c, dirty, False)[0]
        assert worst_row_error(y, forward(f32, dirty, False), rest) > 0.5
        f32.delete_module(m)
        f32.delete_module(c)
    finally:
        fp8.close()
        f32.close()
