"""Fixtures of the Python suite: real gradwire-server processes on loopback.

The suite reads two environment variables (README.md, "Tests", names them too):
GRADWIRE_SERVER_BIN, the gradwire-server binary (default build/server/gradwire-server), and
GRADWIRE_CLI_BIN, the gradwire CLI (default build/client/gradwire); the package itself comes from
PYTHONPATH=client/python or an installed copy.
"""

import os
import re
import signal
import subprocess
import tempfile
import time

import pytest

import gradwire

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SERVER_BIN = os.environ.get("GRADWIRE_SERVER_BIN",
                            os.path.join(ROOT, "build/server/gradwire-server"))
CLI_BIN = os.environ.get("GRADWIRE_CLI_BIN", os.path.join(ROOT, "build/client/gradwire"))
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


class ServerProcess:
    """A gradwire-server process on loopback: ``address`` once started."""

    def __init__(self, *extra, env=None, listen="127.0.0.1:0"):
        if not os.access(SERVER_BIN, os.X_OK):
            raise RuntimeError(f"no gradwire-server at {SERVER_BIN}: build it, or point "
                               "GRADWIRE_SERVER_BIN at one (see client/python/README.md, Tests)")
        self.log = tempfile.NamedTemporaryFile(prefix="gradwire-server-", suffix=".log",
                                               delete=False)
        self.proc = subprocess.Popen([SERVER_BIN, "--listen", listen, *extra], stdout=self.log,
                                     stderr=self.log, env=env)
        self.address = None
        for _ in range(400):
            with open(self.log.name) as f:
                m = re.search(r"listening on ([^\s\"]+)", f.read())  # text or JSON logs
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

    def pause(self):
        """Stops the process (SIGSTOP): it accepts connections but answers nothing. The signal is
        delivered asynchronously, so this waits until every thread of the process is stopped:
        otherwise a request sent at once could still be answered."""
        self.proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not self._all_threads_stopped():
            assert time.monotonic() < deadline, "the server did not stop on SIGSTOP"
            time.sleep(0.001)

    def _all_threads_stopped(self):
        task_dir = f"/proc/{self.proc.pid}/task"
        try:
            tids = os.listdir(task_dir)
        except FileNotFoundError:
            return True  # exited: answers nothing either
        for tid in tids:
            try:
                with open(f"{task_dir}/{tid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, IndexError):
                continue  # the thread ended meanwhile
            if state not in ("T", "t"):
                return False
        return True

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)

    def end(self, kill=False):
        """Ends the process and waits for it; its log stays readable until stop()."""
        self.resume()  # a stopped process would not act on SIGTERM
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            self.proc.wait(timeout=30)

    def stop(self, kill=False):
        self.end(kill)
        if os.path.exists(self.log.name):
            os.unlink(self.log.name)


def _start_server(*extra, env=None):
    """Starts gradwire-server on a free loopback port; yields its address, then stops it."""
    server = ServerProcess(*extra, env=env)
    yield server.address
    server.stop()


@pytest.fixture(scope="session")
def server():
    """A real gradwire-server on a free loopback port for the whole session. Its modules created
    without a recipe are CURRENT (--default-recipe current), the recipe the wire and dtype tests
    were written for; ``default_server`` keeps the server's own default (BLOCK)."""
    yield from _start_server("--default-recipe", "current")


@pytest.fixture(scope="session")
def default_server():
    """A real gradwire-server with every default of its own."""
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
    """Another gradwire-server, for the several-servers tests: as ``server`` (its modules'
    results must not depend on which of the two a module landed on)."""
    yield from _start_server("--default-recipe", "current")


@pytest.fixture
def client(server):
    c = gradwire.Client(server)
    yield c
    c.close()


@pytest.fixture
def fresh_server():
    """A server of this test's own: what the test leaves (or pauses) touches nobody else."""
    server = ServerProcess()
    yield server
    server.stop()


def module_ids(address):
    """The ids of the modules on the server at ``address`` (a throwaway client)."""
    c = gradwire.Client(address)
    try:
        return [m.module_id for m in c.list_modules()]
    finally:
        c.close(keep=True)
