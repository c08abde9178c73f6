"""A backward interrupted while it waits on a slow server (KeyboardInterrupt) goes on on the
server; what it adds to the module's gradients there never reaches a later step."""

import signal
import threading

import pytest
import torch

import gradwire


def interrupted_backward(server, loss):
    """``loss.backward()`` with the server stopped, interrupted by SIGINT after 0.3 s; then the
    server goes on (and runs that backward)."""
    main = threading.main_thread().ident
    server.pause()
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            loss.backward()
    finally:
        timer.cancel()
        server.resume()


def test_interrupted_backward_reaches_no_later_step_local(fresh_server):
    with gradwire.Client(fresh_server.address, timeout=30) as c:
        m = gradwire.RemoteLinear(c, 8, 4, seed=5)
        x1, x2 = torch.randn(16, 8), torch.randn(16, 8)
        interrupted_backward(fresh_server, m(x1).square().sum())
        m.zero_grad()
        m(x2).square().sum().backward()
        after = m.weight.grad.clone()
        m.zero_grad()
        m(x2).square().sum().backward()
        assert after.abs().sum() > 0
        assert torch.equal(after, m.weight.grad)


@pytest.mark.parametrize("zero_first", [True, False], ids=["zero_grad", "next_backward"])
def test_interrupted_backward_reaches_no_later_step_server(fresh_server, zero_first):
    with gradwire.Client(fresh_server.address, timeout=30) as c:
        m = gradwire.RemoteLinear(c, 8, 4, seed=6, optimizer="sgd", lr=0.1)
        twin = gradwire.RemoteLinear(c, 8, 4, seed=6, optimizer="sgd", lr=0.1)
        opt = gradwire.ServerOptimizer(m)
        x1, x2 = torch.randn(16, 8), torch.randn(16, 8)
        interrupted_backward(fresh_server, m(x1).square().sum())
        if zero_first:
            opt.zero_grad()
        m(x2).square().sum().backward()
        opt.step()
        twin(x2).square().sum().backward()
        twin.apply_gradients()
        w, t = m.get_weights(), twin.get_weights()
        assert all(torch.equal(w[k], t[k]) for k in w), "the interrupted gradient was applied"


def test_interrupted_pipeline_backward_reaches_no_later_step(fresh_server):
    with gradwire.Client(fresh_server.address, timeout=30) as c:
        blocks = [gradwire.RemoteLinear(c, 8, 8, seed=7 + i) for i in range(2)]
        model = gradwire.RemoteSequential(blocks, micro_batches=2)
        x1, x2 = torch.randn(8, 8), torch.randn(8, 8)
        interrupted_backward(fresh_server, model(x1).square().sum())
        model.zero_grad()
        model(x2).square().sum().backward()
        after = [b.weight.grad.clone() for b in blocks]
        model.zero_grad()
        model(x2).square().sum().backward()
        for a, b in zip(after, blocks):
            assert a.abs().sum() > 0 and torch.equal(a, b.weight.grad)
