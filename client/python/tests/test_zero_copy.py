"""The client's own encoding of the messages that carry tensors (gradwire.tensor_messages):
every request is byte for byte what protobuf serializes for the whole message, every response
parses to the same fields and tensors as protobuf's parser gives, for each wire dtype and for
empty, size-1, odd and large tensors; a tensor's bytes are read where they lie instead of being
copied, and the results are the client's to write into."""

import numpy as np
import pytest
import torch

import gradwire
from gradwire import tensor_messages, wire
from gradwire.client import Client, _assemble, chunked_parts
from gradwire.train_stream import train_request, train_request_pieces
from gradwire.v1 import service_pb2, tensor_pb2

DTYPES = [wire.F32, wire.BF16, wire.F16, wire.FP8_E4M3, wire.FP8_E5M2]
DTYPE_IDS = ["f32", "bf16", "f16", "e4m3", "e5m2"]
SHAPES = [(), (0,), (0, 5), (1,), (1, 1), (3, 7, 5), (2, 1, 3), (5, 129)]
TORCH_DTYPES = {wire.F32: torch.float32, wire.BF16: torch.bfloat16, wire.F16: torch.float16}
LARGE = 16 << 20  # bytes on the wire


@pytest.fixture(scope="module")
def offline():
    """A client that only builds requests: nothing listens at its address."""
    c = gradwire.Client("127.0.0.1:1")
    yield c
    c.close()


