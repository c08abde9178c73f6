"""Remote FP8 modules as ``torch.nn.Module``s: ``RemoteLinear``, ``RemoteLayerNormLinear``,
``RemoteLayerNormMLP``.

The weights live on the server; forward and backward run there, inside a
``torch.autograd.Function``. Training forwards and backwards go over the client's ``Train``
stream (a request there needs no round trip of its own); tensors too large for one message use
the chunked calls.

**Parameters.** A remote module has real ``nn.Parameter``s with the server's names and shapes
(``weight`` [out, in] and ``bias`` for a Linear; ``layer_norm_weight``, ``layer_norm_bias``,
``fc1_weight``, ``fc1_bias``, ``fc2_weight``, ``fc2_bias`` for a LayerNormMLP), so
``parameters()`` counts, ``named_parameters()`` and ``state_dict()`` keys are those of a local
layer. Their values are a *mirror* of the server's weights, kept lazily:

- *pulled* (GetWeights) only when read and stale: ``module.weight``, ``parameters()``,
  ``named_parameters()`` and ``state_dict()`` (a parent's too), ``pull()``; and, with a local
  optimizer, before a training forward, so that ``step()`` works on current values (an
  inference forward pulls nothing). A pull copies into the same tensors, so a tensor kept from
  an earlier read holds the new values after the next read (``gradwire.pull(model)`` refreshes
  all now). A pull is stale when the server's weight version moved (every forward response,
  optimizer step and weight upload reports it);
- *pushed* (SetWeights) when changed in place here -- an optimizer's ``step()``, ``with
  torch.no_grad(): m.weight.mul_(0.5)`` -- before the module's next forward, ``get_weights()``,
  ``apply_gradients()``, or at once by ``push()``. Changes are seen by the tensors' version
  counters, so a write through ``.data`` is not seen: call ``push()`` after one;
- ``load_state_dict()`` pushes at once, so the server refuses bad values there and then.

Where the optimizer runs (``optimizer="local"`` or a server ``"sgd"``/``"adamw"``), and so
where the gradients go, is explained in ``gradwire.optim``.

**Lifetimes.** A module created here is owned by its client: ``module.delete()`` deletes it,
so does leaving a ``with module:`` block, garbage collection, and ``Client.close()``; with
``keep=True`` only an explicit ``delete()`` does. A module attached by id
(``RemoteModule(client, module_id=...)``) is never deleted implicitly.

**Autograd.** A training forward (training mode, grad enabled) keeps a context on the server
until its backward; a graph dropped without backward releases it. ``backward(retain_graph=True)``
asks the server to retain the context, so a second backward works; a backward without it frees
the context at once. Eval mode or ``torch.no_grad()`` runs an inference forward that saves
nothing.

**dtypes.** A float input of any dtype is accepted and the output (and its gradient) comes back
in the input's dtype and on its device. A bfloat16 or float16 input travels as itself when the
client's wire dtype is "f32" (else in the client's narrower one); under ``torch.autocast`` the
input is cast to the autocast dtype first, as a local Linear's would be. A non-float input is
refused with TypeError. ``module.half()`` / ``.bfloat16()`` / ``.double()`` / ``.to(device)``
change the mirror's dtype and device (16-bit mirrors also make weights and gradients travel in
16 bits).

**Copying.** ``copy.deepcopy`` gives a new module on the same server with the same spec and the
current weights (server optimizer state such as momentum is not copied). ``pickle`` (and
``torch.save(model)``) stores the spec and the weights, never a connection: loading needs an
open ``gradwire.Client`` to the same server in the loading process, and creates a new module
there, or raises a RuntimeError that says so. ``copy.copy`` is refused (two objects would own
one server module).

**Weights given from outside.** ``functional_call`` (torch 1.13's ``stateless`` one and
``torch.func.functional_call``), parametrizations, ``weight_norm`` and pruning make the forward
compute with the weights they give: those are sent first (into a scratch module for a
``functional_call``, into the module for a lasting reparametrization), and the weight
gradients go to the given tensors.

**Non-finite values.** The server takes only finite tensors: rows of an input or a gradient that
hold a NaN or an infinity are not sent, give NaN rows, and make the weight gradients NaN (with
a server optimizer: the next step is skipped), as a local layer's would be.

**TorchScript.** ``torch.jit.trace`` and ``torch.jit.script`` raise a RuntimeError naming the
module: its forward is a call to a server, which a graph cannot record.

``recompute_on_lost_context=True`` keeps each training forward's input on the host. A backward
whose context the server lost (evicted, expired, server restarted, stream replaced) then runs
the forward again on it and backpropagates through that. Caveat: the recompute uses the
module's weights as they are now; if they changed in between, the gradient belongs to the newer
weights, not to the ones that made the output the loss saw.
"""

import collections
import contextlib
import copy
import logging
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from gradwire import kinds, optim, safetensors, wire
from gradwire.client import Client, ContextLostError, GradwireError, open_client_for
from gradwire.cluster import Cluster
from gradwire.v1 import module_pb2

log = logging.getLogger("gradwire")

_ACTIVATIONS = {"gelu": module_pb2.GELU, "relu": module_pb2.RELU, "swiglu": module_pb2.SWIGLU,
                "geglu": module_pb2.GEGLU}
_ACTIVATION_NAMES = {v: k for k, v in _ACTIVATIONS.items()}
_NO_GRAPH = ("cannot be traced or scripted: its forward is a call to gradwire-server, which a "
             "TorchScript graph cannot record (a trace would replay the first answer as a "
             "constant). Trace or script the local parts of the model, and call the remote "
             "module from Python")


def _parameter_shapes(spec: module_pb2.ModuleSpec) -> Dict[str, Tuple[int, ...]]:
    """The shape of every parameter a module of ``spec`` may have, by the server's names."""
    i, o, f = spec.in_features, spec.out_features, spec.ffn_features
    fc1 = 2 * f if spec.activation in (module_pb2.SWIGLU, module_pb2.GEGLU) else f
    return {"weight": (o, i), "bias": (o,), "layer_norm_weight": (i,), "layer_norm_bias": (i,),
            "fc1_weight": (fc1, i), "fc1_bias": (fc1,), "fc2_weight": (o, f), "fc2_bias": (o,)}


def _wire_dtype_of(dtype: torch.dtype) -> int:
    """How parameters (and their gradients) of a mirror in ``dtype`` travel: 16-bit mirrors in
    their own dtype (nothing is lost that the mirror keeps), others as F32."""
    return {torch.bfloat16: wire.BF16, torch.float16: wire.F16}.get(dtype, wire.F32)


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to on ``device_type`` now, or None when it is off there."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4 takes the device type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None
    if device_type == "cpu" and torch.is_autocast_cpu_enabled():
        return torch.get_autocast_cpu_dtype()
    if device_type == "cuda" and torch.is_autocast_enabled():
        return torch.get_autocast_gpu_dtype()
    return None


def _autocast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on for its device, as a local Linear's input
    would be (float64 is left alone, as autocast does)."""
    target = _autocast_dtype(x.device.type)
    if target is None or x.dtype in (target, torch.float64):
        return x
    return x.to(target)


def check_input(module: str, x: Any) -> None:
    """Refuses what a remote module cannot take: a non-tensor, or a tensor not of a float
    dtype (the server computes on floats, and an integer output would be a silent cast)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{module}: input must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{module}: input dtype {x.dtype} is not a floating-point dtype; cast "
                        "it first (x.float(), or x.to(torch.bfloat16))")


# --- futures: forwards and backwards on the Train stream, or unary when too large for it


def _stream_ok(client: Client, tensor: torch.Tensor, dtype: int) -> bool:
    """Whether a request with this tensor fits the Train stream (which has no chunking)."""
    size = tensor.numel() * wire.element_size(dtype)
    return client.chunking != "always" and size <= client.chunk_bytes


def _done(fn: Callable[[], Any]) -> Future:
    """A finished future of ``fn()``: its result or its exception."""
    f: Future = Future()
    try:
        f.set_result(fn())
    except Exception as e:  # noqa: BLE001 - handed to whoever waits on the future
        f.set_exception(e)
    return f


def submit_forward(client: Client, module_id: str, x: torch.Tensor, dtype: int) -> Future:
    """Future of a training forward's (output, context_id, layernorm_output)."""
    if _stream_ok(client, x, dtype):
        return client.train_stream(module_id).forward(module_id, x, True, dtype)
    return _done(lambda: client.forward(module_id, x, training=True, dtype=dtype))


def submit_backward(client: Client, context_id: str, grad_output: torch.Tensor,
                    skip_grad_input: bool, retain: bool, dtype: int) -> Future:
    """Future of a backward's grad_input (None with skip_grad_input)."""
    if _stream_ok(client, grad_output, dtype):
        # The stream of the context's module (routed by it).
        route = client.context_route(context_id, consume=not retain)
        return client.train_stream(route).backward(context_id, grad_output, skip_grad_input,
                                                   retain, dtype)
    return _done(lambda: client.backward(context_id, grad_output, skip_grad_input, retain,
                                         dtype=dtype))


