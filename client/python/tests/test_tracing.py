"""Requests you can follow: every call sends a W3C traceparent, logs it at debug level, and the
server puts its trace-id in its log lines about the call and at the end of the call's error."""

import json
import logging
import re

import pytest
import torch

import gradwire
from gradwire.client import new_traceparent

from conftest import ServerProcess

TRACEPARENT = re.compile(r"traceparent (00-([0-9a-f]{32})-([0-9a-f]{16})-01)")


def test_new_traceparent_is_w3c_version_00():
    tp = new_traceparent()
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", tp), tp
    assert new_traceparent() != tp  # fresh ids each time
    fixed = "4bf92f3577b34da6a3ce929d0e0e4736"
    a, b = new_traceparent(fixed), new_traceparent(fixed)
    assert a.split("-")[1] == b.split("-")[1] == fixed and a != b  # same trace, new parent


def test_trace_id_is_checked(server):
    for bad in ("4BF92F3577B34DA6A3CE929D0E0E4736", "abc", "0" * 32):
        with pytest.raises(ValueError, match="trace_id"):
            gradwire.Client(server, trace_id=bad)


def _rpc_lines(log_path):
    with open(log_path) as f:
        return [json.loads(line) for line in f if '"msg":"rpc"' in line]


def test_calls_are_logged_with_their_traceparent_and_the_server_logs_the_same_id(caplog):
    server = ServerProcess("--log-format", "json", "--log-level", "debug")
    try:
        caplog.set_level(logging.DEBUG, logger="gradwire")
        with gradwire.Client(server.address) as client:
            layer = gradwire.RemoteLinear(client, 8, 4)
            layer(torch.randn(3, 8)).sum().backward()
            with pytest.raises(gradwire.GradwireError) as failed:
                client.delete_module("0123456789abcdef0123456789abcdef")
        sent = [TRACEPARENT.search(r.getMessage()) for r in caplog.records]
        sent = [m for m in sent if m]
        assert len(sent) >= 3, [r.getMessage() for r in caplog.records]
        # The error carries the id of its call, in its message and as request_id.
        error = failed.value
        assert error.code == "NOT_FOUND" and re.fullmatch(r"[0-9a-f]{32}", error.request_id)
        assert str(error).endswith(f"[request {error.request_id}]"), str(error)
        assert error.request_id in {m.group(2) for m in sent}
        server.end()  # the log is complete once the process has exited
        lines = {(l["request_id"], l["parent_id"]): l for l in _rpc_lines(server.log.name)}
        for m in sent:
            assert (m.group(2), m.group(3)) in lines, (m.group(1), sorted(lines))
        delete = [l for (rid, _), l in lines.items() if rid == error.request_id]
        assert [l["method"] for l in delete] == ["DeleteModule"]
        assert delete[0]["code"] == "NOT_FOUND"
    finally:
        server.stop()


def test_a_shared_trace_id_goes_on_every_call(server, caplog):
    trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    caplog.set_level(logging.DEBUG, logger="gradwire")
    with gradwire.Client(server, trace_id=trace) as client:
        client.list_modules()
        with pytest.raises(gradwire.GradwireError) as failed:
            client.delete_module("0123456789abcdef0123456789abcdef")
    ids = {m.group(2) for m in (TRACEPARENT.search(r.getMessage()) for r in caplog.records) if m}
    assert ids == {trace}, ids
    assert failed.value.request_id == trace and str(failed.value).endswith(f"[request {trace}]")


def test_train_stream_errors_carry_the_stream_request_id(server):
    with gradwire.Client(server) as client:
        stream = client.train_stream()
        future = stream.backward("0123456789abcdef0123456789abcdef", torch.randn(2, 4))
        with pytest.raises(gradwire.GradwireError) as failed:
            future.result(timeout=30)
        rid = stream.traceparent.split("-")[1]
        assert failed.value.request_id == rid and str(failed.value).endswith(f"[request {rid}]")
