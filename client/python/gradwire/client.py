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
    """

    def __init__(self, server: str = "127.0.0.1:50051", timeout: float = 30.0,
                 wire_dtype: str = "f32", max_message_mib: int = 64, token: str = None):
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

    def server_info(self) -> service_pb2.GetServerInfoResponse:
        return self._call("GetServerInfo", service_pb2.GetServerInfoRequest())

    def create_module(self, spec: module_pb2.ModuleSpec) -> module_pb2.ModuleInfo:
        return self._call("CreateModule", service_pb2.CreateModuleRequest(spec=spec)).module

    def list_modules(self):
        return list(self._call("ListModules", service_pb2.ListModulesRequest()).modules)

    def delete_module(self, module_id: str) -> None:
        self._call("DeleteModule", service_pb2.DeleteModuleRequest(module_id=module_id))

    def forward(self, module_id: str, x: torch.Tensor, training: bool):
        """Returns (output, context_id or "", layernorm_output or None)."""
        enum = wire.WIRE_DTYPES[self.wire_dtype][0]
        resp = self._call("Forward", service_pb2.ForwardRequest(
            module_id=module_id, input=wire.to_wire(x, self.wire_dtype), training=training,
            output_dtype=enum))
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
        resp = self._call("Backward", req)
        return wire.from_wire(resp.grad_input) if resp.HasField("grad_input") else None

    def release_context(self, context_id: str) -> None:
        self._call("ReleaseContext", service_pb2.ReleaseContextRequest(context_id=context_id))

    def apply_gradients(self, module_id: str, learning_rate: float = 0.0) -> int:
        return self._call("ApplyGradients", service_pb2.ApplyGradientsRequest(
            module_id=module_id, learning_rate=learning_rate)).weight_version

    def get_weights(self, module_id: str) -> dict:
        resp = self._call("GetWeights", service_pb2.GetWeightsRequest(module_id=module_id))
        return {p.name: wire.from_wire(p.tensor) for p in resp.parameters}

    def get_gradients(self, module_id: str, zero: bool = False) -> dict:
        resp = self._call("GetGradients",
                          service_pb2.GetGradientsRequest(module_id=module_id, zero=zero))
        return {p.name: wire.from_wire(p.tensor) for p in resp.gradients}

    def set_weights(self, module_id: str, params: dict) -> int:
        req = service_pb2.SetWeightsRequest(module_id=module_id)
        for name, t in params.items():
            req.parameters.add(name=name, tensor=wire.to_wire(t, "f32"))
        return self._call("SetWeights", req).weight_version
