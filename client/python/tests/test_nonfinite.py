"""NaN and infinite values propagate as through a local layer, so that a loop that skips
non-finite steps (GradScaler's habit, or a check of its own) does, and a skipped step changes
nothing on the server."""

import torch

import gradwire


def finite(t):
    return bool(torch.isfinite(t).all())


def test_nonfinite_input_rows_propagate(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=21)
    before = m.get_weights()
    x = torch.randn(4, 8)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    y = m(x)
    assert torch.isnan(y[1]).all() and torch.isnan(y[2]).all()
    with torch.no_grad():
        assert torch.equal(y[[0, 3]].detach(), m(x[[0, 3]]))  # the other rows as without them
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    loss = y.square().sum()
    opt.zero_grad()
    loss.backward()
    assert not finite(loss) and not finite(m.weight.grad) and not finite(m.bias.grad)
    if all(finite(p.grad) for p in m.parameters()):  # the loop's check: skip the step
        opt.step()
    opt.zero_grad()
    x2 = torch.randn(4, 8)
    m(x2).sum().backward()  # the next step is clean: nothing of the skipped one left
    assert finite(m.weight.grad)
    after = m.get_weights()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_nonfinite_gradient_rows_propagate(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=22)
    x = torch.randn(3, 8, requires_grad=True)
    scale = torch.ones(3, 4)
    scale[1, 2] = float("inf")
    (m(x) * scale).sum().backward()
    assert torch.isnan(x.grad[1]).all()
    assert not finite(m.weight.grad) and not finite(m.bias.grad)
    x_ref = x.detach()[[0, 2]].clone().requires_grad_()
    m.zero_grad()
    m(x_ref).sum().backward()
    assert torch.equal(x.grad[[0, 2]], x_ref.grad)  # the finite rows' input gradients


def test_nonfinite_step_of_a_server_optimizer_is_skipped(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=23, optimizer="sgd", lr=0.1)
    twin = gradwire.RemoteLinear(client, 8, 4, seed=23, optimizer="sgd", lr=0.1)
    opt = gradwire.ServerOptimizer(m)
    before = m.get_weights()
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    m(x).square().sum().backward()
    opt.step()  # skipped: nothing changes on the server
    assert m.skipped_steps == 1
    now = m.get_weights()
    assert all(torch.equal(before[k], now[k]) for k in before)
    x2 = torch.randn(4, 8)
    m(x2).square().sum().backward()
    opt.step()
    twin(x2).square().sum().backward()
    twin.apply_gradients()
    w, t = m.get_weights(), twin.get_weights()
    assert all(torch.equal(w[k], t[k]) for k in w)


def test_nonfinite_through_a_pipeline(client):
    model = gradwire.RemoteSequential(gradwire.RemoteLinear(client, 8, 8, seed=24),
                                      gradwire.RemoteLinear(client, 8, 4, seed=25),
                                      micro_batches=2)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.no_grad():
        x[2, 1] = float("nan")
    y = model(x)
    assert torch.isnan(y[2]).all() and finite(y[[0, 1, 3]])
    y.sum().backward()
    assert finite(x.grad[[0, 1, 3]])
    assert not finite(model[0].weight.grad)
