"""Explicit lifetimes: module.delete(), a module as a context manager, Client.close() deleting
what its modules created (unless keep=True), garbage collection; and no example leaves a module
behind on the server."""

import gc
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import gradwire
from conftest import EXAMPLES, ServerProcess, module_ids


def test_delete(fresh_server):
    with gradwire.Client(fresh_server.address) as c:
        m = gradwire.RemoteLinear(c, 4, 2, keep=True)
        assert module_ids(fresh_server.address) == [m.module_id]
        m.delete()
        assert module_ids(fresh_server.address) == []
        assert m.deleted and "deleted" in repr(m)
        m.delete()  # twice is fine
        with pytest.raises(RuntimeError, match="was deleted"):
            m(torch.randn(1, 4))


def test_context_manager(fresh_server):
    with gradwire.Client(fresh_server.address) as c:
        with gradwire.RemoteLinear(c, 4, 2) as m:
            m(torch.randn(3, 4)).sum().backward()
            assert module_ids(fresh_server.address) == [m.module_id]
        assert module_ids(fresh_server.address) == []
        with gradwire.RemoteSequential([gradwire.RemoteLinear(c, 4, 4), torch.nn.ReLU(),
                                        gradwire.RemoteLinear(c, 4, 2)]) as seq:
            seq(torch.randn(3, 4)).sum().backward()
            assert len(module_ids(fresh_server.address)) == 2
        assert module_ids(fresh_server.address) == []


def test_close_deletes_what_the_client_owns(fresh_server):
    c = gradwire.Client(fresh_server.address)
    owned = [gradwire.RemoteLinear(c, 4, 2), gradwire.RemoteLayerNormMLP(c, 4, 8)]
    kept = gradwire.RemoteLinear(c, 4, 2, keep=True)
    raw = c.create_module(owned[0].spec).module_id  # the raw call owns nothing
    attached = gradwire.RemoteModule.attach(c, raw)
    assert isinstance(attached, gradwire.RemoteLinear)
    y = owned[1](torch.randn(2, 4, requires_grad=True))  # a live context too
    assert sorted(c.owned_modules()) == sorted(m.module_id for m in owned)
    c.close()  # the module objects are all still alive
    assert sorted(module_ids(fresh_server.address)) == sorted([kept.module_id, raw])
    assert all(m.deleted for m in owned) and not kept.deleted
    with pytest.raises(RuntimeError, match="was deleted"):
        owned[0](torch.randn(1, 4))
    del y, owned, attached
    gc.collect()  # finalizers of a closed client do nothing, and raise nothing
    assert sorted(module_ids(fresh_server.address)) == sorted([kept.module_id, raw])


def test_close_keep_leaves_everything(fresh_server):
    c = gradwire.Client(fresh_server.address)
    m = gradwire.RemoteLinear(c, 4, 2)
    c.close(keep=True)
    assert module_ids(fresh_server.address) == [m.module_id]


def test_garbage_collection_deletes(fresh_server):
    with gradwire.Client(fresh_server.address) as c:
        m = gradwire.RemoteLinear(c, 4, 2)
        m(torch.randn(3, 4)).sum().backward()
        del m
        gc.collect()
        assert module_ids(fresh_server.address) == []
        assert c.owned_modules() == []


def test_cluster_close_deletes_on_every_server(fresh_server, second_server):
    with gradwire.Cluster([fresh_server.address, second_server]) as cluster:
        blocks = [gradwire.RemoteLinear(cluster, 4, 4) for _ in range(2)]
        assert [b.client.server for b in blocks] == [fresh_server.address, second_server]
    assert module_ids(fresh_server.address) == []
    assert not set(b.module_id for b in blocks) & set(module_ids(second_server))


EXAMPLE_RUNS = {
    "quickstart.py": ["--steps", "3", "--json"],
    "digits.py": ["--epochs", "1", "--json"],
    "mlp_stack.py": ["--epochs", "1", "--blocks", "2", "--json"],
}


@pytest.mark.parametrize("example", sorted(EXAMPLE_RUNS))
def test_examples_leave_nothing_behind(fresh_server, example, tmp_path):
    args = list(EXAMPLE_RUNS[example])
    if example != "quickstart.py":
        args += ["--plot", str(tmp_path / "loss.png")]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(EXAMPLES)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    run = subprocess.run([sys.executable, os.path.join(EXAMPLES, example), "--server",
                          fresh_server.address, *args], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path), timeout=240)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result  # the example ran to its end
    assert module_ids(fresh_server.address) == [], f"{example} left modules on the server"
    with gradwire.Client(fresh_server.address) as c:
        assert c.server_info().live_contexts == 0


# --- module lifetimes on a server with --module-ttl


@pytest.fixture
def ttl_server():
    server = ServerProcess("--module-ttl", "2")
    yield server
    server.stop()


def test_an_open_client_keeps_its_modules_alive(ttl_server):
    """The server releases a module no call touched for --module-ttl; a client keeps the modules
    it created or attached alive while it is open, and stops at close(keep=True)."""
    with gradwire.Client(ttl_server.address) as owner:
        assert owner.server_info().module_ttl_s == 2.0
        m = gradwire.RemoteLinear(owner, 4, 2, keep=True)
        raw = owner.create_module(m.spec)
        owner.release(raw.module_id)  # not kept alive: only calls would renew it
        with gradwire.Client(ttl_server.address) as other:
            attached = gradwire.RemoteModule(other, module_id=m.module_id)
            assert other.held() == [m.module_id]
            time.sleep(5)  # over two TTLs; the janitor looks every second
            ids = module_ids(ttl_server.address)
            assert m.module_id in ids and raw.module_id not in ids
            assert owner.keep_alive_calls >= 3 and other.keep_alive_calls >= 3
            y = attached(torch.randn(3, 4))
            assert y.shape == (3, 2)
        owner.close(keep=True)  # nobody keeps it alive any more
        time.sleep(4)
        assert m.module_id not in module_ids(ttl_server.address)
