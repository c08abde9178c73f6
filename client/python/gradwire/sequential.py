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
"1", ... as in ``nn.Sequential``, so ``state_dict()`` keys match a local model of the same
layout (a ``RemoteLinear``'s keys are ``nn.Linear``'s); ``load_state_dict()`` pushes the
remote blocks' weights to their servers.

``recompute_on_lost_context`` is honoured per block and micro-batch: such a block keeps the
input of each micro-batch, and a backward whose context the server lost runs that forward again.
"""

from concurrent.futures import Future
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch.autograd.function import once_differentiable

from gradwire.modules import (Context, GraphProbe, RemoteModule, _autocast, check_input, probed,
                              second_backward_error, submit_forward, then)


def _chain(steps, first_input) -> Future:
    """Runs ``steps`` (each: input -> Future of output) one after another on one micro-batch,
    without blocking; the returned future has the last output (or the first error)."""
    done: Future = Future()

    def run(i: int, value) -> None:
        if i == len(steps):
            done.set_result(value)
            return
        then(steps[i](value), done, lambda f: run(i + 1, f.result()))

    try:
        run(0, first_input)
    except Exception as e:  # noqa: BLE001 - a step that fails to start ends this micro-batch
        if not done.done():
            done.set_exception(e)
    return done


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
        ctx.input_dtype, ctx.input_device = x.dtype, x.device
        return torch.cat(outputs).to(device=x.device, dtype=x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        contexts = ctx.contexts
        if contexts is None:
            raise second_backward_error("a RemoteSequential run of remote blocks")
        retain = ctx.probe.keep_graph()
        parts = list(torch.chunk(grad_output.detach().to("cpu", torch.float32), len(contexts)))
        want_input = ctx.needs_input_grad[0]

        def backward_step(m: int, b: int):
            def step(value):
                skip = b == 0 and not want_input
                return contexts[m][b].backward_async(value, skip, retain)

            return step

        n = len(ctx.blocks)
        chains = [_chain([backward_step(m, b) for b in reversed(range(n))], part)
                  for m, part in enumerate(parts)]
        grads = [c.result() for c in chains]
        if not retain:
            ctx.contexts = None
        grad = None
        if want_input:
            grad = torch.cat(grads).to(device=ctx.input_device, dtype=ctx.input_dtype)
        needed = ctx.needs_input_grad[4:]
        param_grads, at = [], 0
        for block, count in zip(ctx.blocks, ctx.counts):
            param_grads += block._gradients_for_autograd(needed[at:at + count])
            at += count
        return (grad, None, None, None, *param_grads)


class RemoteSequential(torch.nn.Module):
    """Modules applied in order, as ``torch.nn.Sequential``; runs of consecutive remote blocks
    train with ``micro_batches`` micro-batches in flight (GPipe: forward all, then backward all
    in reverse). In eval mode, or without grad, every module runs one after another.

    Args:
        blocks: the modules: remote blocks (``RemoteLinear``, ``RemoteLayerNormLinear``,
            ``RemoteLayerNormMLP``, on one server or several) and local ``nn.Module``s, in
            order.
        micro_batches: how many pieces a batch is split into along its first dimension for
            the remote runs.
    """

    def __init__(self, blocks: Sequence[torch.nn.Module], micro_batches: int = 4):
        super().__init__()
        blocks = list(blocks)
        if not blocks:
            raise ValueError("RemoteSequential needs at least one block")
        for i, block in enumerate(blocks):
            if not isinstance(block, torch.nn.Module):
                raise TypeError(f"block {i} is a {type(block).__name__}, not a torch.nn.Module")
        if micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")
        for i, block in enumerate(blocks):
            self.add_module(str(i), block)
        self.micro_batches = micro_batches

    @property
    def blocks(self) -> List[torch.nn.Module]:
        """The modules, in order."""
        return list(self._modules.values())

    @property
    def remote_blocks(self) -> List[RemoteModule]:
        """The remote modules among the blocks, in order."""
        return [b for b in self._modules.values() if isinstance(b, RemoteModule)]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> torch.nn.Module:
        return self.blocks[index]

    def extra_repr(self) -> str:
        return f"micro_batches={self.micro_batches}"

    def _runs(self) -> List[Tuple[bool, List[torch.nn.Module]]]:
        """(remote?, modules) for each maximal run of remote or of local modules."""
        runs: List[Tuple[bool, List[torch.nn.Module]]] = []
        for block in self._modules.values():
            remote = isinstance(block, RemoteModule)
            if runs and runs[-1][0] == remote:
                runs[-1][1].append(block)
            else:
                runs.append((remote, [block]))
        return runs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The modules on ``x`` in order; the output has ``x``'s dtype and device when the last
        module is remote (a local one decides its own)."""
        if not (self.training and torch.is_grad_enabled()):
            for block in self._modules.values():
                x = block(x)
            return x
        for remote, modules in self._runs():
            if not remote:
                for block in modules:
                    x = block(x)
            else:
                x = self._pipeline(modules, x)
        return x

    def _pipeline(self, blocks: List[RemoteModule], x: torch.Tensor) -> torch.Tensor:
        label = f"RemoteSequential run of {len(blocks)} remote blocks"
        for block in blocks:
            block._check_alive()
        if torch.jit.is_tracing():
            raise RuntimeError(f"{blocks[0]._label()} cannot be traced: its forward is a call "
                               "to gradwire-server, which a TorchScript graph cannot record")
        check_input(label, x)
        x = _autocast(x)
        if not any(b._trains(x) for b in blocks):
            for block in blocks:
                x = block(x)
            return x
        for block in blocks:
            block._before_forward(training=True)
        probe = GraphProbe()
        anchors = [a for b in blocks for a in b._anchors()]
        y = _PipelineFunction.apply(x, probe, tuple(blocks), self.micro_batches, *anchors)
        y = probed(y, probe)
        for block in blocks:
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

