"""What a trainer sees when the server loses a context: ContextLostError with the reason, and
recompute_on_lost_context re-running the forward."""

import time

import pytest
import torch

import gradwire
from conftest import ServerProcess


@pytest.fixture
def short_ttl_server():
    server = ServerProcess("--context-ttl", "0.3")
    yield server.address
    server.stop()


def wait_evicted(client):
    deadline = time.time() + 10
    while client.server_info().live_contexts and time.time() < deadline:
        time.sleep(0.05)


def test_evicted_context_names_the_ttl(short_ttl_server):
    with gradwire.Client(short_ttl_server) as c:
        layer = gradwire.RemoteLinear(c, 8, 4, seed=1)
        x = torch.randn(2, 8, requires_grad=True)
        y = layer(x)
        wait_evicted(c)
        with pytest.raises(gradwire.ContextLostError) as e:
            y.sum().backward()
        assert e.value.reason == "ttl"
        assert e.value.code == "NOT_FOUND"
        assert "--context-ttl" in e.value.message


def test_recompute_on_lost_context(short_ttl_server):
    with gradwire.Client(short_ttl_server) as c:
        a = gradwire.RemoteLinear(c, 8, 4, seed=3, recompute_on_lost_context=True)
        b = gradwire.RemoteLinear(c, 8, 4, seed=3)
        x = torch.randn(5, 8)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya = a(xa)
        wait_evicted(c)
        ya.sum().backward()  # recomputed
        assert a.recomputed_backwards == 1
        b(xb).sum().backward()
        assert torch.equal(xa.grad, xb.grad)
        assert b.weight.grad.abs().sum() > 0
        assert torch.equal(a.weight.grad, b.weight.grad)
        assert c.server_info().live_contexts == 0


def test_restarted_server_is_named():
    first = ServerProcess()
    address = first.address
    c = gradwire.Client(address, timeout=5)
    try:
        layer = gradwire.RemoteLinear(c, 8, 4, keep=True)
        y, context_id, _ = c.forward(layer.module_id, torch.randn(2, 8), training=True)
        first.stop(kill=True)
        with pytest.raises(gradwire.ContextLostError) as e:
            c.backward(context_id, torch.ones(2, 4))
        assert e.value.reason == "server_unavailable"
        second = ServerProcess(listen=address)  # a new process on the same address
        try:
            deadline = time.time() + 20  # the channel reconnects after its backoff
            while True:
                try:
                    c.server_info()
                    break
                except gradwire.GradwireError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.2)
            with pytest.raises(gradwire.ContextLostError) as e:
                c.backward(context_id, torch.ones(2, 4))
            assert e.value.reason == "server_restarted", e.value
        finally:
            second.stop()
    finally:
        c.close()
        first.stop()


def wait_reachable(client):
    deadline = time.time() + 20  # the channel reconnects after its backoff
    while True:
        try:
            return client.server_info()
        except gradwire.GradwireError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)


def test_module_lost_to_a_restart_is_named():
    # After a restart the server only knows that the id is not a module; the client knows the
    # process changed, and says that the module went with the old one.
    first = ServerProcess()
    address = first.address
    c = gradwire.Client(address, timeout=5)
    try:
        layer = gradwire.RemoteLinear(c, 8, 4, keep=True)
        stack = gradwire.RemoteSequential(
            [gradwire.RemoteLinear(c, 8, 8, keep=True), torch.nn.ReLU(),
             gradwire.RemoteLinear(c, 8, 4, keep=True)], micro_batches=2)
        first.stop(kill=True)
        second = ServerProcess(listen=address)  # a new process on the same address
        try:
            wait_reachable(c)
            other = gradwire.RemoteLinear(c, 8, 4)  # made on the new process: still there
            calls = [lambda: layer(torch.randn(2, 8, requires_grad=True)),  # training
                     lambda: layer.eval()(torch.randn(2, 8)),  # inference
                     lambda: stack(torch.randn(4, 8, requires_grad=True)),  # pipelined
                     layer.get_weights]
            for call, module in zip(calls, [layer, layer, stack[0], layer]):
                with pytest.raises(gradwire.GradwireError) as e:
                    call()
                assert e.value.code == "NOT_FOUND"
                assert "server restarted" in e.value.message, e.value.message
                assert module.module_id in e.value.message
            # A module deleted on a running server is not said to be lost to a restart.
            c.delete_module(other.module_id)
            with pytest.raises(gradwire.GradwireError) as e:
                other(torch.randn(2, 8, requires_grad=True))
            assert e.value.code == "NOT_FOUND" and "restarted" not in e.value.message
        finally:
            second.stop()
    finally:
        c.close(keep=True)
        first.stop()


def test_whether_a_server_restarted_is_asked_of_the_contexts_module(server):
    """Behind a proxy one client's modules live in several server processes: a context the
    server does not know is judged by the process holding its module (a GetServerInfo routed by
    the module), not by whichever server an unrouted call reaches."""
    import secrets
    with gradwire.Client(server) as c:
        layer = gradwire.RemoteLinear(c, 8, 4, seed=1)
        c.forward(layer.module_id, torch.randn(2, 8), training=True)
        routes = []
        real = c.server_info

        def spy(route=None):
            routes.append(route)
            return real(route)

        c.server_info = spy
        unknown = secrets.token_hex(16)
        c._note_context(unknown, layer.module_id)
        with pytest.raises(gradwire.ContextLostError) as e:
            c.backward(unknown, torch.ones(2, 4))
        assert e.value.reason == "unknown", e.value
        assert routes == [layer.module_id]
        # A failed backward keeps the context's route, so a retry goes to the same server.
        assert c.context_route(unknown, consume=False) == layer.module_id
        # The module's process changed since its forward: that process restarted.
        c._instance_ids[layer.module_id] = "another process"
        unknown = secrets.token_hex(16)
        c._note_context(unknown, layer.module_id)
        with pytest.raises(gradwire.ContextLostError) as e:
            c.backward(unknown, torch.ones(2, 4))
        assert e.value.reason == "server_restarted", e.value
        assert routes == [layer.module_id, layer.module_id]


def test_a_backward_refused_for_its_input_can_be_retried_where_the_context_lives(server):
    with gradwire.Client(server) as c:
        layer = gradwire.RemoteLinear(c, 8, 4, seed=1)
        _, context_id, _ = c.forward(layer.module_id, torch.randn(2, 8), training=True)
        with pytest.raises(gradwire.GradwireError) as e:
            c.backward(context_id, torch.ones(2, 5))  # the wrong width: refused, nothing consumed
        assert e.value.code == "INVALID_ARGUMENT", e.value
        # Still routed by its module.
        assert c.context_route(context_id, consume=False) == layer.module_id
        assert c.backward(context_id, torch.ones(2, 4)).shape == (2, 8)
        assert c.context_route(context_id, consume=False) is None
