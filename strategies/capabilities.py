"""What the rest of fedadapt asks of a strategy, as attributes of its kind.

Every ``strategy=`` option is registered with a :class:`Capabilities`
(:mod:`fedadapt.strategies.registry`); fedadapt's own strategy classes declare theirs as the
class attribute ``capabilities``, and so may a researcher's own (``strategy=custom``): a class
that declares none has those of the nearest registered class it extends (a subclass of Flower's
``FedAvg``: FedAvg's family; of ``FedMedian``: a strategy that combines whole updates). The
checks (:mod:`fedadapt.strategies.checks`), the building (:mod:`fedadapt.strategies.build`) and
the rounds read these attributes, never a strategy's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Capabilities:
    """A strategy's capabilities (all off by default: a strategy that combines whole updates,
    as Krum does)."""

    #: Aggregates through FedAvg's ``aggregate_train``, which fedadapt replaces by the mean of
    #: each tensor over the clients that sent it (FedAvg's family: FedAvg, FedProx, FedAdam, ...).
    per_tensor: bool = False
    #: Averages each tensor over the clients that sent it, in its own way: runs where clients
    #: send different tensors (multitier, personalization, LoRA of different ranks).
    each_tensor: bool = False
    #: One client moves the aggregate by at most ``clipping_norm / clients`` (a public function of
    #: what was sent plus the plain mean of the clipped updates): Flower's DP wrappers'
    #: calibration and its RDP accountant hold.
    fedavg_sensitivity: bool = False
    #: Needs only the weighted sum of the clients' parameters, which SecAgg+ reveals.
    weighted_sum: bool = False
    #: Why no ``dp=`` wrapper composes with it (one clause); "" where the DP checks decide.
    no_dp: str = ""
    #: Rescales each client's update by its SGD steps (FedNova): needs ``train.optimizer=sgd``.
    counts_sgd_steps: bool = False
    #: Applies updates as they arrive on a simulated fleet's clock (FedBuff): needs a fleet, has
    #: no rounds to time out, runs no synchronous round rule.
    asynchronous: bool = False
    #: Aggregates LoRA factors of different ranks (each client sent its own rank's slices):
    #: needs a LoRA method (``method.ranks``); FFA-LoRA's frozen A is refused.
    rank_aware: bool = False
    #: Each client keeps its LoRA B and shares only A (FedSA-LoRA): the run's ``method.share``
    #: becomes ``a``.
    shares_only_a: bool = False
    #: A client may reply at a smaller rank than it was sent (HetLoRA's self-pruning).
    prunes_rank: bool = False
    #: Folds an update into the clients' frozen weights: needs plain LoRA (``method=lora``).
    folds_into_base: bool = False
    #: The global model holds each LoRA layer's folded update ``X.base_delta``.
    global_fold: bool = False
    #: ``(per, plus)``: needs ``per * f + plus`` clients a round to tolerate
    #: ``strategy.num_malicious_nodes`` = f (Krum, Multi-Krum, Bulyan).
    min_clients: Optional[tuple[int, int]] = None
    #: The client side it needs beyond FedAvg's local training, by the name it is registered
    #: under (:func:`fedadapt.pfl.rule.register_strategy_rule`: SCAFFOLD's control variates,
    #: FedDyn's linear term, MOON's contrastive term); None: FedAvg's.
    client_rule: Optional[str] = None


#: FedAvg's family: fedadapt's per-tensor mean under the strategy's own update.
FEDAVG_FAMILY = Capabilities(per_tensor=True, each_tensor=True)


def fedavg_aggregation(cls: type) -> bool:
    """Whether ``cls`` aggregates with FedAvg's own ``aggregate_train`` (what Flower's
    fixed-clipping accountant requires)."""
    from flwr.serverapp.strategy import FedAvg

    return cls.aggregate_train is FedAvg.aggregate_train


#: Why no ``dp=`` composes with a strategy that folds the mean of ``B_k A_k`` into the frozen
#: weights (FLoRA, FedEx-LoRA).
FOLD_NO_DP = ("it folds the mean of the products B_k A_k into the frozen weights, quadratic in "
              "a client's update, so clipping the update does not bound what one client moves "
              "(the noise's calibration)")
