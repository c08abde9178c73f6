"""``RemoteSequential``: modules applied one after another, like ``torch.nn.Sequential``, where
runs of consecutive remote blocks -- possibly on several servers -- train GPipe-style: the batch
is split into micro-batches, all of them go forward through every block of the run, then all
of them go backward in reverse.

Each micro-batch moves through a run as a chain of ``Train``-stream requests: as soon as its
output arrives from block i it is sent on to block i+1, while the other micro-batches are in
flight. Blocks on different servers therefore work on different micro-batches at once; blocks on
one server overlap the wire with the compute.

Local modules (``nn.ReLU``, ``nn.Linear``, ``nn.Dropout``, a ``BatchNorm``...) may sit between
remote blocks: each sees the whole batch at once, as in ``nn.Sequential`` (so its statistics are
those of the batch, not of a micro-batch), and ends the run before it. Children are named "0",
"1", ... (or by an ``OrderedDict``'s keys) as in ``nn.Sequential``, so ``state_dict()`` keys
match a local model of the same layout (a ``RemoteLinear``'s keys are ``nn.Linear``'s); ``load_state_dict()`` pushes the
remote blocks' weights to their servers.

``recompute_on_lost_context`` is honoured per block and micro-batch: such a block keeps the
input of each micro-batch, and a backward whose context the server lost runs that forward again.
"""

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from typing import Iterator, List, Optional, Tuple, Union

import torch

from gradwire.client import GradwireError
from gradwire.modules import (Context, GraphProbe, RemoteModule, _autocast, check_input,
                              clean_gradient, nonfinite_rows, poison_rows, probed,
                              second_backward_error, second_order_guard, submit_forward, then)


class _Chain:
    """Runs ``steps`` (each: input -> Future of output) one after another on one micro-batch,
    without blocking; ``done`` has the last output (or the first error). A class, not a
    closure that calls itself: such a closure is a reference cycle, and through the steps it
    would hold the micro-batch's contexts until Python's cyclic garbage collector ran."""

    def __init__(self, steps, first_input):
        self.steps = steps
        self.done: Future = Future()
        try:
            self._run(0, first_input)
        except Exception as e:  # noqa: BLE001 - a step that fails to start ends this micro-batch
            if not self.done.done():
                self.done.set_exception(e)

    def _run(self, i: int, value) -> None:
        if i == len(self.steps):
            self.done.set_result(value)
            return
        then(self.steps[i](value), self.done, lambda f: self._run(i + 1, f.result()))


def _chain(steps, first_input) -> Future:
    """The future of ``steps`` run one after another on ``first_input`` (see _Chain)."""
    return _Chain(steps, first_input).done


def _check_block(name: str, block) -> None:
    if not isinstance(block, torch.nn.Module):
        raise TypeError(f"block {name} is a {type(block).__name__}, not a torch.nn.Module")


def _check_widths(named: List[Tuple[str, RemoteModule]], x: torch.Tensor) -> None:
    """Refuses, before anything is sent, an input whose last dimension is not what a block of
    the run takes: the server would see a micro-batch, and name its shape, not the one the
    caller passed. The error is the one the server gives a single module's forward."""
    width = x.shape[-1] if x.dim() else None
    for name, block in named:
        want = block.spec.in_features
        if width != want:
            shape = list(x.shape[:-1]) + [width] if width is not None else []
            raise GradwireError(
                "Forward", "INVALID_ARGUMENT",
                f"{block._label()} (RemoteSequential block {name}): input.shape must be "
                f"[..., {want}] (the module's in_features), got {shape}")
        width = block.spec.out_features


