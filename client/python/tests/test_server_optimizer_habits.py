"""Server-optimizer modules (optimizer="sgd" / "adamw") under PyTorch's habits: a gradient-only
autograd call adds nothing to the next step, requires_grad_(False) freezes the module, and
model.parameters() holds the weights the server's steps made."""

import pytest
import torch

import gradwire


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_autograd_grad_of_the_input_adds_nothing_to_the_step(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=7, optimizer="sgd", lr=0.1)
    twin = gradwire.RemoteLinear(client, 8, 4, seed=7, optimizer="sgd", lr=0.1)
    opt = gradwire.ServerOptimizer(m)
    x = torch.randn(5, 8, requires_grad=True)
    saliency, = torch.autograd.grad(m(x).square().sum(), x)  # a saliency map
    assert saliency.abs().sum() > 0
    x.grad = None
    m(x).square().sum().backward(inputs=[x])  # the same through backward(inputs=...)
    assert x.grad.abs().sum() > 0
    x2 = torch.randn(5, 8)
    m(x2).square().sum().backward()
    opt.step()
    twin(x2).square().sum().backward()
    twin.apply_gradients()
    assert same(m.get_weights(), twin.get_weights())


def test_autograd_grad_amid_accumulation_is_refused(client):
    m = gradwire.RemoteLinear(client, 8, 4, optimizer="sgd")
    m(torch.randn(5, 8)).sum().backward()  # accumulated for the next step
    x = torch.randn(5, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="asks for no weight gradients"):
        torch.autograd.grad(m(x).sum(), x)
    gradwire.ServerOptimizer(m).zero_grad()
    gx, = torch.autograd.grad(m(x).sum(), x)  # after zero_grad it works
    assert gx.abs().sum() > 0
    assert all(g.abs().sum() == 0 for g in m.get_gradients().values())


def test_requires_grad_false_freezes_the_module(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=8, optimizer="adamw", lr=0.1,
                              weight_decay=0.1)
    other = gradwire.RemoteLinear(client, 4, 2, seed=9, optimizer="adamw", lr=0.1)
    model = torch.nn.Sequential(m, other)
    opt = gradwire.ServerOptimizer(model)
    before = m.get_weights()
    m.requires_grad_(False)
    x = torch.randn(5, 8, requires_grad=True)
    model(x).square().sum().backward()
    assert x.grad.abs().sum() > 0  # the gradient still flows through the frozen module
    opt.step()
    assert same(m.get_weights(), before), "a frozen module was stepped"
    m.requires_grad_(True)
    model(x).square().sum().backward()
    opt.step()
    assert not same(m.get_weights(), before)  # trains again
    m.bias.requires_grad_(False)
    with pytest.raises(RuntimeError, match="freeze all of it"):
        m(torch.randn(2, 8))


def test_parameters_are_current_after_server_steps(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=10, optimizer="sgd", lr=0.5)
    model = torch.nn.Sequential(m)
    opt = gradwire.ServerOptimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(5, 8)).square().sum().backward()
    opt.step()
    now = dict(model.named_parameters())
    server = client.get_weights(m.module_id)
    assert not torch.equal(now["0.weight"].detach(), before[0])
    assert torch.equal(now["0.weight"].detach(), server["weight"])
    assert torch.equal(now["0.bias"].detach(), server["bias"])
    # An EMA over model.parameters() copies the stepped weights.
    ema = [p.detach().clone() for p in model.parameters()]
    assert torch.equal(ema[0], server["weight"])


def test_clip_grad_norm_over_server_optimizer_parameters_is_refused(client):
    local = torch.nn.Linear(8, 8)
    m = gradwire.RemoteLinear(client, 8, 4, optimizer="sgd")
    model = torch.nn.Sequential(local, m)
    model(torch.randn(5, 8)).square().sum().backward()
    with pytest.raises(RuntimeError, match="gradients stay on the server") as e:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert m.module_id in str(e.value)
    with pytest.raises(RuntimeError, match="gradients stay on the server"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    # Clipping the local parameters alone works, as the message says.
    want = torch.cat([p.grad.flatten() for p in local.parameters()]).norm()
    norm = torch.nn.utils.clip_grad_norm_(local.parameters(), 1e-3)
    assert float(norm) == pytest.approx(float(want)) and float(norm) > 1e-3
    assert m.weight.grad is None  # elsewhere .grad reads as before


def test_autograd_grad_through_a_pipeline_adds_nothing_to_the_step(client):
    blocks = [gradwire.RemoteLinear(client, 8, 8, seed=30 + i, optimizer="sgd", lr=0.1)
              for i in range(2)]
    twins = [gradwire.RemoteLinear(client, 8, 8, seed=30 + i, optimizer="sgd", lr=0.1)
             for i in range(2)]
    model = gradwire.RemoteSequential(blocks, micro_batches=2)
    reference = gradwire.RemoteSequential(twins, micro_batches=2)
    x = torch.randn(4, 8, requires_grad=True)
    gx, = torch.autograd.grad(model(x).square().sum(), x)
    assert gx.abs().sum() > 0
    x2 = torch.randn(4, 8)
    model(x2).square().sum().backward()
    gradwire.ServerOptimizer(model).step()
    reference(x2).square().sum().backward()
    gradwire.ServerOptimizer(reference).step()
    for b, t in zip(blocks, twins):
        assert same(b.get_weights(), t.get_weights())
