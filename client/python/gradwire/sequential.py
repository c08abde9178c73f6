"""``RemoteSequential``: remote blocks chained one after another, possibly on several servers,
trained GPipe-style: the batch is split into micro-batches, all of them go forward through
every block, then all of them go backward in reverse.

Each micro-batch moves through the blocks as a chain of ``Train``-stream requests: as soon as its
output arrives from block i it is sent on to block i+1, while the other micro-batches are in
flight. Blocks on different servers therefore work on different micro-batches at once; blocks on
one server overlap the wire with the compute.
"""

from concurrent.futures import Future
from typing import List, Optional, Sequence

import torch

from gradwire.client import GradwireError
from gradwire.modules import RemoteModule, _Context


def _chain(steps, first_input) -> Future:
    """Runs ``steps`` (each: input -> Future of output) one after another on one micro-batch,
    without blocking; the returned future has the last output (or the first error)."""
    done: Future = Future()

    def run(i: int, value) -> None:
        if i == len(steps):
            done.set_result(value)
            return
        try:
            f = steps[i](value)
        except Exception as e:  # noqa: BLE001 - any failure ends this micro-batch
            done.set_exception(e)
            return

        def next_step(fut: Future) -> None:
            error = fut.exception()
            if error is not None:
                done.set_exception(error)
            else:
                run(i + 1, fut.result())

        f.add_done_callback(next_step)

    run(0, first_input)
    return done


class _PipelineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, anchor, seq):
        del anchor
        blocks = seq.blocks
        parts = list(torch.chunk(x.detach().to("cpu", torch.float32), seq.micro_batches))
        contexts: List[List[Optional[_Context]]] = [[None] * len(blocks) for _ in parts]

        def forward_step(m: int, b: int):
            block = blocks[b]

            def step(value):
                future = block.client.train_stream().forward(block.module_id, value, True)
                out: Future = Future()

                def got(f: Future) -> None:
                    if f.exception() is not None:
                        out.set_exception(f.exception())
                        return
                    y, context_id, _ = f.result()
                    contexts[m][b] = _Context(block, context_id)
                    out.set_result(y)

                future.add_done_callback(got)
                return out

            return step

        chains = [_chain([forward_step(m, b) for b in range(len(blocks))], part)
                  for m, part in enumerate(parts)]
        outputs = [c.result() for c in chains]  # any failure raises here
        ctx.contexts = contexts
        ctx.input_dtype, ctx.input_device = x.dtype, x.device
        return torch.cat(outputs).to(device=x.device, dtype=x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        contexts = ctx.contexts
        ctx.contexts = None
        parts = list(torch.chunk(grad_output.detach().to("cpu", torch.float32), len(contexts)))
        want_input = ctx.needs_input_grad[0]

        def backward_step(m: int, b: int, last: bool):
            def step(value):
                c = contexts[m][b]
                skip = last and not want_input
                future = c.client.train_stream().backward(c.context_id, value,
                                                          skip_grad_input=skip)
                out: Future = Future()

                def got(f: Future) -> None:
                    error = f.exception()
                    if error is not None:
                        out.set_exception(c.client.lost_context(error)
                                          if isinstance(error, GradwireError) else error)
                        return
                    c._finalizer.detach()  # consumed
                    out.set_result(f.result())

                future.add_done_callback(got)
                return out

            return step

        n = len(contexts[0])
        chains = [_chain([backward_step(m, b, b == 0) for b in reversed(range(n))], part)
                  for m, part in enumerate(parts)]
        grads = [c.result() for c in chains]
        if not want_input:
            return None, None, None
        grad = torch.cat(grads).to(device=ctx.input_device, dtype=ctx.input_dtype)
        return grad, None, None


class RemoteSequential(torch.nn.Module):
    """Remote blocks applied in order, trained with ``micro_batches`` micro-batches in flight
    (GPipe: forward all, then backward all in reverse). In eval mode, or without grad, it runs
    inference forwards one block after another.

    ``apply_gradients`` steps every block on its server."""

    def __init__(self, blocks: Sequence[RemoteModule], micro_batches: int = 4):
        super().__init__()
        if not blocks:
            raise ValueError("RemoteSequential needs at least one block")
        if micro_batches < 1:
            raise ValueError("micro_batches must be >= 1")
        self.blocks = torch.nn.ModuleList(blocks)
        self.micro_batches = micro_batches
        self._anchor = torch.nn.Parameter(torch.empty(0), requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            return _PipelineFunction.apply(x, self._anchor, self)
        for block in self.blocks:
            x = block(x)
        return x

    def apply_gradients(self, learning_rate: float = 0.0) -> List[int]:
        """One optimizer step on every block; returns their new weight versions."""
        return [b.apply_gradients(learning_rate) for b in self.blocks]
