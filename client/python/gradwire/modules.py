"""Remote FP8 modules as ``torch.nn.Module``s.

The weights live on the server: the module has no local parameters, so a local optimizer does
not see them. ``apply_gradients()`` runs the module's optimizer on the server after backward.

Training forwards and backwards go over the client's ``Train`` stream (a request there needs no
round trip of its own); tensors too large for one message use the chunked calls.

``recompute_on_lost_context=True`` keeps each training forward's input on the host. A backward
whose context the server lost (evicted, expired, server restarted) then runs the forward again on
it and backpropagates through that. Caveat: the recompute uses the module's weights as they are
now; if ``apply_gradients`` or ``set_weights`` ran in between, the gradient belongs to the newer
weights, not to the ones that made the output the loss saw.
"""

import weakref
from typing import Optional, Union

import torch

from gradwire import safetensors
from gradwire.client import Client, ContextLostError, GradwireError
from gradwire.cluster import Cluster
from gradwire.v1 import module_pb2


class _Context:
    """A training forward's context on the server. Released when garbage-collected unless a
    backward consumed it, so a graph dropped without backward leaves nothing behind. With
    ``saved_input`` (recompute_on_lost_context) a backward whose context the server lost runs
    the forward again on that input first."""

    def __init__(self, module: "RemoteModule", context_id: str,
                 saved_input: Optional[torch.Tensor] = None):
        self.client = module.client
        self.module_id = module.module_id
        self.context_id = context_id
        self.saved_input = saved_input
        self._module = weakref.ref(module)
        self._finalizer = weakref.finalize(self, _Context._release, self.client, context_id)

    @staticmethod
    def _release(client, context_id):
        try:
            client.release_context(context_id)
        except (GradwireError, ValueError):
            pass  # server gone or channel closed: nothing left to free here

    def backward(self, grad_output: torch.Tensor, skip_grad_input: bool) -> Optional[torch.Tensor]:
        try:
            grad_input = _backward(self.client, self.context_id, grad_output, skip_grad_input)
        except ContextLostError:
            if self.saved_input is None:
                raise
            # The server lost the saved tensors: run the forward again on the kept input (at
            # the module's current weights, which may be newer than the first forward's).
            self._finalizer.detach()
            _, self.context_id, _ = _forward(self.client, self.module_id, self.saved_input)
            self._finalizer = weakref.finalize(self, _Context._release, self.client,
                                               self.context_id)
            module = self._module()
            if module is not None:
                module.recomputed_backwards += 1
            grad_input = _backward(self.client, self.context_id, grad_output, skip_grad_input)
        self._finalizer.detach()
        self.saved_input = None
        return grad_input


def _stream_ok(client: Client, tensor: torch.Tensor) -> bool:
    """Whether a request with this tensor fits the Train stream (which has no chunking)."""
    from gradwire import wire
    size = tensor.numel() * wire.element_size(client.activation_dtype)
    return client.chunking != "always" and size <= client.chunk_bytes


def _forward(client: Client, module_id: str, x: torch.Tensor):
    if _stream_ok(client, x):
        return client.train_stream().forward(module_id, x, True).result()
    return client.forward(module_id, x, training=True)


def _backward(client: Client, context_id: str, grad_output: torch.Tensor, skip_grad_input: bool):
    if not _stream_ok(client, grad_output):
        return client.backward(context_id, grad_output, skip_grad_input=skip_grad_input)
    try:
        return client.train_stream().backward(context_id, grad_output,
                                              skip_grad_input=skip_grad_input).result()
    except GradwireError as e:
        raise client.lost_context(e) from None


class _RemoteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, module):
        del anchor  # only there so autograd records the call when x needs no gradient
        out, context_id, _ = _forward(module.client, module.module_id, x)
        saved = x.detach().to("cpu", torch.float32).clone() if module.recompute_on_lost_context \
            else None
        ctx.remote = _Context(module, context_id, saved)
        ctx.input_dtype, ctx.input_device = x.dtype, x.device
        return out.to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        grad_input = ctx.remote.backward(grad_output.float(),
                                         skip_grad_input=not ctx.needs_input_grad[0])
        ctx.remote = None
        if grad_input is not None:
            grad_input = grad_input.to(device=ctx.input_device, dtype=ctx.input_dtype)
        return grad_input, None, None


