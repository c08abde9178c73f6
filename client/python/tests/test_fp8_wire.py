"""FP8 (and 16-bit) on the wire: the client's encoder and decoder agree bit for bit with the
server's codec, on every FP8 code and on fresh random tensors; training with wire_dtype="fp8"."""

import os

import pytest
import torch

import gradwire
from gradwire import wire
from gradwire.v1 import service_pb2

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