class _PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probe, blocks, micro_batches, *anchors):
        parts = list(torch.chunk(x.detach().to("cpu", torch.float32),
                                 micro_batches if x.dim() > 1 else 1))
        contexts: List[List[Optional[Context]]] = [[None] * len(blocks) for _ in parts]
        dtypes = [b.client.wire_dtypes_for(x.dtype) for b in blocks]

        def forward_step(m: int, b: int):
            block = blocks[b]
            activation_dtype, gradient_dtype = dtypes[b]

            def step(value):
                out: Future = Future()
                saved = value.clone() if block.recompute_on_lost_context else None
                future = submit_forward(block.client, block.module_id, value, activation_dtype)

                def got(f: Future) -> None:
                    y, context_id, _ = f.result()
                    contexts[m][b] = Context(block, context_id, activation_dtype,
                                             gradient_dtype, saved)
                    out.set_result(y)

                then(future, out, got)
                return out

            return step

        chains = [_chain([forward_step(m, b) for b in range(len(blocks))], part)
                  for m, part in enumerate(parts)]
        outputs = [c.result() for c in chains]  # any failure raises here
        ctx.contexts, ctx.blocks, ctx.probe = contexts, blocks, probe
        ctx.counts = [len(b._anchors()) for b in blocks]
        ctx.anchor_nodes, at = [], 0
        for count in ctx.counts:
            ctx.anchor_nodes.append([a.grad_fn for a in anchors[at:at + count]])
            at += count
        ctx.input_dtype, ctx.input_device = x.dtype, x.device
        return torch.cat(outputs).to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        with torch.no_grad():
            grads = _PipelineFunction._backward(ctx, grad_output.detach())
        anchors = [p for block in ctx.blocks if block.local_optimizer for _, p in block._items()]
        return second_order_guard("a RemoteSequential run of remote blocks (" + ", ".join(
            b._label() for b in ctx.blocks) + ")", grads, (grad_output, *anchors))

    @staticmethod
    def _backward(ctx, grad_output):
        contexts = ctx.contexts
        if contexts is None:
            raise second_backward_error("a RemoteSequential run of remote blocks")
        retain = ctx.probe.keep_graph()
        grad_output, bad = clean_gradient(grad_output.detach())
        parts = list(torch.chunk(grad_output.to("cpu", torch.float32), len(contexts)))
        want_input = ctx.needs_input_grad[0]

        def backward_step(m: int, b: int):
            def step(value):
                skip = b == 0 and not want_input
                return contexts[m][b].backward_async(value, skip, retain)

            return step

        n = len(ctx.blocks)
        # Server-optimizer blocks whose weight gradients autograd does not ask for (see
        # _RemoteFunction): dropped after the backward.
        drop = [not b.local_optimizer and not b._weights_wanted(nodes)
                for b, nodes in zip(ctx.blocks, ctx.anchor_nodes)]
        for block, dropped in zip(ctx.blocks, drop):
            block._settle_interrupted()
            if dropped:
                block._check_droppable()
            else:
                block._backwards_since_step += 1
        chains = [_chain([backward_step(m, b) for b in reversed(range(n))], part)
                  for m, part in enumerate(parts)]
        try:
            grads = [c.result() for c in chains]
        except BaseException:
            # Interrupted: the pending chains go on on the servers (see wait_backward).
            pending = [c for c in chains if not c.done()]
            for block in ctx.blocks if pending else ():
                block._interrupted.extend(pending)
            raise
        for block, dropped in zip(ctx.blocks, drop):
            if dropped:
                block._drop_server_gradients()
        if not retain:
            ctx.contexts = None
        grad = None
        if want_input:
            grad = poison_rows(torch.cat(grads), bad).to(device=ctx.input_device,
                                                         dtype=ctx.input_dtype)
        needed = ctx.needs_input_grad[4:]
        param_grads, at = [], 0
        for block, count, dropped in zip(ctx.blocks, ctx.counts, drop):
            grads_here = block._gradients_for_autograd(needed[at:at + count])
            if bad is not None:  # non-finite, as a local layer's would be (see clean_gradient)
                grads_here = [g.fill_(float("nan")) if g is not None else None
                              for g in grads_here]
                if not block.local_optimizer and not dropped:
                    block._nonfinite_gradients = True
            param_grads += grads_here
            at += count
        return (grad, None, None, None, *param_grads)


