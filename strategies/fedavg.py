"""Adapter-only FedAvg and FedProx, and the local-only reference.

They subclass Flower's strategies and change only what differs:

* **Seeded sampling by partition.** Flower samples node ids with the global ``random`` module,
  and simulated node ids are random per run; these strategies sample *partition ids* with their
  own ``random.Random(seed)`` (state that a checkpoint can save), so the same seed trains the same
  clients in every run.
* **Per-round config.** The learning rate of the round (and FedProx's ``proximal-mu``) travel in
  the ``ConfigRecord``.
* **Client-mean evaluation.** Besides Flower's example-weighted mean, the unweighted mean of the
  clients' local accuracies (the personalization metric).

What is averaged is whatever the clients send: only the communicated trainable tensors.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable
from typing import Optional

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx


def aggregate_client_metrics(replies: list[RecordDict], weight_key: str) -> MetricRecord:
    """Weighted and unweighted means of every metric the clients report."""
    rows = [next(iter(r.metric_records.values())) for r in replies]
    weights = [float(m[weight_key]) for m in rows]
    out: dict[str, float] = {weight_key: float(sum(weights)), "num-clients": float(len(rows))}
    keys = sorted({k for m in rows for k in m.keys()} - {weight_key})
    for key in keys:  # non-finite values (a client without test data) are left out
        vals = [(float(m[key]), w) for m, w in zip(rows, weights)
                if key in m and math.isfinite(float(m[key]))]
        if not vals:
            continue
        total_w = sum(w for _, w in vals)
        out[key] = sum(v * w for v, w in vals) / total_w if total_w else float("nan")
        out[f"{key}_client_mean"] = sum(v for v, _ in vals) / len(vals)
    return MetricRecord(out)


class SeededSampling:
    """Mixin: sample partition ids with a seeded RNG; map them to node ids from a handshake."""

    def init_sampling(self, seed: int) -> None:
        # Separate streams: how often or how many clients are evaluated never changes which
        # clients train.
        self.rng = random.Random(f"train-{seed}")
        self.eval_rng = random.Random(f"evaluate-{seed}")
        self.node_of: dict[int, int] = {}

    def set_nodes(self, node_of_partition: dict[int, int]) -> None:
        self.node_of = dict(sorted(node_of_partition.items()))
        self.partition_of = {node: pid for pid, node in self.node_of.items()}

    def state_dict(self) -> dict:
        """What a checkpoint must save to continue sampling exactly (JSON-able)."""
        def dump(rng):
            version, internal, gauss = rng.getstate()
            return [version, list(internal), gauss]

        return {"rng": dump(self.rng), "eval_rng": dump(self.eval_rng)}

    def load_state_dict(self, state: dict) -> None:
        for key, rng in (("rng", self.rng), ("eval_rng", self.eval_rng)):
            version, internal, gauss = state[key]
            rng.setstate((version, tuple(internal), gauss))

    def in_partition_order(self, replies: Iterable[Message]) -> list[Message]:
        """Replies sorted by partition id. ``send_and_receive`` returns them in arrival order,
        and floating-point sums depend on order: sorting makes aggregation reproducible."""
        return sorted(replies, key=lambda m: self.partition_of.get(m.metadata.src_node_id, -1))

    def sample(self, fraction: float, minimum: int, rng: random.Random | None = None
               ) -> list[int]:
        """Node ids of ``max(int(N * fraction), minimum)`` clients drawn without replacement."""
        pids = list(self.node_of)
        k = min(len(pids), max(int(len(pids) * fraction), minimum))
        return [self.node_of[p] for p in sorted((rng or self.rng).sample(pids, k))]

    def round_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        config["server-round"] = server_round
        return config

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]
                           ) -> Optional[MetricRecord]:
        """Example-weighted and client means of the (already screened) evaluation replies,
        whatever weighting the training average uses."""
        contents = [m.content for m in replies if not m.has_error()]
        return self.evaluate_metrics_aggr_fn(contents, "num-examples") if contents else None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        if self.fraction_train == 0.0:
            return []
        nodes = self.sample(self.fraction_train, self.min_train_nodes)
        record = RecordDict({self.arrayrecord_key: arrays,
                             self.configrecord_key: self.round_config(server_round, config)})
        return self._construct_messages(record, nodes, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self.sample(self.fraction_evaluate, self.min_evaluate_nodes, self.eval_rng)
        record = RecordDict({self.arrayrecord_key: arrays,
                             self.configrecord_key: self.round_config(server_round, config)})
        return self._construct_messages(record, nodes, MessageType.EVALUATE)


#: Train replies carry this metric (1 per client) for ``method.weighting=uniform``.
UNIFORM_KEY = "unit-weight"


def _kwargs(num_clients: int, fraction_train: float, fraction_evaluate: float,
            weighting: str = "examples") -> dict:
    """Minimum node counts so that round 1 samples the intended number of clients."""
    return dict(
        weighted_by_key=UNIFORM_KEY if weighting == "uniform" else "num-examples",
        fraction_train=fraction_train,
        fraction_evaluate=fraction_evaluate,
        min_train_nodes=max(1, int(num_clients * fraction_train)),
        min_evaluate_nodes=int(num_clients * fraction_evaluate),
        min_available_nodes=num_clients,
        train_metrics_aggr_fn=aggregate_client_metrics,
        evaluate_metrics_aggr_fn=aggregate_client_metrics,
    )


class AdapterFedAvg(SeededSampling, FedAvg):
    """FedAvg over the communicated tensors, with seeded per-round client sampling."""

    def __init__(self, *, num_clients: int, fraction_train: float, fraction_evaluate: float,
                 seed: int, weighting: str = "examples") -> None:
        FedAvg.__init__(self, **_kwargs(num_clients, fraction_train, fraction_evaluate,
                                        weighting))
        self.init_sampling(seed)


class AdapterFedProx(SeededSampling, FedProx):
    """FedProx: FedAvg plus ``proximal-mu`` in every train config (clients add the term)."""

    def __init__(self, *, num_clients: int, fraction_train: float, fraction_evaluate: float,
                 seed: int, proximal_mu: float, weighting: str = "examples") -> None:
        FedProx.__init__(self, proximal_mu=proximal_mu,
                         **_kwargs(num_clients, fraction_train, fraction_evaluate, weighting))
        self.init_sampling(seed)

    def round_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        config["proximal-mu"] = self.proximal_mu
        return super().round_config(server_round, config)


class LocalOnly(AdapterFedAvg):
    """Each client trains its own model; nothing is aggregated (the replies carry no arrays)."""

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        contents = [m.content for m in replies]  # already screened by the round loop
        return None, (self.train_metrics_aggr_fn(contents, self.weighted_by_key)
                      if contents else None)


def build_strategy(name: str, *, federated: bool, num_clients: int, fraction_train: float,
                   fraction_evaluate: float, seed: int, proximal_mu: float = 0.0,
                   weighting: str = "examples"):
    """The strategy a method asks for (``method.strategy``, ``method.weighting``), or LocalOnly
    when not federated."""
    common = dict(num_clients=num_clients, fraction_train=fraction_train,
                  fraction_evaluate=fraction_evaluate, seed=seed, weighting=weighting)
    if not federated:
        return LocalOnly(**common)
    if name == "fedprox":
        return AdapterFedProx(proximal_mu=proximal_mu, **common)
    return AdapterFedAvg(**common)
