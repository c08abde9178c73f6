"""Routable calls: the client names the module of every call about one in the gradwire-route
header (a proxy in front of several servers routes by it, docs/scaling-out.md), proposes the
ids of the modules it creates, and opens one Train stream per module. Every call the client makes
is recorded by an interceptor on its channel; the server refuses a call routed by another
module."""

import grpc
import pytest
import torch

import gradwire
from gradwire.client import ROUTE_HEADER
from gradwire.v1 import module_pb2, service_pb2, service_pb2_grpc

# The calls about one module, and those about none.
MODULE_CALLS = {"CreateModule", "DeleteModule", "KeepAlive", "Forward", "Backward",
                "ReleaseContext", "ApplyGradients", "GetGradients", "GetWeights", "SetWeights",
                "ForwardChunked", "BackwardChunked", "GetWeightsChunked", "SetWeightsChunked",
                "Train"}


class Recorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
               grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Notes (method, route header) of every call on the channel."""

    def __init__(self):
        self.calls = []

    def _note(self, details):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        route = dict(details.metadata or ()).get(ROUTE_HEADER)
        self.calls.append((method.rsplit("/", 1)[-1], route))

    def intercept_unary_unary(self, continuation, details, request):
        self._note(details)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation, details, request):
        self._note(details)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        self._note(details)
        return continuation(details, request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        self._note(details)
        return continuation(details, request_iterator)


def recorded(server, **options):
    """A client whose every call the returned Recorder sees."""
    c = gradwire.Client(server, shared_memory="off", **options)
    rec = Recorder()
    c._channel = grpc.intercept_channel(c._channel, rec)
    c._stub = service_pb2_grpc.GradwireStub(c._channel)
    c._raw_calls = {}
    return c, rec


def routes(rec, method):
    return [r for m, r in rec.calls if m == method]


@pytest.mark.parametrize("chunking", ["never", "always"])
def test_every_call_about_a_module_names_it(server, chunking):
    c, rec = recorded(server, chunking=chunking)
    with c:
        m = gradwire.RemoteLinear(c, 8, 4, seed=1)
        other = gradwire.RemoteLinear(c, 8, 4, seed=2)
        ids = {m.module_id, other.module_id}
        x = torch.randn(5, 8, requires_grad=True)
        (m(x).sum() + other(x).sum()).backward()  # pipelined: the Train streams
        y, ctx, _ = c.forward(m.module_id, torch.randn(3, 8), True)
        c.backward(ctx, torch.randn(3, 4))
        _, ctx2, _ = c.forward(other.module_id, torch.randn(3, 8), True)
        c.release_context(ctx2)
        c.apply_gradients(m.module_id)
        c.get_gradients(m.module_id)
        c.set_weights(m.module_id, c.get_weights(m.module_id))
        c.delete_module(other.module_id)
        assert c.module_info(m.module_id).module_id == m.module_id
    about = [(method, route) for method, route in rec.calls if method in MODULE_CALLS]
    assert about, rec.calls
    unrouted = [(method, route) for method, route in about if route not in ids]
    assert not unrouted, unrouted
    # The create proposed the id it was routed by; each module had a stream of its own (the
    # pipelined steps go unary when every call is chunked).
    assert sorted(routes(rec, "CreateModule")) == sorted(ids)
    assert sorted(routes(rec, "Train")) == (sorted(ids) if chunking == "never" else [])
    # The explicit backward and release (the last of their kind): their contexts' modules.
    assert routes(rec, "Backward" if chunking == "never" else "BackwardChunked")[-1] == m.module_id
    assert routes(rec, "ReleaseContext")[-1] == other.module_id
    assert routes(rec, "DeleteModule")[0] == other.module_id
    # The lookup of one module asks its server.
    assert routes(rec, "ListModules")[-1] == m.module_id


def test_the_client_proposes_the_module_id(server):
    c, rec = recorded(server)
    with c:
        spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=8, out_features=4)
        info = c.create_module(spec)
        assert routes(rec, "CreateModule") == [info.module_id]
        assert len(info.module_id) == 32 and int(info.module_id, 16) >= 0
        c.delete_module(info.module_id)


def test_a_call_routed_by_another_module_is_refused(client):
    spec = module_pb2.ModuleSpec(kind=module_pb2.LINEAR, in_features=8, out_features=4, seed=4)
    a = client.create_module(spec).module_id
    b = client.create_module(spec).module_id
    before = client.get_weights(a)
    with pytest.raises(gradwire.GradwireError) as e:
        client._call("ApplyGradients", service_pb2.ApplyGradientsRequest(module_id=a), route=b)
    assert e.value.code == "INVALID_ARGUMENT"
    assert a in e.value.message and b in e.value.message and ROUTE_HEADER in e.value.message
    after = client.get_weights(a)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A routed create must propose the id it is routed by.
    with pytest.raises(gradwire.GradwireError) as e:
        client._call("CreateModule", service_pb2.CreateModuleRequest(spec=spec), route=a)
    assert e.value.code == "INVALID_ARGUMENT" and "propose" in e.value.message
    # An id that is taken is refused, and the module keeps its weights.
    with pytest.raises(gradwire.GradwireError) as e:
        client._call("CreateModule", service_pb2.CreateModuleRequest(spec=spec, module_id=a),
                     route=a)
    assert e.value.code == "ALREADY_EXISTS"
    assert all(torch.equal(before[k], v) for k, v in client.get_weights(a).items())
    client.delete_module(a)
    client.delete_module(b)
