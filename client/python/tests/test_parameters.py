"""Remote modules have real parameters: the server's names and shapes, counted by parameters(),
mirrored lazily, moved by state_dict()/load_state_dict(), trained by a local torch optimizer (its
gradients from GetGradients, its step pushed with SetWeights), or left to the server's optimizer
and then frozen here."""

import io
import logging

import pytest
import torch

import gradwire


def calls(caplog, method):
    return sum(1 for r in caplog.records if r.name == "gradwire" and
               r.getMessage().startswith(method + " "))


def test_names_shapes_and_counts(client):
    lin = gradwire.RemoteLinear(client, 12, 5)
    assert [(n, tuple(p.shape)) for n, p in lin.named_parameters()] == \
        [("weight", (5, 12)), ("bias", (5,))]
    assert sum(p.numel() for p in lin.parameters()) == \
        sum(p.numel() for p in torch.nn.Linear(12, 5).parameters())
    no_bias = gradwire.RemoteLinear(client, 12, 5, bias=False)
    assert [n for n, _ in no_bias.named_parameters()] == ["weight"]
    mlp = gradwire.RemoteLayerNormMLP(client, 8, 6, 4, activation="swiglu")
    shapes = {n: tuple(p.shape) for n, p in mlp.named_parameters()}
    assert shapes == {"layer_norm_weight": (8,), "layer_norm_bias": (8,), "fc1_weight": (12, 8),
                      "fc1_bias": (12,), "fc2_weight": (4, 6), "fc2_bias": (4,)}
    for m in (lin, no_bias, mlp):
        server = m.get_weights()
        assert {n: tuple(t.shape) for n, t in server.items()} == \
            {n: tuple(p.shape) for n, p in m.named_parameters()}
        assert list(m.state_dict()) == list(server)


def test_mirrored_lazily(client, caplog):
    caplog.set_level(logging.DEBUG, logger="gradwire")
    local = gradwire.RemoteLinear(client, 6, 3)
    with torch.no_grad():
        local(torch.randn(2, 6))
    assert calls(caplog, "GetWeights") == 1  # creating pulls once; inference needs no more
    local(torch.randn(2, 6)).sum().backward()
    assert calls(caplog, "GetWeights") == 1  # training: the values are current already
    caplog.clear()
    m = gradwire.RemoteLinear(client, 6, 3, optimizer="sgd", lr=0.5)
    assert calls(caplog, "GetWeights") == 1  # creating pulls the values once
    w = m.weight.detach().clone()  # current: no second pull
    assert calls(caplog, "GetWeights") == 1
    assert torch.equal(w, client.get_weights(m.module_id)["weight"])
    m.weight, m.bias, m.state_dict()  # noqa: B018 - current: no second pull
    assert calls(caplog, "GetWeights") == 2  # (the line above read the server once, directly)
    m(torch.randn(4, 6)).square().sum().backward()
    assert calls(caplog, "GetWeights") == 2  # a forward with a server optimizer needs no values
    m.apply_gradients()
    assert not torch.equal(m.weight, w)  # the step moved the version: the read pulls again
    assert calls(caplog, "GetWeights") == 3
    assert torch.equal(m.weight.detach(), client.get_weights(m.module_id)["weight"])


def test_parameters_hold_the_server_values_before_any_forward(client):
    # An EMA or teacher copy taken at once is the real model, not uninitialised memory.
    seq = torch.nn.Sequential(torch.nn.Linear(4, 8), gradwire.RemoteLinear(client, 8, 4, seed=5))
    flat = torch.nn.utils.parameters_to_vector(seq.parameters())
    assert torch.isfinite(flat).all()
    server = client.get_weights(seq[1].module_id)
    assert torch.equal(flat[-(4 * 8 + 4):], torch.cat([server["weight"].flatten(), server["bias"]]))


