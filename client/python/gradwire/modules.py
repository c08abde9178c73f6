"""Remote FP8 modules as ``torch.nn.Module``s.

The weights live on the server: the module has no local parameters, so a local optimizer does
not see them. ``apply_gradients()`` runs the module's optimizer on the server after backward.
"""

import weakref

import torch

from gradwire import safetensors
from gradwire.client import Client, GradwireError
from gradwire.v1 import module_pb2


class _Context:
    """A training forward's context on the server. Released when garbage-collected unless a
    backward consumed it, so a graph dropped without backward leaves nothing behind."""

    def __init__(self, client: Client, context_id: str):
        self.client = client
        self.context_id = context_id
        self.consumed = False
        self._finalizer = weakref.finalize(self, _Context._release, client, context_id)

    @staticmethod
    def _release(client, context_id):
        try:
            client.release_context(context_id)
        except (GradwireError, ValueError):
            pass  # server gone or channel closed: nothing left to free here

    def backward(self, grad_output, skip_grad_input):
        grad_input = self.client.backward(self.context_id, grad_output,
                                          skip_grad_input=skip_grad_input)
        self.consumed = True
        self._finalizer.detach()
        return grad_input


class _RemoteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, module):
        del anchor  # only there so autograd records the call when x needs no gradient
        out, context_id, _ = module.client.forward(module.module_id, x, training=True)
        ctx.remote = _Context(module.client, context_id)
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

    def __init__(self, client: Client, spec: module_pb2.ModuleSpec = None, module_id: str = None,
                 keep: bool = False):
        super().__init__()
        if (spec is None) == (module_id is None):
            raise ValueError("give exactly one of spec (create a module) or module_id (use one)")
        self.client = client
        self.module_id = module_id or client.create_module(spec).module_id
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


def _spec(kind, in_features, out_features, bias, recipe, seed, learning_rate, name, momentum=0.0,
          **extra):
    spec = module_pb2.ModuleSpec(kind=kind, in_features=in_features, out_features=out_features,
                                 bias=bias, seed=seed, name=name, **extra)
    if recipe not in ("current", "delayed"):
        raise ValueError(f"recipe must be 'current' or 'delayed', got {recipe!r}")
    spec.recipe.scaling = module_pb2.DELAYED if recipe == "delayed" else module_pb2.CURRENT
    spec.optimizer.sgd.learning_rate = learning_rate
    spec.optimizer.sgd.momentum = momentum
    return spec


class RemoteLinear(RemoteModule):
    """FP8 ``y = x W^T + b`` on the server; trains with SGD (``learning_rate``, ``momentum``)."""

    def __init__(self, client, in_features, out_features, bias=True, recipe="current", seed=0,
                 learning_rate=0.01, momentum=0.0, name=""):
        super().__init__(client, _spec(module_pb2.LINEAR, in_features, out_features, bias, recipe,
                                       seed, learning_rate, name, momentum))


class RemoteLayerNormLinear(RemoteModule):
    """FP8 ``LayerNorm(x) W^T + b`` on the server."""

    def __init__(self, client, in_features, out_features, bias=True, recipe="current", seed=0,
                 learning_rate=0.01, momentum=0.0, eps=1e-5, name=""):
        super().__init__(client, _spec(module_pb2.LAYERNORM_LINEAR, in_features, out_features,
                                       bias, recipe, seed, learning_rate, name, momentum,
                                       layernorm_eps=eps))


_ACTIVATIONS = {"gelu": module_pb2.GELU, "relu": module_pb2.RELU, "swiglu": module_pb2.SWIGLU,
                "geglu": module_pb2.GEGLU}


class RemoteLayerNormMLP(RemoteModule):
    """FP8 ``FC2(act(FC1(LayerNorm(x))))`` on the server."""

    def __init__(self, client, hidden_size, ffn_hidden_size, out_features=None, bias=True,
                 activation="gelu", recipe="current", seed=0, learning_rate=0.01, momentum=0.0,
                 checkpoint=False, name=""):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}")
        super().__init__(client, _spec(module_pb2.LAYERNORM_MLP, hidden_size,
                                       out_features or hidden_size, bias, recipe, seed,
                                       learning_rate, name, momentum, ffn_features=ffn_hidden_size,
                                       activation=_ACTIVATIONS[activation],
                                       checkpoint=checkpoint))
