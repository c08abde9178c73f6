"""Where a remote module's optimizer runs, and the server optimizers from keyword arguments.

Every remote module picks one place for its weight gradients, with ``optimizer=``:

- ``"local"`` (the default): a torch optimizer on this machine. After each backward through
  the module, the gradients the server accumulated are read with ``GetGradients`` (and zeroed
  there) and handed to autograd as the gradients of the module's parameters, so ``.grad``
  accumulates, ``zero_grad()``, ``clip_grad_norm_``, gradient hooks and every
  ``torch.optim`` optimizer behave as for a local layer. ``step()`` changes the local copy in
  place; that change is sent to the server with ``SetWeights`` before the module's next use
  (forward, ``get_weights``, ``state_dict`` export) or at once by ``module.push()``. The cost
  per step is one gradient and one weight transfer per module.

- ``"sgd"`` or ``"adamw"``: the server's optimizer, configured here (``lr``, ``momentum``,
  ``nesterov``, ``weight_decay``; ``betas``, ``eps``), stepped by ``module.apply_gradients()``
  or by a ``ServerOptimizer``, which LR schedulers drive. Gradients and weights then never
  cross the wire. The module's parameters are a mirror whose ``.grad`` stays None: a local
  optimizer leaves them alone, as it does any parameter without a gradient, and
  ``apply_gradients()`` on a ``"local"`` module is refused (its gradients are in ``.grad``).
  Reading them through ``parameters()`` after a step pulls the new values.
  ``requires_grad_(False)`` freezes such a module (all its parameters, or none): no weight
  gradient, and ``ServerOptimizer.step()`` leaves it alone. A backward that asks for no weight
  gradient (``torch.autograd.grad(loss, x)``) leaves none for the next step; while gradients
  for the next step are accumulated it is refused. ``torch.nn.utils.clip_grad_norm_`` and
  ``clip_grad_value_`` over these parameters raise: their gradients stay on the server, which
  does not clip; clip the local parameters alone, or use ``"local"`` to clip.

The server's SGD and AdamW follow ``torch.optim.SGD`` and ``torch.optim.AdamW`` step for step
(``tests/test_optimizers.py`` checks one step of each against torch).
"""

import math
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from gradwire.v1 import module_pb2

OPTIMIZERS = ("local", "sgd", "adamw")

# The wire reads 0 as "the configured rate" (ApplyGradientsRequest.learning_rate): a rate a
# scheduler brings down to 0 travels as the smallest positive float32 instead, which moves no
# weight by a representable amount yet still updates the optimizer's moments, as torch does.
_SMALLEST_RATE = 1.4e-45


