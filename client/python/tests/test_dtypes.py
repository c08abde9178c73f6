"""dtypes are real: bfloat16 and float16 inputs travel as such when the client's wire dtype is
f32, outputs and gradients come back in the input's dtype, autocast casts the input as it would
a local Linear's, .half()/.double() change the parameters, and a non-float input is refused."""

import pytest
import torch

import gradwire
from gradwire import wire
from gradwire.client import Client


@pytest.fixture
def sent(monkeypatch):
    """The wire dtypes of the tensors forward and backward requests carried."""
    seen = []
    forward_request, backward_request = Client.forward_request, Client.backward_request

    def fwd(self, *args, **kwargs):
        req = forward_request(self, *args, **kwargs)
        seen.append(("forward", req.input.dtype, req.output_dtype))
        return req

    def bwd(self, *args, **kwargs):
        req = backward_request(self, *args, **kwargs)
        seen.append(("backward", req.grad_output.dtype, req.grad_input_dtype))
        return req

    monkeypatch.setattr(Client, "forward_request", fwd)
    monkeypatch.setattr(Client, "backward_request", bwd)
    return seen


@pytest.mark.parametrize("form", ["exact", "f32"])
@pytest.mark.parametrize("dtype, code", [(torch.bfloat16, wire.BF16), (torch.float16, wire.F16)])
def test_16_bit_inputs_travel_as_such(server, sent, form, dtype, code):
    """Under "f32" and "exact" a 16-bit tensor travels in its own dtype; "exact" sends a Linear's
    input as the server's E4M3 cast of it instead, and grad_output as its E5M2 cast (CURRENT, the
    fixture server's default) with its column sums (the output and grad_input still come back in
    16 bits)."""
    client = gradwire.Client(server, wire_dtype=form)
    m = gradwire.RemoteLinear(client, 16, 8, seed=3)
    x = torch.randn(4, 16).to(dtype).requires_grad_()
    y = m(x)
    assert y.dtype == dtype
    y.float().sum().backward()
    assert x.grad.dtype == dtype and x.grad.abs().sum() > 0
    sent_input = wire.FP8_E4M3 if form == "exact" else code
    sent_grad = wire.FP8_E5M2 if form == "exact" else code
    assert sent == [("forward", sent_input, code), ("backward", sent_grad, code)]
    # The server got exactly x and rounded its float32 output once, to dtype.
    with torch.no_grad():
        assert torch.equal(m.eval()(x), m(x.float()).to(dtype))


def test_a_narrower_client_wire_dtype_wins(server, sent):
    with gradwire.Client(server, wire_dtype="fp8") as c:
        m = gradwire.RemoteLinear(c, 16, 8)
        y = m(torch.randn(4, 16, dtype=torch.bfloat16))
        assert y.dtype == torch.bfloat16
        assert sent[0] == ("forward", wire.FP8_E4M3, wire.FP8_E4M3)


@pytest.mark.parametrize("form", ["exact", "f32"])
def test_float32_and_float64_travel_as_f32(server, sent, form):
    """Their outputs come back as F32; "exact" sends a Linear's input as its E4M3 cast, a
    LayerNormLinear's as F32."""
    client = gradwire.Client(server, wire_dtype=form)
    m = gradwire.RemoteLinear(client, 16, 8)
    assert m(torch.randn(2, 16, dtype=torch.float64)).dtype == torch.float64
    assert m(torch.randn(2, 16)).dtype == torch.float32
    ln = gradwire.RemoteLayerNormLinear(client, 16, 8)
    assert ln(torch.randn(2, 16)).dtype == torch.float32
    linear_input = wire.FP8_E4M3 if form == "exact" else wire.F32
    assert [s[1:] for s in sent] == [(linear_input, wire.F32)] * 2 + [(wire.F32, wire.F32)]


@pytest.mark.parametrize("form", ["exact", "f32"])
def test_autocast_casts_the_input(server, sent, form):
    client = gradwire.Client(server, wire_dtype=form)
    m = gradwire.RemoteLinear(client, 16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    sent_input = wire.FP8_E4M3 if form == "exact" else wire.BF16
    assert sent[0] == ("forward", sent_input, wire.BF16)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32  # through autocast's own cast


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.uint8])
def test_non_float_input_is_refused(client, dtype):
    m = gradwire.RemoteLinear(client, 4, 2)
    with pytest.raises(TypeError, match="not a floating-point dtype"):
        m(torch.ones(3, 4, dtype=dtype))
    with pytest.raises(TypeError, match="not a floating-point dtype"):
        gradwire.RemoteSequential([m])(torch.ones(3, 4, dtype=dtype))
    assert client.server_info().live_contexts == 0


def test_half_and_double_change_the_parameters(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=1)
    server = client.get_weights(m.module_id)
    m.half()
    assert all(p.dtype == torch.float16 for p in m.parameters())
    assert m.state_dict()["weight"].dtype == torch.float16
    assert torch.equal(m.weight, server["weight"].half())  # pulled in float16
    x = torch.randn(3, 8, dtype=torch.float16, requires_grad=True)
    m(x).float().sum().backward()
    assert m.weight.grad.dtype == torch.float16
    m.double()
    assert m.weight.dtype == torch.float64
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    y = m(torch.randn(3, 8, dtype=torch.float64))  # the step, pushed first
    assert y.dtype == torch.float64
    assert torch.allclose(client.get_weights(m.module_id)["weight"], m.weight.float())
