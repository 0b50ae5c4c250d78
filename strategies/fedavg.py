"""Per-tensor FedAvg, the local-only reference, and the client metrics every strategy reports.

Flower's strategies drive the rounds unchanged (:mod:`fedadapt.strategies.build` builds them from
the ``strategy=`` and ``dp=`` config groups). fedadapt adds what its methods need and Flower's
FedAvg cannot express, each as a subclass overriding only what differs:

* :class:`PerTensorFedAvg`: a client sends only the tensors it trained (a tier-3 client of a
  layer-wise model: exit 3's head and the blocks it ran), so each tensor is the weighted mean
  over the clients that sent it and a tensor nobody sent keeps its value. With every client
  sending every tensor this is exactly FedAvg. It overrides ``aggregate_train`` (and remembers
  the arrays ``configure_train`` sent); Flower's server optimisers compose with it the way they
  extend FedAvg (``FedAdam`` -> ``FedOpt`` -> ``PerTensorFedAvg`` -> ``FedAvg``, see
  :func:`per_tensor`).
* :class:`LocalOnly`: each client trains its own model; nothing is aggregated.
* :func:`aggregate_client_metrics`: besides the weighted mean of every metric, the unweighted
  mean over the clients (the personalization metric).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedadapt.codec import as_numpy, record, to_array

__all__ = ["LocalOnly", "PerTensorFedAvg", "aggregate_client_metrics", "average_by_tensor",
           "per_tensor"]


#: Client metrics whose largest value is also reported (``<key>_max``): a privacy guarantee
#: is the worst client's.
WORST_OF = ("dpsgd_epsilon",)


def aggregate_client_metrics(replies: list[RecordDict], weight_key: str) -> MetricRecord:
    """Weighted and unweighted means of every metric the clients report."""
    # plain dicts: a MetricRecord checks every key on every access
    rows = [dict(record(r, MetricRecord).items()) for r in replies]
    weights = [float(m[weight_key]) for m in rows]
    out: dict[str, float] = {weight_key: float(sum(weights)), "num-clients": float(len(rows))}
    keys = sorted({k for m in rows for k in m.keys()} - {weight_key})
    for key in keys:  # non-finite values (a client without test data) are left out
        vals = [(float(m[key]), w) for m, w in zip(rows, weights)
                if key in m and not isinstance(m[key], list) and math.isfinite(float(m[key]))]
        if not vals:
            continue
        total_w = sum(w for _, w in vals)
        out[key] = sum(v * w for v, w in vals) / total_w if total_w else float("nan")
        out[f"{key}_client_mean"] = sum(v for v, _ in vals) / len(vals)
        if key in WORST_OF:
            out[f"{key}_max"] = max(v for v, _ in vals)
    return MetricRecord(out)


def average_by_tensor(current: ArrayRecord, contents: Sequence[RecordDict], weight_key: str
                      ) -> ArrayRecord:
    """Each tensor of ``current``: the ``weight_key``-weighted mean over the replies that hold
    it (accumulated in float64, in the order given), or its current value when none does.

    One tensor at a time: besides the replies, the server holds one tensor's float64 sum and
    the new record, never every reply decoded at once (a whole CLIP's replies are 605 MB
    each)."""
    weights = [float(record(c, MetricRecord)[weight_key]) for c in contents]
    sent = [record(c, ArrayRecord) for c in contents]
    out = ArrayRecord()
    for name, array in current.items():
        acc, term, total = None, None, 0.0
        for arrays, w in zip(sent, weights):
            if name not in arrays:
                continue
            values = as_numpy(arrays[name])
            if acc is None:  # float64(x) * w, then added: two roundings, as always
                acc = np.empty(values.shape, dtype=np.float64)  # arrays, 0-d ones too
                term = np.empty_like(acc)
                np.multiply(values, w, out=acc, dtype=np.float64)
            else:
                np.add(acc, np.multiply(values, w, out=term, dtype=np.float64), out=acc)
            total += w
        if acc is None or total <= 0:
            out[name] = array
            continue
        out[name] = to_array(np.divide(acc, total, out=acc).astype(np.dtype(array.dtype)))
    return out


class PerTensorFedAvg(FedAvg):
    """FedAvg averaging each tensor over the clients that sent it (see the module docstring).

    Flower's reply check (one ArrayRecord with the same keys in every reply) is left out: a
    tier-k client's reply holds its tier's tensors only. fedadapt's server screens every reply
    before aggregation (names and shapes against what that client trains, finite values)."""

    #: Set by ``configure_train`` every round: never part of a checkpoint.
    _transient = ("_sent_arrays",)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._sent_arrays = arrays  # a tensor nobody trains keeps this value
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if not valid:
            return None, None
        contents = [msg.content for msg in valid]
        return (average_by_tensor(self._sent_arrays, contents, self.weighted_by_key),
                self.train_metrics_aggr_fn(contents, self.weighted_by_key))


_PER_TENSOR: dict[type, type] = {FedAvg: PerTensorFedAvg}


def per_tensor(cls: type) -> type:
    """``cls`` (FedAvg or a strategy that extends it through ``super().aggregate_train``:
    FedProx, FedAvgM, FedAdam, FedYogi, FedAdagrad) with :class:`PerTensorFedAvg`'s averaging
    under its own: ``class PerTensorFedAdam(FedAdam, PerTensorFedAvg)``, whose method order is
    FedAdam, FedOpt, PerTensorFedAvg, FedAvg."""
    if cls not in _PER_TENSOR:
        _PER_TENSOR[cls] = type(f"PerTensor{cls.__name__}", (cls, PerTensorFedAvg),
                                {"__module__": __name__, "__doc__": cls.__doc__})
    return _PER_TENSOR[cls]


class LocalOnly(FedAvg):
    """Each client trains its own model; nothing is aggregated (the replies carry no arrays)."""

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        contents = [msg.content for msg in valid]
        return None, (self.train_metrics_aggr_fn(contents, self.weighted_by_key)
                      if contents else None)
