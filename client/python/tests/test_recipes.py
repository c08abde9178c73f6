"""The block-scaled FP8 recipes from Python (recipe="block" / "mxfp8", docs/block-scaling.md):
the server runs them, the module's spec names them, and one outlier costs only its own row."""

import os
import sys

import pytest
import torch

import gradwire
from gradwire import wire
from gradwire.v1 import module_pb2


@pytest.mark.parametrize("recipe,value", [("block", module_pb2.BLOCK), ("mxfp8", module_pb2.MXFP8)])
def test_a_block_recipe_keeps_the_other_rows_of_an_outlier(client, recipe, value):
    m = gradwire.RemoteLinear(client, 64, 8, recipe=recipe, seed=3)
    assert m.spec.recipe.scaling == value
    # What the server says the module is (its own spec, read back).
    assert gradwire.RemoteModule.attach(client, m.module_id).spec.recipe.scaling == value
    x = torch.randn(5, 64)
    dirty = x.clone()
    dirty[0, 7] = 3e6
    with torch.no_grad():
        clean_y, dirty_y = m(x), m(dirty)
    # Each row's blocks are its own: rows 1..4 come out bit for bit as without the outlier.
    assert torch.equal(clean_y[1:], dirty_y[1:])
    # The same weights (same seed) under per-tensor scaling: the two FP8 results agree to a few
    # E4M3 roundings.
    per_tensor = gradwire.RemoteLinear(client, 64, 8, recipe="current", seed=3)
    with torch.no_grad():
        other = per_tensor(x)
    assert (clean_y - other).norm() <= 0.1 * other.norm()


def test_block_hybrid_is_block_with_e5m2_gradients(client):
    m = gradwire.RemoteLinear(client, 64, 8, recipe="block-hybrid", seed=3)
    assert m.spec.recipe.scaling == module_pb2.BLOCK
    assert m.spec.recipe.format == module_pb2.HYBRID
    plain = gradwire.RemoteLinear(client, 64, 8, recipe="block", seed=3)
    assert plain.spec.recipe.format == module_pb2.E4M3_ONLY
    x = torch.randn(16, 64)
    x[0, 0] = 3e6
    dy = torch.randn(16, 8)
    for module in (m, plain):
        x.grad = None
        y = module(x.detach().requires_grad_(True))
        y.backward(dy)
    # The same forward (E4M3 both), gradients cast differently (E5M2 against E4M3).
    with torch.no_grad():
        assert torch.equal(m(x), plain(x))


def test_an_unknown_recipe_is_refused_before_any_call(client):
    with pytest.raises(ValueError, match="'block', 'block-hybrid', 'mxfp8' or None"):
        gradwire.RemoteLinear(client, 4, 2, recipe="blocks")


def test_a_module_without_a_recipe_gets_the_servers_default(default_server):
    """Against a server with its own defaults (--default-recipe block): a module created without a
    recipe is BLOCK, its spec says so, an outlier keeps to its row, and the exact wire sends its
    input as the BLOCK cast (E4M3 with 1 x 128 block scales, read from the spec the server
    returned, not the one asked for); a margin asks for CURRENT."""
    c = gradwire.Client(default_server)
    try:
        m = gradwire.RemoteLinear(c, 64, 8, seed=3)
        assert m.spec.recipe.scaling == module_pb2.BLOCK
        assert c.exact_fp8_input(m.module_id) and c.fp8_block(m.module_id) == 128
        x = torch.randn(5, 64)
        sent = c.forward_request(m.module_id, x, False).message.input
        assert sent.dtype == wire.FP8_E4M3 and sent.block_scales.block_cols == 128
        dirty = x.clone()
        dirty[0, 7] = 3e6
        with torch.no_grad():
            assert torch.equal(m(x)[1:], m(dirty)[1:])
        spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=8, out_features=4)
        spec.recipe.margin = 1
        assert c.create_module(spec).spec.recipe.scaling == module_pb2.CURRENT
        explicit = gradwire.RemoteLinear(c, 64, 8, recipe="current", seed=3)
        assert explicit.spec.recipe.scaling == module_pb2.CURRENT
        assert c.exact_fp8_input(explicit.module_id)
    finally:
        c.close()


# FP8 training under every recipe ends within 5% of the same model trained in float32 from the
# same weights and data: the two examples that train a float32 twin beside the remote model,
# shortened.
RECIPES = ["current", "delayed", "block", "block-hybrid", "mxfp8"]
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def example(name):
    sys.path.insert(0, EXAMPLES)
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_digits_example_trains_within_five_percent_of_float32(client, recipe):
    history = example("digits").train(client, epochs=3, seed=0, recipe=recipe, log=lambda s: None)
    fp8, f32 = history["fp8_loss"][-1], history["f32_loss"][-1]
    assert history["fp8_loss"][-1] < 0.5 * history["fp8_loss"][0], history  # it learned
    assert abs(fp8 - f32) <= 0.05 * f32, history


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_mlp_stack_example_trains_within_five_percent_of_float32(client, recipe):
    history = example("mlp_stack").train(client, epochs=4, blocks=2, seed=0, recipe=recipe,
                              log=lambda s: None)
    fp8, f32 = history["fp8_loss"][-1], history["f32_loss"][-1]
    assert history["fp8_loss"][-1] < history["fp8_loss"][0], history  # it learned
    assert abs(fp8 - f32) <= 0.05 * f32, history
