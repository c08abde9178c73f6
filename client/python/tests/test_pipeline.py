"""Train streams, RemoteSequential's GPipe schedule and placement on several servers: the
pipelined path gives the results of the plain sequential one."""

import os

import pytest
import torch

import gradwire


def make_blocks(where, seed, n=3, width=24, ffn=40, lr=0.05, momentum=0.0):
    return [gradwire.RemoteLayerNormMLP(where, width, ffn, seed=seed + i, optimizer="sgd", lr=lr,
                                        momentum=momentum)
            for i in range(n)]


def sequential_reference(blocks, x, dy, micro_batches):
    """The same micro-batches, one blocking call at a time (unary Forward/Backward)."""
    outs, grads = [], []
    for xm, dym in zip(torch.chunk(x, micro_batches), torch.chunk(dy, micro_batches)):
        contexts, h = [], xm
        for b in blocks:
            h, ctx, _ = b.client.forward(b.module_id, h, training=True)
            contexts.append((b, ctx))
        outs.append(h)
        g = dym
        for b, ctx in reversed(contexts):
            g = b.client.backward(ctx, g)
        grads.append(g)
    return torch.cat(outs), torch.cat(grads)


def check_same(piped, plain, x, dy, micro_batches):
    xp = x.clone().requires_grad_()
    y = gradwire.RemoteSequential(piped, micro_batches=micro_batches)(xp)
    y.backward(dy)
    y_ref, g_ref = sequential_reference(plain, x, dy, micro_batches)
    # Each micro-batch's casts see the same values in either schedule: bit for bit.
    assert torch.equal(y.detach(), y_ref)
    assert torch.equal(xp.grad, g_ref)
    # Weight gradients sum the micro-batches, perhaps in another order: fp32 rounding.
    for a, b in zip(piped, plain):
        ga, gb = a.get_gradients(), b.get_gradients()
        for name in ga:
            scale = gb[name].abs().max().item() + 1e-30
            assert torch.allclose(ga[name], gb[name], rtol=1e-5, atol=1e-6 * scale), name
    for b in piped + plain:
        assert b.client.server_info().live_contexts == 0


def test_train_stream_futures(client):
    layer = gradwire.RemoteLinear(client, 16, 8, seed=2)
    stream = client.train_stream()
    xs = [torch.randn(4, 16) for _ in range(6)]
    futures = [stream.forward(layer.module_id, x, True) for x in xs]  # all in flight
    results = [f.result(timeout=30) for f in futures]
    for x, (y, ctx, _) in zip(xs, results):
        want, _, _ = client.forward(layer.module_id, x, training=False)
        assert torch.equal(y, want) and ctx
    backs = [stream.backward(ctx, torch.ones(4, 8)) for _, ctx, _ in results]
    assert all(g.result(timeout=30).shape == (4, 16) for g in backs)
    bad = stream.backward(results[0][1], torch.ones(4, 8))  # consumed already
    with pytest.raises(gradwire.GradwireError) as e:
        bad.result(timeout=30)
    assert e.value.code == "FAILED_PRECONDITION"
    assert client.server_info().live_contexts == 0


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_pipeline_matches_the_sequential_path(client, micro_batches):
    seed = int.from_bytes(os.urandom(2), "little")
    torch.manual_seed(seed)
    x, dy = torch.randn(16, 24), torch.randn(16, 24)
    check_same(make_blocks(client, seed), make_blocks(client, seed), x, dy, micro_batches)


def test_pipeline_over_two_servers(server, second_server):
    seed = int.from_bytes(os.urandom(2), "little")
    torch.manual_seed(seed)
    with gradwire.Cluster([server, second_server]) as cluster:
        piped = make_blocks(cluster, seed)  # round-robin: servers 0, 1, 0
        assert [b.client.server for b in piped] == [server, second_server, server]
        plain = make_blocks(cluster, seed)
        x, dy = torch.randn(12, 24), torch.randn(12, 24)
        check_same(piped, plain, x, dy, 3)
        # The module id can name its server; a bare id is found by asking.
        qualified = cluster.qualified_id(piped[1].module_id)
        assert qualified == f"{second_server}/{piped[1].module_id}"
        fresh = gradwire.Cluster([server, second_server])
        try:
            assert fresh.client_for(piped[1].module_id).server == second_server
            assert fresh.client_for(qualified).server == second_server
            with pytest.raises(gradwire.GradwireError) as e:
                fresh.locate("0" * 32)
            assert e.value.code == "NOT_FOUND"
        finally:
            fresh.close()


def test_pipeline_trains(client):
    torch.manual_seed(0)
    blocks = make_blocks(client, 11, n=2, width=16, ffn=32, lr=0.1, momentum=0.9)
    model = gradwire.RemoteSequential(blocks, micro_batches=4)
    x = torch.randn(32, 16)
    target = torch.tanh(x @ torch.randn(16, 16) * 0.3)
    losses = []
    for _ in range(25):
        loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        model.apply_gradients()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_mlp_stack_example_shortened(client, tmp_path):
    import os as _os
    import sys as _sys
    _sys.path.insert(0, _os.path.join(_os.path.dirname(_os.path.dirname(__file__)), "examples"))
    import mlp_stack
    history = mlp_stack.train(client, epochs=4, seed=0, log=lambda s: None)
    assert history["fp8_acc"][-1] >= 0.9, history
    assert abs(history["fp8_acc"][-1] - history["f32_acc"][-1]) <= 0.04, history
    assert history["fp8_seconds"] > 0 and history["f32_seconds"] > 0
    png = tmp_path / "stack.png"
    mlp_stack.plot(history, str(png), 3)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert client.server_info().live_contexts == 0
