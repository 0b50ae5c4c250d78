"""Adapter-only FedAvg and FedProx, and the local-only reference.

They subclass Flower's strategies and change only what differs:

* **Seeded sampling by client.** Flower samples node ids with the global ``random`` module; here
  a Flower node may train many clients (a simulation worker), so these strategies sample
  *partition ids* with their own ``random.Random(seed)`` (state a checkpoint saves): the same
  seed trains the same clients in every run. Drawing k of N clients costs O(k).
* **Per-round config.** The learning rate of the round (and FedProx's ``proximal-mu``) travel in
  the ``ConfigRecord``.
* **Per-tensor averaging over the clients that trained it.** A client sends only the tensors it
  trained (a tier-3 client of a layer-wise model: exit 3's head and the blocks it ran), so each
  tensor is the weighted mean over the clients that sent it; a tensor nobody sent keeps its value.
  With every client sending every tensor this is exactly FedAvg.
* **Client-mean evaluation.** Besides the example-weighted mean, the unweighted mean of the
  clients' local accuracies (the personalization metric).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg, FedProx

from fedadapt.federation.records import UNIFORM_KEY

__all__ = ["UNIFORM_KEY", "AdapterFedAvg", "AdapterFedProx", "LocalOnly",
           "aggregate_client_metrics", "average_by_tensor", "build_strategy"]


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


def average_by_tensor(current: ArrayRecord, contents: Sequence[RecordDict], weight_key: str
                      ) -> ArrayRecord:
    """Each tensor of ``current``: the ``weight_key``-weighted mean over the replies that hold
    it (accumulated in float64, in the order given), or its current value when none does.

    One tensor at a time: besides the replies, the server holds one tensor's float64 sum and
    the new record, never every reply decoded at once (a whole CLIP's replies are 605 MB
    each)."""
    weights = [float(content.metric_records["metrics"][weight_key]) for content in contents]
    sent = [content.array_records["arrays"] for content in contents]
    out = ArrayRecord()
    for name, array in current.items():
        acc, total = None, 0.0
        for arrays, w in zip(sent, weights):
            if name in arrays:
                t = torch.from_numpy(arrays[name].numpy()).double() * w
                acc = t if acc is None else acc + t
                total += w
        if acc is None or total <= 0:
            out[name] = array
            continue
        dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype  # not decoded
        out[name] = Array.from_torch_tensor((acc / total).to(dtype))
    return out


class SeededSampling:
    """Mixin: sample partition ids with seeded RNGs (a training and an evaluation stream)."""

    def init_sampling(self, seed: int, num_clients: int) -> None:
        # Separate streams: how often or how many clients are evaluated never changes which
        # clients train.
        self.num_clients = num_clients
        self.rng = random.Random(f"train-{seed}")
        self.eval_rng = random.Random(f"evaluate-{seed}")

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

    def sample(self, fraction: float, minimum: int, rng: random.Random | None = None
               ) -> list[int]:
        """Sorted partition ids of ``max(int(N * fraction), minimum)`` clients, drawn without
        replacement."""
        k = min(self.num_clients, max(int(self.num_clients * fraction), minimum))
        return sorted((rng or self.rng).sample(range(self.num_clients), k))

    def sample_train(self) -> list[int]:
        return self.sample(self.fraction_train, self.min_train_nodes) \
            if self.fraction_train > 0 else []

    def sample_evaluate(self) -> list[int]:
        return self.sample(self.fraction_evaluate, self.min_evaluate_nodes, self.eval_rng) \
            if self.fraction_evaluate > 0 else []

    def round_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        config["server-round"] = server_round
        return config

    def aggregate_clients(self, current: ArrayRecord, contents: Sequence[RecordDict]
                          ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        """The new global arrays (per-tensor means over the senders) and the train metrics of
        the (already screened) client contents, in partition order."""
        if not contents:
            return None, None
        return (average_by_tensor(current, contents, self.weighted_by_key),
                self.train_metrics_aggr_fn(list(contents), self.weighted_by_key))

    def aggregate_evaluate_clients(self, contents: Sequence[RecordDict]
                                   ) -> Optional[MetricRecord]:
        """Example-weighted and client means of the (already screened) evaluation replies,
        whatever weighting the training average uses."""
        return self.evaluate_metrics_aggr_fn(list(contents), "num-examples") if contents \
            else None


def _kwargs(num_clients: int, fraction_train: float, fraction_evaluate: float,
            weighting: str = "examples") -> dict:
    """Minimum client counts so that a round samples the intended number of clients."""
    return dict(
        weighted_by_key=UNIFORM_KEY if weighting == "uniform" else "num-examples",
        fraction_train=fraction_train,
        fraction_evaluate=fraction_evaluate,
        min_train_nodes=max(1, int(num_clients * fraction_train)),
        min_evaluate_nodes=int(num_clients * fraction_evaluate),
        min_available_nodes=1,
        train_metrics_aggr_fn=aggregate_client_metrics,
        evaluate_metrics_aggr_fn=aggregate_client_metrics,
    )


class AdapterFedAvg(SeededSampling, FedAvg):
    """FedAvg over the communicated tensors, with seeded per-round client sampling."""

    def __init__(self, *, num_clients: int, fraction_train: float, fraction_evaluate: float,
                 seed: int, weighting: str = "examples") -> None:
        FedAvg.__init__(self, **_kwargs(num_clients, fraction_train, fraction_evaluate,
                                        weighting))
        self.init_sampling(seed, num_clients)


class AdapterFedProx(SeededSampling, FedProx):
    """FedProx: FedAvg plus ``proximal-mu`` in every train config (clients add the term)."""

    def __init__(self, *, num_clients: int, fraction_train: float, fraction_evaluate: float,
                 seed: int, proximal_mu: float, weighting: str = "examples") -> None:
        FedProx.__init__(self, proximal_mu=proximal_mu,
                         **_kwargs(num_clients, fraction_train, fraction_evaluate, weighting))
        self.init_sampling(seed, num_clients)

    def round_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        config["proximal-mu"] = self.proximal_mu
        return super().round_config(server_round, config)


class LocalOnly(AdapterFedAvg):
    """Each client trains its own model; nothing is aggregated (the replies carry no arrays)."""

    def aggregate_clients(self, current: ArrayRecord, contents: Sequence[RecordDict]
                          ) -> tuple[Optional[ArrayRecord], Optional[MetricRecord]]:
        return None, (self.train_metrics_aggr_fn(list(contents), self.weighted_by_key)
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