def optimizer_config(optimizer: str = "local", lr: Optional[float] = None,
                     momentum: Optional[float] = None, nesterov: Optional[bool] = None,
                     weight_decay: Optional[float] = None,
                     betas: Optional[Tuple[float, float]] = None,
                     eps: Optional[float] = None) -> Optional[module_pb2.OptimizerConfig]:
    """The ``OptimizerConfig`` of a server optimizer, or None for ``optimizer="local"``.

    Args:
        optimizer: "local", "sgd" or "adamw".
        lr: learning rate (default 0.01 for SGD, 0.001 for AdamW).
        momentum: SGD momentum in [0, 1) (default 0).
        nesterov: SGD Nesterov momentum (needs momentum > 0; default False).
        weight_decay: SGD's L2 term added to the gradient (default 0), or AdamW's decoupled
            decay (default 0.01, as torch.optim.AdamW).
        betas: AdamW's (beta1, beta2), each in (0, 1) (default (0.9, 0.999)).
        eps: AdamW's epsilon, > 0 (default 1e-8).

    Raises ValueError for an unknown optimizer, a value out of range, or a setting that
    belongs to another optimizer (a local optimizer takes its settings from torch.optim).
    """
    given = {k: v for k, v in dict(lr=lr, momentum=momentum, nesterov=nesterov,
                                   weight_decay=weight_decay, betas=betas, eps=eps).items()
             if v is not None}
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "local":
        if given:
            raise ValueError(
                f"{', '.join(given)} configure a server optimizer; with optimizer='local' the "
                "torch optimizer you build takes them (or pass optimizer='sgd' or 'adamw')")
        return None
    foreign = set(given) & ({"betas", "eps"} if optimizer == "sgd" else {"momentum", "nesterov"})
    if foreign:
        raise ValueError(f"{', '.join(sorted(foreign))} do not apply to optimizer={optimizer!r}")
    config = module_pb2.OptimizerConfig()
    if optimizer == "sgd":
        lr = 0.01 if lr is None else lr
        momentum = 0.0 if momentum is None else momentum
        weight_decay = 0.0 if weight_decay is None else weight_decay
        _check(lr > 0 and math.isfinite(lr), f"lr must be > 0, got {lr}")
        _check(0 <= momentum < 1, f"momentum must be in [0, 1), got {momentum}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        _check(not nesterov or momentum > 0, "nesterov needs momentum > 0")
        config.sgd.learning_rate = lr
        config.sgd.momentum = momentum
        config.sgd.weight_decay = weight_decay
        config.sgd.nesterov = bool(nesterov)
    else:
        lr = 1e-3 if lr is None else lr
        beta1, beta2 = (0.9, 0.999) if betas is None else betas
        eps = 1e-8 if eps is None else eps
        weight_decay = 0.01 if weight_decay is None else weight_decay
        _check(lr > 0 and math.isfinite(lr), f"lr must be > 0, got {lr}")
        # 0 on the wire means "the default", so a beta of exactly 0 cannot be asked for.
        _check(0 < beta1 < 1 and 0 < beta2 < 1, f"betas must be in (0, 1), got {betas}")
        _check(eps > 0, f"eps must be > 0, got {eps}")
        _check(weight_decay >= 0, f"weight_decay must be >= 0, got {weight_decay}")
        config.adamw.learning_rate = lr
        config.adamw.beta1, config.adamw.beta2 = beta1, beta2
        config.adamw.eps = eps
        config.adamw.weight_decay = weight_decay
    return config


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def describe(config: Optional[module_pb2.OptimizerConfig]) -> str:
    """A short text of an optimizer config, for repr: "local", "sgd(lr=0.01, momentum=0.9)"."""
    if config is None:
        return "local"
    if config.HasField("adamw"):
        a = config.adamw
        return (f"adamw(lr={a.learning_rate:.4g}, betas=({a.beta1 or 0.9:.4g}, "
                f"{a.beta2 or 0.999:.4g}), weight_decay={a.weight_decay:.4g})")
    g = config.sgd
    text = f"sgd(lr={g.learning_rate or 0.01:.4g}"
    if g.momentum:
        text += f", momentum={g.momentum:.4g}" + (", nesterov" if g.nesterov else "")
    if g.weight_decay:
        text += f", weight_decay={g.weight_decay:.4g}"
    return text + ")"


def configured_lr(config: module_pb2.OptimizerConfig) -> float:
    """The learning rate a server optimizer config sets."""
    if config.HasField("adamw"):
        return float(config.adamw.learning_rate)
    return float(config.sgd.learning_rate or 0.01)


def wire_rate(lr: Optional[float]) -> float:
    """ApplyGradientsRequest.learning_rate for a step at ``lr`` (None: the configured one)."""
    if lr is None:
        return 0.0
    if not (lr >= 0 and math.isfinite(lr)):
        raise ValueError(f"learning rate must be finite and >= 0, got {lr}")
    return lr if lr > 0 else _SMALLEST_RATE


class ServerOptimizer(torch.optim.Optimizer):
    """Steps remote modules with their server optimizers, as a ``torch.optim.Optimizer``, so
    that ``torch.optim.lr_scheduler`` schedulers drive their learning rates.

    One parameter group per module, with the module's configured ``lr``; ``step()`` runs
    ``apply_gradients(lr=group["lr"])`` on each, and ``zero_grad()`` zeroes the gradients the
    server accumulated (only where a backward ran since the last step). Momentum and Adam
    moments stay on the server; ``state_dict()`` holds the learning rates.

    Args:
        modules: a model (every remote module in it with a server optimizer is taken; modules
            with ``optimizer="local"`` are left to your torch optimizer), or remote modules.

    ::

        opt = gradwire.ServerOptimizer(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
        for x, y in data:
            loss_fn(model(x), y).backward()
            opt.step(); opt.zero_grad(); sched.step()
    """

    def __init__(self, modules: Union[torch.nn.Module, Iterable[torch.nn.Module]]):
        from gradwire.modules import RemoteModule
        if isinstance(modules, torch.nn.Module):
            found = [m for m in modules.modules()
                     if isinstance(m, RemoteModule) and not m.local_optimizer]
        else:
            found = list(modules)
            for m in found:
                if not isinstance(m, RemoteModule):
                    raise TypeError(f"ServerOptimizer takes remote modules, got {type(m)}")
                if m.local_optimizer:
                    raise ValueError(f"{m._label()} has optimizer='local': train it with a "
                                     "torch optimizer over its parameters")
        if not found:
            raise ValueError("no remote module with a server optimizer (optimizer='sgd' or "
                             "'adamw') to step")
        self.remote_modules: List[RemoteModule] = found
        groups = [{"params": list(m.parameters()), "lr": m.configured_lr,
                   "module_id": m.module_id} for m in found]
        super().__init__(groups, {"lr": groups[0]["lr"]})

    @torch.no_grad()
    def step(self, closure=None):
        """One server optimizer step of every module at its group's current ``lr``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for module, group in zip(self.remote_modules, self.param_groups):
            # A frozen module (requires_grad_(False)) is left alone, as a torch optimizer
            # leaves a parameter without a gradient: no weight decay, no momentum.
            if any(p.requires_grad for p in module._parameters.values()):
                module.apply_gradients(lr=group["lr"])
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zeroes the gradients the server accumulated since the last step."""
        for module in self.remote_modules:
            module.zero_server_gradients()


def remote_modules(model: torch.nn.Module) -> Sequence[torch.nn.Module]:
    """Every remote module in ``model`` (itself included), in ``model.modules()`` order."""
    from gradwire.modules import RemoteModule
    return [m for m in model.modules() if isinstance(m, RemoteModule)]


def pull(model: torch.nn.Module) -> Dict[str, int]:
    """Copies the server's weights into every remote module of ``model`` now, discarding local
    changes not pushed yet (``RemoteModule.pull``); returns module id -> weight version."""
    return {m.module_id: m.pull() for m in remote_modules(model)}


def push(model: torch.nn.Module) -> Dict[str, int]:
    """Sends the local changes of every remote module in ``model`` to its server now
    (``RemoteModule.push``); returns module id -> weight version."""
    return {m.module_id: m.push() for m in remote_modules(model)}