def test_a_new_parameter_a_tied_weight_or_new_storage_is_pushed(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=2)
    x = torch.randn(5, 8)

    def server_weight():
        return client.get_weights(m.module_id)["weight"]

    # m.weight = nn.Parameter(...): a new tensor, its version counter maybe the old one's.
    new = torch.randn(4, 8)
    m.weight = torch.nn.Parameter(new.clone())
    with torch.no_grad():
        y = m(x)
    assert torch.equal(server_weight(), new)
    want = x @ new.t() + m.bias.detach()
    assert ((y - want).norm() / want.norm()).item() < 0.1  # FP8 of the new weights
    # A weight tied to another module's, then changed there in place.
    head = torch.nn.Linear(8, 4)
    m.weight = head.weight
    with torch.no_grad():
        m(x)
    assert torch.equal(server_weight(), head.weight.detach())
    with torch.no_grad():
        head.weight.mul_(2)
        m(x)
    assert torch.equal(server_weight(), head.weight.detach())
    # vector_to_parameters writes through .data: new storage, the same version counter.
    vec = torch.randn(sum(p.numel() for p in m.parameters()))
    torch.nn.utils.vector_to_parameters(vec, m.parameters())
    with torch.no_grad():
        m(x)
    assert torch.equal(server_weight(), vec[:32].view(4, 8))


def test_state_dict_moves_the_real_weights(client, tmp_path):
    a = gradwire.RemoteLayerNormLinear(client, 10, 6, seed=1)
    b = gradwire.RemoteLayerNormLinear(client, 10, 6, seed=2)
    assert not torch.equal(a.state_dict()["weight"], b.state_dict()["weight"])
    torch.save(a.state_dict(), tmp_path / "a.pt")
    b.load_state_dict(torch.load(tmp_path / "a.pt"))
    wa, wb = a.get_weights(), client.get_weights(b.module_id)  # b's server copy, read directly
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    x = torch.randn(3, 10)
    with torch.no_grad():
        assert torch.equal(a.eval()(x), b.eval()(x))


def test_state_dict_interchanges_with_torch_linear(client):
    local = torch.nn.Linear(7, 3)
    remote = gradwire.RemoteLinear(client, 7, 3)
    remote.load_state_dict(local.state_dict())
    server = client.get_weights(remote.module_id)
    assert torch.equal(server["weight"], local.weight.detach())
    back = torch.nn.Linear(7, 3)
    back.load_state_dict(remote.state_dict())
    assert torch.equal(back.bias, local.bias)