def then(future: Future, done: Future, fn: Callable[[Future], None]) -> None:
    """Runs ``fn(future)`` once ``future`` completes; an exception ``fn`` raises fails ``done``
    (a done-callback's own exception would otherwise be swallowed and ``done`` never finish)."""

    def run(f: Future) -> None:
        try:
            fn(f)
        except Exception as e:  # noqa: BLE001
            if not done.done():
                done.set_exception(e)

    future.add_done_callback(run)


class Context:
    """A training forward's context on the server. Released when garbage-collected unless a
    backward consumed it, so a graph dropped without backward leaves nothing behind. With
    ``saved_input`` (recompute_on_lost_context) a backward whose context the server lost runs
    the forward again on that input first."""

    def __init__(self, module: "RemoteModule", context_id: str, activation_dtype: int,
                 gradient_dtype: int, saved_input: Optional[torch.Tensor] = None):
        self.client = module.client
        self.module_id = module.module_id
        self.context_id = context_id
        self.activation_dtype = activation_dtype
        self.gradient_dtype = gradient_dtype
        self.saved_input = saved_input
        self._module = weakref.ref(module)
        self._finalizer = weakref.finalize(self, Context._release, self.client, context_id)

    @staticmethod
    def _release(client: Client, context_id: str) -> None:
        if client.closed:
            return  # closing ended the stream, which released its contexts
        try:
            client.release_context(context_id)
        except GradwireError:
            pass  # gone already (consumed, evicted, server restarted): nothing left to free

    def backward_async(self, grad_output: torch.Tensor, skip_grad_input: bool,
                       retain: bool) -> Future:
        """Future of grad_input. ``retain`` keeps the context for another backward."""
        return _Backward(self, grad_output, skip_grad_input, retain).done


class _Backward:
    """One backward of a Context, with at most one recompute of its forward. Its steps are
    methods, not closures of one another: closures that call each other form a reference cycle
    that holds the Context, and a retained graph dropped afterwards would keep the server's
    context until Python's cyclic garbage collector ran."""

    def __init__(self, context: Context, grad_output: torch.Tensor, skip_grad_input: bool,
                 retain: bool):
        self.context = context
        self.grad_output = grad_output
        self.skip_grad_input = skip_grad_input
        self.retain = retain
        self.recomputed = False
        self.done: Future = Future()
        self._attempt()

    def _attempt(self) -> None:
        c = self.context
        f = submit_backward(c.client, c.context_id, self.grad_output, self.skip_grad_input,
                            self.retain, c.gradient_dtype)
        then(f, self.done, self._finished)

    def _finished(self, f: Future) -> None:
        c = self.context
        error = f.exception()
        if error is None:
            if not self.retain:
                c._finalizer.detach()
                c.saved_input = None
            self.done.set_result(f.result())
            return
        if isinstance(error, GradwireError):
            error = c.client.lost_context(error, c.module_id)
        if self.recomputed or c.saved_input is None or \
                not isinstance(error, ContextLostError):
            self.done.set_exception(error)
            return
        # The server lost the saved tensors: run the forward again on the kept input (at the
        # module's current weights, which may be newer than the first forward's).
        log.debug("context %s lost (%s): recomputing the forward of module %s", c.context_id,
                  error.reason, c.module_id)
        c._finalizer.detach()
        g = submit_forward(c.client, c.module_id, c.saved_input, c.activation_dtype)
        then(g, self.done, self._forwarded)

    def _forwarded(self, g: Future) -> None:
        c = self.context
        _, c.context_id, _ = g.result()
        c._finalizer = weakref.finalize(c, Context._release, c.client, c.context_id)
        module = c._module()
        if module is not None:
            module.recomputed_backwards += 1
        self.recomputed = True
        self._attempt()


class GraphProbe:
    """Tells a backward whether autograd keeps the graph after it (``retain_graph=True`` or
    ``create_graph=True``), which autograd does not tell a Function.

    ``_Probe`` is applied to the remote output, so its node runs just before the remote node's
    in backward; without retain_graph, autograd frees a node's saved tensors right after running
    it. Whether the probe's saved tensor is still there when the remote backward runs is the
    answer."""

    __slots__ = ("ctx",)

    def __init__(self) -> None:
        self.ctx = None

    def keep_graph(self) -> bool:
        if self.ctx is None:
            return False
        try:
            self.ctx.saved_tensors
            return True
        except RuntimeError:
            return False


class _Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, probe):
        probe.ctx = ctx
        ctx.save_for_backward(torch.empty(0))
        # detach(): a new tensor on the same storage, not a view, so in-place ops on the result
        # (an nn.ReLU(inplace=True) after the layer) stay legal.
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def probed(y: torch.Tensor, probe: GraphProbe) -> torch.Tensor:
    """``y`` behind a probe node (see GraphProbe)."""
    return _Probe.apply(y, probe)


def second_backward_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"Trying to backward through {what} a second time: its context on the server was freed "
        "by the first backward. Specify retain_graph=True on the first backward to keep it.")


def nonfinite_rows(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The rows (all dimensions but the last, flattened) of ``t`` holding a NaN or an
    infinity, as a bool mask; None when every value is finite."""
    if t.numel() == 0 or bool(torch.isfinite(t).all()):
        return None
    return ~torch.isfinite(t.reshape(-1, t.shape[-1])).all(dim=-1)


def clean_gradient(grad_output: torch.Tensor
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A backward's ``grad_output`` as the server takes it (finite: rows holding a NaN or an
    infinity zeroed) and the mask of those rows (None when there were none). The caller makes
    their input gradients NaN and the weight gradients non-finite, as a local layer's would
    be, so that a loop that skips non-finite steps (``torch.cuda.amp.GradScaler``, a check of
    its own) sees them."""
    bad = nonfinite_rows(grad_output)
    if bad is None:
        return grad_output, None
    rows = grad_output.reshape(-1, grad_output.shape[-1])
    clean = torch.where(bad[:, None], torch.zeros((), dtype=rows.dtype), rows)
    return clean.reshape(grad_output.shape), bad


def poison_rows(grad_input: Optional[torch.Tensor], bad: Optional[torch.Tensor]
                ) -> Optional[torch.Tensor]:
    """``grad_input`` with the rows of ``bad`` set to NaN."""
    if grad_input is None or bad is None:
        return grad_input
    rows = grad_input.reshape(-1, grad_input.shape[-1]).clone()
    rows[bad] = float("nan")
    return rows.reshape(grad_input.shape)


class _NonFiniteStep(torch.autograd.Function):
    """Marks, in backward, that non-finite values reached the weight gradients of server-optimizer
    modules, whose next step is then skipped (see ``RemoteModule.apply_gradients``)."""

    @staticmethod
    def forward(ctx, y, modules, *anchors):
        ctx.modules = modules
        return y.detach()

    @staticmethod
    def backward(ctx, grad):
        for m in ctx.modules:
            m._nonfinite_gradients = True
        return (grad, None) + (None,) * (len(ctx.needs_input_grad) - 2)


class _NoSecondOrder(torch.autograd.Function):
    """Passes on a gradient that a remote backward computed (under ``create_graph=True``) and
    refuses, naming the module, to be differentiated again: the server's backward has no
    backward of its own. ``deps``: the tensors the gradient would depend on locally (the
    gradient of the output, the weights), so that a double backward reaches this node."""

    @staticmethod
    def forward(ctx, label, grad, *deps):
        ctx.label = label
        return grad.detach()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            f"{ctx.label}: a double backward (differentiating a gradient made with "
            "create_graph=True) cannot pass through this module: the server computes its "
            "backward, which is not itself differentiable. Keep gradient penalties and "
            "higher-order gradients to local layers, or detach() the gradient first.")


def second_order_guard(label: str, outputs: Sequence[Optional[torch.Tensor]],
                       deps: Sequence[Optional[torch.Tensor]]
                       ) -> Tuple[Optional[torch.Tensor], ...]:
    """A remote backward's ``outputs`` as it returns them: as they are, or, when autograd
    records the backward itself (``create_graph=True``), behind a node that refuses a double
    backward with a message naming the module (``label``)."""
    if not torch.is_grad_enabled():
        return tuple(outputs)
    deps = [d for d in deps if isinstance(d, torch.Tensor) and d.requires_grad]
    if not deps:
        return tuple(outputs)
    return tuple(_NoSecondOrder.apply(label, o, *deps) if isinstance(o, torch.Tensor) else o
                 for o in outputs)


def wait_backward(future: Future, modules: Sequence["RemoteModule"]) -> Any:
    """The result of a backward's ``future``. Interrupted while waiting (KeyboardInterrupt), the
    backward goes on on the server and adds to the gradients of ``modules`` there: each module
    then drops what it added before its gradients are used again (``_settle_interrupted``)."""
    try:
        return future.result()
    except BaseException:
        if not future.done():
            for m in modules:
                m._interrupted.append(future)
        raise


