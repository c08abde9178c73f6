"""A thin Python client of gradwire-server (gRPC)."""

import os

import grpc
import torch

from gradwire import wire
from gradwire.v1 import module_pb2, service_pb2, service_pb2_grpc


class GradwireError(RuntimeError):
    """A call the server refused or could not serve: ``code`` is the gRPC status code name."""

    def __init__(self, method: str, code: str, message: str):
        super().__init__(f"{method}: {code}: {message}")
        self.method = method
        self.code = code
        self.message = message


class Client:
    """Connection to one gradwire-server. Every call has a deadline of ``timeout`` seconds.

    ``wire_dtype`` ("f32", "bf16" or "f16") is how activations and gradients travel; bf16 halves
    the bytes at a small cost in accuracy. ``token`` is the bearer token for a server that
    requires tokens (default: the ``GRADWIRE_TOKEN`` environment variable, if set).

    Tensors larger than ``chunk_kib`` KiB (it must not exceed the server's ``--chunk-kib``) travel
    on the chunked calls; ``chunking`` is "auto" (by the request's and the expected response's
    size), "always" or "never".
    """

    def __init__(self, server: str = "127.0.0.1:50051", timeout: float = 30.0,
                 wire_dtype: str = "f32", max_message_mib: int = 64, token: str = None,
                 chunk_kib: int = 4096, chunking: str = "auto"):
        if chunking not in ("auto", "always", "never"):
            raise ValueError("chunking must be 'auto', 'always' or 'never'")
        self.chunk_bytes = chunk_kib << 10
        self.chunking = chunking
        self.chunked_calls = 0
        self._modules = {}  # module_id -> ModuleSpec, to predict response sizes
        if wire_dtype not in wire.WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {sorted(wire.WIRE_DTYPES)}")
        self.server = server
        self.timeout = timeout
        self.wire_dtype = wire_dtype
        if token is None:
            token = os.environ.get("GRADWIRE_TOKEN") or None
        self._metadata = (("authorization", "Bearer " + token),) if token else None
        limit = max_message_mib << 20
        self._channel = grpc.insecure_channel(server, options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
        ])
        self._stub = service_pb2_grpc.GradwireStub(self._channel)

    def close(self):
        self._channel.close()

    def _call(self, method: str, request):
        try:
            return getattr(self._stub, method)(request, timeout=self.timeout,
                                               metadata=self._metadata)
        except grpc.RpcError as e:
            raise GradwireError(method, e.code().name, e.details()) from None

    def _use_chunked(self, request_bytes: int, response_bytes: int = 0) -> bool:
        if self.chunking != "auto":
            return self.chunking == "always"
        return request_bytes > self.chunk_bytes or response_bytes > self.chunk_bytes

    def _chunked(self, method: str, header, part_type, tensors, response_type=None):
        """Calls a chunked method: ``header`` (its tensors' data moved into chunks) then chunks;
        returns the reassembled response (or the single response of SetWeightsChunked)."""
        datas = [t.data for t in tensors]
        for t in tensors:
            t.data = b""

        def parts():
            yield part_type(header=header)
            for i, data in enumerate(datas):
                view = memoryview(data)
                for off in range(0, len(data), self.chunk_bytes):
                    yield part_type(chunk=service_pb2.TensorChunk(
                        tensor=i, offset=off, data=bytes(view[off:off + self.chunk_bytes])))

        self.chunked_calls += 1
        try:
            result = getattr(self._stub, method)(parts(), timeout=self.timeout,
                                                 metadata=self._metadata)
            if response_type is None:
                return result
            return _assemble(method, result, response_type)
        except grpc.RpcError as e:
            raise GradwireError(method, e.code().name, e.details()) from None

    def _spec(self, module_id: str):
        if module_id not in self._modules:
            try:
                self.list_modules()
            except GradwireError:
                pass
        return self._modules.get(module_id)

    def server_info(self) -> service_pb2.GetServerInfoResponse:
        return self._call("GetServerInfo", service_pb2.GetServerInfoRequest())

    def create_module(self, spec: module_pb2.ModuleSpec) -> module_pb2.ModuleInfo:
        info = self._call("CreateModule", service_pb2.CreateModuleRequest(spec=spec)).module
        self._modules[info.module_id] = info.spec
        return info

    def list_modules(self):
        modules = list(self._call("ListModules", service_pb2.ListModulesRequest()).modules)
        for m in modules:
            self._modules[m.module_id] = m.spec
        return modules

    def delete_module(self, module_id: str) -> None:
        self._call("DeleteModule", service_pb2.DeleteModuleRequest(module_id=module_id))

    def forward(self, module_id: str, x: torch.Tensor, training: bool):
        """Returns (output, context_id or "", layernorm_output or None)."""
        enum = wire.WIRE_DTYPES[self.wire_dtype][0]
        req = service_pb2.ForwardRequest(
            module_id=module_id, input=wire.to_wire(x, self.wire_dtype), training=training,
            output_dtype=enum)
        out_bytes = 0
        if self.chunking == "auto" and not self._use_chunked(len(req.input.data)) and x.dim() > 0:
            spec = self._spec(module_id)
            if spec is not None:
                rows = x.numel() // max(1, x.shape[-1])
                width = spec.out_features + (spec.in_features if spec.return_layernorm_output
                                             and spec.kind != module_pb2.LINEAR else 0)
                out_bytes = rows * width * x.new_empty(0, dtype=wire.WIRE_DTYPES[
                    self.wire_dtype][1]).element_size()
        if self._use_chunked(len(req.input.data), out_bytes):
            resp = self._chunked("ForwardChunked", req, service_pb2.ForwardRequestPart,
                                 [req.input], service_pb2.ForwardResponse)
        else:
            resp = self._call("Forward", req)
        ln = wire.from_wire(resp.layernorm_output) if resp.HasField("layernorm_output") else None
        return wire.from_wire(resp.output), resp.context_id, ln

    def backward(self, context_id: str, grad_output: torch.Tensor, skip_grad_input=False,
                 retain=False, grad_layernorm_output=None):
        """Returns grad_input (None with skip_grad_input)."""
        enum = wire.WIRE_DTYPES[self.wire_dtype][0]
        req = service_pb2.BackwardRequest(
            context_id=context_id, grad_output=wire.to_wire(grad_output, self.wire_dtype),
            retain=retain, skip_grad_input=skip_grad_input, grad_input_dtype=enum)
        if grad_layernorm_output is not None:
            req.grad_layernorm_output.CopyFrom(wire.to_wire(grad_layernorm_output, self.wire_dtype))
        sent = len(req.grad_output.data) + len(req.grad_layernorm_output.data)
        if self._use_chunked(sent, 0 if skip_grad_input else sent):
            tensors = [req.grad_output]
            if req.HasField("grad_layernorm_output"):
                tensors.append(req.grad_layernorm_output)
            resp = self._chunked("BackwardChunked", req, service_pb2.BackwardRequestPart, tensors,
                                 service_pb2.BackwardResponse)
        else:
            resp = self._call("Backward", req)
        return wire.from_wire(resp.grad_input) if resp.HasField("grad_input") else None

    def release_context(self, context_id: str) -> None:
        self._call("ReleaseContext", service_pb2.ReleaseContextRequest(context_id=context_id))

    def apply_gradients(self, module_id: str, learning_rate: float = 0.0) -> int:
        return self._call("ApplyGradients", service_pb2.ApplyGradientsRequest(
            module_id=module_id, learning_rate=learning_rate)).weight_version

    def get_weights(self, module_id: str) -> dict:
        req = service_pb2.GetWeightsRequest(module_id=module_id)
        spec = self._spec(module_id) if self.chunking == "auto" else None
        size = 0
        if spec is not None:  # an upper bound of the parameters' bytes
            fc1 = 2 * spec.ffn_features
            size = 4 * (spec.in_features * spec.out_features + spec.out_features +
                        2 * spec.in_features + fc1 * spec.in_features + fc1 +
                        spec.out_features * spec.ffn_features)
        if self._use_chunked(0, size):
            self.chunked_calls += 1
            try:
                stream = self._stub.GetWeightsChunked(req, timeout=self.timeout,
                                                      metadata=self._metadata)
                resp = _assemble("GetWeightsChunked", stream, service_pb2.GetWeightsResponse)
            except grpc.RpcError as e:
                raise GradwireError("GetWeightsChunked", e.code().name, e.details()) from None
        else:
            resp = self._call("GetWeights", req)
        return {p.name: wire.from_wire(p.tensor) for p in resp.parameters}

    def get_gradients(self, module_id: str, zero: bool = False) -> dict:
        resp = self._call("GetGradients",
                          service_pb2.GetGradientsRequest(module_id=module_id, zero=zero))
        return {p.name: wire.from_wire(p.tensor) for p in resp.gradients}

    def set_weights(self, module_id: str, params: dict) -> int:
        req = service_pb2.SetWeightsRequest(module_id=module_id)
        for name, t in params.items():
            req.parameters.add(name=name, tensor=wire.to_wire(t, "f32"))
        if self._use_chunked(sum(len(p.tensor.data) for p in req.parameters)):
            return self._chunked("SetWeightsChunked", req, service_pb2.SetWeightsRequestPart,
                                 [p.tensor for p in req.parameters]).weight_version
        return self._call("SetWeights", req).weight_version


