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


def _start_server(*extra, env=None):
    """Starts gradwire-server on a free loopback port; yields its address, then stops it."""
    log = tempfile.NamedTemporaryFile(prefix="gradwire-server-", suffix=".log", delete=False)
    proc = subprocess.Popen([SERVER_BIN, "--listen", "127.0.0.1:0", *extra], stdout=log,
                            stderr=log, env=env)
    address = None
    for _ in range(200):
        with open(log.name) as f:
            m = re.search(r"listening on (\S+)", f.read())
        if m:
            address = m.group(1)
            break
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    if address is None:
        proc.kill()
        with open(log.name) as f:
            raise RuntimeError("gradwire-server did not start:\n" + f.read())
    yield address
    proc.terminate()
    proc.wait(timeout=30)
    os.unlink(log.name)


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


@pytest.fixture
def client(server):
    c = gradwire.Client(server)
    yield c
    c.close()
