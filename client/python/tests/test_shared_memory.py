"""Shared-memory tensors from Python: a server on this host with --allow-shared-memory reads
inputs from and writes results into a SharedMemoryRegion; the results are bit for bit what the
same calls over the wire give. Off by default."""

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