class _RemoteFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probe, module, activation_dtype, gradient_dtype, *anchors):
        y, context_id, _ = submit_forward(module.client, module.module_id, x,
                                          activation_dtype).result()
        saved = x.detach().to("cpu", torch.float32).clone() \
            if module.recompute_on_lost_context else None
        ctx.remote = Context(module, context_id, activation_dtype, gradient_dtype, saved)
        ctx.module, ctx.probe = module, probe
        ctx.weight_nodes = [] if module.local_optimizer else [a.grad_fn for a in anchors]
        ctx.input_dtype, ctx.input_device = x.dtype, x.device
        return y.to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        # Not torch's once_differentiable: its error on a double backward names no module.
        with torch.no_grad():
            grads = _RemoteFunction._backward(ctx, grad_output.detach())
        module = ctx.module
        weights = tuple(p for _, p in module._items()) if module.local_optimizer else ()
        return second_order_guard(module._label(), grads, (grad_output, *weights))

    @staticmethod
    def _backward(ctx, grad_output):
        remote = ctx.remote
        if remote is None:
            raise second_backward_error(ctx.module._label())
        retain = ctx.probe.keep_graph()
        module = ctx.module
        grad_output, bad = clean_gradient(grad_output)
        # A server optimizer's backward asked only for input gradients (autograd.grad(loss, x),
        # a frozen module) adds weight gradients all the same, which must not reach a step.
        drop = not module.local_optimizer and not module._weights_wanted(ctx.weight_nodes)
        # With a local optimizer the backward accumulates into the module's one gradient buffer
        # on the server, which the client then reads and zeroes: this thread's backward and
        # its read go together, so that another thread's backward through the module cannot
        # land in between and each call gets its own weight gradients.
        with module._backward_lock if module.local_optimizer or drop else \
                contextlib.nullcontext():
            module._settle_interrupted()
            if drop:
                module._check_droppable()
            else:
                module._backwards_since_step += 1  # the server's gradients change from here
            future = remote.backward_async(grad_output, not ctx.needs_input_grad[0], retain)
            grad_input = wait_backward(future, [module])
            try:
                if drop:
                    module._drop_server_gradients()
                grads = module._gradients_for_autograd(ctx.needs_input_grad[5:])
            except BaseException as e:
                if not isinstance(e, Exception):  # interrupted: what it added may still be there
                    module._interrupted.append(future)
                raise
        if not retain:
            ctx.remote = None
        if bad is not None:
            grad_input = poison_rows(grad_input, bad)
            grads = [g.fill_(float("nan")) if g is not None else None for g in grads]
            if not module.local_optimizer and not drop:
                module._nonfinite_gradients = True
        if grad_input is not None:
            grad_input = grad_input.to(device=ctx.input_device, dtype=ctx.input_dtype)
        return (grad_input, None, None, None, None, *grads)


_TENSOR_BASE = getattr(torch._C, "TensorBase", None) or torch._C._TensorBase
_CLIP_GRAD = os.path.join("torch", "nn", "utils", "clip_grad.py")


class _ServerParameter(torch.nn.Parameter):
    """A parameter of a module trained by the server's optimizer: its gradient stays on the
    server and ``.grad`` stays None. ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_``
    would therefore clip nothing of it and leave it out of the norm, silently; reading its
    ``.grad`` from them raises instead, saying what to do."""

    @property
    def grad(self):
        frame, depth = sys._getframe(1), 0
        while frame is not None and depth < 2:  # the function, or a comprehension in it
            if frame.f_code.co_filename.endswith(_CLIP_GRAD):
                raise RuntimeError(
                    f"{getattr(self, '_gradwire_label', 'a remote module')}: its gradients stay "
                    "on the server (optimizer='sgd' or 'adamw'), so gradient clipping here "
                    "would neither count nor clip them, and the server's optimizer does not "
                    "clip. Clip only the local parameters (leave this module's out), or create "
                    "the module with optimizer='local' to clip its gradients")
            frame, depth = frame.f_back, depth + 1
        return _TENSOR_BASE.grad.__get__(self)

    @grad.setter
    def grad(self, value):
        _TENSOR_BASE.grad.__set__(self, value)


class _LiveParameters(collections.OrderedDict):
    """A remote module's ``_parameters``: iterating its items -- what ``named_parameters()``,
    ``parameters()`` (a parent's too) and ``state_dict()`` do -- first pulls the server's
    weights when they moved since the last pull and nothing changed here, so such a read is
    current, as a local module's is. The module's own code iterates without pulling
    (``RemoteModule._items``)."""

    def __init__(self, owner: "RemoteModule"):
        super().__init__()
        self._owner = weakref.ref(owner)

    def items(self):
        owner = self._owner()
        if owner is not None:
            owner._refresh_for_read()
        return super().items()

    def __reduce__(self):  # a plain OrderedDict in copies: no owner to pull for
        return (collections.OrderedDict, (list(dict.items(self)),))


class _WithTensors(torch.autograd.Function):
    """A training forward of a server module on weights given here (``torch.func``'s
    ``functional_call``, a parametrization, ``weight_norm``, pruning): the weights were sent
    before the forward, and the backward hands the server's weight gradients to the given
    tensors, through which autograd reaches whatever made them."""

    @staticmethod
    def forward(ctx, x, probe, target, activation_dtype, gradient_dtype, names, *tensors):
        y, context_id, _ = submit_forward(target.client, target.module_id, x,
                                          activation_dtype).result()
        ctx.remote = Context(target, context_id, activation_dtype, gradient_dtype)
        ctx.target, ctx.probe, ctx.names = target, probe, names
        ctx.places = [(t.dtype, t.device) for t in tensors]
        ctx.input_dtype, ctx.input_device = x.dtype, x.device
        return y.to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        with torch.no_grad():
            grads = _WithTensors._backward(ctx, grad_output.detach())
        return second_order_guard(ctx.target._label(), grads, (grad_output,))

    @staticmethod
    def _backward(ctx, grad_output):
        remote, target = ctx.remote, ctx.target
        if remote is None:
            raise second_backward_error(target._label())
        retain = ctx.probe.keep_graph()
        grad_output, bad = clean_gradient(grad_output)
        with target._backward_lock:  # the backward and the read of its gradients, together
            target._settle_interrupted()
            future = remote.backward_async(grad_output, not ctx.needs_input_grad[0], retain)
            grad_input = wait_backward(future, [target])
            grads = target.client.get_gradients(target.module_id, zero=True)
        if not retain:
            ctx.remote = None
        if grad_input is not None:
            grad_input = grad_input.to(device=ctx.input_device, dtype=ctx.input_dtype)
        weights = [grads[n].to(device=device, dtype=dtype) if want else None
                   for n, (dtype, device), want in zip(ctx.names, ctx.places,
                                                       ctx.needs_input_grad[6:])]
        if bad is not None:
            grad_input = poison_rows(grad_input, bad)
            weights = [w.fill_(float("nan")) if w is not None else None for w in weights]
        return (grad_input, None, None, None, None, None, *weights)


class _Twin:
    """A scratch server module with the spec of a remote module, for forwards on weights that
    are not the module's own for longer than one call (``functional_call``): each such forward
    sends them there first, so the module's own weights stay as they are. A backward may come
    after the next call's weights arrived (no staleness limit): the server keeps the weights a
    context was made with until its backward."""

    def __init__(self, owner: "RemoteModule"):
        spec = module_pb2.ModuleSpec()
        spec.CopyFrom(owner.spec)
        spec.max_staleness = -1
        spec.ClearField("optimizer")
        info = owner.client.create_module(spec)
        self.client = owner.client
        self.module_id = info.module_id
        self.client.own(self.module_id)  # deleted by Client.close(), if not before
        self._text = f"{owner._label()} (on given weights: module {self.module_id})"
        self._backward_lock = threading.Lock()
        self._interrupted: List[Future] = []
        self._sent: Optional[List[Tuple[torch.Tensor, int]]] = None
        self.recomputed_backwards = 0

    def _label(self) -> str:
        return self._text

    def _settle_interrupted(self) -> None:
        pending, self._interrupted = self._interrupted, []
        for f in pending:
            try:
                f.result(timeout=self.client.timeout)
            except BaseException:  # noqa: BLE001 - failed or still running: zeroed below
                pass
        if pending:
            self.client.get_gradients(self.module_id, zero=True, dtype=wire.FP8_E4M3)