class RemoteModule(torch.nn.Module):
    """A module hosted by gradwire-server. Training mode with grad enabled runs a training
    forward (the server keeps the saved tensors until backward); otherwise an inference forward
    that saves nothing."""

    def __init__(self, client: Union[Client, "Cluster"], spec: module_pb2.ModuleSpec = None,
                 module_id: str = None, keep: bool = False,
                 recompute_on_lost_context: bool = False, where: Optional[int] = None):
        super().__init__()
        if (spec is None) == (module_id is None):
            raise ValueError("give exactly one of spec (create a module) or module_id (use one)")
        if isinstance(client, Cluster):
            # Several servers: the module lives on one, and every call about it goes there.
            if module_id is None:
                module_id = client.create_module(spec, where).module_id
            client = client.client_for(module_id)
        self.client = client
        self.module_id = module_id or client.create_module(spec).module_id
        self.recompute_on_lost_context = recompute_on_lost_context
        self.recomputed_backwards = 0  # backwards that re-ran their forward (context lost)
        # A zero-size parameter makes autograd call our backward even when the input needs no
        # gradient (the first layer), so the server still accumulates the weight gradients.
        self._anchor = torch.nn.Parameter(torch.empty(0), requires_grad=True)
        self._finalizer = None
        if spec is not None and not keep:
            self._finalizer = weakref.finalize(self, RemoteModule._delete, client, self.module_id)

    @staticmethod
    def _delete(client, module_id):
        try:
            client.delete_module(module_id)
        except (GradwireError, ValueError):
            pass

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return _RemoteFunction.apply(x, self._anchor, self)
        out, _, _ = self.client.forward(self.module_id, x, training=False)
        return out.to(device=x.device, dtype=x.dtype)

    def apply_gradients(self, learning_rate: float = 0.0) -> int:
        """One optimizer step on the server; returns the new weight version."""
        return self.client.apply_gradients(self.module_id, learning_rate)

    def get_weights(self) -> dict:
        return self.client.get_weights(self.module_id)

    def set_weights(self, params: dict) -> int:
        return self.client.set_weights(self.module_id, params)

    def get_gradients(self, zero: bool = False) -> dict:
        return self.client.get_gradients(self.module_id, zero)

    def export_safetensors(self, path: str) -> None:
        safetensors.save(self.get_weights(), path, {"format": "gradwire", "module_id": self.module_id})

    def import_safetensors(self, path: str) -> int:
        tensors, _ = safetensors.load(path)
        return self.set_weights({k: v.float() for k, v in tensors.items()})


def _spec(kind: int, in_features: int, out_features: int, bias: bool, recipe: str, seed: int,
          learning_rate: float, name: str, momentum: float = 0.0,
          **extra) -> module_pb2.ModuleSpec:
    spec = module_pb2.ModuleSpec(kind=kind, in_features=in_features, out_features=out_features,
                                 bias=bias, seed=seed, name=name, **extra)
    if recipe not in ("current", "delayed"):
        raise ValueError(f"recipe must be 'current' or 'delayed', got {recipe!r}")
    spec.recipe.scaling = module_pb2.DELAYED if recipe == "delayed" else module_pb2.CURRENT
    spec.optimizer.sgd.learning_rate = learning_rate
    spec.optimizer.sgd.momentum = momentum
    return spec


class RemoteLinear(RemoteModule):
    """FP8 ``y = x W^T + b`` on the server; trains with SGD (``learning_rate``, ``momentum``).

    ``module_args`` go to RemoteModule (``keep``, ``recompute_on_lost_context``, ``where``)."""

    def __init__(self, client: Union[Client, Cluster], in_features: int, out_features: int,
                 bias: bool = True, recipe: str = "current", seed: int = 0,
                 learning_rate: float = 0.01, momentum: float = 0.0, name: str = "",
                 **module_args):
        super().__init__(client, _spec(module_pb2.LINEAR, in_features, out_features, bias, recipe,
                                       seed, learning_rate, name, momentum), **module_args)


class RemoteLayerNormLinear(RemoteModule):
    """FP8 ``LayerNorm(x) W^T + b`` on the server."""

    def __init__(self, client: Union[Client, Cluster], in_features: int, out_features: int,
                 bias: bool = True, recipe: str = "current", seed: int = 0,
                 learning_rate: float = 0.01, momentum: float = 0.0, eps: float = 1e-5,
                 name: str = "", **module_args):
        super().__init__(client, _spec(module_pb2.LAYERNORM_LINEAR, in_features, out_features,
                                       bias, recipe, seed, learning_rate, name, momentum,
                                       layernorm_eps=eps), **module_args)


_ACTIVATIONS = {"gelu": module_pb2.GELU, "relu": module_pb2.RELU, "swiglu": module_pb2.SWIGLU,
                "geglu": module_pb2.GEGLU}


class RemoteLayerNormMLP(RemoteModule):
    """FP8 ``FC2(act(FC1(LayerNorm(x))))`` on the server."""

    def __init__(self, client: Union[Client, Cluster], hidden_size: int, ffn_hidden_size: int,
                 out_features: Optional[int] = None, bias: bool = True,
                 activation: str = "gelu", recipe: str = "current", seed: int = 0,
                 learning_rate: float = 0.01, momentum: float = 0.0, checkpoint: bool = False,
                 name: str = "", **module_args):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}")
        super().__init__(client, _spec(module_pb2.LAYERNORM_MLP, hidden_size,
                                       out_features or hidden_size, bias, recipe, seed,
                                       learning_rate, name, momentum, ffn_features=ffn_hidden_size,
                                       activation=_ACTIVATIONS[activation],
                                       checkpoint=checkpoint), **module_args)
