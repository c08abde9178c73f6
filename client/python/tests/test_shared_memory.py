"""Shared-memory tensors from Python. By default a client on the server's host passes large
tensors through a region the server makes for it alone, by itself, with the wire's bits; a server
with --shared-memory off, or a client of another user, means the wire without an error. A server
with --allow-shared-memory also reads inputs from and writes results into a SharedMemoryRegion a
client makes; the results are bit for bit what the same calls over the wire give."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import gradwire
from gradwire import SharedMemoryRegion
from gradwire.v1 import module_pb2

from conftest import _start_server


@pytest.fixture(scope="module")
def shm_server():
    yield from _start_server("--allow-shared-memory", "--max-shared-memory-regions", "4")


def spec(kind, seed):
    s = module_pb2.ModuleSpec(kind=kind, in_features=48, out_features=24, seed=seed,
                              return_layernorm_output=kind == module_pb2.LAYERNORM_LINEAR)
    if kind == module_pb2.LAYERNORM_MLP:
        s.ffn_features = 40
    return s


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16", "fp8"])
@pytest.mark.parametrize("kind", [module_pb2.LINEAR, module_pb2.LAYERNORM_LINEAR,
                                  module_pb2.LAYERNORM_MLP])
def test_training_step_matches_the_wire(shm_server, wire_dtype, kind):
    c = gradwire.Client(shm_server, wire_dtype=wire_dtype)
    try:
        a = c.create_module(spec(kind, 3)).module_id
        b = c.create_module(spec(kind, 3)).module_id
        x, dy = torch.randn(5, 48), torch.randn(5, 24)
        with SharedMemoryRegion(c, 1 << 16) as region:
            assert [r.name for r in c.list_shared_memory()] == [region.name]
            y_wire, ctx_a, ln_wire = c.forward(a, x, training=True)
            y_shm, ctx_b, ln_shm = c.forward_shared(b, x, training=True, region=region)
            assert torch.equal(y_wire, y_shm)
            assert (ln_wire is None) == (ln_shm is None)
            if ln_wire is not None:
                assert torch.equal(ln_wire, ln_shm)
            dx_wire = c.backward(ctx_a, dy)
            dx_shm = c.backward_shared(ctx_b, dy, region=region)
            assert torch.equal(dx_wire, dx_shm)
            ga, gb = c.get_gradients(a), c.get_gradients(b)
            for (name, t), (_, u) in zip(ga.items(), gb.items()):
                assert torch.equal(t, u), name
        assert c.list_shared_memory() == []  # closed: unregistered
    finally:
        c.close()


@pytest.mark.parametrize("recipe", ["current", "block", "block-hybrid", "mxfp8"])
def test_exact_backward_into_a_region_keeps_the_bits(shm_server, recipe):
    """backward_shared under the exact wire: grad_output's FP8 cast (both copies under the block
    recipes) in the client's region, its column sums in the request (the Linear has a bias):
    the F32 wire's results, bit for bit."""
    exact = gradwire.Client(shm_server)
    f32 = gradwire.Client(shm_server, wire_dtype="f32")
    try:
        s = spec(module_pb2.LINEAR, 4)
        s.bias = True
        s.recipe.scaling, s.recipe.format = gradwire.modules._RECIPES[recipe]
        a = exact.create_module(s).module_id
        b = f32.create_module(s).module_id
        x, dy = torch.randn(5, 48), torch.randn(5, 24) * 1e3
        with SharedMemoryRegion(exact, 1 << 16) as region:
            ya, ca, _ = exact.forward_shared(a, x, training=True, region=region)
            yb, cb, _ = f32.forward(b, x, training=True)
            assert torch.equal(ya.view(torch.int32), yb.view(torch.int32))
            da = exact.backward_shared(ca, dy, region=region)
            assert exact.exact_fp8_gradients == 1
        db = f32.backward(cb, dy)
        assert torch.equal(da.view(torch.int32), db.view(torch.int32))
        ga, gb = exact.get_gradients(a), f32.get_gradients(b)
        assert ga.keys() == gb.keys() and "bias" in ga
        for name in ga:
            assert torch.equal(ga[name].view(torch.int32), gb[name].view(torch.int32)), name
        exact.delete_module(a)
        f32.delete_module(b)
    finally:
        exact.close()
        f32.close()


def test_limits_and_errors(shm_server):
    c = gradwire.Client(shm_server)
    try:
        regions = [SharedMemoryRegion(c, 4096) for _ in range(4)]
        with pytest.raises(gradwire.GradwireError) as e:
            SharedMemoryRegion(c, 4096)
        assert e.value.code == "RESOURCE_EXHAUSTED"
        assert "--max-shared-memory-regions" in e.value.message
        for r in regions:
            r.close()
        with pytest.raises(gradwire.GradwireError) as e:
            c.register_shared_memory("x", "/not-the-prefix", 0, 16)
        assert e.value.code == "INVALID_ARGUMENT"
        # A tensor that does not fit: refused before anything runs.
        m = c.create_module(spec(module_pb2.LINEAR, 1)).module_id
        with SharedMemoryRegion(c, 256) as small:
            with pytest.raises(ValueError):
                c.forward_shared(m, torch.randn(4, 48), training=False, region=small)
    finally:
        c.close()


