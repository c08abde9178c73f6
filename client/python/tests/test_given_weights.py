"""Forwards on weights given from outside the module: functional_call, parametrizations,
weight_norm and pruning. What the forward sees is what the server computes with, and the
gradient reaches the given tensors (and through them what made them)."""

import pytest
import torch
import torch.nn.utils.parametrize as parametrize
import torch.nn.utils.prune as prune

import gradwire


def reference(client, m, weights, x, seed=0):
    """Output and weight gradients of a fresh module with ``weights`` set, on ``x``."""
    ref = gradwire.RemoteLinear(client, m.spec.in_features, m.spec.out_features, seed=seed)
    ref.set_weights({k: v.detach().float() for k, v in weights.items()})
    y = ref(x)
    y.square().sum().backward()
    return y.detach(), {k: p.grad for k, p in ref.named_parameters()}


def check_functional_call(client, call):
    m = gradwire.RemoteLinear(client, 8, 4, seed=11)
    own = m.get_weights()
    w = torch.randn(4, 8, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    x = torch.randn(5, 8)
    y = call(m, {"weight": w, "bias": b}, (x,))
    y.square().sum().backward()
    want_y, want_grads = reference(client, m, {"weight": w, "bias": b}, x)
    assert torch.equal(y.detach(), want_y)
    assert torch.equal(w.grad, want_grads["weight"]) and torch.equal(b.grad, want_grads["bias"])
    assert m.weight.grad is None and m.bias.grad is None  # the module's own got nothing
    now = m.get_weights()
    assert all(torch.equal(own[k], now[k]) for k in own)  # its weights are unchanged
    # Only the weight given: the bias is the module's own, and its gradient goes to it.
    w.grad = None
    y = call(m, {"weight": w}, (x,))
    y.square().sum().backward()
    want_y, want_grads = reference(client, m, {"weight": w, "bias": own["bias"]}, x)
    assert torch.equal(y.detach(), want_y)
    assert torch.equal(w.grad, want_grads["weight"])
    assert torch.equal(m.bias.grad, want_grads["bias"])
    # The module itself computes with its own weights again.
    want_y = reference(client, m, own, x)[0]
    with torch.no_grad():
        assert torch.equal(m(x), want_y)


def test_functional_call_uses_the_given_weights(client):
    from torch.nn.utils import stateless
    check_functional_call(client, stateless.functional_call)


@pytest.mark.skipif(not hasattr(getattr(torch, "func", None), "functional_call"),
                    reason=f"torch.func.functional_call needs torch 2, this is {torch.__version__}")
def test_torch_func_functional_call_uses_the_given_weights(client):
    check_functional_call(client, torch.func.functional_call)


class Double(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_parametrization_is_what_the_server_computes_with(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=12)
    w0 = m.get_weights()
    x = torch.randn(5, 8)
    parametrize.register_parametrization(m, "weight", Double())
    y = m(x)
    y.square().sum().backward()
    want_y, want_grads = reference(client, m, {"weight": 2 * w0["weight"], "bias": w0["bias"]},
                                   x)
    assert torch.equal(y.detach(), want_y)
    original = m.parametrizations.weight.original
    assert torch.equal(original.grad, 2 * want_grads["weight"])  # through the parametrization
    assert torch.equal(m.bias.grad, want_grads["bias"])
    # A local optimizer trains the original; the next forward computes with the new value.
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    opt.step()
    want_y = reference(client, m, {"weight": 2 * original.detach(), "bias": m.bias.detach()},
                       x)[0]
    with torch.no_grad():
        assert torch.equal(m(x), want_y)


def test_orthogonal_parametrization(client):
    from torch.nn.utils.parametrizations import orthogonal
    m = gradwire.RemoteLinear(client, 8, 8, seed=13)
    orthogonal(m, "weight")
    w = m.weight.detach()
    assert torch.allclose(w @ w.T, torch.eye(8), atol=1e-5)
    x = torch.randn(5, 8)
    want_y = reference(client, m, {"weight": w, "bias": m.bias}, x)[0]
    with torch.no_grad():
        assert torch.equal(m(x), want_y)


def test_weight_norm_and_pruning(client):
    x = torch.randn(5, 8)
    m = gradwire.RemoteLinear(client, 8, 4, seed=14)
    w0 = m.get_weights()
    torch.nn.utils.weight_norm(m)
    with torch.no_grad():
        m.weight_g.mul_(2)
    y = m(x)
    y.square().sum().backward()
    want_y, _ = reference(client, m, {"weight": 2 * w0["weight"], "bias": w0["bias"]}, x)
    assert torch.allclose(y.detach(), want_y, rtol=1e-5, atol=1e-6)
    assert m.weight_g.grad.abs().sum() > 0 and m.weight_v.grad.abs().sum() > 0

    p = gradwire.RemoteLinear(client, 8, 4, seed=15)
    w1 = p.get_weights()
    prune.l1_unstructured(p, "weight", amount=0.5)
    masked = w1["weight"] * p.weight_mask
    assert (masked == 0).sum() == 16
    y = p(x)
    y.square().sum().backward()
    want_y, want_grads = reference(client, p, {"weight": masked, "bias": w1["bias"]}, x)
    assert torch.equal(y.detach(), want_y)
    assert torch.equal(p.weight_orig.grad, want_grads["weight"] * p.weight_mask)
    assert "weight_orig" in p.state_dict() and "weight_mask" in p.state_dict()


def test_reparametrized_server_optimizer_module_is_refused(client):
    m = gradwire.RemoteLinear(client, 8, 4, optimizer="sgd")
    parametrize.register_parametrization(m, "weight", Double())
    with pytest.raises(RuntimeError, match="optimizer='local'"):
        m(torch.randn(2, 8))


def test_functional_call_scratch_module_goes_with_the_module(client, server):
    from torch.nn.utils import stateless
    from conftest import module_ids
    m = gradwire.RemoteLinear(client, 8, 4, seed=16)
    w = torch.randn(4, 8)
    stateless.functional_call(m, {"weight": w}, (torch.randn(2, 8),))
    stateless.functional_call(m, {"weight": w}, (torch.randn(2, 8),))  # the same scratch module
    scratch = m._twin.module_id
    assert scratch in module_ids(server) and scratch != m.module_id
    m.delete()
    assert scratch not in module_ids(server) and m.module_id not in module_ids(server)
