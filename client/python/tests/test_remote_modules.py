"""Remote modules from PyTorch: gradients against float64 references, context lifetimes,
weights in safetensors, and the digits example in a shortened form."""

import gc
import os
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F

import gradwire

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))

E4M3 = (4, 3, 448.0)
E5M2 = (5, 2, 57344.0)


def fake_fp8(x: torch.Tensor, fmt) -> torch.Tensor:
    """float64 value of x cast to FP8 with per-tensor current scaling (as the server casts it):
    round to nearest even at the format's precision, saturate, then undo the scale."""
    exponent_bits, mantissa_bits, fp8_max = fmt
    x = x.detach().float()
    amax = x.abs().max().item()
    scale = torch.tensor(fp8_max / amax if amax > 0 else 1.0, dtype=torch.float32)
    v = (x * scale).double()  # the multiply happens in fp32 on the server
    a = v.abs()
    min_exp = 2 - (1 << (exponent_bits - 1))
    exp = torch.floor(torch.log2(a.clamp(min=2.0 ** min_exp))).clamp(min=min_exp)
    quantum = torch.pow(2.0, exp - mantissa_bits)
    r = torch.round(a / quantum) * quantum
    r = torch.where(a >= fp8_max, torch.tensor(fp8_max, dtype=torch.float64), r.clamp(max=fp8_max))
    return torch.sign(v) * r * (1.0 / scale).double()


def live_contexts(client):
    return client.server_info().live_contexts


def close_to_sum(actual, expected, terms, rel=2e-5):
    """Within fp32 accumulation error of a sum whose |terms| add up to ``terms``."""
    excess = (actual.double() - expected).abs() - (rel * terms + 1e-6)
    return excess.max().item() <= 0


def test_linear_gradients_match_float64_on_dequantized_operands(client):
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    m = gradwire.RemoteLinear(client, 24, 10, seed=3)
    w = m.get_weights()
    x = torch.randn(7, 24, requires_grad=True)
    dy = torch.randn(7, 10)
    y = m(x)
    assert live_contexts(client) == 1
    y.backward(dy)
    assert live_contexts(client) == 0  # backward freed the context

    xq, wq, dyq = fake_fp8(x, E4M3), fake_fp8(w["weight"], E4M3), fake_fp8(dy, E5M2)
    b = w["bias"].double()
    assert close_to_sum(y.detach(), xq @ wq.T + b, xq.abs() @ wq.abs().T + b.abs())
    assert close_to_sum(x.grad, dyq @ wq, dyq.abs() @ wq.abs())
    g = {"weight": m.weight.grad, "bias": m.bias.grad}  # GetGradients, mirrored into .grad
    assert close_to_sum(g["weight"], dyq.T @ xq, dyq.abs().T @ xq.abs())
    assert torch.allclose(g["bias"].double(), dy.double().sum(0), rtol=1e-5, atol=1e-5)


def test_layernorm_mlp_gradients_match_float64_autograd(client):
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))
    m = gradwire.RemoteLayerNormMLP(client, 32, 48, activation="swiglu", seed=5)
    w = {k: v.double().requires_grad_() for k, v in m.get_weights().items()}
    x = torch.randn(2, 9, 32, requires_grad=True)
    dy = torch.randn(2, 9, 32)
    m(x).backward(dy)

    x64 = x.detach().double().requires_grad_()
    h = F.layer_norm(x64, (32,), w["layer_norm_weight"], w["layer_norm_bias"], 1e-5)
    h = F.linear(h, w["fc1_weight"], w["fc1_bias"])
    a, gate = h.chunk(2, dim=-1)
    y64 = F.linear(F.silu(a) * gate, w["fc2_weight"], w["fc2_bias"])
    y64.backward(dy.double())
    rel = (x.grad.double() - x64.grad).norm() / x64.grad.norm()
    assert rel < 0.25, f"grad_input relative error {rel:.3f}"
    grads = dict((n, p.grad) for n, p in m.named_parameters())
    for name in ("fc1_weight", "fc2_weight", "layer_norm_weight"):
        rel = (grads[name].double() - w[name].grad).norm() / w[name].grad.norm()
        assert rel < 0.25, f"{name} relative error {rel:.3f}"


def test_no_grad_and_inference_mode_leave_nothing_on_the_server(client):
    m = gradwire.RemoteLinear(client, 8, 4)
    x = torch.randn(3, 8, requires_grad=True)
    with torch.no_grad():
        y = m(x)
    assert not y.requires_grad
    with torch.inference_mode():
        y = m(x)
    assert not y.requires_grad
    # eval, and nothing needs a gradient: a server optimizer's parameters are frozen here (a
    # local layer's would need one, and then keep the graph as nn.Linear's do).
    frozen = gradwire.RemoteLinear(client, 8, 4, optimizer="sgd", lr=0.1).eval()
    y = frozen(torch.randn(3, 8))
    assert y.grad_fn is None
    assert live_contexts(client) == 0
    assert m.eval()(torch.randn(3, 8)).grad_fn is not None  # as nn.Linear(8, 4).eval() gives


