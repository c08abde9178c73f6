import os
import re
import subprocess
import tempfile
import time

import pytest

import gradwire

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SERVER_BIN = os.environ.get("GRADWIRE_SERVER_BIN",
                            os.path.join(ROOT, "build/server/gradwire-server"))
CLI_BIN = os.environ.get("GRADWIRE_CLI_BIN", os.path.join(ROOT, "build/client/gradwire"))


class ServerProcess:
    """A gradwire-server process on loopback: ``address`` once started."""

    def __init__(self, *extra, env=None, listen="127.0.0.1:0"):
        self.log = tempfile.NamedTemporaryFile(prefix="gradwire-server-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen([SERVER_BIN, "--listen", listen, *extra], stdout=self.log,
                                     stderr=self.log, env=env)
        self.address = None
        for _ in range(400):
            with open(self.log.name) as f:
                m = re.search(r"listening on (\S+)", f.read())
            if m:
                self.address = m.group(1)
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if self.address is None:
            self.proc.kill()
            with open(self.log.name) as f:
                raise RuntimeError("gradwire-server did not start:\n" + f.read())

    def stop(self, kill=False):
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=30)
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def _start_server(*extra, env=None):
    """Starts gradwire-server on a free loopback port; yields its address, then stops it."""
    server = ServerProcess(*extra, env=env)
    yield server.address
    server.stop()


@pytest.fixture(scope="session")
def server():
    """A real gradwire-server on a free loopback port for the whole session."""
    yield from _start_server()


TENANT_TOKENS = {"alice": "alice-" + os.urandom(12).hex(), "bob": "bob-" + os.urandom(12).hex()}


@pytest.fixture(scope="session")
def token_server():
    """A gradwire-server that requires bearer tokens (tenants alice and bob)."""
    env = dict(os.environ)
    env["GRADWIRE_SERVER_TOKENS"] = ",".join(f"{t}:{k}" for t, k in TENANT_TOKENS.items())
    yield from _start_server(env=env)


@pytest.fixture(scope="session")
def second_server():
    """Another gradwire-server, for the several-servers tests."""
    yield from _start_server()


@pytest.fixture
def client(server):
    c = gradwire.Client(server)
    yield c
    c.close()