class RemoteSequential(torch.nn.Module):
    """Modules applied in order, as ``torch.nn.Sequential``; runs of consecutive remote blocks
    train with ``micro_batches`` micro-batches in flight (GPipe: forward all, then backward all
    in reverse). In eval mode, or without grad, every module runs one after another.

    Built as ``nn.Sequential`` is -- ``RemoteSequential(a, b, c)``, or from an ``OrderedDict``
    of name -> module (the names are the children's) -- or from one list of modules. It is
    edited as ``nn.Sequential`` is too: ``seq[i]`` (negative too), ``seq[1:]`` (a
    RemoteSequential of the same modules and ``micro_batches``), ``seq[i] = module``, ``del
    seq[i]`` / ``del seq[a:b]``, ``append``, ``extend``, ``insert``, ``pop``, ``len``,
    iteration. As in ``nn.Sequential``, deleting, inserting or popping renames the children
    "0", "1", ... in their new order. Editing changes the structure only: nothing is created or
    deleted on a server.

    Args:
        *blocks: the modules -- remote blocks (``RemoteLinear``, ``RemoteLayerNormLinear``,
            ``RemoteLayerNormMLP``, on one server or several) and local ``nn.Module``s -- in
            order; or one ``OrderedDict`` of them by name; or one list of them.
        micro_batches: how many pieces a batch is split into along its first dimension for
            the remote runs (keyword only).
    """

    def __init__(self, *blocks, micro_batches: int = 4):
        super().__init__()
        if len(blocks) == 1 and isinstance(blocks[0], Mapping):
            named = list(blocks[0].items())
        else:
            if len(blocks) == 1 and not isinstance(blocks[0], torch.nn.Module) and \
                    isinstance(blocks[0], Iterable):
                blocks = tuple(blocks[0])  # the list form
            named = [(str(i), block) for i, block in enumerate(blocks)]
        for name, block in named:
            _check_block(name, block)
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise TypeError(f"micro_batches must be an int, got {type(micro_batches).__name__}")
        if micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")
        for name, block in named:
            self.add_module(name, block)
        self.micro_batches = micro_batches

    @property
    def blocks(self) -> List[torch.nn.Module]:
        """The modules, in order."""
        return list(self._modules.values())

    @property
    def remote_blocks(self) -> List[RemoteModule]:
        """The remote modules among the blocks, in order."""
        return [b for b in self._modules.values() if isinstance(b, RemoteModule)]

    # --- nn.Sequential's container methods

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def _key(self, index: int) -> str:
        """The child name at ``index`` (negative counts from the end), or IndexError."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"RemoteSequential indices must be integers or slices, not "
                            f"{type(index).__name__}")
        n = len(self._modules)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a RemoteSequential of {n} "
                             "modules")
        return list(self._modules)[index % n]

    def __getitem__(self, index: Union[int, slice]):
        if isinstance(index, slice):
            return type(self)(OrderedDict(list(self._modules.items())[index]),
                              micro_batches=self.micro_batches)
        return self._modules[self._key(index)]

    def __setitem__(self, index: int, module: torch.nn.Module) -> None:
        key = self._key(index)
        _check_block(key, module)
        self._modules[key] = module

    def __delitem__(self, index: Union[int, slice]) -> None:
        keys = list(self._modules)[index] if isinstance(index, slice) else [self._key(index)]
        for key in keys:
            del self._modules[key]
        self._renumber()

    def _renumber(self) -> None:
        self._modules = OrderedDict((str(i), m) for i, m in enumerate(self._modules.values()))

    def append(self, module: torch.nn.Module) -> "RemoteSequential":
        """Adds ``module`` at the end; returns self."""
        _check_block(str(len(self._modules)), module)
        self.add_module(str(len(self._modules)), module)
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> "RemoteSequential":
        """Adds ``modules`` at the end, in order; returns self."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: torch.nn.Module) -> "RemoteSequential":
        """Puts ``module`` before position ``index`` (``len(self)``: at the end; negative
        counts from the end); returns self."""
        n = len(self._modules)
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, got {type(index).__name__}")
        if not -n <= index <= n:
            raise IndexError(f"index {index} is out of range for inserting into a "
                             f"RemoteSequential of {n} modules")
        _check_block(str(index), module)
        modules = list(self._modules.values())
        modules.insert(index, module)
        self._modules = OrderedDict((str(i), m) for i, m in enumerate(modules))
        return self

    def pop(self, index: int = -1) -> torch.nn.Module:
        """Removes the module at ``index`` (default: the last) and returns it."""
        module = self[index]
        del self[index]
        return module

    def extra_repr(self) -> str:
        return f"micro_batches={self.micro_batches}"

    # --- the forward

    def _runs(self) -> List[Tuple[bool, List[Tuple[str, torch.nn.Module]]]]:
        """(remote?, [(name, module)...]) for each maximal run of remote or of local
        modules."""
        runs: List[Tuple[bool, List[Tuple[str, torch.nn.Module]]]] = []
        for name, block in self._modules.items():
            remote = isinstance(block, RemoteModule)
            if runs and runs[-1][0] == remote:
                runs[-1][1].append((name, block))
            else:
                runs.append((remote, [(name, block)]))
        return runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The modules on ``x`` in order; the output has ``x``'s dtype and device when the last
        module is remote (a local one decides its own)."""
        if not (self.training and torch.is_grad_enabled()):
            for block in self._modules.values():
                x = block(x)
            return x
        for remote, named in self._runs():
            if not remote:
                for _, block in named:
                    x = block(x)
            else:
                x = self._pipeline(named, x)
        return x

    def _pipeline(self, named: List[Tuple[str, RemoteModule]], x: torch.Tensor) -> torch.Tensor:
        blocks = [block for _, block in named]
        label = f"RemoteSequential run of {len(blocks)} remote blocks"
        for block in blocks:
            block._check_alive()
        if torch.jit.is_tracing():
            raise RuntimeError(f"{blocks[0]._label()} cannot be traced: its forward is a call "
                               "to gradwire-server, which a TorchScript graph cannot record")
        check_input(label, x)
        x = _autocast(x)
        # A block on given weights (functional_call, a parametrization), or an input with NaN or
        # infinite values, takes the blocks' own forwards, which handle them.
        if not any(b._trains(x) for b in blocks) or nonfinite_rows(x) is not None or \
                any(b._given_weights() is not None for b in blocks):
            for block in blocks:
                x = block(x)
            return x
        _check_widths(named, x)
        for block in blocks:
            with block._calls():
                block._before_forward(training=True)
        probe = GraphProbe()
        anchors = [a for b in blocks for a in b._anchors()]
        try:
            y = _PipelineFunction.apply(x, probe, tuple(blocks), self.micro_batches, *anchors)
        except GradwireError as e:
            # The server names the module it does not know: say why, if it restarted.
            block = next((b for b in blocks if b.module_id in e.message), None)
            explained = e if block is None else block._explained(e)
            if explained is e:
                raise
            raise explained from None
        y = probed(y, probe)
        for block in blocks:
            with block._calls():
                block._after_forward()
        return y

    def apply_gradients(self, lr: Optional[float] = None) -> List[int]:
        """One server optimizer step of every remote block; returns their new weight versions.
        Refused if a remote block has ``optimizer="local"`` (see ``RemoteModule``)."""
        return [b.apply_gradients(lr) for b in self.remote_blocks]

    def delete(self) -> None:
        """Deletes every remote block on its server now."""
        for block in self.remote_blocks:
            block.delete()

    def __enter__(self) -> "RemoteSequential":
        return self

    def __exit__(self, *exc) -> None:
        for block in self.remote_blocks:
            if block.owned:
                block.delete()

    def __prepare_scriptable__(self):
        raise RuntimeError("a RemoteSequential with remote blocks cannot be scripted: their "
                           "forward is a call to gradwire-server")

