"""Chunked calls from the Python client: same results as the unary calls, chosen by size. The
clients here keep to the wire (shared_memory="off"): on the server's host they would otherwise pass
these tensors through shared memory, which takes neither path."""
import pytest
import torch

import gradwire
from gradwire.v1 import module_pb2
from conftest import _start_server


@pytest.fixture(scope="module")
def small_chunk_server():
    """A server whose chunks are 64 KiB, so modest tensors take the chunked path."""
    yield from _start_server("--chunk-kib", "64")


def _linear(client, n_in, n_out):
    spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=n_in, out_features=n_out,
                                 bias=True, seed=3)
    return client.create_module(spec).module_id


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16"])
def test_chunked_forward_backward_match_unary(small_chunk_server, wire_dtype):
    unary = gradwire.Client(small_chunk_server, wire_dtype=wire_dtype, chunking="never",
                            shared_memory="off")
    chunked = gradwire.Client(small_chunk_server, wire_dtype=wire_dtype, chunk_kib=64,
                              chunking="always", shared_memory="off")
    try:
        mid = _linear(unary, 256, 384)
        x, dy = torch.randn(300, 256), torch.randn(300, 384)
        ya, ca, _ = unary.forward(mid, x, True)
        yb, cb, _ = chunked.forward(mid, x, True)
        assert torch.equal(ya, yb)
        ga, gb = unary.backward(ca, dy), chunked.backward(cb, dy)
        assert ga.shape == (300, 256) and torch.equal(ga, gb)
        assert unary.chunked_calls == 0 and chunked.chunked_calls == 2
        assert unary.server_info().live_contexts == 0
    finally:
        unary.close()
        chunked.close()


def test_auto_picks_chunks_for_large_tensors(small_chunk_server):
    # f32: the sizes below are float32's (the exact wire would send the input as E4M3 codes).
    c = gradwire.Client(small_chunk_server, chunk_kib=64, shared_memory="off", wire_dtype="f32")
    try:
        narrow, wide = _linear(c, 64, 32), _linear(c, 16, 4096)
        c.forward(narrow, torch.randn(4, 64), False)
        assert c.chunked_calls == 0
        y, _, _ = c.forward(narrow, torch.randn(512, 64), False)  # 128 KiB request
        assert y.shape == (512, 32) and c.chunked_calls == 1
        y, ctx, _ = c.forward(wide, torch.randn(8, 16), True)  # 128 KiB response
        assert y.shape == (8, 4096) and c.chunked_calls == 2
        c.backward(ctx, torch.randn(8, 4096))
        assert c.chunked_calls == 3
        weights = c.get_weights(wide)
        assert c.chunked_calls == 4
        weights["weight"] = torch.randn(4096, 16)
        c.set_weights(wide, weights)
        assert c.chunked_calls == 5
        assert torch.equal(c.get_weights(wide)["weight"], weights["weight"])
    finally:
        c.close()


def test_chunk_larger_than_the_server_allows_is_refused(small_chunk_server):
    c = gradwire.Client(small_chunk_server, chunk_kib=128, chunking="always",
                        shared_memory="off")
    try:
        mid = _linear(c, 256, 8)
        with pytest.raises(gradwire.GradwireError) as e:
            c.forward(mid, torch.randn(512, 256), True)
        assert e.value.code == "INVALID_ARGUMENT" and "chunk limit" in e.value.message
        assert c.server_info().live_contexts == 0
    finally:
        c.close()


def test_auto_chunks_a_backward_by_its_grad_input(small_chunk_server):
    """Under the exact wire a backward's request may be small (grad_output as FP8 codes) and its
    response large: grad_input, F32 [rows, in_features], 128 KiB here, takes the chunked call."""
    c = gradwire.Client(small_chunk_server, chunk_kib=64, shared_memory="off")
    try:
        m = _linear(c, 4096, 16)
        _, ctx, _ = c.forward(m, torch.randn(8, 4096), True)
        assert c.exact_grad_output(m) is not None
        calls = c.chunked_calls
        g = c.backward(ctx, torch.randn(8, 16))
        assert g.shape == (8, 4096) and c.chunked_calls == calls + 1
        assert c.exact_fp8_gradients == 1
    finally:
        c.close()
