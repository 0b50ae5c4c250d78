"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous
Federated Optimization", NeurIPS 2020): normalised averaging for clients that take different
numbers of local steps (``strategy=fednova``).

FedAvg weights each client's change ``x - y_i`` by its data, so a client that ran more local
steps pulls the model further: the global model drifts toward the objective of the clients that
worked most. FedNova divides each change by the client's accumulated step weights ``a_i`` and
scales the average back by their weighted mean::

    x <- x - tau_eff * sum_i p_i (x - y_i) / a_i,      tau_eff = sum_i p_i a_i

``p_i`` the clients' data shares (their training examples, or equal with
``method.weighting=uniform``), ``a_i`` the L1 norm of the client's step weights: for SGD with
momentum ``rho`` over ``tau_i`` steps, ``(tau_i - rho (1 - rho^tau_i) / (1 - rho)) / (1 - rho)``
(``tau_i`` for plain SGD). A client's steps follow from the examples it trained (its
``num-examples``), the batch size and the local epochs: ``tau_i = epochs x ceil(n_i / B)``. With
every client taking the same steps FedNova is FedAvg. With ``fleet.partial_work`` a client cut at
the deadline trains fewer steps, and FedNova weighs its change by its data share ``p_i`` all the
same, normalised by its fewer steps, where FedAvg weights it down by its work.

Each tensor is aggregated over the clients that sent it (as fedadapt's FedAvg; a tensor nobody
sent keeps its value). The weight decay of the clients' optimiser is not in ``a_i`` (nor in the
paper's).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Callable, Optional

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedadapt.codec import UNIFORM_KEY, as_numpy, to_array
from fedadapt.config import ConfigError
from fedadapt.strategies.capabilities import Capabilities


def step_weights(steps: int, momentum: float = 0.0) -> float:
    """``||a||_1`` of a client that took ``steps`` SGD steps with ``momentum`` (FedNova's
    ``a_i``): ``steps`` without momentum."""
    if steps <= 0:
        return 0.0
    if not momentum:
        return float(steps)
    rho = float(momentum)
    return (steps - rho * (1 - rho ** steps) / (1 - rho)) / (1 - rho)


def local_steps(examples: int, batch_size: int, epochs: int) -> int:
    """The SGD steps a client takes over ``examples`` examples: ``epochs x ceil(n / B)``."""
    return int(epochs) * math.ceil(int(examples) / int(batch_size))


#: Why no ``dp=`` composes with FedNova.
NO_DP = ("its noise is calibrated to FedAvg's mean of the clipped updates, and FedNova rescales "
         "each update by its client's steps")


class FedNova(FedAvg):
    """FedNova's normalised averaging (see the module docstring). ``local_momentum``,
    ``local_batch_size``, ``local_epochs`` are the clients' (``train.*``); ``examples_of(node)``
    a client's training examples (its data share; None: what it reports, ``num-examples``)."""

    capabilities = Capabilities(each_tensor=True, counts_sgd_steps=True, no_dp=NO_DP)

    #: Set by ``configure_train`` every round: never part of a checkpoint.
    _transient = ("_sent_arrays",)

    def __init__(self, local_momentum: float = 0.0, local_batch_size: int = 32,
                 local_epochs: int = 1, examples_of: Optional[Callable[[int], int]] = None,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0 <= local_momentum < 1:
            raise ConfigError(f"train.momentum={local_momentum} is invalid with strategy=fednova:"
                              f" its step weights need 0 <= momentum < 1")
        self.local_momentum = float(local_momentum)
        self.local_batch_size, self.local_epochs = int(local_batch_size), int(local_epochs)
        self.examples_of = examples_of
        self._sent_arrays: Optional[ArrayRecord] = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._sent_arrays = arrays  # x: what every client started from
        return super().configure_train(server_round, arrays, config, grid)

    def client_terms(self, msg: Message) -> tuple[float, float]:
        """``(data weight, a_i)`` of a reply: its data share's weight (``examples_of``, or its
        ``num-examples``; 1 with uniform weighting) and its step weights from the examples it
        trained."""
        metrics = next(iter(msg.content.metric_records.values()))
        trained = int(metrics["num-examples"])
        if self.weighted_by_key == UNIFORM_KEY:
            weight = 1.0
        elif self.examples_of is not None:
            weight = float(self.examples_of(msg.metadata.src_node_id))
        else:
            weight = float(metrics[self.weighted_by_key])
        steps = local_steps(trained, self.local_batch_size, self.local_epochs)
        return weight, step_weights(steps, self.local_momentum)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``x - tau_eff * sum_i p_i (x - y_i) / a_i`` per tensor, over the clients that sent
        it (float64); the metrics as FedAvg's."""
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if not valid:
            return None, None
        terms = [self.client_terms(msg) for msg in valid]
        sent = [next(iter(msg.content.array_records.values())) for msg in valid]
        out = ArrayRecord()
        for name, array in self._sent_arrays.items():
            holders = [(arrays, w, a) for arrays, (w, a) in zip(sent, terms)
                       if name in arrays and a > 0]
            total = sum(w for _, w, _ in holders)
            if not holders or total <= 0:
                out[name] = array
                continue
            x = as_numpy(array).astype(np.float64)
            tau_eff = sum(w / total * a for _, w, a in holders)
            step = sum(w / total * (x - as_numpy(arrays[name]).astype(np.float64)) / a
                       for arrays, w, a in holders)
            out[name] = to_array((x - tau_eff * step).astype(np.dtype(array.dtype)))
        contents = [msg.content for msg in valid]
        metrics = dict(self.train_metrics_aggr_fn(contents, self.weighted_by_key))
        total = sum(w for w, _ in terms)
        if total > 0:  # over every client of the round (a tensor's: over its senders)
            metrics["tau_eff"] = float(sum(w / total * a for w, a in terms))
        return out, MetricRecord(metrics)


__all__ = ["FedNova", "local_steps", "step_weights"]
