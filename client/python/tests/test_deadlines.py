"""Every call has a deadline, Train-stream requests included: against a stopped (SIGSTOP) server,
a training forward, a backward and a pipelined forward fail with DEADLINE_EXCEEDED naming the
call, in about ``timeout`` seconds, and the stream is replaced so training goes on once the server
answers again."""

import threading
import time

import pytest
import torch

import gradwire

TIMEOUT = 1.0


def within(seconds, fn):
    """Runs ``fn`` in a thread; returns (its exception or None, elapsed). A call still running
    after ``seconds`` fails the test instead of hanging the suite."""
    outcome = {}

    def run():
        start = time.monotonic()
        try:
            fn()
            outcome["error"] = None
        except Exception as e:  # noqa: BLE001 - handed to the test
            outcome["error"] = e
        outcome["elapsed"] = time.monotonic() - start

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the call was still waiting after {seconds} s: no deadline"
    return outcome["error"], outcome["elapsed"]


def assert_deadline(error, elapsed, method):
    assert isinstance(error, gradwire.GradwireError), repr(error)
    assert error.code == "DEADLINE_EXCEEDED", error
    assert error.method == method and method in str(error), error
    assert TIMEOUT * 0.9 <= elapsed <= TIMEOUT + 3, elapsed


def test_training_forward_has_a_deadline_and_the_stream_is_replaced(fresh_server):
    with gradwire.Client(fresh_server.address, timeout=TIMEOUT) as c:
        layer = gradwire.RemoteLinear(c, 8, 4)
        x = torch.randn(2, 8, requires_grad=True)
        layer(x).sum().backward()  # the stream works, and the weights are mirrored
        old = c.train_stream(layer.module_id)  # the layer's stream (routed by its id)
        fresh_server.pause()
        try:
            error, elapsed = within(20, lambda: layer(torch.randn(2, 8, requires_grad=True)))
            assert_deadline(error, elapsed, "Train.Forward")
            assert "stream was replaced" in error.message
            assert old.closed and old.replaced
        finally:
            fresh_server.resume()
        # Training goes on over a new stream.
        x = torch.randn(2, 8, requires_grad=True)
        layer(x).sum().backward()
        assert c.train_stream(layer.module_id) is not old
        assert x.grad is not None and x.grad.abs().sum() > 0
        assert c.server_info().live_contexts == 0


def test_backward_has_a_deadline(fresh_server):
    with gradwire.Client(fresh_server.address, timeout=TIMEOUT) as c:
        layer = gradwire.RemoteLinear(c, 8, 4)
        y = layer(torch.randn(2, 8, requires_grad=True))
        fresh_server.pause()
        try:
            error, elapsed = within(20, lambda: y.sum().backward())
            assert_deadline(error, elapsed, "Train.Backward")
        finally:
            fresh_server.resume()


def test_pipelined_forward_has_a_deadline(fresh_server):
    with gradwire.Client(fresh_server.address, timeout=TIMEOUT) as c:
        model = gradwire.RemoteSequential([gradwire.RemoteLinear(c, 8, 8, seed=i)
                                           for i in range(2)], micro_batches=2)
        model(torch.randn(4, 8)).sum().backward()
        fresh_server.pause()
        try:
            error, elapsed = within(20, lambda: model(torch.randn(4, 8)))
            assert_deadline(error, elapsed, "Train.Forward")
        finally:
            fresh_server.resume()
        model(torch.randn(4, 8)).sum().backward()  # and again once the server answers


def test_raw_stream_futures_complete_at_their_deadline(fresh_server):
    with gradwire.Client(fresh_server.address, timeout=TIMEOUT) as c:
        layer = gradwire.RemoteLinear(c, 8, 4, keep=True)
        stream = c.train_stream()
        fresh_server.pause()
        try:
            futures = [stream.forward(layer.module_id, torch.randn(2, 8)) for _ in range(3)]
            # .result() with no timeout of its own: the stream's deadline ends the wait.
            error, elapsed = within(20, lambda: futures[0].result())
            assert_deadline(error, elapsed, "Train.Forward")
            later = [f.exception(timeout=5) for f in futures[1:]]
            assert all(isinstance(e, gradwire.GradwireError) for e in later), later
            assert all("replaced" in e.message for e in later), later
        finally:
            fresh_server.resume()