def test_eval_keeps_the_graph_as_a_local_layer_does(client):
    # eval() changes a layer's behaviour, not autograd: a gradient still flows through the
    # remote layer to the layers before it.
    torch.manual_seed(0)
    first = torch.nn.Linear(8, 8)
    m = torch.nn.Sequential(first, gradwire.RemoteLinear(client, 8, 4, seed=3)).eval()
    x = torch.randn(3, 8, requires_grad=True)
    y = m(x)
    assert y.requires_grad
    y.sum().backward()
    assert first.weight.grad is not None and first.weight.grad.abs().sum() > 0
    # The gradient is the one a local fp32 twin gives, within FP8's tolerance.
    twin = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)).eval()
    twin.load_state_dict(m.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    twin(x2).sum().backward()
    assert torch.allclose(x.grad, x2.grad, rtol=0.25, atol=0.125)
    assert live_contexts(client) == 0


def test_dropping_a_graph_releases_its_context(client):
    m = gradwire.RemoteLinear(client, 8, 4)
    y = m(torch.randn(3, 8, requires_grad=True))
    assert live_contexts(client) == 1
    del y
    gc.collect()
    assert live_contexts(client) == 0


def test_first_layer_without_input_grad_still_trains(client):
    m = gradwire.RemoteLinear(client, 8, 4, optimizer="sgd", lr=0.1)
    before = m.get_weights()["weight"]
    x = torch.randn(16, 8)  # data: no gradient wanted
    (m(x) ** 2).mean().backward()
    assert m.get_gradients()["weight"].abs().sum() > 0
    assert m.apply_gradients() == 2
    assert not torch.equal(m.get_weights()["weight"], before)


def test_server_errors_become_exceptions_and_change_nothing(client):
    m = gradwire.RemoteLinear(client, 8, 4)
    with pytest.raises(gradwire.GradwireError) as e:
        m(torch.randn(3, 7))
    assert e.value.code == "INVALID_ARGUMENT" and "input.shape" in e.value.message
    assert live_contexts(client) == 0


def test_safetensors_round_trip_is_bit_exact(client):
    a = gradwire.RemoteLayerNormLinear(client, 12, 6, seed=1)
    b = gradwire.RemoteLayerNormLinear(client, 12, 6, seed=2)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "a.safetensors")
        a.export_safetensors(path)
        b.import_safetensors(path)
    wa, wb = a.get_weights(), b.get_weights()
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_bf16_wire_trains_too(server):
    c = gradwire.Client(server, wire_dtype="bf16")
    m = gradwire.RemoteLinear(c, 8, 4)
    x = torch.randn(5, 8, requires_grad=True)
    m(x).sum().backward()
    assert x.grad.shape == (5, 8) and x.grad.abs().sum() > 0
    c.close()


def test_digits_example_shortened(client):
    import digits
    history = digits.train(client, epochs=4, seed=0, log=lambda s: None)
    assert history["fp8_acc"][-1] >= 0.90, history
    assert abs(history["fp8_acc"][-1] - history["f32_acc"][-1]) <= 0.02, history


def test_safetensors_files_interoperate_with_the_cli(client, server):
    import subprocess
    from conftest import CLI_BIN
    from gradwire import safetensors
    a = gradwire.RemoteLinear(client, 8, 4, seed=1)
    b = gradwire.RemoteLinear(client, 8, 4, seed=2)
    with tempfile.TemporaryDirectory() as d:
        ours, theirs = os.path.join(d, "py.safetensors"), os.path.join(d, "cli.safetensors")
        a.export_safetensors(ours)
        run = subprocess.run([CLI_BIN, "weights", "import", "--server", server, "--module",
                              b.module_id, ours], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        assert all(torch.equal(a.get_weights()[k], b.get_weights()[k]) for k in ("weight", "bias"))
        run = subprocess.run([CLI_BIN, "weights", "export", "--server", server, "--module",
                              b.module_id, theirs], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        tensors, metadata = safetensors.load(theirs)
        assert metadata["module_id"] == b.module_id
        assert torch.equal(tensors["weight"], a.get_weights()["weight"])


def test_output_and_grad_follow_the_input_dtype(client):
    m = gradwire.RemoteLinear(client, 8, 4)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = m(x)
    assert y.dtype == torch.float64
    y.sum().backward()
    assert x.grad.dtype == torch.float64 and x.grad.abs().sum() > 0


def test_an_empty_batch_gives_an_empty_output_as_nn_linear_does(client):
    m = gradwire.RemoteLinear(client, 8, 4)
    local = torch.nn.Linear(8, 4)
    for shape in ((0, 8), (2, 0, 8)):
        x = torch.randn(*shape, requires_grad=True)
        y = m(x)
        assert y.shape == local(x).shape == shape[:-1] + (4,)
        y.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
    assert m.weight.grad is not None and torch.equal(m.weight.grad, torch.zeros(4, 8))
    with torch.no_grad():
        assert m(torch.randn(0, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert live_contexts(client) == 0


def test_a_size_that_is_not_a_whole_number_is_named(client):
    before = len(client.list_modules())
    with pytest.raises(TypeError, match="in_features must be an int, got float 8.0"):
        gradwire.RemoteLinear(client, 8.0, 4)
    with pytest.raises(TypeError, match="out_features must be an int, got bool"):
        gradwire.RemoteLinear(client, 8, True)
    with pytest.raises(ValueError, match="in_features must be at least 1, got 0"):
        gradwire.RemoteLayerNormLinear(client, 0, 4)
    with pytest.raises(TypeError, match="ffn_hidden_size must be an int"):
        gradwire.RemoteLayerNormMLP(client, 8, "16")
    with pytest.raises(TypeError, match="hidden_size must be an int"):
        gradwire.RemoteLayerNormMLP(client, 8.5, 16)
    assert len(client.list_modules()) == before  # refused before anything was sent
