"""RemoteSequential mixes local modules and remote blocks, honours recompute_on_lost_context per
block and micro-batch, and exports and loads a state_dict."""

import time
from collections import OrderedDict

import pytest
import torch

import gradwire
from conftest import ServerProcess


def build(client, seed, recompute=False, optimizer="local"):
    torch.manual_seed(seed)
    return gradwire.RemoteSequential([
        torch.nn.Linear(6, 8),
        gradwire.RemoteLayerNormMLP(client, 8, 16, seed=seed, optimizer=optimizer,
                                    recompute_on_lost_context=recompute),
        gradwire.RemoteLinear(client, 8, 8, seed=seed + 1, optimizer=optimizer,
                              recompute_on_lost_context=recompute),
        torch.nn.ReLU(),
        gradwire.RemoteLinear(client, 8, 3, seed=seed + 2, optimizer=optimizer),
    ], micro_batches=3)


def test_local_and_remote_blocks_match_one_by_one(client):
    model = build(client, 7)
    twin = build(client, 7)
    assert [type(b).__name__ for b in model] == ["Linear", "RemoteLayerNormMLP", "RemoteLinear",
                                                "ReLU", "RemoteLinear"]
    x = torch.randn(9, 6, requires_grad=True)
    xt = x.detach().clone().requires_grad_()
    y = model(x)  # pipelined runs of remote blocks, local modules on the whole batch
    h = xt
    for block in twin:  # the same modules applied one by one (a micro-batch each: 3 rows)
        h = torch.cat([block(part) for part in h.split(3)]) \
            if isinstance(block, gradwire.RemoteModule) else block(h)
    assert torch.equal(y, h)
    dy = torch.randn(9, 3)
    y.backward(dy)
    h.backward(dy)
    assert torch.equal(x.grad, xt.grad)
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert p.grad is not None and q.grad is not None, name
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name
    assert client.server_info().live_contexts == 0


def test_trains_with_one_local_optimizer(client):
    model = build(client, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    x = torch.randn(24, 6)
    target = torch.tanh(x[:, :3])
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


def test_state_dict_export_and_load(client, tmp_path):
    a, b = build(client, 1), build(client, 2)
    sd = a.state_dict()
    assert list(sd)[:4] == ["0.weight", "0.bias", "1.layer_norm_weight", "1.layer_norm_bias"]
    assert "4.weight" in sd and sd["4.weight"].shape == (3, 8)
    torch.save(sd, tmp_path / "stack.pt")
    b.load_state_dict(torch.load(tmp_path / "stack.pt"))
    a.eval(), b.eval()
    x = torch.randn(5, 6)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))
    # A RemoteLinear's entries are an nn.Linear's: a local head takes them as they are.
    head = torch.nn.Linear(8, 3)
    head.load_state_dict({"weight": sd["4.weight"], "bias": sd["4.bias"]})
    assert torch.equal(head.weight, b[4].get_weights()["weight"])


def test_server_optimizer_blocks_step_together(client):
    model = build(client, 4, optimizer="sgd")
    before = [b.get_weights()["fc1_weight" if i == 1 else "weight"]
              for i, b in enumerate(model) if isinstance(b, gradwire.RemoteModule)]
    model(torch.randn(6, 6)).sum().backward()
    assert len(model.apply_gradients()) == 3
    after = [b.get_weights()["fc1_weight" if i == 1 else "weight"]
             for i, b in enumerate(model) if isinstance(b, gradwire.RemoteModule)]
    assert all(not torch.equal(p, q) for p, q in zip(before, after))
    with pytest.raises(RuntimeError, match="local optimizer"):
        build(client, 5).apply_gradients()


@pytest.fixture
def short_ttl_server():
    server = ServerProcess("--context-ttl", "0.3")
    yield server.address
    server.stop()


def wait_evicted(client):
    deadline = time.time() + 10
    while client.server_info().live_contexts and time.time() < deadline:
        time.sleep(0.05)


def test_recompute_on_lost_context_per_block(short_ttl_server):
    with gradwire.Client(short_ttl_server) as c:
        model = gradwire.RemoteSequential([
            gradwire.RemoteLinear(c, 6, 6, seed=1, recompute_on_lost_context=True),
            torch.nn.Tanh(),
            gradwire.RemoteLinear(c, 6, 6, seed=2, recompute_on_lost_context=True),
            gradwire.RemoteLinear(c, 6, 2, seed=3, recompute_on_lost_context=True)],
            micro_batches=2)
        twin = gradwire.RemoteSequential([
            gradwire.RemoteLinear(c, 6, 6, seed=1), torch.nn.Tanh(),
            gradwire.RemoteLinear(c, 6, 6, seed=2), gradwire.RemoteLinear(c, 6, 2, seed=3)],
            micro_batches=2)
        x = torch.randn(4, 6)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya = model(xa)
        wait_evicted(c)
        ya.sum().backward()  # every context was evicted: each block and micro-batch recomputes
        assert [b.recomputed_backwards for b in model.remote_blocks] == [2, 2, 2]
        twin(xb).sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)
        assert c.server_info().live_contexts == 0
        yb = twin(xb)
        wait_evicted(c)
        with pytest.raises(gradwire.ContextLostError) as e:
            yb.sum().backward()
        assert e.value.reason == "ttl"


def test_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        gradwire.RemoteSequential([torch.nn.ReLU(), lambda x: x])


def test_shape_error_names_the_shape_passed(client):
    # The batch is split into micro-batches, but the error is about what the caller passed.
    model = gradwire.RemoteSequential([gradwire.RemoteLinear(client, 6, 6)], micro_batches=4)
    before = client.server_info().live_contexts
    with pytest.raises(gradwire.GradwireError) as e:
        model(torch.randn(4, 7, requires_grad=True))
    assert e.value.code == "INVALID_ARGUMENT"
    assert "got [4, 7]" in e.value.message and "[1, 7]" not in e.value.message
    assert "must be [..., 6]" in e.value.message and "block 0" in e.value.message
    # A block of the run that does not take the previous block's output: the whole batch's
    # shape at that block, and the block's name.
    model = gradwire.RemoteSequential(OrderedDict(
        a=gradwire.RemoteLinear(client, 6, 6), b=gradwire.RemoteLinear(client, 5, 6)))
    with pytest.raises(gradwire.GradwireError) as e:
        model(torch.randn(8, 3, 6, requires_grad=True))
    assert "got [8, 3, 6]" in e.value.message and "must be [..., 5]" in e.value.message
    assert "block b" in e.value.message and model.b.module_id in e.value.message
    assert client.server_info().live_contexts == before
