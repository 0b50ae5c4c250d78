"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS
2022) on fedadapt's simulated clock (``strategy=fedbuff``, needs a ``fleet=``).

Clients train asynchronously: ``concurrency`` of them are training at any moment, each from the
global model as it was when it started. The server applies an update as soon as ``buffer_size``
of them have arrived (in simulated time), each client's change weighted down by its staleness
``tau`` (the server updates since it started)::

    x <- x + server_lr * sum_k p_k s(tau_k) (y_k - x_{v_k})

``y_k`` the client's trained tensors, ``x_{v_k}`` the global tensors it started from, ``p_k``
the replies' ``weighted_by_key`` weights normalised over the buffer (per tensor, over the clients
that sent it), ``s(tau) = 1 / sqrt(1 + tau)`` (the paper's choice; ``staleness=constant``: 1).
The clients whose updates were applied are replaced by as many new ones, sampled among the
clients available then, which start from the new model.

One "round" of fedadapt's loop is one server update: ``configure_train`` starts the clients that
fill the free slots (all ``concurrency`` in round 1), fedadapt's server computes when each will
arrive on the fleet's clock and tells :meth:`FedBuff.arrive`, and ``aggregate_train`` buffers
their changes and applies the ``buffer_size`` earliest arrivals of all the clients in flight.
A client is trained when it starts (from the model it would download then), so its change is
the one it would deliver. The clients in flight (by node), their changes and the clock are the
strategy's state, checkpointed and resumed with it.

FedBuff is an :class:`~fedadapt.strategies.asynchronous.AsynchronousStrategy` (``arrive`` and
``now``): that protocol is all the server knows of it, and all it knows of the server.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from typing import Optional

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedadapt.codec import as_numpy, to_array
from fedadapt.config import ConfigError
from fedadapt.strategies.capabilities import Capabilities
from fedadapt.strategies.state import StrategyStateError

STALENESS = ("sqrt", "constant")


def staleness_weight(tau: int, kind: str = "sqrt") -> float:
    """``s(tau)``: ``1 / sqrt(1 + tau)`` (``sqrt``) or 1 (``constant``)."""
    return 1.0 / math.sqrt(1.0 + tau) if kind == "sqrt" else 1.0


class FedBuff(FedAvg):
    """FedBuff: buffered asynchronous aggregation (see the module docstring), an
    :class:`~fedadapt.strategies.asynchronous.AsynchronousStrategy`. FedAvg's other parameters
    are FedAvg's (``weighted_by_key``, the metric aggregation); ``fraction_train`` sets
    ``concurrency`` when it is 0."""

    capabilities = Capabilities(each_tensor=True, asynchronous=True)

    _transient = ("_sent_arrays", "arrivals")

    def __init__(self, buffer_size: int = 10, concurrency: int = 0, server_lr: float = 1.0,
                 staleness: str = "sqrt", num_clients: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        for key, value, low in (("buffer_size", buffer_size, 1), ("concurrency", concurrency, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"strategy.{key}={value!r} is invalid: an integer >= {low}")
        if not (isinstance(server_lr, (int, float)) and math.isfinite(server_lr)
                and server_lr > 0):
            raise ConfigError(f"strategy.server_lr={server_lr!r} is invalid: must be > 0")
        if staleness not in STALENESS:
            raise ConfigError(f"strategy.staleness={staleness!r} is invalid: one of "
                              f"{STALENESS}")
        self.buffer_size, self.server_lr, self.staleness = buffer_size, float(server_lr), staleness
        self.concurrency = concurrency or max(buffer_size,
                                              int(num_clients * self.fraction_train))
        if self.concurrency < buffer_size:
            raise ConfigError(f"strategy.concurrency={concurrency} is invalid: below "
                              f"strategy.buffer_size={buffer_size}, no update would ever fill "
                              f"the buffer")
        #: The server's updates so far (the model's version).
        self.version = 0
        #: The simulated second of the last update.
        self.now = 0.0
        #: The clients training now: node, the version it started from, when it arrives, its
        #: weight and loss, and its change per tensor.
        self.in_flight: list[dict] = []
        #: ``{node: (start, seconds)}`` of the clients ``configure_train`` started, from
        #: :meth:`arrive`; consumed by ``aggregate_train``.
        self.arrivals: dict[int, tuple[float, float]] = {}
        self._sent_arrays: Optional[ArrayRecord] = None

    def summary(self) -> None:  # Flower's start logs this; FedAvg's would misdescribe us
        pass

    def arrive(self, arrivals: Mapping[int, tuple[float, float]]) -> None:
        """When the clients started this round arrive: ``{node: (start, seconds)}``."""
        self.arrivals = dict(arrivals)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Start clients in the free slots: sampled (Python's ``random``, the run's stream)
        among the clients the grid offers (a fleet's available ones) that are not training."""
        self._sent_arrays = arrays
        if any("node" not in f for f in self.in_flight):
            raise StrategyStateError(
                "strategy=fedbuff: this checkpoint's clients in flight are keyed by partition "
                "id, as fedadapt wrote them before FedBuff took its arrivals by node id "
                "(AsynchronousStrategy); it cannot resume: start the run again")
        busy = {f["node"] for f in self.in_flight}
        free = [n for n in grid.get_node_ids() if n not in busy]
        k = min(self.concurrency - len(self.in_flight), len(free))
        if k <= 0:
            return []
        nodes = random.sample(free, k)
        config["server-round"] = server_round
        record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: config})
        return self._construct_messages(record, nodes, MessageType.TRAIN)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Buffer the started clients' changes, then apply the ``buffer_size`` earliest
        arrivals (None while fewer are in flight)."""
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        sent = self._sent_arrays
        for msg in valid:
            node = msg.metadata.src_node_id
            if node not in self.arrivals:
                raise ValueError(f"FedBuff: no arrival time for node {node} (fedadapt's "
                                 f"server calls FedBuff.arrive; it needs fleet=)")
            start, seconds = self.arrivals[node]
            content = msg.content
            trained = next(iter(content.array_records.values()))
            metrics = next(iter(content.metric_records.values()))
            self.in_flight.append({
                "node": node, "version": self.version, "finish": start + seconds,
                "weight": float(metrics[self.weighted_by_key]),
                "loss": float(metrics.get("train_loss", float("nan"))),
                "delta": {n: as_numpy(trained[n]).astype(np.float64)
                          - as_numpy(sent[n]).astype(np.float64) for n in trained.keys()}})
        self.arrivals = {}
        # the buffer's size; fewer only when no client could start (the rest are all busy or
        # offline): then the clients in flight are applied as they are, or nothing would move
        k = self.buffer_size if len(self.in_flight) >= self.buffer_size else (
            0 if valid else len(self.in_flight))
        if k == 0:
            return None, None
        self.in_flight.sort(key=lambda f: (f["finish"], f["node"]))
        buffer, self.in_flight = self.in_flight[:k], self.in_flight[k:]
        taus = [self.version - f["version"] for f in buffer]
        new = ArrayRecord()
        for name, array in sent.items():
            holders = [(f, staleness_weight(t, self.staleness)) for f, t in zip(buffer, taus)
                       if name in f["delta"]]
            total = sum(f["weight"] for f, _ in holders)
            if not holders or total <= 0:
                new[name] = array
                continue
            step = sum(f["weight"] / total * s * f["delta"][name] for f, s in holders)
            value = as_numpy(array).astype(np.float64) + self.server_lr * step
            new[name] = to_array(value.astype(np.dtype(array.dtype)))
        self.now = max(self.now, buffer[-1]["finish"])
        self.version += 1
        losses = [(f["loss"], f["weight"]) for f in buffer if math.isfinite(f["loss"])]
        weight = sum(w for _, w in losses)
        return new, MetricRecord({
            "staleness_mean": float(np.mean(taus)), "staleness_max": float(max(taus)),
            **({"train_loss": sum(v * w for v, w in losses) / weight} if weight > 0 else {})})


__all__ = ["FedBuff", "STALENESS", "staleness_weight"]
