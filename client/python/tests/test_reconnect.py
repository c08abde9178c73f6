"""A server that restarts is reached again at once, and an unreachable server's error names the
real cause: nothing listening, no port in the address, a connection that has not retried yet."""

import time

import grpc
import pytest

import gradwire
from conftest import ServerProcess


def refusal(client):
    try:
        with pytest.raises(gradwire.GradwireError) as e:
            client.server_info()
        return e.value
    finally:
        client.close()


def test_restarted_server_is_reached_at_once():
    server = ServerProcess()
    address = server.address
    client = gradwire.Client(address, timeout=5)
    try:
        client.server_info()
        server.stop()
        # Calls fail while the server is down; gRPC's own backoff would grow past 4 s by now.
        down = time.monotonic()
        while time.monotonic() - down < 6.0:
            with pytest.raises(gradwire.GradwireError) as e:
                client.server_info()
            assert e.value.code == "UNAVAILABLE"
            assert "TLS" not in str(e.value), e.value
            time.sleep(0.05)
        server = ServerProcess(listen=address)
        up = time.monotonic()
        errors = []
        while True:
            try:
                info = client.server_info()
                break
            except gradwire.GradwireError as e:
                errors.append(e)
                assert time.monotonic() - up < 10, errors[-1]
                time.sleep(0.02)
        waited = time.monotonic() - up
        assert info.instance_id
        assert waited < 1.0, f"reached {waited:.2f} s after the restart"
        for e in errors:  # never the TLS guess: the server answers plaintext
            assert e.code == "UNAVAILABLE" and "TLS" not in str(e), e
    finally:
        client.close()
        server.stop()


class _Unavailable(grpc.RpcError):
    def __init__(self, details):
        self._details = details

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._details


def test_connection_not_retried_yet_is_named(server):
    """The error of a call made while this connection waits to retry (the server was down at its
    last attempt and listens again now): the server answers, so the hint says that, not TLS."""
    client = gradwire.Client(server, timeout=5)
    try:
        e = client._error("GetServerInfo", _Unavailable(
            f"failed to connect to all addresses; last error: UNKNOWN: ipv4:{server}: Failed to "
            "connect to remote host: Connection refused"))
        assert e.code == "UNAVAILABLE"
        assert "TLS" not in str(e), e
        assert f"gradwire-server answers at {server} now" in str(e)
        assert "restarted?" in str(e)
    finally:
        client.close()


def test_address_without_port_is_named():
    e = refusal(gradwire.Client("127.0.0.1", timeout=5))
    assert e.code == "UNAVAILABLE"
    assert "TLS" not in str(e), e
    assert "'127.0.0.1' names no port" in str(e)