def test_off_by_default(client):
    with pytest.raises(gradwire.GradwireError) as e:
        SharedMemoryRegion(client, 4096)
    assert e.value.code == "FAILED_PRECONDITION"
    assert "--allow-shared-memory" in e.value.message


# --- regions the server makes (CreateSharedMemory), used by forward/backward by themselves


def big_spec(kind=module_pb2.LINEAR, seed=5):
    s = module_pb2.ModuleSpec(kind=kind, in_features=256, out_features=128, seed=seed,
                              return_layernorm_output=kind == module_pb2.LAYERNORM_LINEAR)
    if kind == module_pb2.LAYERNORM_MLP:
        s.ffn_features = 96
    return s


@pytest.mark.parametrize("kind", [module_pb2.LINEAR, module_pb2.LAYERNORM_LINEAR,
                                  module_pb2.LAYERNORM_MLP])
def test_forward_and_backward_use_shared_memory_by_themselves(server, kind):
    auto = gradwire.Client(server)  # the default: shared_memory="auto"
    wire = gradwire.Client(server, shared_memory="off")
    try:
        m = auto.create_module(big_spec(kind)).module_id
        wire._modules[m] = auto._modules[m]
        x, dy = torch.randn(300, 256), torch.randn(300, 128)
        y_wire, ctx_wire, ln_wire = wire.forward(m, x, training=True)
        dx_wire = wire.backward(ctx_wire, dy, grad_layernorm_output=None)
        g_wire = auto.get_gradients(m, zero=True)
        y, ctx, ln = auto.forward(m, x, training=True)
        dx = auto.backward(ctx, dy)
        g = auto.get_gradients(m, zero=True)
        assert auto.shared_memory_calls == 2 and wire.shared_memory_calls == 0
        assert torch.equal(y, y_wire) and torch.equal(dx, dx_wire)
        assert (ln is None) == (ln_wire is None)
        if ln is not None:
            assert torch.equal(ln, ln_wire)
        for name in g_wire:
            assert torch.equal(g[name], g_wire[name]), name
        # The results are the caller's own: the next call's writes into the region leave them.
        y_again = y.clone()
        auto.forward(m, torch.randn(300, 256), training=False)
        assert torch.equal(y, y_again)
        # One region, reused; a small call keeps to the wire.
        assert auto._shm.made == 1
        auto.forward(m, torch.randn(1, 256), training=False)
        assert auto.shared_memory_calls == 3
        regions = auto.list_shared_memory()
        assert len(regions) == 1
        assert not os.path.exists("/dev/shm" + regions[0].key)  # its name is gone
    finally:
        auto.close()
        wire.close()
    probe = gradwire.Client(server)
    try:
        assert probe.list_shared_memory() == []  # close() unregistered it
    finally:
        probe.close()


def test_a_region_the_server_closed_costs_nothing(server):
    c = gradwire.Client(server)
    try:
        m = c.create_module(big_spec()).module_id
        x = torch.randn(300, 256)
        y1, _, _ = c.forward(m, x, training=False)
        [region] = c.list_shared_memory()
        assert c.unregister_shared_memory(region.name) == 1  # behind the pool's back
        y2, _, _ = c.forward(m, x, training=False)  # refused before anything ran: the wire
        assert c.shared_memory_calls == 1
        y3, _, _ = c.forward(m, x, training=False)  # a new region
        assert c.shared_memory_calls == 2 and c._shm.made == 2
        assert torch.equal(y1, y2) and torch.equal(y1, y3)
    finally:
        c.close()


def test_off_on_the_server_means_the_wire_without_an_error():
    for srv in _start_server("--shared-memory", "off"):
        c = gradwire.Client(srv)
        try:
            m = c.create_module(big_spec()).module_id
            y, _, _ = c.forward(m, torch.randn(300, 256), training=False)
            assert y.shape == (300, 128)
            assert c._shm.off and c.shared_memory_calls == 0
        finally:
            c.close()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to run a client under another user")
def test_a_client_of_another_user_uses_the_wire(server):
    """The server's objects are its user's only: a client under another uid cannot open them,
    unregisters the region and uses the wire; nothing is left on the server."""
    code = textwrap.dedent(f"""
        import torch, gradwire
        from gradwire.v1 import module_pb2
        c = gradwire.Client({server!r})
        m = c.create_module(module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=256,
                                                  out_features=128, seed=5)).module_id
        y, _, _ = c.forward(m, torch.randn(300, 256), training=False)
        assert y.shape == (300, 128), y.shape
        assert c._shm.off and c.shared_memory_calls == 0
        assert c.list_shared_memory() == []
        c.close()
        print("wire ok")
    """)
    package = os.path.dirname(os.path.dirname(os.path.abspath(gradwire.__file__)))
    out = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
         code], env={**os.environ, "PYTHONPATH": package, "HOME": "/tmp"},
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "wire ok" in out.stdout
