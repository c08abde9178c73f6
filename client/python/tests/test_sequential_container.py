"""RemoteSequential is built, indexed and edited as torch.nn.Sequential is (varargs, an
OrderedDict, slices, append, insert, del...), and whatever it becomes still trains: each edited
model gives the output and gradients of one built from the same modules in that order."""

from collections import OrderedDict

import pytest
import torch

import gradwire


def blocks(client):
    """Three remote blocks and two local ones, 6 wide."""
    torch.manual_seed(0)
    return [gradwire.RemoteLinear(client, 6, 6, seed=1), torch.nn.Tanh(),
            gradwire.RemoteLinear(client, 6, 6, seed=2),
            gradwire.RemoteLayerNormMLP(client, 6, 12, seed=3), torch.nn.Linear(6, 6)]


def children(module):
    return [(name, id(child)) for name, child in module.named_children()]


def assert_trains_like(model, modules, client):
    """``model`` gives the output and input gradient of a RemoteSequential built from
    ``modules`` (list form), with the same micro-batches, and leaves no context behind."""
    twin = gradwire.RemoteSequential(list(modules), micro_batches=model.micro_batches)
    x = torch.randn(6, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = model(xa), twin(xb)
    assert torch.equal(ya, yb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(xa.grad, xb.grad) and xa.grad.abs().sum() > 0
    assert client.server_info().live_contexts == 0


def test_varargs_as_nn_sequential(client):
    mods = blocks(client)
    model = gradwire.RemoteSequential(*mods, micro_batches=3)
    assert children(model) == children(torch.nn.Sequential(*mods))
    assert model.micro_batches == 3 and len(model) == 5
    assert_trains_like(model, mods, client)
    single = gradwire.RemoteSequential(mods[0])  # one module, not a list of them
    assert list(single) == [mods[0]] and single.micro_batches == 4


def test_ordered_dict_names_the_children(client):
    mods = blocks(client)
    names = ["inp", "act", "mid", "mlp", "head"]
    model = gradwire.RemoteSequential(OrderedDict(zip(names, mods)), micro_batches=2)
    assert children(model) == children(torch.nn.Sequential(OrderedDict(zip(names, mods))))
    assert model.mlp is mods[3] and model[3] is mods[3]
    keys = list(model.state_dict())
    assert keys[:2] == ["inp.weight", "inp.bias"] and "mlp.fc1_weight" in keys
    assert keys[-2:] == ["head.weight", "head.bias"]
    assert_trains_like(model, mods, client)


def test_indexing_and_slices(client):
    mods = blocks(client)
    model = gradwire.RemoteSequential(mods, micro_batches=2)
    assert model[-1] is mods[-1] and model[-5] is mods[0] and model[2] is mods[2]
    assert list(model) == mods and len(model) == 5
    for index in (5, -6):
        with pytest.raises(IndexError):
            model[index]
    tail, head = model[1:], model[:-1]
    assert type(tail) is gradwire.RemoteSequential and type(head) is gradwire.RemoteSequential
    # The names and modules nn.Sequential's slices keep, and the micro-batches.
    local = torch.nn.Sequential(*mods)
    assert children(tail) == children(local[1:]) and children(head) == children(local[:-1])
    assert children(model[::2]) == children(local[::2])
    assert tail.micro_batches == 2 and len(model[5:]) == 0
    assert_trains_like(tail, mods[1:], client)
    assert_trains_like(head, mods[:-1], client)
    # The slices compose back into the whole model.
    x = torch.randn(6, 6, requires_grad=True)
    assert torch.equal(model[2:](model[:2](x)), model(x))


def test_edits_as_nn_sequential(client):
    mods = blocks(client)
    extra = [gradwire.RemoteLinear(client, 6, 6, seed=9), torch.nn.ReLU(),
             torch.nn.Identity()]
    model = gradwire.RemoteSequential(mods[:2], micro_batches=2)
    local = torch.nn.Sequential(*mods[:2])
    edits = [
        lambda s: s.append(mods[2]),
        lambda s: s.extend(mods[3:]),
        lambda s: s.insert(1, extra[0]),
        lambda s: s.insert(-1, extra[1]),
        lambda s: s.insert(len(s), extra[2]),
        lambda s: s.__delitem__(2),
        lambda s: s.__delitem__(-1),
        lambda s: s.__delitem__(slice(3, 5)),
        lambda s: s.pop(0),
    ]
    for edit in edits:
        returned = edit(model)
        expected = edit(local)
        assert children(model) == children(local)
        if isinstance(expected, torch.nn.Sequential):
            assert returned is model  # append, extend and insert return the container
        else:
            assert returned is expected  # pop returns the module
    assert list(model) == [extra[0], mods[2], mods[4]]
    assert_trains_like(model, list(local), client)
    model[-1] = mods[3]  # item assignment
    assert model[2] is mods[3] and list(model._modules) == ["0", "1", "2"]
    assert_trains_like(model, list(model), client)
    del model[:]
    assert len(model) == 0
    x = torch.randn(2, 6)
    assert model(x) is x  # empty: the identity, as nn.Sequential


def test_refuses_what_nn_sequential_refuses(client):
    model = gradwire.RemoteSequential(torch.nn.ReLU())
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        model.append(lambda x: x)
    with pytest.raises(TypeError, match="not a torch.nn.Module"):
        model.insert(0, 3)
    with pytest.raises(IndexError):
        model.insert(3, torch.nn.ReLU())
    with pytest.raises(TypeError, match="indices must be integers"):
        model["0"]
    with pytest.raises(TypeError, match="micro_batches must be an int"):
        gradwire.RemoteSequential([torch.nn.ReLU()], micro_batches=2.0)