class RemoteModule(torch.nn.Module):
    """A module hosted by gradwire-server, with real parameters that mirror the server's
    weights (see the ``gradwire.modules`` docstring for when they are pulled and pushed).

    Use ``RemoteLinear``, ``RemoteLayerNormLinear`` or ``RemoteLayerNormMLP`` to create one;
    this class takes a raw ``ModuleSpec``, or attaches to an existing module by id.

    Args:
        client: a ``Client``, or a ``Cluster`` (the module is placed on one of its servers).
        spec: create a module from this spec (owned: deleted with the module object, by
            ``delete()``, or by ``Client.close()``, unless ``keep``).
        module_id: or use this existing module (not owned: never deleted implicitly).
        optimizer: "local" (a torch optimizer trains the parameters: gradients are mirrored
            into ``.grad``), or "server" / "sgd" / "adamw" (the module's server optimizer,
            configured in ``spec``, steps with ``apply_gradients()``). See ``gradwire.optim``.
        keep: leave a created module on the server when this object, or its client, goes away.
        recompute_on_lost_context: keep each training forward's input on the host, and run the
            forward again when the server lost its context by the time of the backward.
        where: with a Cluster, the index of the server to create the module on (default:
            round-robin).
    """

    def __init__(self, client: Union[Client, Cluster], spec: Optional[module_pb2.ModuleSpec] = None,
                 module_id: Optional[str] = None, *, optimizer: str = "local",
                 keep: bool = False, recompute_on_lost_context: bool = False,
                 where: Optional[int] = None):
        super().__init__()
        self.__dict__["_parameters"] = _LiveParameters(self)
        self._reading = False  # a read of the parameters is pulling them now
        # Futures of backwards interrupted while waiting (KeyboardInterrupt): what they add to
        # the server's gradients is dropped before the module's gradients are used again.
        self._interrupted: List[Future] = []
        # A backward since the last step had NaN or infinite values (server optimizer): the next
        # step is skipped, as GradScaler skips one; skipped_steps counts them.
        self._nonfinite_gradients = False
        self.skipped_steps = 0
        if (spec is None) == (module_id is None):
            raise ValueError("give exactly one of spec (create a module) or module_id (use one)")
        if optimizer not in ("local", "server", "sgd", "adamw"):
            raise ValueError(f"optimizer must be 'local', 'server', 'sgd' or 'adamw', got "
                             f"{optimizer!r}")
        if where is not None and not isinstance(client, Cluster):
            raise ValueError("where= picks a server of a Cluster; this is a single Client")
        created = spec is not None
        if isinstance(client, Cluster):
            # Several servers: the module lives on one, and every call about it goes there.
            if created:
                info = client.create_module(spec, where)
                client = client.client_for(info.module_id)
            else:
                client = client.client_for(module_id)
                info = client.module_info(module_id.rsplit("/", 1)[-1])
        elif created:
            info = client.create_module(spec)
        else:
            info = client.module_info(module_id)
        self.client: Client = client
        self.module_id: str = info.module_id
        self._backward_lock = threading.Lock()  # a backward and its gradients' read, together
        client.hold(info.module_id)  # kept alive on a server with --module-ttl while open
        # The server process the module lives in: a module the server no longer knows is then
        # told apart from one deleted on a running server (see _explained).
        self._instance_id = _instance_of(client, info.module_id)
        self.spec: module_pb2.ModuleSpec = info.spec
        self._server_names: Tuple[str, ...] = tuple(info.parameter_names)
        self._twin: Optional[_Twin] = None  # made on the first forward on given weights
        self._sent: Optional[List[Tuple[torch.Tensor, int]]] = None  # given weights sent last
        self.local_optimizer: bool = optimizer == "local"
        self.recompute_on_lost_context = recompute_on_lost_context
        self.recomputed_backwards = 0  # backwards that re-ran their forward (context lost)
        self._owned = created and not keep
        self._deleted = False
        self._backwards_since_step = 0
        # Mirror state: the weight version the parameters hold (None: never pulled), each
        # parameter as of then (the tensor object, its storage and its version counter), and
        # local changes that survived a .to().
        self._synced: Optional[int] = None
        self._versions: Dict[str, Tuple[torch.Tensor, int, int]] = {}
        self._local_edits = False
        shapes = _parameter_shapes(self.spec)
        unknown = [n for n in info.parameter_names if n not in shapes]
        if unknown:
            if created:  # leave nothing behind for an object that will not exist
                client.delete_module(self.module_id)
            raise RuntimeError(f"module {self.module_id} has parameters this client does not "
                               f"know: {unknown} (a newer server? upgrade the package)")
        # requires_grad=True in both modes: with a server optimizer too it says whether the
        # module trains (requires_grad_(False) freezes it), though its gradients stay on the
        # server and .grad stays None.
        kind = torch.nn.Parameter if self.local_optimizer else _ServerParameter
        for name in info.parameter_names:
            self.register_parameter(name, kind(torch.empty(shapes[name])))
            self._parameters[name]._gradwire_label = self._label()
        self._record(None)
        # Autograd records a Function only when an input needs grad: with a server optimizer
        # the parameters are not its inputs (their gradients stay on the server), so this empty
        # tensor (not a parameter: it belongs to no state_dict) keeps the call in the graph of a
        # first layer, whose input needs none; a node over it tells a backward whether autograd
        # wants the weights' gradients (_anchors, _weights_wanted).
        self._anchor = torch.empty(0, requires_grad=True)
        self._finalizer = None
        if self._owned:
            client.own(self.module_id, self)
            self._finalizer = weakref.finalize(self, RemoteModule._delete_quietly, client,
                                               self.module_id)
        # The parameters hold the server's values from the start (not uninitialised memory): a
        # copy taken before the first forward (an EMA, a teacher) is the real model.
        self.pull()
        log.debug("%s: %s", "created" if created else "attached", self._label())

    @classmethod
    def attach(cls, client: Union[Client, Cluster], module_id: str, *, optimizer: str = "server",
               recompute_on_lost_context: bool = False) -> "RemoteModule":
        """A module object for an existing server module, of the class of its kind (never
        deleted implicitly). ``optimizer`` defaults to "server": the module keeps training with
        the optimizer it was created with."""
        target = client.client_for(module_id) if isinstance(client, Cluster) else client
        kind = target.module_info(module_id.rsplit("/", 1)[-1]).spec.kind
        # The class that names the kind (its _kind), else the general one.
        kind_class = {getattr(c, "_kind", None): c
                      for c in RemoteModule.__subclasses__()}.get(kind, RemoteModule)
        obj = kind_class.__new__(kind_class)
        RemoteModule.__init__(obj, client, module_id=module_id, optimizer=optimizer,
                              recompute_on_lost_context=recompute_on_lost_context)
        return obj

    @staticmethod
    def _delete_quietly(client: Client, module_id: str) -> None:
        if client.closed:
            return
        try:
            client.delete_module(module_id)
        except GradwireError as e:
            log.debug("module %s not deleted on garbage collection: %s", module_id, e)

    # --- identity

    def _label(self) -> str:
        return f"{type(self).__name__} {self.module_id} on {self.client.server}"

    @property
    def kind(self) -> str:
        """"LINEAR", "LAYERNORM_LINEAR" or "LAYERNORM_MLP"."""
        return kinds.name(self.spec.kind)

    @property
    def owned(self) -> bool:
        """Whether this object deletes the server module (created here, not ``keep``, not
        deleted yet)."""
        return self._owned and not self._deleted

    @property
    def deleted(self) -> bool:
        """Whether ``delete()`` ran."""
        return self._deleted

    @property
    def configured_lr(self) -> float:
        """The learning rate of the module's server optimizer."""
        return optim.configured_lr(self.spec.optimizer)

    def _sizes(self) -> str:
        s = self.spec
        return f"in_features={s.in_features}, out_features={s.out_features}, bias={s.bias}"

    def extra_repr(self) -> str:
        optimizer = "local" if self.local_optimizer else optim.describe(self.spec.optimizer)
        state = ", deleted" if self._deleted else ""
        return (f"{self._sizes()}, kind={self.kind}, optimizer={optimizer}, "
                f"server={self.client.server}, id={self.module_id}{state}")

    def _check_alive(self) -> None:
        if self._deleted:
            raise RuntimeError(f"{self._label()} was deleted")

    def _explained(self, error: GradwireError) -> GradwireError:
        """``error``, or, when the server does not know this module because it restarted
        since the module was created, an error (same method and code) that says so: the
        server's own answer only says the id is not a module."""
        if error.code != "NOT_FOUND" or self.module_id not in error.message or \
                self._instance_id is None:
            return error
        now = _instance_of(self.client, self.module_id)
        if now is None or now == self._instance_id:
            return error
        return GradwireError(
            error.method, error.code,
            f"{self._label()} is gone: the server restarted since the module was created "
            f"(instance {self._instance_id}, now {now}), and a module lives only as long as "
            "the server process that holds it. Create it again (its weights come back from a "
            f"checkpoint: load_state_dict or import_safetensors). The server said: "
            f"{error.message}", error.request_id)

    @contextlib.contextmanager
    def _calls(self):
        """Raises a failed call's error through ``_explained``."""
        try:
            yield
        except GradwireError as e:
            explained = self._explained(e)
            if explained is e:
                raise
            raise explained from None

    # --- the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The module on ``x`` ([..., in_features], any float dtype, any device): a training
        forward (context on the server until backward) in training mode with grad enabled,
        else an inference forward. The output has ``x``'s dtype and device."""
        self._check_alive()
        if torch.jit.is_tracing():
            raise RuntimeError(f"{self._label()} {_NO_GRAPH}")
        check_input(self._label(), x)
        x = _autocast(x)
        if x.numel() == 0 and x.dim() >= 1:
            if x.shape[-1] != self.spec.in_features:
                # The error the server gives a batch with rows (which it never sees here).
                raise GradwireError(
                    "Forward", "INVALID_ARGUMENT",
                    f"{self._label()}: input.shape must be [..., {self.spec.in_features}] (the "
                    f"module's in_features), got {list(x.shape)}: the last dimension is "
                    f"{x.shape[-1]}")
            return self._empty_forward(x)
        bad = nonfinite_rows(x) if x.dim() >= 1 else None
        if bad is not None:
            return self._nonfinite_forward(x, bad)
        given = self._given_weights()
        if given is not None:
            return self._forward_given(x, *given)
        activation_dtype, gradient_dtype = self.client.wire_dtypes_for(x.dtype)
        training = self._trains(x)
        with self._calls():
            self._before_forward(training)
            if training:
                probe = GraphProbe()
                y = _RemoteFunction.apply(x, probe, self, activation_dtype, gradient_dtype,
                                          *self._anchors())
                y = probed(y, probe)
                self._after_forward()
            else:
                out, _, _ = self.client.forward(self.module_id, x, training=False,
                                                dtype=activation_dtype)
                y = out.to(device=x.device, dtype=x.dtype)
        return y

    def _nonfinite_forward(self, x: torch.Tensor, bad: torch.Tensor) -> torch.Tensor:
        """An input with NaN or infinite values (the server takes only finite ones), as a local
        layer takes it: the rows holding them give NaN rows (the server computes the others),
        and the weight gradients of a backward through them are non-finite -- NaN in ``.grad``
        with a local optimizer; with a server optimizer the module's next step is skipped --
        so that a loop that skips non-finite steps (GradScaler, a check of its own) does."""
        rows = x.reshape(-1, x.shape[-1])
        good = (~bad).nonzero().squeeze(1)
        y_good = self.forward(rows.index_select(0, good))  # forward: the hooks run once
        out = torch.full((rows.shape[0], self.spec.out_features), float("nan"),
                         dtype=y_good.dtype, device=y_good.device)
        y = out.index_copy(0, good.to(y_good.device), y_good)
        if torch.is_grad_enabled() and self._trainable():
            if self.local_optimizer:
                weights = [p for _, p in self._items() if p.requires_grad]
                taint = sum((p.sum() * float("nan")).to(y.dtype) for p in weights)
                y = torch.where(bad.to(y.device)[:, None], y + taint, y)
            elif self.training or x.requires_grad:
                y = _NonFiniteStep.apply(y, [self], self._anchor)
        return y.reshape(tuple(x.shape[:-1]) + (self.spec.out_features,))

    def _empty_forward(self, x: torch.Tensor) -> torch.Tensor:
        """An input with no rows, as ``nn.Linear`` takes it: an output with no rows, and no call
        to the server. The output stays in the graph of whatever needs a gradient (the input,
        local parameters), so a backward gives them zeros, as for a local layer."""
        y = x.new_zeros(tuple(x.shape[:-1]) + (self.spec.out_features,))
        if torch.is_grad_enabled():
            needs = [x] if x.requires_grad else []
            if self.local_optimizer:
                needs += [p for p in self._parameters.values() if p.requires_grad]
            for t in needs:
                y = y + (t.sum() * 0).to(y.dtype)
        return y

    def _items(self) -> List[Tuple[str, torch.Tensor]]:
        """The server's parameters by name, without the pull a read through ``parameters()``
        makes (and without those a reparametrization added: ``weight_g``, ``weight_orig``)."""
        names = self.__dict__.get("_server_names")
        return [(n, p) for n, p in dict.items(self._parameters)
                if names is None or n in names]

    def _given_weights(self) -> Optional[Tuple[Dict[str, torch.Tensor], bool]]:
        """The weights a forward computes with where they are not the module's own parameters
        (name -> tensor), and whether they hold for this call only; None when they all are.

        - ``functional_call``: torch 1.13's ``stateless.functional_call`` answers the names it
          replaces through the module's attributes (``_attr_to_path``); torch 2's
          ``torch.func.functional_call`` puts the given tensors, not Parameters, into
          ``_parameters`` for the call. For this call only.
        - A parametrization (``torch.nn.utils.parametrize``: ``orthogonal``, ``spectral_norm``,
          your own), ``weight_norm`` and pruning take the name out of ``_parameters`` and
          answer it as an attribute computed from their own parameters. Lasting."""
        own = self.__dict__["_parameters"]
        paths = self.__dict__.get("_attr_to_path") or {}
        given: Dict[str, torch.Tensor] = {}
        temporary = False
        for name in self._server_names:
            registered = dict.get(own, name)
            if name in paths:
                given[name], temporary = getattr(self, name), True
            elif registered is not None and not isinstance(registered, torch.nn.Parameter):
                given[name], temporary = registered, True
            elif registered is None and name not in own:
                value = getattr(self, name, None)
                if not isinstance(value, torch.Tensor):
                    raise RuntimeError(f"{self._label()}: parameter {name} is gone, and no "
                                       "parametrization gives it; the server module has it")
                given[name] = value
        return (given, temporary) if given else None

    def _forward_given(self, x: torch.Tensor, given: Dict[str, torch.Tensor],
                       temporary: bool) -> torch.Tensor:
        """The forward on weights given here (see ``_given_weights``): they are sent first --
        into a scratch module for a ``functional_call``, into the module itself for a lasting
        reparametrization -- and the backward hands the weight gradients to them."""
        for t in given.values():
            functorch = getattr(getattr(torch._C, "_functorch", None),
                                "is_functorch_wrapped_tensor", None)
            if functorch is not None and functorch(t):
                raise RuntimeError(
                    f"{self._label()}: torch.func transforms (grad, vmap, jacrev, ...) cannot "
                    "pass through a module computed on a server; call torch.func."
                    "functional_call without them and take gradients with torch.autograd")
        if not temporary and not self.local_optimizer:
            raise RuntimeError(
                f"{self._label()}: {', '.join(given)} is reparametrized here (a "
                "parametrization, weight_norm or pruning), but the server's optimizer would "
                "step the weights the reparametrization computes; create the module with "
                "optimizer='local' and train the reparametrization's parameters")
        self._refresh()  # the module's own parameters among them hold the server's values
        names = list(self._server_names)
        own = dict(self._items())
        tensors = [given[n] if n in given else own[n] for n in names]
        if temporary:
            if self._twin is None:
                with self._calls():
                    self._twin = _Twin(self)
                weakref.finalize(self, RemoteModule._delete_quietly, self.client,
                                 self._twin.module_id)
            target = self._twin
        else:
            if self._dirty():
                self.push()
            target = self
        sent = [(t, t._version) for t in tensors]
        if target._sent is None or len(target._sent) != len(sent) or \
                any(a is not b or va != vb for (a, va), (b, vb) in zip(target._sent, sent)):
            values = {n: t.detach().to("cpu", torch.float32) for n, t in zip(names, tensors)}
            with self._calls():
                version = self.client.set_weights(target.module_id, values)
            target._sent = sent
            if target is self:
                self._record(version)  # its own parameters hold what the server has
        activation_dtype, gradient_dtype = self.client.wire_dtypes_for(x.dtype)
        if not torch.is_grad_enabled() or \
                not (x.requires_grad or any(t.requires_grad for t in tensors)):
            with self._calls():
                out, _, _ = self.client.forward(target.module_id, x, training=False,
                                                dtype=activation_dtype)
            return out.to(device=x.device, dtype=x.dtype)
        probe = GraphProbe()
        with self._calls():
            y = _WithTensors.apply(x, probe, target, activation_dtype, gradient_dtype,
                                   tuple(names), *tensors)
        return probed(y, probe)

    def _refresh_for_read(self) -> None:
        """Before ``named_parameters()`` / ``parameters()`` / ``state_dict()`` reads the
        parameters: pulls them when the server's weights moved (a server optimizer's step,
        another writer) and nothing changed here."""
        if self.__dict__.get("_reading", True) or "_synced" not in self.__dict__:
            return  # the module's own iteration, or one while it is being built
        self._reading = True
        try:
            self._refresh()
        except GradwireError as e:
            log.warning("%s: the parameters read now may be stale, the pull failed: %s",
                        self._label(), e)
        finally:
            self._reading = False

    def _trainable(self) -> bool:
        """Whether the weights want gradients: with a server optimizer, whether the parameters
        require grad (all of them, or none: the server's optimizer steps the whole module)."""
        flags = {p.requires_grad for p in self._parameters.values()}
        if len(flags) > 1 and not self.local_optimizer:
            frozen = [n for n, p in self._items() if not p.requires_grad]
            raise RuntimeError(
                f"{self._label()}: {', '.join(frozen)} do not require grad but the other "
                "parameters do; the server's optimizer steps the whole module, so freeze all of "
                "it (module.requires_grad_(False)) or none, or create it with "
                "optimizer='local' to freeze single parameters")
        return True in flags

    def _trains(self, x: torch.Tensor) -> bool:
        """Whether a forward on ``x`` needs a context on the server: grad on, and something to
        backpropagate to. In training mode that is always the weights with a server optimizer;
        in eval mode, as for a local layer, the graph still reaches an input or local
        parameters that need grad (only ``no_grad()`` and ``inference_mode()`` cut it)."""
        if not torch.is_grad_enabled():
            return False
        trainable = self._trainable()
        local_grads = self.local_optimizer and trainable
        if not self.training:
            return x.requires_grad or local_grads
        return trainable or x.requires_grad

    def _anchors(self) -> Tuple[torch.Tensor, ...]:
        """The tensors a training forward's node hangs from besides the input: the parameters
        (a local optimizer), or for a server optimizer a node of its own over ``_anchor`` when
        the module trains, which a backward asks autograd about (``_weights_wanted``)."""
        if self.local_optimizer:
            return tuple(p for _, p in self._items())
        if not self._trainable():
            return ()
        return (self._anchor.view_as(self._anchor),)

    @staticmethod
    def _weights_wanted(nodes: Sequence[Any]) -> bool:
        """In a backward of a server-optimizer module: whether autograd runs the node of the
        module's anchor, i.e. whether this backward is for the weights too (``backward()``),
        or only for some inputs (``torch.autograd.grad(loss, x)``, ``backward(inputs=...)``)."""
        if not nodes:
            return False
        check = getattr(torch._C, "_will_engine_execute_node", None)
        if check is None:
            return True
        try:
            return any(check(n) for n in nodes if n is not None)
        except (RuntimeError, TypeError):
            return True

    def _settle_interrupted(self) -> None:
        """Waits for the backwards interrupted while waiting on this module (within the
        client's timeout) and drops the weight gradients they added on the server. With a local
        optimizer every earlier backward's gradients were already read into ``.grad``, so only
        theirs go; with a server optimizer the interrupted step is dropped whole (the gradients
        accumulated since the last step), as the server keeps one sum."""
        if not self._interrupted:
            return
        pending, self._interrupted = self._interrupted, []
        deadline = time.monotonic() + self.client.timeout
        for i, f in enumerate(pending):
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                self._interrupted = pending[i:]
                raise RuntimeError(
                    f"{self._label()}: a backward interrupted earlier is still running on the "
                    f"server after {self.client.timeout:g} s, and its weight gradients would "
                    "be added to this one's; try again once the server has finished it") \
                    from None
            except BaseException:  # noqa: BLE001 - failed: it added nothing
                pass
        if not self.local_optimizer and self._backwards_since_step > len(pending):
            log.warning("%s: an interrupted backward's gradients are dropped, with the "
                        "gradients accumulated since the last step", self._label())
        self._drop_server_gradients()

    def _drop_server_gradients(self) -> None:
        """Zeroes the gradients the server accumulated (GetGradients is the only call that
        does; FP8 keeps the answer small)."""
        with self._calls():
            self.client.get_gradients(self.module_id, zero=True, dtype=wire.FP8_E4M3)
        self._backwards_since_step = 0

    def _check_droppable(self) -> None:
        """Before a server-optimizer backward whose weight gradients nobody asked for: they can
        be dropped afterwards only while the server holds no other gradients for the next
        step, so refuse it otherwise."""
        if self._backwards_since_step:
            raise RuntimeError(
                f"{self._label()}: this backward asks for no weight gradients (autograd.grad() "
                "of inputs only, or the module is frozen), but the server adds them to the "
                f"gradients of the {self._backwards_since_step} backward(s) accumulated for the "
                "next step of its optimizer, where they cannot be told apart. Run it before "
                "those backwards or after step()/zero_grad(), or use optimizer='local'")

    def _gradients_for_autograd(self, needed: Sequence[bool]) -> List[Optional[torch.Tensor]]:
        """After a backward: the gradients autograd accumulates into the parameters' ``.grad``
        (a local optimizer), read and zeroed on the server; None for each with a server
        optimizer, whose gradients stay there."""
        if not self.local_optimizer:
            return [None] * len(needed)
        # Zeroed even when no parameter wants them (frozen), so they cannot reach a later step.
        grads = self.client.get_gradients(self.module_id, zero=True,
                                          dtype=self._parameter_wire_dtype())
        self._backwards_since_step = 0
        return [grads[name].to(device=p.device, dtype=p.dtype) if want else None
                for (name, p), want in zip(self._items(), needed)]

    # --- the mirror of the weights

    def _record(self, version: Optional[int]) -> None:
        """The parameters now hold weight ``version`` (None: unknown) and no local change."""
        self._synced = version
        self._versions = {n: (p, p.data_ptr(), p._version) for n, p in self._items()}
        self._local_edits = False

    def _dirty(self) -> bool:
        """Whether the parameters changed since the last pull or push: written in place (the
        version counter), given new storage (``p.data = ...``, as
        ``vector_to_parameters`` does), or replaced by another tensor (``m.weight =
        nn.Parameter(...)``, or a weight tied to another module's)."""
        if self._local_edits:
            return True
        for n, p in self._items():
            seen = self._versions.get(n)
            if seen is None or seen[0] is not p or seen[1] != p.data_ptr() or \
                    seen[2] != p._version:
                return True
        return False

    def _stale(self) -> bool:
        """Whether the server's weights may differ from the parameters' values."""
        if self._synced is None:
            return True
        known = self.client.weight_versions.get(self.module_id)
        return known is not None and known != self._synced

    def _parameter_wire_dtype(self) -> int:
        dtypes = {p.dtype for p in self._parameters.values()}
        return _wire_dtype_of(dtypes.pop()) if len(dtypes) == 1 else wire.F32

    def _refresh(self) -> None:
        """Pulls when the server's weights moved and nothing here changed."""
        if not self._deleted and not self._dirty() and self._stale():
            self.pull()

    def _before_forward(self, training: bool) -> None:
        if self._dirty():
            self.push()
        elif training and self.local_optimizer and self._stale():
            # The step after this forward's backward must work on the current values (an
            # inference forward needs none: nothing is pulled for it).
            self.pull()

    def _after_forward(self) -> None:
        # A training forward's response reports the weight version: if another writer moved
        # it, the coming step must see the new values.
        if self.local_optimizer:
            self._refresh()

    def pull(self) -> int:
        """Copies the server's weights into the parameters now, discarding local changes not
        pushed yet; returns the weight version."""
        self._check_alive()
        with self._calls():
            weights, version = self.client.get_weights_versioned(self.module_id,
                                                                 self._parameter_wire_dtype())
        self._copy_in(weights)
        self._record(version)
        log.debug("pulled the weights of %s (version %d)", self._label(), version)
        return version

    def _copy_in(self, weights: Dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, p in self._items():
                if name not in weights:
                    continue
                if tuple(weights[name].shape) != tuple(p.shape):
                    raise RuntimeError(f"{self._label()}: the server's {name} has shape "
                                       f"{tuple(weights[name].shape)}, the module expects "
                                       f"{tuple(p.shape)}")
                p.copy_(weights[name])

    def push(self) -> int:
        """Sends the parameters' values to the server now (SetWeights); returns the new weight
        version. A forward does this by itself after an in-place change."""
        self._check_alive()
        params = {n: p.detach() for n, p in self._items()}
        with self._calls():
            version = self.client.set_weights(self.module_id, params,
                                              self._parameter_wire_dtype())
        self._record(version)
        log.debug("pushed the weights of %s (version %d)", self._label(), version)
        return version

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        if isinstance(value, torch.nn.Parameter) and name in self.__dict__["_parameters"]:
            self._refresh()  # module.weight reads the server's current values
        return value

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._refresh()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        if len(error_msgs) > errors or self._deleted:
            return  # load_state_dict raises them, after every module had its say
        loaded = [n for n in self._parameters if prefix + n in state_dict]
        if not loaded:
            return
        if len(loaded) == len(self._parameters) or self._synced is not None:
            self.push()  # every value here is valid: loaded, pulled, or changed here
            return
        # Some parameters loaded into a mirror never pulled: send only those, and pull the
        # others when next read.
        version = self.client.set_weights(
            self.module_id, {n: self._parameters[n].detach() for n in loaded},
            self._parameter_wire_dtype())
        self._record(None)
        log.debug("pushed %s of %s (version %d)", loaded, self._label(), version)

    def _apply(self, fn, *args, **kwargs):
        # .to(), .half(), .cuda() convert the mirror: neither a local change nor a new pull.
        dirty = self._dirty()
        result = super()._apply(fn, *args, **kwargs)
        synced = self._synced
        self._record(synced)
        self._local_edits = dirty
        return result

    # --- weights, gradients and the server optimizer

    def apply_gradients(self, lr: Optional[float] = None) -> int:
        """One step of the module's server optimizer on the gradients accumulated since the last
        step, which it then zeroes; ``lr`` overrides the configured learning rate for this step.
        Returns the new weight version. Refused for ``optimizer="local"``: the gradients are
        then in the parameters' ``.grad``, for a torch optimizer."""
        self._check_alive()
        if self.local_optimizer:
            raise RuntimeError(
                f"{self._label()} trains with a local optimizer (optimizer='local'): its "
                "gradients are in the parameters' .grad for your torch optimizer's step(). "
                "Create it with optimizer='sgd' or 'adamw' to step it on the server.")
        if self._dirty():
            self.push()
        self._settle_interrupted()
        if self._nonfinite_gradients:
            # As GradScaler skips a step whose gradients are not finite: nothing changes.
            log.warning("%s: step skipped, a backward had non-finite values (its gradients "
                        "are dropped)", self._label())
            self._drop_server_gradients()
            self._nonfinite_gradients = False
            self.skipped_steps += 1
            return self.client.weight_versions.get(self.module_id, self._synced or 0)
        with self._calls():
            version = self.client.apply_gradients(self.module_id, optim.wire_rate(lr))
        self._backwards_since_step = 0
        return version

    def zero_server_gradients(self) -> None:
        """Zeroes the gradients the server accumulated, if a backward ran since the last step
        (with a local optimizer they never stay there)."""
        self._check_alive()
        self._settle_interrupted()  # zeroes them, if a backward was interrupted
        self._nonfinite_gradients = False
        if self._backwards_since_step:
            self._drop_server_gradients()

    def get_weights(self) -> Dict[str, torch.Tensor]:
        """The server's current weights by parameter name, as new float32 CPU tensors (local
        changes are pushed first, and the mirror is refreshed on the way)."""
        self._check_alive()
        if self._dirty():
            self.push()
        with self._calls():
            weights, version = self.client.get_weights_versioned(self.module_id)
        self._copy_in(weights)
        self._record(version)
        return weights

    def set_weights(self, params: Dict[str, torch.Tensor]) -> int:
        """Replaces the named parameters on the server (any subset; all are checked before any
        changes) and in the mirror; returns the new weight version. ``load_state_dict`` does
        the same from a state dict."""
        self._check_alive()
        if self._dirty():
            self.push()
        with self._calls():
            version = self.client.set_weights(self.module_id, params)
        self._copy_in(params)
        self._record(version if set(params) >= set(self._parameters) else None)
        return version

    def get_gradients(self, zero: bool = False) -> Dict[str, torch.Tensor]:
        """The gradients the server accumulated since the last step or zeroing, by parameter
        name (float32 CPU tensors); ``zero`` zeroes them after reading. With
        ``optimizer="local"`` each backward moves them into ``.grad``, so this reads zeros."""
        self._check_alive()
        self._settle_interrupted()
        with self._calls():
            grads = self.client.get_gradients(self.module_id, zero)
        if zero:
            self._backwards_since_step = 0
        return grads

    def export_safetensors(self, path: str) -> None:
        """Writes the server's current weights to a safetensors file (the CLI reads it too)."""
        safetensors.save(self.get_weights(), path,
                         {"format": "gradwire", "module_id": self.module_id})

    def import_safetensors(self, path: str) -> int:
        """Loads weights from a safetensors file into the module; returns the weight version."""
        tensors, _ = safetensors.load(path)
        return self.set_weights({k: v.float() for k, v in tensors.items()})

    # --- lifetime

    def delete(self) -> None:
        """Deletes the module on the server now (owned or not, kept or not). Deleting twice,
        or a module the server no longer has, is fine; using it afterwards raises."""
        if self._deleted:
            return
        try:
            self.client.delete_module(self.module_id)
        except GradwireError as e:
            if e.code != "NOT_FOUND":
                raise
        if self._finalizer is not None:
            self._finalizer.detach()
        if self._twin is not None:
            RemoteModule._delete_quietly(self.client, self._twin.module_id)
        self._deleted = True

    def __enter__(self) -> "RemoteModule":
        return self

    def __exit__(self, *exc) -> None:
        if self.owned:
            self.delete()

    # --- copies, pickles and TorchScript

    def _portable_state(self) -> Dict[str, Any]:
        """What a copy needs: spec, options and current weights; no connection."""
        self._check_alive()
        return {"spec": self.spec.SerializeToString(), "local_optimizer": self.local_optimizer,
                "keep": not self._owned, "recompute": self.recompute_on_lost_context,
                "training": self.training,
                "weights": {k: v.detach().cpu().clone() for k, v in self.state_dict().items()}}

    @classmethod
    def _rebuild(cls, client: Client, state: Dict[str, Any]) -> "RemoteModule":
        obj = cls.__new__(cls)
        RemoteModule.__init__(obj, client, spec=module_pb2.ModuleSpec.FromString(state["spec"]),
                              optimizer="local" if state["local_optimizer"] else "server",
                              keep=state["keep"], recompute_on_lost_context=state["recompute"])
        weights = state["weights"]
        dtypes = {t.dtype for t in weights.values()}
        if len(dtypes) == 1 and dtypes != {torch.float32}:
            obj.to(dtypes.pop())
        obj.load_state_dict(weights)
        obj.train(state["training"])
        return obj

    def __deepcopy__(self, memo: Dict[int, Any]) -> "RemoteModule":
        new = type(self)._rebuild(self.client, self._portable_state())
        memo[id(self)] = new
        device = next((p.device for p in self._parameters.values()), torch.device("cpu"))
        if device.type != "cpu":
            new.to(device)
        # As nn.Module's deepcopy: each parameter keeps requires_grad, and a parameter this
        # deepcopy has already copied (a weight tied to another module's) stays tied to that
        # copy; one not copied yet is recorded, so a later module that shares it ties to ours.
        with torch.no_grad():
            for name, p in self._items():
                if p is None:
                    continue
                if id(p) in memo:
                    new._parameters[name] = memo[id(p)]
                    continue
                mine = new._parameters[name]
                mine.requires_grad_(p.requires_grad)
                memo[id(p)] = mine
        for key, value in self.__dict__.items():  # plain attributes a user set, and hooks
            if key not in new.__dict__ or "hook" in key:
                new.__dict__[key] = copy.deepcopy(value, memo)
        log.debug("deep copy of %s: %s", self._label(), new.module_id)
        return new

    def __copy__(self):
        raise TypeError(f"{self._label()}: a shallow copy would share the server module with "
                        "the original, and both would delete it; use copy.deepcopy for a new "
                        "module with the same weights")

    def __reduce_ex__(self, protocol):
        return (_restore, (type(self), self.client.server, self._portable_state()))

    def __prepare_scriptable__(self):
        raise RuntimeError(f"{self._label()} {_NO_GRAPH}")


def _instance_of(client: Client, module_id: str) -> Optional[str]:
    """The instance id of the server process ``client``'s calls about ``module_id`` reach (behind
    a proxy, the one holding it), or None when it cannot be asked."""
    try:
        return client.instance_id(module_id)
    except GradwireError:
        return None


def _restore(cls: type, server: str, state: Dict[str, Any]) -> RemoteModule:
    """Unpickles a remote module: a new module, on an open client to the same server."""
    client = open_client_for(server)
    if client is None:
        raise RuntimeError(
            f"cannot unpickle a {cls.__name__} of {server}: a pickle holds the module's spec and "
            f"weights but no connection, and no gradwire.Client to {server} is open in this "
            f"process. Open one (gradwire.Client({server!r}, ...)) and load again; the "
            "module is created anew there")
    return cls._rebuild(client, state)


# The FP8 scaling recipes by name (docs/block-scaling.md for the block-scaled ones): the
# scaling, and the formats (unset: the recipe's own; "block-hybrid" is BLOCK with E5M2 gradients).
_RECIPES = {"current": (module_pb2.CURRENT, module_pb2.FP8_FORMAT_UNSPECIFIED),
            "delayed": (module_pb2.DELAYED, module_pb2.FP8_FORMAT_UNSPECIFIED),
            "block": (module_pb2.BLOCK, module_pb2.FP8_FORMAT_UNSPECIFIED),
            "block-hybrid": (module_pb2.BLOCK, module_pb2.HYBRID),
            "mxfp8": (module_pb2.MXFP8, module_pb2.FP8_FORMAT_UNSPECIFIED)}


def _spec(kind: int, in_features: int, out_features: int, bias: bool, recipe: Optional[str],
          seed: int,
          name: str, max_staleness: int,
          optimizer: Optional[module_pb2.OptimizerConfig], labels: Optional[Dict[str, str]] = None,
          **extra) -> module_pb2.ModuleSpec:
    """The spec of a module of ``kind``; ``labels``: the class's argument names of spec fields,
    for its errors."""
    if recipe is not None and recipe not in _RECIPES:
        raise ValueError(
            "recipe must be 'current', 'delayed', 'block', 'block-hybrid', 'mxfp8' or None, "
            f"got {recipe!r}")
    sizes = {"in_features": in_features, "out_features": out_features}
    sizes.update({k: v for k, v in extra.items() if k.endswith("_features")})
    labels = labels or {}
    for key, value in sizes.items():
        arg = labels.get(key, key)
        # As nn.Linear's sizes: a whole number (8, not 8.0; not True), at least 1.
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{arg} must be an int, got {type(value).__name__} {value!r}")
        if value < 1:
            raise ValueError(f"{arg} must be at least 1, got {value}")
    for arg, value in (("bias", bias),):
        if not isinstance(value, bool):
            raise TypeError(f"{arg} must be a bool, got {type(value).__name__} {value!r}")
    spec = module_pb2.ModuleSpec(kind=kind, in_features=in_features, out_features=out_features,
                                 bias=bias, seed=seed, name=name, max_staleness=max_staleness,
                                 **extra)
    if recipe is not None:  # None: unset, the server's --default-recipe
        spec.recipe.scaling, spec.recipe.format = _RECIPES[recipe]
    if optimizer is not None:
        spec.optimizer.CopyFrom(optimizer)
    return spec


_COMMON_ARGS = """
        recipe: FP8 scaling, "current" (per tensor, per call), "delayed" (amax history),
            "block" (a power-of-two scale per 1x128 block, 128x128 for weights; E4M3
            throughout), "block-hybrid" (the same with E5M2 gradients) or "mxfp8" (per 32
            elements along each GEMM's reduction): with a block recipe one outlier
            costs only its own block. None (default): the server's ``--default-recipe``
            (block on a CPU server, current on a CUDA one); ``.spec.recipe`` says which.
        seed: seed of the deterministic initialisation (same seed, same weights everywhere).
        name: a label ListModules shows.
        optimizer: "local" (default: a torch optimizer over ``parameters()`` trains it; its
            gradients arrive in ``.grad``), or "sgd" / "adamw" (the server's optimizer, stepped
            by ``apply_gradients()`` or ``gradwire.ServerOptimizer``). See ``gradwire.optim``.
        lr, momentum, nesterov, weight_decay: the server optimizer's settings (SGD: all four;
            AdamW: lr and weight_decay).
        betas, eps: AdamW's.
        max_staleness: refuse a backward whose forward ran more than this many weight versions
            ago (0: weights must not change between a forward and its backward; -1: no limit).
        keep: leave the module on the server when this object or its client goes away (only
            ``delete()`` removes it).
        recompute_on_lost_context: keep each training forward's input on the host and run the
            forward again if the server lost its context before the backward.
        where: with a Cluster, the index of the server that holds the module (default:
            round-robin).
"""


class RemoteLinear(RemoteModule):
    _kind = module_pb2.LINEAR
    __doc__ = """FP8 ``y = x W^T + b`` on the server; parameters ``weight`` [out_features,
    in_features] and ``bias`` [out_features], as ``torch.nn.Linear``'s (so a state_dict loads
    into either).

    Args:
        client: a ``Client``, or a ``Cluster``.
        in_features, out_features: sizes of the input's and the output's last dimension.
        bias: whether there is a bias.""" + _COMMON_ARGS

    def __init__(self, client: Union[Client, Cluster], in_features: int, out_features: int,
                 bias: bool = True, *, recipe: Optional[str] = None, seed: int = 0, name: str = "",
                 optimizer: str = "local", lr: Optional[float] = None,
                 momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                 weight_decay: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 max_staleness: int = 0, keep: bool = False,
                 recompute_on_lost_context: bool = False, where: Optional[int] = None):
        config = optim.optimizer_config(optimizer, lr, momentum, nesterov, weight_decay, betas,
                                        eps)
        super().__init__(client, _spec(module_pb2.LINEAR, in_features, out_features, bias,
                                       recipe, seed, name, max_staleness, config),
                         optimizer=optimizer, keep=keep,
                         recompute_on_lost_context=recompute_on_lost_context, where=where)


class RemoteLayerNormLinear(RemoteModule):
    _kind = module_pb2.LAYERNORM_LINEAR
    __doc__ = """FP8 ``LayerNorm(x) W^T + b`` on the server; parameters ``layer_norm_weight``,
    ``layer_norm_bias`` [in_features], ``weight`` [out_features, in_features], ``bias``.

    Args:
        client: a ``Client``, or a ``Cluster``.
        in_features, out_features: sizes of the input's and the output's last dimension.
        bias: whether the Linear has a bias.
        layernorm_eps: the LayerNorm's epsilon.
        zero_centered_gamma: the LayerNorm scale is 1 + gamma, gamma starting at 0.""" + \
        _COMMON_ARGS

    def __init__(self, client: Union[Client, Cluster], in_features: int, out_features: int,
                 bias: bool = True, *, layernorm_eps: float = 1e-5,
                 zero_centered_gamma: bool = False, recipe: Optional[str] = None, seed: int = 0,
                 name: str = "", optimizer: str = "local", lr: Optional[float] = None,
                 momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                 weight_decay: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 max_staleness: int = 0, keep: bool = False,
                 recompute_on_lost_context: bool = False, where: Optional[int] = None):
        config = optim.optimizer_config(optimizer, lr, momentum, nesterov, weight_decay, betas,
                                        eps)
        super().__init__(client, _spec(module_pb2.LAYERNORM_LINEAR, in_features, out_features,
                                       bias, recipe, seed, name, max_staleness, config,
                                       layernorm_eps=layernorm_eps,
                                       zero_centered_gamma=zero_centered_gamma),
                         optimizer=optimizer, keep=keep,
                         recompute_on_lost_context=recompute_on_lost_context, where=where)


class RemoteLayerNormMLP(RemoteModule):
    _kind = module_pb2.LAYERNORM_MLP
    __doc__ = """FP8 ``FC2(act(FC1(LayerNorm(x))))`` on the server; parameters
    ``layer_norm_weight``, ``layer_norm_bias`` [hidden_size], ``fc1_weight`` [ffn_hidden_size
    (twice that for swiglu/geglu), hidden_size], ``fc1_bias``, ``fc2_weight`` [out_features,
    ffn_hidden_size], ``fc2_bias``.

    Args:
        client: a ``Client``, or a ``Cluster``.
        hidden_size: size of the input's last dimension.
        ffn_hidden_size: width of the hidden layer (the activation's output).
        out_features: size of the output's last dimension (default: hidden_size).
        bias: whether FC1 and FC2 have biases.
        activation: "gelu" (tanh approximation), "relu", "swiglu" or "geglu".
        checkpoint: save only the input in training forwards and recompute the rest in
            backward (less server memory per context, same results).
        layernorm_eps: the LayerNorm's epsilon.
        zero_centered_gamma: the LayerNorm scale is 1 + gamma, gamma starting at 0.""" + \
        _COMMON_ARGS

    def __init__(self, client: Union[Client, Cluster], hidden_size: int, ffn_hidden_size: int,
                 out_features: Optional[int] = None, bias: bool = True, *,
                 activation: str = "gelu", checkpoint: bool = False, layernorm_eps: float = 1e-5,
                 zero_centered_gamma: bool = False, recipe: Optional[str] = None, seed: int = 0,
                 name: str = "", optimizer: str = "local", lr: Optional[float] = None,
                 momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                 weight_decay: Optional[float] = None,
                 betas: Optional[Tuple[float, float]] = None, eps: Optional[float] = None,
                 max_staleness: int = 0, keep: bool = False,
                 recompute_on_lost_context: bool = False, where: Optional[int] = None):
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got "
                             f"{activation!r}")
        config = optim.optimizer_config(optimizer, lr, momentum, nesterov, weight_decay, betas,
                                        eps)
        super().__init__(client, _spec(module_pb2.LAYERNORM_MLP, hidden_size,
                                       out_features or hidden_size, bias, recipe, seed, name,
                                       max_staleness, config,
                                       labels={"in_features": "hidden_size",
                                               "ffn_features": "ffn_hidden_size"},
                                       ffn_features=ffn_hidden_size,
                                       activation=_ACTIVATIONS[activation],
                                       checkpoint=checkpoint, layernorm_eps=layernorm_eps,
                                       zero_centered_gamma=zero_centered_gamma),
                         optimizer=optimizer, keep=keep,
                         recompute_on_lost_context=recompute_on_lost_context, where=where)

    def _sizes(self) -> str:
        s = self.spec
        activation = _ACTIVATION_NAMES.get(s.activation, "gelu")
        return (f"hidden_size={s.in_features}, ffn_hidden_size={s.ffn_features}, "
                f"out_features={s.out_features}, bias={s.bias}, activation={activation}")
