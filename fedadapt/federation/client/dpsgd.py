"""DP-SGD on one client's trained tensors (``dp=dpsgd``), by Opacus.

Each step takes each of the client's examples with probability q (Poisson sampling, what
Opacus's accountants assume; :func:`fedadapt.strategies.privacy.dpsgd_schedule`), Opacus's
``GradSampleModule`` computes every example's gradient of the trained tensors (the frozen backbone
has none), and Opacus's ``DPOptimizer`` clips each to ``max_grad_norm``, sums them, adds Gaussian
noise of std ``noise * max_grad_norm`` and divides by the expected batch size n q before the
run's optimizer steps. Per-sample gradients need one client's model: DP-SGD clients train one at
a time (:func:`fedadapt.federation.client.worker.train_groups`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fedadapt.config import ConfigError
from fedadapt.strategies.privacy import dpsgd_schedule

#: The seed streams of a DP-SGD client's batches and noise (beside its own seed).
BATCH_STREAM, NOISE_STREAM = 0xD95, 0xD96


@dataclass(frozen=True)
class PrivateSteps:
    """One client's DP-SGD in one round: its noise multiplier and the clipping norm."""

    noise: float
    max_grad_norm: float


def refuse_untrainable(model, method: str) -> None:
    """Refuse, in one line, a trained module Opacus cannot train privately (BatchNorm: each
    example's output depends on the others in its batch), named with Opacus's reason."""
    from opacus.utils.module_utils import trainable_modules
    from opacus.validators import ModuleValidator

    for name, module in trainable_modules(model):
        check = ModuleValidator.VALIDATORS.get(type(module))
        errors = check(module) if check is not None else []
        if errors:
            why = str(errors[0]).split(". ")[0]
            raise ConfigError(f"dp=dpsgd is invalid for method={method}: its trained module "
                              f"{name} ({type(module).__name__}): {why}")


def probe(model, source, indices: np.ndarray, method: str) -> None:
    """One forward and backward of two of ``indices`` under Opacus's hooks, no step taken: a
    model whose trained tensors Opacus gives no per-sample gradient (a module it has no rule
    for and cannot differentiate per example) is refused in one line before any round."""
    params = [p for p in model.parameters() if p.requires_grad]
    was = model.training
    model.train()
    opt = PrivateOptimizer(model, params, torch.optim.SGD(params, lr=0.0),
                           PrivateSteps(0.0, 1.0), 2, 2, 0)
    try:
        x, y = next(iter(source.stream([np.asarray(indices)[:2]], params[0].device)))
        model.training_loss(x, y).backward()
        missing = [n for n, p in model.named_parameters()
                   if p.requires_grad and getattr(p, "grad_sample", None) is None]
        if missing:
            raise ValueError(f"none for {missing[0]}")
    except Exception as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"dp=dpsgd is invalid for method={method}: Opacus computes no "
                          f"per-sample gradient of its trained tensors ({why})") from err
    finally:
        opt.close()
        for p in params:
            p.grad = None
        model.train(was)


def poisson_batches(indices: np.ndarray, batch_size: int, epochs: int, seed: int
                    ) -> list[np.ndarray]:
    """The round's batches: each of ``indices`` in each step with probability q, over the steps
    of :func:`dpsgd_schedule` (a batch may be empty), drawn from ``seed``."""
    indices = np.asarray(indices)
    q, steps = dpsgd_schedule(len(indices), batch_size, epochs)
    gen = torch.Generator().manual_seed(seed)
    return [indices[(torch.rand(len(indices), generator=gen) < q).numpy()]
            for _ in range(steps)]


class PrivateOptimizer:
    """The run's optimizer behind Opacus's ``DPOptimizer``, the model's trained modules hooked
    by Opacus's ``GradSampleModule`` until :meth:`close`; the noise drawn from ``seed``.
    ``step(extra)`` adds ``extra``'s
    gradients (FedProx's proximal term: no example's data in it) after the noise."""

    def __init__(self, model, params: list, optimizer, steps: PrivateSteps, examples: int,
                 batch_size: int, seed: int) -> None:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        while _OPEN:  # a client that raised mid-round left its hooks on the process's model
            _OPEN.pop().close()
        _OPEN.append(self)
        from opacus.utils.module_utils import trainable_modules

        dev = params[0].device
        self.params = params
        # Opacus records a module's inputs only in training mode; a frozen backbone is held in
        # eval mode with the trained modules inside it (LoRA's factors): those alone train here
        # (their own computation is the same in both modes; dropout modules stay as they are)
        self.held = [m for _, m in trainable_modules(model) if not m.training]
        for m in self.held:
            m.training = True
        self.hooks = GradSampleModule(model, batch_first=True, loss_reduction="mean",
                                      strict=True)
        # a trained module behind the frozen backbone gets no input gradient; torch warns that
        # its full backward hook fires on the output gradient, which is what Opacus reads
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        self.opt = DPOptimizer(optimizer, noise_multiplier=steps.noise,
                               max_grad_norm=steps.max_grad_norm,
                               expected_batch_size=examples * dpsgd_schedule(
                                   examples, batch_size, 1)[0],
                               loss_reduction="mean",
                               generator=torch.Generator(dev).manual_seed(seed))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none)

    def step(self, extra: Optional[list[torch.Tensor]] = None) -> None:
        if not self.opt.pre_step():
            return
        if extra is not None:
            for p, g in zip(self.params, extra):
                p.grad += g
        self.opt.original_optimizer.step()

    def noise_step(self, extra: Optional[list[torch.Tensor]] = None) -> None:
        """A step whose batch drew no example: the noise alone (and ``extra``)."""
        self.opt.zero_grad(True)
        for p in self.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
        self.step(extra)

    def close(self) -> None:
        """Take Opacus's hooks and per-sample gradients off the model (the process's model
        serves other clients)."""
        self.opt.zero_grad(True)
        self.hooks.to_standard_module()
        for m in self.held:
            m.training = False
        if self in _OPEN:
            _OPEN.remove(self)


#: The :class:`PrivateOptimizer` whose hooks are on a model now (at most one per process).
_OPEN: list[PrivateOptimizer] = []
