"""backward(retain_graph=True) asks the server to retain the context (BackwardRequest.retain), so
a second backward works and gives the same gradients; without it the context is freed by the
first backward, and a second one raises autograd's own kind of error."""

import gc
import time

import pytest
import torch

import gradwire


def live(client):
    return client.server_info().live_contexts


def settled(client, want, seconds=5.0):
    """live(client) once it equals ``want``, or after ``seconds``. A dropped graph's last
    reference may go on a Train stream's reader thread, which still unwinds the callback that
    completed the forward when the caller already has its output: the release then follows a
    moment later, by reference counting all the same."""
    deadline = time.monotonic() + seconds
    while live(client) != want and time.monotonic() < deadline:
        time.sleep(0.02)
    return live(client)


@pytest.mark.parametrize("optimizer", ["local", "sgd"])
def test_second_backward_with_retain_graph(client, optimizer):
    m = gradwire.RemoteLinear(client, 6, 3, seed=1, optimizer=optimizer)
    x = torch.randn(4, 6, requires_grad=True)
    y = m(x)
    y.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    w1 = m.weight.grad.clone() if optimizer == "local" else m.get_gradients()["weight"]
    assert live(client) == 1  # retained on the server
    y.sum().backward()
    assert torch.equal(x.grad, 2 * g1)
    w2 = m.weight.grad if optimizer == "local" else m.get_gradients()["weight"]
    assert torch.allclose(w2, 2 * w1, rtol=1e-6, atol=1e-6)
    assert live(client) == 0  # the last backward freed it
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_without_retain_the_context_is_freed_at_once(client):
    m = gradwire.RemoteLinear(client, 6, 3)
    y = m(torch.randn(4, 6, requires_grad=True))
    y.sum().backward()
    assert live(client) == 0
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        y.sum().backward()


def test_two_losses_through_one_graph(client):
    m = gradwire.RemoteLayerNormMLP(client, 8, 16, seed=2)
    x = torch.randn(5, 8, requires_grad=True)
    y = m(x)
    g = torch.autograd.grad(y.square().sum(), x, retain_graph=True)[0]
    y.sum().backward()
    ref = gradwire.RemoteLayerNormMLP(client, 8, 16, seed=2)
    xr = x.detach().clone().requires_grad_()
    ref(xr).sum().backward()
    assert torch.equal(x.grad, xr.grad)  # same context, retained, same answer
    assert g.abs().sum() > 0 and live(client) == 0


def test_retained_graph_dropped_releases_the_context(client):
    m = gradwire.RemoteLinear(client, 6, 3)
    y = m(torch.randn(4, 6, requires_grad=True))
    y.sum().backward(retain_graph=True)
    assert live(client) == 1
    del y
    gc.collect()
    assert live(client) == 0


def test_retained_graphs_dropped_in_a_loop_release_without_the_cyclic_gc(client):
    # Reference counting alone must free each graph's server context when the graph goes:
    # with the cyclic collector off, nothing may pile up on the server.
    m = gradwire.RemoteLinear(client, 6, 3)
    seq = gradwire.RemoteSequential([gradwire.RemoteLinear(client, 6, 6, seed=i)
                                     for i in range(2)], micro_batches=2)
    x = torch.randn(4, 6, requires_grad=True)
    gc.collect()
    before = live(client)
    gc.disable()
    try:
        for _ in range(50):
            y = m(x)
            y.sum().backward(retain_graph=True)
            del y
        assert settled(client, before) == before
        for _ in range(20):
            y = seq(x)
            y.sum().backward(retain_graph=True)
            del y
        assert settled(client, before) == before
        for _ in range(20):  # forwards whose graph is dropped without any backward
            y = seq(x)
            del y
        assert settled(client, before) == before
    finally:
        gc.enable()


def test_pipeline_with_retain_graph(client):
    blocks = [gradwire.RemoteLinear(client, 6, 6, seed=i) for i in range(2)]
    model = gradwire.RemoteSequential(blocks, micro_batches=2)
    x = torch.randn(4, 6, requires_grad=True)
    y = model(x)
    y.sum().backward(retain_graph=True)
    g1 = x.grad.clone()
    assert live(client) == 4  # 2 blocks x 2 micro-batches
    y.sum().backward()
    assert torch.equal(x.grad, 2 * g1) and live(client) == 0
    with pytest.raises(RuntimeError, match="second time"):
        y.sum().backward()


def test_in_place_op_on_the_output(client):
    m = gradwire.RemoteLinear(client, 6, 3)
    x = torch.randn(4, 6, requires_grad=True)
    y = torch.nn.ReLU(inplace=True)(m(x))
    y.sum().backward()
    assert x.grad is not None and live(client) == 0
