"""Ditto (Li, Hu, Beirami, Smith, ICML 2021, arXiv 2012.04221, Algorithm 1).

Each client trains the global model as FedAvg does (what it sends back), and beside it its own
personal copy ``v_k`` of the same tensors, pulled towards the global model ``w^t`` it received
by the proximal term ``lam/2 ||v_k - w^t||^2``:

    v_k <- v_k - eta_p * (grad F_k(v_k) + lam * (v_k - w^t))

``v_k`` starts at the global model on the client's first round (as the paper initialises it)
and is kept on the client from round to round (the rule's state: never sent); the client is
evaluated with it. ``lam = 0`` is local training of the personal copy, a large ``lam`` pins it
to the global model.

On a frozen backbone the personal copy covers what the method trains (a head, adapters, LoRA,
tokens); the backbone is shared and frozen. Both trainings run side by side with the other
clients (two calls of :meth:`RoundWork.train`); the personal one draws its batches from its own
seed stream.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from fedadapt.config import PflConfig, RunConfig, check
from fedadapt.federation.client.grouped import ClientResult
from fedadapt.federation.client.training import derive_seed
from fedadapt.pfl.rule import ClientRule, RoundWork, check_composes, register_pfl

#: The seed stream of a client's personal steps (its batches, exits and crops).
PERSONAL_STREAM = 0xD1770


@register_pfl
@dataclass
class Ditto(PflConfig, ClientRule):
    """``pfl=ditto``: a personal copy trained beside the global model, towards it."""

    name: str = "ditto"
    #: The proximal weight lambda of the personal objective (>= 0; 0: local training).
    lam: float = 0.1
    #: Local epochs of the personal copy per round (>= 1); null: ``train.local_epochs``.
    personal_epochs: Optional[int] = None
    #: Learning rate of the personal copy (> 0); null: the round's (``train.lr``).
    personal_lr: Optional[float] = None

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        check_composes(cfg, self)
        check(self.lam >= 0, "pfl.lam", self.lam,
              "Ditto's proximal weight lambda must be >= 0 (0: the personal copy trains alone)")
        check(self.personal_epochs is None or self.personal_epochs >= 1, "pfl.personal_epochs",
              self.personal_epochs, "must be >= 1, or null (train.local_epochs)")
        check(self.personal_lr is None or self.personal_lr > 0, "pfl.personal_lr",
              self.personal_lr, "must be > 0, or null (the round's learning rate)")

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        shared = work.train()  # the global model, as FedAvg trains it: what is sent
        names = work.model.trainable_names()
        personal = []
        for job in work.jobs:
            received = {n: job.tensors[n] for n in names}
            start = {n: work.state[job.cid].get(n, received[n]) for n in names}
            personal.append(replace(
                job, tensors={**job.tensors, **start}, anchor=received,
                seed=derive_seed(job.seed, PERSONAL_STREAM),
                crop_seed=None if job.crop_seed is None
                else derive_seed(job.crop_seed, PERSONAL_STREAM)))
        mine = work.train(personal, epochs=self.personal_epochs, lr=self.personal_lr,
                          mu=self.lam)
        for job in work.jobs:
            res = mine.get(job.cid)
            if isinstance(res, str):  # the client fails its round
                shared[job.cid] = res
            elif isinstance(shared.get(job.cid), ClientResult):
                work.state[job.cid].clear()
                work.state[job.cid].update({n: res.tensors[n] for n in names})
        return shared

    def evaluated(self, model, tensors: dict[str, torch.Tensor],
                  state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The personal copy (the global model before the client's first round)."""
        return {**tensors, **state}