def values(shape, seed):
    """Values over many binades, both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    return x * torch.pow(10.0, torch.randint(-3, 3, shape, generator=g).float())


def reference(t, dtype):
    """The whole Tensor message of ``t``, built the generic way: float32 bytes, rounded to the
    16-bit dtype by torch, copied into the message (FP8 from the codec's own encoder, which
    test_fp8_wire holds to the server's)."""
    if dtype not in TORCH_DTYPES:
        return wire.to_wire(t, dtype)
    x = t.detach().to(torch.float32).contiguous().to(TORCH_DTYPES[dtype])
    raw = x.view(torch.int16) if x.element_size() == 2 else x
    return tensor_pb2.Tensor(dtype=dtype, shape=list(x.shape), data=raw.numpy().tobytes())


def reference_decode(msg):
    """A wire tensor decoded with torch's own conversions, from a copy of its bytes."""
    shape = list(msg.shape)
    buf = bytearray(msg.data)
    if not buf:
        return torch.zeros(shape)
    if msg.dtype == wire.F32:
        return torch.frombuffer(buf, dtype=torch.float32).reshape(shape)
    if msg.dtype in (wire.BF16, wire.F16):
        bits = torch.frombuffer(buf, dtype=torch.int16).view(TORCH_DTYPES[msg.dtype])
        return bits.float().reshape(shape)
    codes = torch.frombuffer(buf, dtype=torch.uint8)
    return (wire.fp8_decode(codes, msg.dtype) *
            torch.tensor(msg.scale_inv, dtype=torch.float32)).reshape(shape)


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype == torch.float32 and \
        torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def without_data(msg):
    """``msg`` with every tensor's data emptied (what a parsed Received's message holds)."""
    out = type(msg)()
    out.CopyFrom(msg)
    stack = [out]
    while stack:
        m = stack.pop()
        if isinstance(m, (tensor_pb2.Tensor, service_pb2.TensorChunk)):
            m.data = b""
        for field, value in m.ListFields():
            if field.message_type is None:
                continue
            stack.extend(value if field.label == field.LABEL_REPEATED else [value])
    return out


# --- requests


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_request_is_protobufs_encoding(offline, dtype, shape):
    x = values(shape, 1)
    req = offline.forward_request("module-1", x, True, dtype)
    want = service_pb2.ForwardRequest(module_id="module-1", input=reference(x, dtype),
                                      training=True, output_dtype=dtype)
    assert req.SerializeToString() == want.SerializeToString()
    assert req.to_message() == want
    assert req.nbytes == len(want.input.data)
    assert req.input.data == b"" and req.input.dtype == dtype  # fields read through


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_backward_request_is_protobufs_encoding(offline, dtype, shape):
    g, ln = values(shape, 2), values(shape, 3)
    req = offline.backward_request("ctx-1", g, skip_grad_input=True, retain=True,
                                   grad_layernorm_output=ln, dtype=dtype)
    want = service_pb2.BackwardRequest(
        context_id="ctx-1", grad_output=reference(g, dtype), retain=True, skip_grad_input=True,
        grad_input_dtype=dtype, grad_layernorm_output=reference(ln, dtype))
    assert req.SerializeToString() == want.SerializeToString()
    plain = offline.backward_request("ctx-2", g, dtype=dtype)
    assert plain.SerializeToString() == service_pb2.BackwardRequest(
        context_id="ctx-2", grad_output=reference(g, dtype),
        grad_input_dtype=dtype).SerializeToString()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_train_requests_are_protobufs_encoding(offline, dtype, shape):
    x = values(shape, 4)
    for request_id in (1, 127, 128, 1 << 40):
        fwd = offline.forward_request("module-1", x, True, dtype)
        want = service_pb2.TrainRequest(request_id=request_id, forward=fwd.to_message())
        assert train_request(request_id, train_request_pieces("forward", fwd)) == \
            want.SerializeToString()
        bwd = offline.backward_request("ctx-1", x, retain=True, dtype=dtype)
        want = service_pb2.TrainRequest(request_id=request_id, backward=bwd.to_message())
        assert train_request(request_id, train_request_pieces("backward", bwd)) == \
            want.SerializeToString()
    release = tensor_messages.Outgoing(service_pb2.ReleaseContextRequest(context_id="ctx-1"))
    assert train_request(9, train_request_pieces("release", release)) == \
        service_pb2.TrainRequest(request_id=9, release=release.message).SerializeToString()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_set_weights_request_is_protobufs_encoding(dtype):
    params = {f"p{i}": values(shape, 10 + i) for i, shape in enumerate(SHAPES)}
    req = Client.set_weights_request("module-1", params, dtype)
    want = service_pb2.SetWeightsRequest(module_id="module-1")
    for name, t in params.items():
        want.parameters.add(name=name, tensor=reference(t, dtype))
    assert req.SerializeToString() == want.SerializeToString()
    assert req.nbytes == sum(len(p.tensor.data) for p in want.parameters)


def expected_parts(whole, part_type, tensors, chunk_bytes):
    """A chunked request built the generic way: the header with its tensors' data emptied,
    then each tensor's bytes in chunks."""
    out = [part_type(header=without_data(whole)).SerializeToString()]
    for i, t in enumerate(tensors):
        for off in range(0, len(t.data), chunk_bytes):
            out.append(part_type(chunk=service_pb2.TensorChunk(
                tensor=i, offset=off, data=t.data[off:off + chunk_bytes])).SerializeToString())
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("chunk_bytes", [1, 7, 4096])
def test_chunked_parts_are_protobufs_encoding(offline, dtype, chunk_bytes):
    x, ln = values((3, 7, 5), 20), values((0, 5), 21)
    fwd = offline.forward_request("module-1", x, False, dtype)
    whole = fwd.to_message()
    assert list(chunked_parts(fwd, service_pb2.ForwardRequestPart, chunk_bytes)) == \
        expected_parts(whole, service_pb2.ForwardRequestPart, [whole.input], chunk_bytes)
    # An empty tensor keeps its place in the order: the one after it is tensor 1.
    bwd = offline.backward_request("ctx-1", ln, grad_layernorm_output=x, dtype=dtype)
    whole = bwd.to_message()
    assert list(chunked_parts(bwd, service_pb2.BackwardRequestPart, chunk_bytes)) == \
        expected_parts(whole, service_pb2.BackwardRequestPart,
                       [whole.grad_output, whole.grad_layernorm_output], chunk_bytes)
    sw = Client.set_weights_request("module-1", {"weight": x, "bias": ln, "g": x[0]}, dtype)
    whole = sw.to_message()
    assert list(chunked_parts(sw, service_pb2.SetWeightsRequestPart, chunk_bytes)) == \
        expected_parts(whole, service_pb2.SetWeightsRequestPart,
                       [p.tensor for p in whole.parameters], chunk_bytes)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_requests_are_protobufs_encoding(offline, dtype):
    n = LARGE // wire.element_size(dtype)
    x = values((n // 1024, 1024), 30)
    if dtype in TORCH_DTYPES:
        x = x.to(TORCH_DTYPES[dtype])
    fwd = offline.forward_request("module-1", x, True, dtype)
    assert fwd.nbytes == LARGE
    want = service_pb2.ForwardRequest(module_id="module-1", input=reference(x, dtype),
                                      training=True, output_dtype=dtype)
    assert fwd.SerializeToString() == want.SerializeToString()
    assert train_request(5, train_request_pieces("forward", fwd)) == \
        service_pb2.TrainRequest(request_id=5, forward=want).SerializeToString()
    chunk = 4 << 20
    assert list(chunked_parts(fwd, service_pb2.ForwardRequestPart, chunk)) == \
        expected_parts(want, service_pb2.ForwardRequestPart, [want.input], chunk)
    sw = Client.set_weights_request("module-1", {"weight": x, "bias": x[0]}, dtype)
    whole = service_pb2.SetWeightsRequest(module_id="module-1")
    whole.parameters.add(name="weight", tensor=want.input)
    whole.parameters.add(name="bias", tensor=reference(x[0], dtype))
    assert sw.SerializeToString() == whole.SerializeToString()


def test_requests_use_the_tensors_memory(offline):
    """A contiguous float32 tensor (and a 16-bit one sent in its own dtype) goes to the encoder
    as its own memory; anything else as one converted copy, with the same bytes."""
    x = torch.randn(64, 32)
    data = offline.forward_request("m", x, True, wire.F32).data
    assert np.shares_memory(np.asarray(next(iter(data.values()))), x.numpy())
    h = torch.randn(64, 32).to(torch.bfloat16)
    data = offline.forward_request("m", h, True, wire.BF16).data
    assert np.shares_memory(np.asarray(next(iter(data.values()))), h.view(torch.int16).numpy())
    t = x.t()  # not contiguous
    req = offline.forward_request("m", t, True, wire.F32)
    assert not np.shares_memory(np.asarray(next(iter(req.data.values()))), x.numpy())
    assert req.to_message().input.data == t.contiguous().numpy().tobytes()
    g = torch.randn(4, 3, requires_grad=True) * 2  # part of a graph
    assert offline.forward_request("m", g, True, wire.F32).to_message().input.data == \
        g.detach().numpy().tobytes()


def test_a_tensor_without_its_message_is_refused():
    req = tensor_messages.Outgoing(service_pb2.BackwardRequest(context_id="c"),
                                   {(2, tensor_messages.DATA): b"\x00" * 8})
    with pytest.raises(ValueError, match="no place"):
        req.SerializeToString()
    both = service_pb2.ForwardRequest(input=tensor_pb2.Tensor(dtype=wire.F32, shape=[1],
                                                              data=b"\x00" * 4))
    with pytest.raises(ValueError, match="in the message and apart"):
        tensor_messages.serialize(both, {(2, tensor_messages.DATA): b"\x00" * 4})


# --- responses


def check_parsed(whole, received, buf):
    """``received`` (parsed from ``buf``, the encoding of ``whole``) has every field of
    ``whole``, its tensors' bytes as views of ``buf`` itself."""
    assert received.message == without_data(whole)
    for view in received.data.values():
        assert isinstance(view, memoryview) and view.obj is buf


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_response_parses_in_place(dtype, shape):
    y, ln = values(shape, 40), values(shape, 41)
    whole = service_pb2.ForwardResponse(output=reference(y, dtype), context_id="ctx-9",
                                        weight_version=12, layernorm_output=reference(ln, dtype),
                                        server_seconds=0.25)
    buf = whole.SerializeToString()
    received = tensor_messages.reader(service_pb2.ForwardResponse)(buf)
    check_parsed(whole, received, buf)
    out, ctx, got_ln = Client.forward_result(received)
    assert ctx == "ctx-9"
    assert same_bits(out, reference_decode(whole.output))
    assert same_bits(got_ln, reference_decode(whole.layernorm_output))
    # The whole message decodes alike.
    out2, _, ln2 = Client.forward_result(whole)
    assert same_bits(out2, out) and same_bits(ln2, got_ln)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_train_and_weights_responses_parse_in_place(dtype, shape):
    y = values(shape, 50)
    fwd = service_pb2.TrainResponse(request_id=1 << 33, forward=service_pb2.ForwardResponse(
        output=reference(y, dtype), context_id="c", weight_version=3))
    buf = fwd.SerializeToString()
    received = tensor_messages.reader(service_pb2.TrainResponse)(buf)
    check_parsed(fwd, received, buf)
    assert received.message.request_id == 1 << 33
    out, _, ln = Client.forward_result(received.field("forward"))
    assert same_bits(out, reference_decode(fwd.forward.output)) and ln is None

    bwd = service_pb2.TrainResponse(request_id=2, backward=service_pb2.BackwardResponse(
        grad_input=reference(y, dtype), server_seconds=1.5))
    buf = bwd.SerializeToString()
    received = tensor_messages.reader(service_pb2.TrainResponse)(buf)
    check_parsed(bwd, received, buf)
    b = received.field("backward")
    assert same_bits(wire.decode(b.message.grad_input, b.tensor_data("grad_input")),
                     reference_decode(bwd.backward.grad_input))

    weights = service_pb2.GetWeightsResponse(weight_version=4)
    for i, s in enumerate(SHAPES):
        weights.parameters.add(name=f"p{i}", tensor=reference(values(s, 60 + i), dtype))
    buf = weights.SerializeToString()
    received = tensor_messages.reader(service_pb2.GetWeightsResponse)(buf)
    check_parsed(weights, received, buf)
    items = received.items("parameters")
    assert [p.message.name for p in items] == [p.name for p in weights.parameters]
    for p, want in zip(items, weights.parameters):
        assert same_bits(wire.decode(p.message.tensor, p.tensor_data("tensor")),
                         reference_decode(want.tensor))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("chunk_bytes", [1, 5, 4096])
def test_chunked_response_assembles_from_views(dtype, chunk_bytes):
    y, ln = values((3, 7, 5), 70), values((2, 5), 71)
    whole = service_pb2.ForwardResponse(output=reference(y, dtype), context_id="c",
                                        layernorm_output=reference(ln, dtype))
    raw = expected_parts(whole, service_pb2.ForwardResponsePart,
                         [whole.output, whole.layernorm_output], chunk_bytes)
    parts = [tensor_messages.reader(service_pb2.ForwardResponsePart)(b) for b in raw]
    for part, buf in zip(parts, raw):
        assert all(v.obj is buf for v in part.data.values())
    received = _assemble("ForwardChunked", parts, service_pb2.ForwardResponse)
    assert received.owned and received.message == without_data(whole)
    out, _, got_ln = Client.forward_result(received)
    assert same_bits(out, reference_decode(whole.output))
    assert same_bits(got_ln, reference_decode(whole.layernorm_output))


def test_large_responses_parse_in_place():
    # Every bit pattern may arrive (NaNs among them): random bytes, compared bit for bit.
    data = np.random.default_rng(80).integers(0, 256, LARGE, dtype=np.uint8).tobytes()
    for dtype in DTYPES:
        n = LARGE // wire.element_size(dtype)
        whole = service_pb2.ForwardResponse(output=tensor_pb2.Tensor(
            dtype=dtype, shape=[n // 1024, 1024], data=data, scale_inv=0.375), weight_version=1)
        buf = whole.SerializeToString()
        received = tensor_messages.parse(service_pb2.ForwardResponse, buf)
        check_parsed(whole, received, buf)
        assert received.tensor_data("output").nbytes == LARGE
        assert same_bits(Client.forward_result(received)[0], reference_decode(whole.output))


def test_every_16_bit_and_fp8_code_decodes_as_torch_converts():
    codes = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    for dtype in (wire.BF16, wire.F16):
        msg = tensor_pb2.Tensor(dtype=dtype, shape=[1 << 16], data=codes.numpy().tobytes())
        assert same_bits(wire.decode(msg, msg.data), reference_decode(msg))  # NaNs too
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dtype in (wire.FP8_E4M3, wire.FP8_E5M2):
        for scale_inv in (1.0, 0.0078125 * 3, 3.0e-7, 1.5e30):
            msg = tensor_pb2.Tensor(dtype=dtype, shape=[16, 16], data=codes.numpy().tobytes(),
                                    scale_inv=scale_inv)
            assert same_bits(wire.decode(msg, msg.data), reference_decode(msg))


def test_decoded_tensors_are_the_callers():
    """An F32 result read from received (immutable) bytes is a copy the caller may write into;
    one from a buffer of its own (a chunked response's) is that buffer."""
    whole = service_pb2.ForwardResponse(output=reference(torch.arange(6.0).reshape(2, 3),
                                                         wire.F32))
    buf = whole.SerializeToString()
    received = tensor_messages.parse(service_pb2.ForwardResponse, buf)
    out = Client.forward_result(received)[0]
    out.add_(1)  # autograd may accumulate into it
    assert buf == whole.SerializeToString()
    assert torch.equal(Client.forward_result(received)[0], torch.arange(6.0).reshape(2, 3))
    own = np.frombuffer(torch.arange(6.0).numpy().tobytes(), dtype=np.uint8).copy()
    t = wire.decode(tensor_pb2.Tensor(dtype=wire.F32, shape=[6]), own, owned=True)
    assert np.shares_memory(t.numpy(), own)
    for dtype in (wire.BF16, wire.F16, wire.FP8_E4M3):  # converted into memory of their own
        whole = service_pb2.ForwardResponse(output=reference(torch.arange(6.0), dtype))
        buf = whole.SerializeToString()
        out = Client.forward_result(tensor_messages.parse(service_pb2.ForwardResponse, buf))[0]
        out.mul_(2)
        assert buf == whole.SerializeToString()


def test_malformed_responses_are_refused():
    whole = service_pb2.ForwardResponse(output=reference(torch.randn(4, 4), wire.F32),
                                        context_id="c")
    buf = whole.SerializeToString()
    for cut in (1, 2, 3, len(buf) // 2, len(buf) - 1):
        with pytest.raises((ValueError, IndexError)):
            tensor_messages.parse(service_pb2.ForwardResponse, buf[:cut])
    bad = service_pb2.ForwardResponse(output=tensor_pb2.Tensor(
        dtype=wire.F32, shape=[2, 3], data=b"\x00" * 20)).SerializeToString()
    received = tensor_messages.parse(service_pb2.ForwardResponse, bad)
    with pytest.raises(ValueError, match="needs 24"):
        Client.forward_result(received)


# --- against the server


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16", "f16", "fp8"])
def test_unary_chunked_and_train_calls_agree(server, wire_dtype):
    unary = gradwire.Client(server, wire_dtype=wire_dtype, chunking="never")
    chunked = gradwire.Client(server, wire_dtype=wire_dtype, chunking="always", chunk_kib=1)
    try:
        layer = gradwire.RemoteLayerNormLinear(unary, 37, 11, seed=5)
        x, dy = values((3, 5, 37), 90), values((3, 5, 11), 91)
        results = []
        for c in (unary, chunked):
            y, ctx, _ = c.forward(layer.module_id, x, True)
            results.append((y, c.backward(ctx, dy)))
        stream = unary.train_stream()
        y, ctx, _ = stream.forward(layer.module_id, x).result()
        results.append((y, stream.backward(ctx, dy).result()))
        for y, dx in results[1:]:
            assert same_bits(y, results[0][0]) and same_bits(dx, results[0][1])
        assert y.shape == (3, 5, 11) and dx.shape == (3, 5, 37)
        assert chunked.chunked_calls == 2
        w = {"weight": values((11, 37), 92), "bias": torch.zeros(11)}
        chunked.set_weights(layer.module_id, w, wire.F32)
        assert torch.equal(unary.get_weights(layer.module_id)["weight"], w["weight"])
        assert torch.equal(chunked.get_weights(layer.module_id)["weight"], w["weight"])
    finally:
        unary.close()
        chunked.close()