def test_bad_state_dict_is_refused_and_changes_nothing(client):
    m = gradwire.RemoteLinear(client, 4, 2)
    before = m.get_weights()
    with pytest.raises(RuntimeError, match="size mismatch"):
        m.load_state_dict({"weight": torch.zeros(3, 4), "bias": torch.zeros(2)})
    after = client.get_weights(m.module_id)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_local_optimizer_trains_the_remote_weights(client):
    torch.manual_seed(0)
    m = gradwire.RemoteLinear(client, 8, 4, seed=5)  # optimizer="local"
    twin = gradwire.RemoteLinear(client, 8, 4, seed=5, optimizer="sgd", lr=0.1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, dy = torch.randn(6, 8), torch.randn(6, 4)
    m(x).backward(dy)
    twin(x).backward(dy)
    server_grads = twin.get_gradients()
    # The gradients came from GetGradients into .grad, and left the server's buffer empty.
    assert torch.equal(m.weight.grad, server_grads["weight"])
    assert torch.equal(m.bias.grad, server_grads["bias"])
    assert m.get_gradients()["weight"].abs().sum() == 0
    before = client.get_weights(m.module_id)["weight"]
    opt.step()
    twin.apply_gradients()
    # Pushed before the next use, not at step(): the server still has the old weights...
    assert torch.equal(client.get_weights(m.module_id)["weight"], before)
    with torch.no_grad():
        m(x)
    # ... and the new ones after the next forward, as the server's own SGD step made them.
    after = client.get_weights(m.module_id)
    assert not torch.equal(after["weight"], before)
    twin_w = twin.get_weights()
    assert torch.allclose(after["weight"], twin_w["weight"], rtol=0, atol=1e-6)
    assert torch.allclose(after["bias"], twin_w["bias"], rtol=0, atol=1e-6)


def test_grad_accumulation_zero_grad_and_clipping(client):
    m = gradwire.RemoteLinear(client, 5, 3, seed=2)
    x1, x2 = torch.randn(4, 5), torch.randn(4, 5)
    m(x1).sum().backward()
    g1 = m.weight.grad.clone()
    m(x2).sum().backward()  # accumulates, as for a local layer
    g12 = m.weight.grad.clone()
    m.zero_grad()
    m(x2).sum().backward()
    g2 = m.weight.grad.clone()
    assert torch.allclose(g12, g1 + g2, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(g2, g12)  # zero_grad really zeroed: nothing stale on the server
    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e-3)
    assert norm > 1e-3
    total = torch.sqrt(sum(p.grad.square().sum() for p in m.parameters()))
    assert torch.isclose(total, torch.tensor(1e-3), rtol=1e-3)
    w = m.weight.detach().clone()
    torch.optim.SGD(m.parameters(), lr=1.0).step()
    m.push()
    assert torch.allclose(client.get_weights(m.module_id)["weight"], w - m.weight.grad,
                          atol=1e-7)


def test_in_place_edits_reach_the_server(client):
    for optimizer in ("local", "sgd"):
        m = gradwire.RemoteLinear(client, 4, 2, optimizer=optimizer)
        with torch.no_grad():
            m.weight.fill_(0.25)
            m.bias.zero_()
        with torch.no_grad():
            y = m.eval()(torch.ones(1, 4))
        assert torch.allclose(y, torch.ones(1, 2)), optimizer  # 4 x 0.25, in FP8 exactly
        assert torch.equal(client.get_weights(m.module_id)["weight"], torch.full((2, 4), 0.25))


def test_server_optimizer_gradients_stay_on_the_server(client):
    m = gradwire.RemoteLinear(client, 4, 2, optimizer="sgd")
    assert all(p.requires_grad for p in m.parameters())  # trained, by the server
    x = torch.randn(3, 4)  # no grad wanted: the call is still recorded, for the server's step
    m(x).sum().backward()
    assert m.weight.grad is None and m.get_gradients()["weight"].abs().sum() > 0
    local = gradwire.RemoteLinear(client, 4, 2)
    with pytest.raises(RuntimeError, match="local optimizer"):
        local.apply_gradients()


def test_another_writer_is_seen(client, server):
    m = gradwire.RemoteLinear(client, 4, 2)
    m(torch.randn(2, 4)).sum().backward()  # mirrored
    other = gradwire.Client(server)
    try:
        other.set_weights(m.module_id, {"weight": torch.full((2, 4), 2.0)})
    finally:
        other.close()
    with torch.no_grad():
        m(torch.randn(2, 4))  # reports the new version: a local-optimizer module pulls it
    assert torch.equal(m.weight.detach(), torch.full((2, 4), 2.0))


def test_load_state_dict_of_a_subset(client):
    m = gradwire.RemoteLinear(client, 4, 2, seed=3)
    server_w = client.get_weights(m.module_id)
    m.load_state_dict({"bias": torch.tensor([1.0, -1.0])}, strict=False)
    now = client.get_weights(m.module_id)
    assert torch.equal(now["bias"], torch.tensor([1.0, -1.0]))
    assert torch.equal(now["weight"], server_w["weight"])  # the unpulled weight was not sent
    assert torch.equal(m.weight.detach(), server_w["weight"])  # and reads the server's


def test_torch_save_of_the_state_dict_round_trips(client):
    m = gradwire.RemoteLayerNormMLP(client, 6, 8, seed=4)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf)
    server = client.get_weights(m.module_id)
    assert all(torch.equal(loaded[k], server[k]) for k in server)


def test_weight_gradients_per_call_from_threads(client):
    """torch.autograd.grad through one module from 8 threads at once gives each thread its own
    weight gradient, bit for bit what the same call alone gives; .grad's sum stays right."""
    import threading
    r = gradwire.RemoteLinear(client, 32, 16)
    xs = [torch.randn(4 + i, 32) for i in range(8)]
    alone = [torch.autograd.grad(r(x).sum(), [r.weight])[0] for x in xs]
    got = [None] * len(xs)
    barrier = threading.Barrier(len(xs))

    def run(i):
        barrier.wait()
        for _ in range(3):
            g = torch.autograd.grad(r(xs[i]).sum(), [r.weight])[0]
            if got[i] is None:
                got[i] = g
            assert torch.equal(g, got[i]), i

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (a, g) in enumerate(zip(alone, got)):
        assert g is not None and torch.equal(a, g), i
    r.weight.grad = None
    for x in xs:
        r(x).sum().backward()
    assert torch.equal(r.weight.grad, sum(alone[1:], alone[0].clone()))
