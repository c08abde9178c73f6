"""Copying and tracing: deepcopy and pickle make a new remote module from the state_dict (pickle
needs an open client to the same server, or says so); a shallow copy, torch.jit.trace and
torch.jit.script raise clear errors."""

import copy
import io
import pickle

import pytest
import torch

import gradwire
from conftest import module_ids


def same_weights(a, b):
    wa, wb = a.get_weights(), b.get_weights()
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_deepcopy_is_a_new_module_with_the_weights(fresh_server):
    with gradwire.Client(fresh_server.address) as c:
        m = gradwire.RemoteLayerNormMLP(c, 6, 12, seed=1, recompute_on_lost_context=True)
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(torch.randn(4, 6)).sum().backward()
        opt.step()  # a local change not pushed yet: the copy has it too
        m.tag = "mine"
        twin = copy.deepcopy(m)
        assert type(twin) is type(m) and twin.module_id != m.module_id
        assert same_weights(m, twin)
        assert twin.recompute_on_lost_context and twin.tag == "mine"
        assert sorted(module_ids(fresh_server.address)) == sorted([m.module_id, twin.module_id])
        with torch.no_grad():
            twin.fc2_bias.add_(1.0)
        twin.push()
        assert not same_weights(m, twin)  # independent
    assert module_ids(fresh_server.address) == []  # both owned by the client


def test_deepcopy_of_a_model(client):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), gradwire.RemoteLinear(client, 4, 2))
    twin = copy.deepcopy(model)
    assert twin[1].module_id != model[1].module_id
    x = torch.randn(3, 4)
    model.eval(), twin.eval()
    with torch.no_grad():
        assert torch.equal(model(x), twin(x))


def test_deepcopy_keeps_frozen_tied_and_hooks(client):
    """As nn.Module's deepcopy: requires_grad=False stays, a weight tied between two layers is
    one parameter in the copy too, and the module's hooks come along."""
    a = gradwire.RemoteLinear(client, 4, 4, seed=3)
    b = gradwire.RemoteLinear(client, 4, 4, seed=4)
    b.weight = a.weight  # tied
    a.bias.requires_grad_(False)
    calls = []
    a.register_forward_hook(lambda module, inputs, output: calls.append(module))
    model = torch.nn.Sequential(a, b)
    assert len(list(model.parameters())) == 3
    twin = copy.deepcopy(model)
    ta, tb = twin[0], twin[1]
    assert ta.module_id != a.module_id and tb.module_id != b.module_id
    assert len(list(twin.parameters())) == 3
    assert tb.weight is ta.weight
    assert not ta.bias.requires_grad and ta.weight.requires_grad and tb.bias.requires_grad
    x = torch.randn(2, 4)
    twin(x)
    assert calls == [ta]  # the copy's hook runs, on the copy
    # The tie holds on the server too: a step of the shared weight reaches both copies.
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    twin(x).square().sum().backward()
    assert ta.bias.grad is None
    opt.step()
    twin(x)
    assert torch.equal(ta.get_weights()["weight"], tb.get_weights()["weight"])
    assert torch.equal(ta.get_weights()["weight"], ta.weight.detach())


def test_pickle_with_an_open_client(client):
    m = gradwire.RemoteLinear(client, 5, 3, seed=2, optimizer="sgd", lr=0.2).eval()
    blob = pickle.dumps(m)
    assert client.server.encode() in blob and b"Bearer" not in blob
    back = pickle.loads(blob)
    assert back.module_id != m.module_id and same_weights(m, back)
    assert not back.local_optimizer and back.configured_lr == pytest.approx(0.2)
    assert not back.training
    buf = io.BytesIO()
    torch.save(torch.nn.Sequential(m), buf)  # torch.save of a whole model pickles it
    buf.seek(0)
    assert same_weights(m, torch.load(buf)[0])


def test_unpickle_without_a_client_says_what_to_do(fresh_server):
    c = gradwire.Client(fresh_server.address)
    blob = pickle.dumps(gradwire.RemoteLinear(c, 4, 2))
    c.close()
    with pytest.raises(RuntimeError, match="no gradwire.Client to .* is open"):
        pickle.loads(blob)
    with gradwire.Client(fresh_server.address) as again:
        restored = pickle.loads(blob)
        assert restored.client is again
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(again)


def test_shallow_copy_is_refused(client):
    with pytest.raises(TypeError, match="deepcopy"):
        copy.copy(gradwire.RemoteLinear(client, 4, 2))


def test_jit_trace_and_script_raise_clear_errors(client):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), gradwire.RemoteLinear(client, 4, 2))
    with pytest.raises(RuntimeError, match="cannot be traced or scripted"):
        torch.jit.trace(model, torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="cannot be traced or scripted"):
        torch.jit.trace(model.eval(), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="cannot be traced or scripted"):
        torch.jit.script(model)
    seq = gradwire.RemoteSequential([gradwire.RemoteLinear(client, 4, 4)])
    with pytest.raises(RuntimeError, match="cannot be"):
        torch.jit.trace(seq, torch.randn(3, 4))
