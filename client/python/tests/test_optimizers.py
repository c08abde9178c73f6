"""Every server optimizer from keyword arguments -- SGD with momentum, Nesterov and weight decay,
AdamW with betas, eps and weight decay -- steps as torch.optim's does; ServerOptimizer lets
torch's LR schedulers drive the server's learning rate; wrong settings are refused here."""

import pytest
import torch

import gradwire


def server_vs_torch(client, torch_class, steps=3, **kwargs):
    """Steps a remote module on the server and a float32 copy of its weights with torch_class on
    the same gradients; returns the largest difference of the weights after each step."""
    torch.manual_seed(0)
    name = {torch.optim.SGD: "sgd", torch.optim.AdamW: "adamw"}[torch_class]
    m = gradwire.RemoteLinear(client, 8, 4, seed=11, optimizer=name, **kwargs)
    ref = {k: v.clone().requires_grad_() for k, v in m.get_weights().items()}
    opt = torch_class(list(ref.values()), **kwargs)
    diffs = []
    for _ in range(steps):
        m(torch.randn(16, 8)).backward(torch.randn(16, 4))
        grads = m.get_gradients()
        for k, p in ref.items():
            p.grad = grads[k]
        opt.step()
        m.apply_gradients()
        got = m.get_weights()
        diffs.append(max((got[k] - ref[k].detach()).abs().max().item() for k in ref))
    return diffs


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.8, nesterov=True),
    dict(lr=0.05, momentum=0.5, weight_decay=0.1),
])
def test_sgd_steps_as_torch(client, kwargs):
    assert max(server_vs_torch(client, torch.optim.SGD, **kwargs)) < 2e-6


@pytest.mark.parametrize("kwargs", [
    dict(lr=0.01),
    dict(lr=0.02, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1),
])
def test_adamw_steps_as_torch(client, kwargs):
    assert max(server_vs_torch(client, torch.optim.AdamW, **kwargs)) < 2e-6


def test_the_spec_carries_the_settings(client):
    m = gradwire.RemoteLayerNormMLP(client, 4, 8, optimizer="adamw", lr=0.003,
                                    betas=(0.85, 0.95), eps=1e-7, weight_decay=0.2)
    a = m.spec.optimizer.adamw
    assert (a.learning_rate, a.beta1, a.beta2, a.eps, a.weight_decay) == pytest.approx(
        (0.003, 0.85, 0.95, 1e-7, 0.2))
    assert "adamw(lr=0.003" in repr(m)
    s = gradwire.RemoteLinear(client, 4, 2, optimizer="sgd", lr=0.2, momentum=0.5,
                              nesterov=True, weight_decay=0.01).spec.optimizer.sgd
    assert (s.learning_rate, s.momentum, s.nesterov, s.weight_decay) == pytest.approx(
        (0.2, 0.5, True, 0.01))


def test_lr_scheduler_drives_the_server_rate(client):
    m = gradwire.RemoteLinear(client, 6, 3, optimizer="sgd", lr=0.4)
    opt = gradwire.ServerOptimizer([m])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        opt.zero_grad()
        m(torch.randn(5, 6)).sum().backward()
        g = m.get_gradients()["weight"]
        w = m.get_weights()["weight"]
        opt.step()
        sched.step()
        expected = w - 0.4 * 0.5 ** step * g
        assert torch.allclose(m.get_weights()["weight"], expected, rtol=0, atol=1e-6), step
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert opt.state_dict()["param_groups"][0]["lr"] == pytest.approx(0.05)
    # A rate scheduled down to 0 moves nothing (the wire's 0 would mean "the configured one").
    for group in opt.param_groups:
        group["lr"] = 0.0
    m(torch.randn(5, 6)).sum().backward()
    w = m.get_weights()["weight"]
    opt.step()
    assert torch.equal(m.get_weights()["weight"], w)


def test_server_optimizer_zero_grad(client):
    m = gradwire.RemoteLinear(client, 6, 3, optimizer="sgd")
    opt = gradwire.ServerOptimizer([m])
    m(torch.randn(5, 6)).sum().backward()
    assert m.get_gradients()["weight"].abs().sum() > 0
    opt.zero_grad()
    assert m.get_gradients()["weight"].abs().sum() == 0


def test_server_optimizer_takes_the_server_trained_modules_of_a_model(client):
    model = torch.nn.Sequential(gradwire.RemoteLinear(client, 4, 4, optimizer="sgd", lr=0.3),
                                torch.nn.ReLU(), gradwire.RemoteLinear(client, 4, 2),
                                gradwire.RemoteLinear(client, 2, 2, optimizer="adamw"))
    opt = gradwire.ServerOptimizer(model)
    assert [m.module_id for m in opt.remote_modules] == [model[0].module_id, model[3].module_id]
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.3, 1e-3])
    with pytest.raises(ValueError, match="optimizer='local'"):
        gradwire.ServerOptimizer([model[2]])
    with pytest.raises(ValueError, match="no remote module"):
        gradwire.ServerOptimizer(torch.nn.Sequential(model[2]))


@pytest.mark.parametrize("kwargs, message", [
    (dict(lr=0.1), "configure a server optimizer"),
    (dict(optimizer="sgd", betas=(0.9, 0.99)), "do not apply"),
    (dict(optimizer="adamw", momentum=0.9), "do not apply"),
    (dict(optimizer="sgd", nesterov=True), "nesterov needs momentum"),
    (dict(optimizer="sgd", momentum=1.0), "momentum must be in"),
    (dict(optimizer="sgd", lr=-1.0), "lr must be > 0"),
    (dict(optimizer="adamw", betas=(0.0, 0.9)), "betas must be in"),
    (dict(optimizer="adagrad"), "optimizer must be one of"),
])
def test_wrong_settings_are_refused_before_any_call(kwargs, message):
    # No server: the refusal comes before anything is sent.
    c = gradwire.Client("127.0.0.1:1", timeout=1)
    try:
        with pytest.raises(ValueError, match=message):
            gradwire.RemoteLinear(c, 4, 2, **kwargs)
    finally:
        c.close()
