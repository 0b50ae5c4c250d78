"""FedRep and FedBABU: the head stays on each client, and it trains apart from the body.

* **FedRep** (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, arXiv 2102.07078): each round a
  client first trains its personal head for ``pfl.head_epochs`` epochs with the shared
  representation fixed (the paper takes many head steps, e.g. 10 epochs), then the
  representation for ``train.local_epochs`` epochs with its new head fixed; only the
  representation is sent and averaged. On a frozen backbone the representation is what the
  method trains in front of its classifier (adapters, LoRA, a token, a hidden layer). With
  ``pfl.norms=true`` the backbone's normalisation parameters are personal too, so they train in
  the first phase, beside the head (FedRep's rule: what is local trains first, with what is
  shared fixed).
* **FedBABU** (Oh, Kim, Yun, ICLR 2022, arXiv 2106.06042): the head stays at its random
  initialisation during FL (it never trains, so it is never sent: every client and the server
  hold the same initial head); only the body trains and is averaged. After FL every client
  fine-tunes the whole trainable model, body and head, on its own training split. That fine-tune
  is fedadapt's personalization step, ``setting=local_finetune`` (``setting.epochs``,
  ``setting.personalize=trainable``), which reports each client's accuracy before and after it:
  ``pfl=fedbabu`` without it is refused in one line naming the setting, rather than the preset
  setting it behind the user's back (a ``pfl`` preset would then change another group).

Both keep the head on the client (``keeps = "head"``) and refuse a method with no head (its
classes are text features: FedCLIP's AttAI) or with nothing but a head (``linear_head``: no body
to federate), where the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fedadapt.adapters.personal import head_names
from fedadapt.config import PflConfig, RunConfig, check
from fedadapt.federation.client.grouped import ClientResult
from fedadapt.pfl.rule import ClientRule, RoundWork, check_composes, register_pfl


@register_pfl
@dataclass
class FedRep(PflConfig, ClientRule):
    """``pfl=fedrep``: the head trains first with the body fixed, then the body with the head
    fixed; the head stays on each client, the body is federated."""

    name: str = "fedrep"
    #: Local epochs of the head, with the body fixed, before the body's ``train.local_epochs``
    #: (the paper: 10).
    head_epochs: int = 10
    keeps: ClassVar[str] = "head"

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        from fedadapt.strategies.registry import sample_level

        check(self.head_epochs >= 1, "pfl.head_epochs", self.head_epochs,
              "FedRep trains the head for at least 1 epoch each round before the body")
        check(not sample_level(cfg.dp), "pfl", self.name,
              f"dp={cfg.dp.name} accounts train.local_epochs of steps a round, and FedRep "
              f"takes pfl.head_epochs more (its privacy spent would be understated)")
        check_composes(cfg, self)

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        """Each client from its own seed in both phases (its batches in the body's epochs are
        shuffled as in its head's first ones); the loss reported is the body's. The head phase
        trains clients side by side; the body phase holds each client's own head fixed, so
        :meth:`RoundWork.train` trains it one client at a time (side by side the clients
        would share one head) and says so once."""
        model = work.model
        personal = model.personal_names()  # the head (and FedBN's norms): trained first
        shared = model.communicated_names()  # the body: trained second, sent
        first = work.train(names=personal, epochs=self.head_epochs)
        failed = {cid: res for cid, res in first.items() if isinstance(res, str)}
        jobs = [replace(job, tensors=first[job.cid].tensors) for job in work.jobs
                if job.cid not in failed]
        return {**failed, **work.train(jobs, names=shared)}


@register_pfl
@dataclass
class FedBabu(PflConfig, ClientRule):
    """``pfl=fedbabu``: the head stays at its initialisation during FL (never trained, never
    sent), the body is federated; ``setting=local_finetune`` fine-tunes both after FL."""

    name: str = "fedbabu"
    keeps: ClassVar[str] = "head"

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        check(cfg.setting.kind.personal_phase, "pfl", self.name,
              f"FedBABU fine-tunes every client's model after FL, and setting="
              f"{cfg.setting.name} has no such step: add setting=local_finetune")
        check(cfg.setting.personalize in ("trainable", "full"), "setting.personalize",
              cfg.setting.personalize, "pfl=fedbabu fine-tunes the head with the body after FL: "
              "trainable or full")
        check_composes(cfg, self)

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        head = set(head_names(work.model, work.num_classes))
        return work.train(names=[n for n in work.model.trainable_names() if n not in head])
