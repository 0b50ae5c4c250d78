"""APFL, adaptive personalized federated learning (Deng, Kamani, Mahdavi, 2020, arXiv
2003.13461, Algorithm 1).

Each client keeps a personal model ``v`` and a mixing weight ``alpha``; its personalized model
is the mixture ``alpha v + (1 - alpha) w`` of its personal model and the global one. Each local
step on a batch, from the values before the step:

    w     <- w - eta * grad F(w)                          (the local copy of the global model)
    v     <- v - eta * alpha * grad F(m)                   m = alpha v + (1 - alpha) w
    alpha <- clip(alpha - eta_alpha * <v - w, grad F(m)>, 0, 1)   (adaptive APFL only)

``w`` is sent to the server (its update is FedAvg's), ``v`` and ``alpha`` stay on the client
(the rule's state; ``v`` starts at the global model on the client's first round) and the client
is evaluated with its mixture with the global model it holds.

On a frozen backbone ``v`` and ``w`` are what the method trains (a head, adapters, LoRA,
tokens), mixed tensor by tensor; the backbone is shared. A step runs two forwards with
different tensors (``torch.func.functional_call``), so the clients train one at a time. The
steps of ``w`` and ``v`` use the run's optimiser (``train.optimizer``, each model its own;
the paper's plain SGD with ``train.optimizer=sgd train.momentum=0``), ``alpha`` plain
projected SGD.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch.func import functional_call

from fedadapt.config import PflConfig, RunConfig, check
from fedadapt.devices import autocast, seed_torch
from fedadapt.federation.client.group_jobs import StepLoss
from fedadapt.federation.client.grouped import ClientJob, ClientResult
from fedadapt.federation.client.training import local_optimizer, local_schedule
from fedadapt.federation.client.worker import reason_of
from fedadapt.grouping import dropout
from fedadapt.pfl.rule import ClientRule, RoundWork, check_composes, register_pfl

#: The rule state's name of a client's mixing weight (beside its personal tensors, by name).
ALPHA_KEY = "apfl:alpha"


@register_pfl
@dataclass
class Apfl(PflConfig, ClientRule):
    """``pfl=apfl``: a personal model mixed with the global one by a learned weight."""

    name: str = "apfl"
    #: The mixing weight of the personal model at a client's first round, in [0, 1].
    alpha: float = 0.25
    #: The mixing weight's learning rate (> 0); null: the round's (``train.lr``).
    alpha_lr: Optional[float] = None
    #: true: each client learns its alpha (the paper's adaptive APFL); false: alpha stays fixed.
    adaptive_alpha: bool = True

    alone_because = ("a step runs two forwards with different tensors, the global model's copy "
                     "and the mixture, which the side-by-side forms do not")

    def check(self, cfg: RunConfig) -> None:
        from fedadapt.strategies.registry import sample_level

        super().check(cfg)
        check_composes(cfg, self)
        check(0 <= self.alpha <= 1, "pfl.alpha", self.alpha, "APFL's mixing weight must be in "
              "[0, 1]")
        check(self.alpha_lr is None or self.alpha_lr > 0, "pfl.alpha_lr", self.alpha_lr,
              "must be > 0, or null (the round's learning rate)")
        check(not sample_level(cfg.dp), "dp", cfg.dp.name, "pfl=apfl trains by its own steps "
              "(two models and a mixture), not DP-SGD's")

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        out: dict[int, ClientResult | str] = {}
        for job in work.jobs:
            try:
                out[job.cid] = self._train_client(work, job)
            except Exception as err:  # this client fails its round, the others go on
                out[job.cid] = reason_of(err)
        return out

    def _train_client(self, work: RoundWork, job: ClientJob) -> ClientResult:
        model, train, spec = work.model, work.train_config, work.spec
        lr, mu = work.rates[job.cid]
        alpha_lr = lr if self.alpha_lr is None else self.alpha_lr
        state = work.state[job.cid]
        names = model.trainable_names()
        dev = next(model.parameters()).device

        def leaf(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(dev, torch.float32).clone().requires_grad_(True)

        w = {n: leaf(job.tensors[n]) for n in names}
        v = {n: leaf(state.get(n, job.tensors[n])) for n in names}
        alpha = leaf(state.get(ALPHA_KEY, torch.tensor([self.alpha])))
        alpha.requires_grad_(self.adaptive_alpha)
        start = {n: t.detach().clone() for n, t in w.items()}  # FedProx's anchor (mu > 0)
        opt_w = local_optimizer(list(w.values()), train, lr)
        opt_v = local_optimizer(list(v.values()), train, lr)

        step = StepLoss(model)
        masks = dropout.install(model)
        batches, exits = local_schedule(job.indices, train, job.seed, job.exits)
        crops = None
        if job.crop_seed is not None and train.crop_scale is not None:
            scale = (float(train.crop_scale[0]), float(train.crop_scale[1]))
            crops = [(scale, np.full(len(b), job.crop_seed, dtype=np.uint64)) for b in batches]
        source = job.source if job.source is not None else spec.train_source
        seed_torch(job.seed, dev)
        model.train()
        losses, sizes = [], []
        for t, (x, y) in enumerate(source.stream(batches, dev, crops)):
            keyed = dropout.keyed(torch.tensor(dropout.step_key(job.seed, t))) if masks \
                else nullcontext()
            mixed = {n: alpha * v[n] + (1 - alpha) * w[n].detach() for n in names}
            with autocast(dev.type, spec.precision), keyed:
                loss_w = functional_call(step, _prefixed(w), (x, y, exits[t])).float()
                loss_m = functional_call(step, _prefixed(mixed), (x, y, exits[t])).float()
            objective = loss_w + loss_m
            if mu > 0:
                objective = objective + 0.5 * mu * sum((w[n] - start[n]).pow(2).sum()
                                                       for n in names)
            opt_w.zero_grad(set_to_none=True)
            opt_v.zero_grad(set_to_none=True)
            alpha.grad = None
            objective.backward()
            if train.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(list(w.values()), train.clip_grad_norm)
                torch.nn.utils.clip_grad_norm_(list(v.values()), train.clip_grad_norm)
            with torch.no_grad():  # alpha's step from the values before this step's
                if self.adaptive_alpha and alpha.grad is not None:
                    alpha.sub_(alpha_lr * alpha.grad).clamp_(0.0, 1.0)
            opt_w.step()
            opt_v.step()
            losses.append(loss_w.detach())
            sizes.append(len(y))
        state.clear()
        state.update({n: t.detach().cpu() for n, t in v.items()})
        state[ALPHA_KEY] = alpha.detach().cpu()
        tensors = {**job.tensors, **{n: t.detach().cpu().to(job.tensors[n].dtype)
                                     for n, t in w.items()}}
        total = sum(value * n for value, n in zip(torch.stack(losses).double().tolist()
                                                  if losses else [], sizes))
        return ClientResult(tensors=tensors, loss=total / max(sum(sizes), 1), seen=sum(sizes))

    def evaluated(self, model, tensors: dict[str, torch.Tensor],
                  state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mixture ``alpha v + (1 - alpha) w`` with the global model ``w`` it holds (the
        global model itself before the client's first round)."""
        if ALPHA_KEY not in state:
            return tensors
        a = float(state[ALPHA_KEY])
        return {**tensors, **{n: (a * v + (1 - a) * tensors[n].float()).to(tensors[n].dtype)
                              for n, v in state.items() if n != ALPHA_KEY}}


def _prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` named as :class:`StepLoss` holds them (its ``model``'s)."""
    return {f"model.{n}": t for n, t in tensors.items()}