@pytest.mark.parametrize("training", [False, True])
def test_unary_calls_name_the_call(fresh_server, training):
    with gradwire.Client(fresh_server.address, timeout=TIMEOUT, chunking="never") as c:
        layer = gradwire.RemoteLinear(c, 8, 4, keep=True)
        fresh_server.pause()
        try:
            error, elapsed = within(20, lambda: c.forward(layer.module_id, torch.randn(2, 8),
                                                          training=training))
            assert_deadline(error, elapsed, "Forward")
            assert "no answer within 1 s" in error.message
        finally:
            fresh_server.resume()


def test_close_with_a_stalled_server_waits_one_deadline(fresh_server, caplog):
    c = gradwire.Client(fresh_server.address, timeout=TIMEOUT)
    modules = [gradwire.RemoteLinear(c, 4, 2) for _ in range(3)]
    fresh_server.pause()
    try:
        error, elapsed = within(20, c.close)
        assert error is None and elapsed < 2 * TIMEOUT + 1, (error, elapsed)
        assert "could not delete 3 modules" in caplog.text
        assert all(m.module_id in caplog.text for m in modules)
    finally:
        fresh_server.resume()


def test_close_with_a_stalled_server_and_a_train_stream_waits_one_deadline(fresh_server):
    """Deleting the modules and ending the Train stream share one deadline: a stalled server
    costs close() one timeout, not one for the deletes and another for the stream."""
    c = gradwire.Client(fresh_server.address, timeout=TIMEOUT)
    m = gradwire.RemoteLinear(c, 4, 2)
    m(torch.randn(3, 4, requires_grad=True)).sum().backward()  # on the Train stream
    assert c._trains  # the module's routed stream
    fresh_server.pause()
    try:
        error, elapsed = within(20, c.close)
        assert error is None and elapsed < TIMEOUT + 0.8, (error, elapsed)
    finally:
        fresh_server.resume()


def test_a_training_forward_without_its_answer_releases_the_context_it_named(fresh_server):
    """The client draws a training forward's context id; when the answer never comes (here the
    server is stopped past the deadline) it releases that id in the background, so a context the
    server made and answered into the void does not stay behind. Refusals and inference forwards
    release nothing."""
    with gradwire.Client(fresh_server.address, timeout=TIMEOUT, chunking="never") as c:
        layer = gradwire.RemoteLinear(c, 8, 4, keep=True)
        out, context_id, _ = c.forward(layer.module_id, torch.randn(2, 8), training=True)
        assert len(context_id) == 32 and int(context_id, 16) >= 0  # the client's own draw
        c.release_context(context_id)
        with pytest.raises(gradwire.GradwireError) as refused:
            c.forward(layer.module_id, torch.randn(2, 7), training=True)  # wrong width
        assert refused.value.code == "INVALID_ARGUMENT"
        assert c.unanswered_releases == 0
        fresh_server.pause()
        try:
            error, _ = within(20, lambda: c.forward(layer.module_id, torch.randn(2, 8),
                                                    training=False))
            assert error is not None and error.code == "DEADLINE_EXCEEDED", error
            assert c.unanswered_releases == 0  # inference makes no context
            error, _ = within(20, lambda: c.forward(layer.module_id, torch.randn(2, 8),
                                                    training=True))
            assert error is not None and error.code == "DEADLINE_EXCEEDED", error
            assert c.unanswered_releases == 1
        finally:
            fresh_server.resume()
        deadline = time.monotonic() + 10
        while c.server_info().live_contexts != 0:
            assert time.monotonic() < deadline, "a context stayed behind"
            time.sleep(0.05)