def _slots(msg):
    """The tensors of a chunked message, in chunk order (see service.proto's TensorChunk)."""
    if isinstance(msg, service_pb2.ForwardResponse):
        names = ["output", "layernorm_output"]
    elif isinstance(msg, service_pb2.BackwardResponse):
        names = ["grad_input"]
    else:
        return [p.tensor for p in msg.parameters]
    return [getattr(msg, n) for n in names if msg.HasField(n)]


def _assemble(method: str, parts, response_type):
    """Reassembles a chunked response from its parts (header, then chunks in order)."""
    header, buffers, sizes, index, offset, received = None, [], [], 0, 0, 0
    for part in parts:
        if part.HasField("header"):
            if header is not None:
                raise GradwireError(method, "INTERNAL", "the header came twice")
            header = response_type()
            header.CopyFrom(part.header)
            for t in _slots(header):
                n = 1
                for d in t.shape:
                    n *= d
                size = n * {1: 4, 2: 2, 3: 2, 4: 1, 5: 1}.get(t.dtype, 0)
                sizes.append(size)
                buffers.append(bytearray(size))
            continue
        c = part.chunk
        while index < len(sizes) and offset >= sizes[index]:
            index, offset = index + 1, 0
        if header is None or c.tensor != index or c.offset != offset or \
                offset + len(c.data) > sizes[index]:
            raise GradwireError(method, "INTERNAL", "the server sent chunks out of order")
        buffers[index][offset:offset + len(c.data)] = c.data
        offset += len(c.data)
        received += len(c.data)
    if header is None:
        raise GradwireError(method, "INTERNAL", "no header")
    if received != sum(sizes):
        raise GradwireError(method, "INTERNAL",
                            f"the response ended early: {received} of {sum(sizes)} bytes")
    for t, buf in zip(_slots(header), buffers):
        t.data = bytes(buf)
    return header
