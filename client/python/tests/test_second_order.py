"""What a remote module's backward cannot do is refused at the call, naming the module: a double
backward through it, and an empty batch of the wrong width."""

import pytest
import torch

import gradwire


def test_double_backward_names_the_module(client):
    m = gradwire.RemoteLinear(client, 8, 4, seed=1)
    x = torch.randn(3, 8, requires_grad=True)
    g, = torch.autograd.grad(m(x).square().sum(), x, create_graph=True)
    # The first-order gradient is the one without create_graph.
    plain, = torch.autograd.grad(m(x).square().sum(), x)
    assert torch.equal(g.detach(), plain) and plain.abs().sum() > 0
    assert g.requires_grad
    with pytest.raises(RuntimeError) as e:
        g.square().sum().backward()
    assert m.module_id in str(e.value) and "double backward" in str(e.value)


def test_double_backward_through_a_pipeline_names_the_blocks(client):
    a = gradwire.RemoteLinear(client, 8, 8, seed=2)
    b = gradwire.RemoteLinear(client, 8, 4, seed=3)
    model = gradwire.RemoteSequential(a, b, micro_batches=2)
    x = torch.randn(4, 8, requires_grad=True)
    g, = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError) as e:
        g.sum().backward()
    assert a.module_id in str(e.value) and b.module_id in str(e.value)


def test_empty_batch_of_the_wrong_width_names_the_width(client):
    m = gradwire.RemoteLinear(client, 8, 4)
    with pytest.raises(gradwire.GradwireError) as e:
        m(torch.randn(0, 5))
    assert e.value.code == "INVALID_ARGUMENT"
    assert "input.shape must be [..., 8]" in str(e.value) and "got [0, 5]" in str(e.value)
    assert m(torch.randn(0, 8)).shape == (0, 4)  # the right width: an empty output
