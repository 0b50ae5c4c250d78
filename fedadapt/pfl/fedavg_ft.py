"""FedAvg + fine-tuning (FedAvg-FT), the personalization baseline of pFL tables: the model is
FedAvg's, and each client is evaluated with its own fine-tuned copy of it.

A selected client trains the global tensors it received as FedAvg does (those are sent), and
beside them fine-tunes a copy of the same received tensors for ``pfl.ft_epochs`` on its own
training split, which it keeps (its rule state) and is evaluated with. A client's copy is of the
global model of the last round it trained in (the model aggregated after that round is fine-tuned
the next time it is selected). docs/personalization.md shows this module as the pattern of a
researcher's own kind.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fedadapt.config import PflConfig, RunConfig, check
from fedadapt.federation.client.training import derive_seed
from fedadapt.pfl.rule import ClientRule, check_composes, register_pfl


@register_pfl
@dataclass
class FedAvgFT(PflConfig, ClientRule):
    """``pfl=fedavg_ft``: FedAvg, each client evaluated with its fine-tuned copy."""

    name: str = "fedavg_ft"
    #: Local epochs of the fine-tune (of everything the method trains).
    ft_epochs: int = 1

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        check_composes(cfg, self)
        check(self.ft_epochs >= 1, "pfl.ft_epochs", self.ft_epochs, "must be >= 1")

    def train_round(self, work):
        tuned = work.train([replace(job, seed=derive_seed(job.seed, 0xF7)) for job in work.jobs],
                           epochs=self.ft_epochs)  # its own shuffles
        for cid, res in tuned.items():
            if not isinstance(res, str):  # a client that failed keeps its old copy
                work.state[cid].clear()
                work.state[cid].update(res.tensors)
        return work.train()  # FedAvg's training: what is sent

    def evaluated(self, model, tensors, state):
        return {**tensors, **state}  # its fine-tuned copy, once it has one
