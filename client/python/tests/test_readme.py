"""What the README says a run does is what a run does: the example's quoted results, an
unreachable server's error, and a habit table that names every habit it promises."""

import os
import re
import socket
import sys
import time

import pytest

import gradwire

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(PACKAGE, "README.md")


def readme():
    with open(README, encoding="utf-8") as f:
        return f.read()


def row(text, starts):
    rows = [line for line in text.splitlines() if line.startswith("| " + starts)]
    assert len(rows) == 1, f"no single table row for {starts!r}"
    return rows[0]


def test_mlp_stack_results_are_those_quoted(client):
    text = " ".join(readme().split())
    quote = re.search(r"test accuracy ([\d.]+)% for the FP8 stack and ([\d.]+)% for its float32 "
                      r"twin, final training loss ([\d.]+) vs ([\d.]+)", text)
    assert quote, "the README quotes no run of mlp_stack.py"
    sys.path.insert(0, os.path.join(PACKAGE, "examples"))
    try:
        import mlp_stack
    finally:
        sys.path.pop(0)
    history = mlp_stack.train(client, log=lambda line: None)  # the defaults, as quoted
    fp8_acc, f32_acc, fp8_loss, f32_loss = (float(v) for v in quote.groups())
    # Within a test sample (1 of 171) and three units of the last digit quoted: the local
    # layers' float32 arithmetic may round otherwise with another BLAS.
    assert abs(100 * history["fp8_acc"][-1] - fp8_acc) < 0.6, history["fp8_acc"][-1]
    assert abs(100 * history["f32_acc"][-1] - f32_acc) < 0.6, history["f32_acc"][-1]
    assert abs(history["fp8_loss"][-1] - fp8_loss) <= 3e-4, history["fp8_loss"][-1]
    assert abs(history["f32_loss"][-1] - f32_loss) <= 3e-4, history["f32_loss"][-1]


def test_unreachable_server_is_described_as_it_fails():
    described = row(readme(), "an unreachable server")
    assert "UNAVAILABLE" in described and "at once" in described
    assert "DEADLINE_EXCEEDED" not in described
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = gradwire.Client(f"127.0.0.1:{port}", timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(gradwire.GradwireError) as e:
            client.server_info()
        assert e.value.code == "UNAVAILABLE" and time.monotonic() - start < 5
    finally:
        client.close()


def test_create_graph_is_described_as_it_behaves():
    text = " ".join(readme().split())
    assert "has no graph" not in text  # it has one: a node that refuses a double backward
    assert "raises a RuntimeError naming the module" in text


@pytest.mark.parametrize("habit", [
    "functional_call", "torch.func.functional_call", "parametrize", "weight_norm", "prune",
    "KeyboardInterrupt", "torch.autograd.grad", "requires_grad_(False)", "clip_grad_norm_",
    "model.parameters()", "copy.deepcopy", "NaN", "restarts", "double backward",
    "empty batch of the wrong width"])
def test_habit_table_names_every_habit(habit):
    text = readme()
    table = text[text.index("### The habit table"):text.index("## Differences from local")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and habit in line]
    assert rows, f"the habit table has no row for {habit}"
    assert all(len(r.split(" | ")) >= 2 and len(r.split(" | ")[-1]) > 20 for r in rows)
