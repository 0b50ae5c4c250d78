"""FedPer and LG-FedAvg: one part of what trains stays on each client, the rest is FedAvg's.

* **FedPer** (Arivazhagan et al., 2019, arXiv 1912.00818): the base layers are federated, the
  personalization layers (here the classifier) stay on each client; local training updates
  both. On a frozen backbone the base layers are what the method trains in front of its head
  (adapters, LoRA, a client token, a hidden layer).
* **LG-FedAvg** (Liang et al., 2020, arXiv 2001.01523): the reverse: local representations
  (here everything the method trains in front of the classifier) stay on each client, the
  global classifier is federated.

Both train as FedAvg does; only what is sent differs (``keeps``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedadapt.config import PflConfig, RunConfig
from fedadapt.pfl.rule import ClientRule, check_composes, register_pfl


@register_pfl
@dataclass
class FedPer(PflConfig, ClientRule):
    """``pfl=fedper``: the head stays on each client, the body is federated."""

    name: str = "fedper"
    keeps: ClassVar[str] = "head"

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        check_composes(cfg, self)


@register_pfl
@dataclass
class LgFedAvg(PflConfig, ClientRule):
    """``pfl=lg_fedavg``: the body stays on each client, the head is federated."""

    name: str = "lg_fedavg"
    keeps: ClassVar[str] = "body"

    def check(self, cfg: RunConfig) -> None:
        super().check(cfg)
        check_composes(cfg, self)
