"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated
Learning", ICML 2020, arXiv 1910.06378, Algorithm 1): control variates that correct the clients'
drift on non-IID data (``strategy=scaffold``).

The server keeps a control variate ``c`` beside the model ``x`` (over the trained tensors only:
the backbone is frozen and never moves) and sends both (``c`` as ``rule/c/<tensor>``). Each
client corrects every local step's gradient by ``c - c_i`` (its own variate ``c_i``, zero at
first), takes its ``K`` steps to ``y_i``, then updates its variate by option I (the gradient of
its loss at ``x`` over its data, one pass) or option II (``c_i - c + (x - y_i) / (K lr)``, the
paper's recommended one; with SGD momentum ``K`` is the weight of its steps, FedNova's
``a_i``), and sends ``y_i`` and ``dc_i = c_i+ - c_i`` (``rule/dc/<tensor>``); its client side
is :mod:`fedadapt.pfl.drift`. The server then moves::

    x <- x + eta_g * mean_{i in S}(y_i - x),      c <- c + |S|/N * mean_{i in S}(dc_i)

with ``N`` all the clients (``partition.num_clients``). The means are plain, as the paper's
(``method.weighting`` is not read). Each tensor moves over the clients that sent it (a
multi-tier client sends its tier's tensors): ``c`` stays the mean of all ``N`` clients' ``c_i``,
a client's ``c_i`` being zero for a tensor it never trains. ``c`` goes down and ``dc_i`` comes up
beside the tensors, so a round moves twice FedAvg's bytes. ``c`` is strategy state
(checkpointed with the run). The paper assumes every sampled client's reply arrives: a client
whose reply is late (``federation.round_timeout``, a fleet's deadline) or screened out has
moved its own ``c_i`` all the same, as a real device would, and ``c`` then differs from the mean
of the ``c_i`` by its change.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedadapt.codec import RULE_PREFIX, as_numpy, to_array
from fedadapt.config import ConfigError, check
from fedadapt.strategies.capabilities import Capabilities

#: The server's variate as a client receives it, and a client's change of its own.
C_PREFIX, DC_PREFIX = RULE_PREFIX + "c/", RULE_PREFIX + "dc/"
#: ``strategy.option``: how a client updates its variate.
OPTIONS = ("I", "II")

#: Why no ``dp=`` wrapper composes with SCAFFOLD or FedDyn.
NO_DP = ("its noise is calibrated to FedAvg's mean of the clipped updates, and the server also "
         "moves its own state (a control variate or FedDyn's h) by the clients' updates")


def check_drift(cfg, name: str) -> None:
    """What SCAFFOLD and FedDyn refuse beyond their keys: work cut at a fleet's deadline (their
    client state assumes each client's full local work)."""
    partial = getattr(cfg.fleet, "partial_work", False)  # a key of the simulated fleets
    check(not partial, "fleet.partial_work", partial,
          f"strategy={name} updates each client's state from its full local work (its steps "
          f"and its data); set fleet.partial_work=false")


def arrays_of(msg: Message) -> ArrayRecord:
    """A reply's arrays."""
    return next(iter(msg.content.array_records.values()))


class Scaffold(FedAvg):
    """SCAFFOLD's server (see the module docstring): ``option`` (``I`` / ``II``) is its
    clients', ``server_lr`` the global step ``eta_g``, ``num_clients`` all the clients ``N``."""

    capabilities = Capabilities(each_tensor=True, no_dp=NO_DP, client_rule="scaffold")

    #: Set by ``configure_train`` every round: never part of a checkpoint.
    _transient = ("_sent_arrays",)

    def __init__(self, option: str = "II", server_lr: float = 1.0, num_clients: int = 1,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        if str(option) not in OPTIONS:
            raise ConfigError(f"strategy.option={option} is invalid: one of {OPTIONS}")
        if not server_lr > 0:
            raise ConfigError(f"strategy.server_lr={server_lr} is invalid: must be > 0")
        self.option, self.server_lr, self.num_clients = str(option), float(server_lr), \
            int(num_clients)
        #: The server's control variate ``c`` per tensor (float64); None before round 1.
        self.c: Optional[dict[str, np.ndarray]] = None
        self._sent_arrays: Optional[ArrayRecord] = None

    @staticmethod
    def check_run(cfg) -> None:
        """Its refusals, from the config alone (before any data is read)."""
        check(str(cfg.strategy.option) in OPTIONS, "strategy.option", cfg.strategy.option,
              f"one of {OPTIONS} (the paper's options for the clients' variates)")
        check(cfg.strategy.server_lr > 0, "strategy.server_lr", cfg.strategy.server_lr,
              "must be > 0 (the global step eta_g)")
        if str(cfg.strategy.option) == "II":
            check(cfg.train.optimizer == "sgd", "train.optimizer", cfg.train.optimizer,
                  "strategy.option=II reads a client's variate from its SGD steps, "
                  "(x - y_i) / (K lr): use train.optimizer=sgd or strategy.option=I")
        check(str(cfg.strategy.option) != "I" or cfg.dp.name != "dpsgd", "strategy.option",
              cfg.strategy.option, "option I's gradient pass over a client's data is not "
              "DP-SGD's accounted steps: use strategy.option=II with dp=dpsgd")
        check_drift(cfg, "scaffold")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """x and c (``rule/c/<tensor>``, zero at first) to the sampled clients."""
        self._sent_arrays = arrays
        if self.c is None:
            self.c = {n: np.zeros(a.shape, np.float64) for n, a in arrays.items()}
        out = ArrayRecord()
        for name, array in arrays.items():
            out[name] = array
        for name, array in arrays.items():
            out[C_PREFIX + name] = to_array(self.c[name].astype(np.dtype(array.dtype)))
        return super().configure_train(server_round, out, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """x and c moved per tensor over the clients that sent it (float64); the metrics as
        FedAvg's."""
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if not valid:
            return None, None
        sent = [arrays_of(msg) for msg in valid]
        out = ArrayRecord()
        for name, array in self._sent_arrays.items():
            holders = [arrays for arrays in sent if name in arrays]
            if not holders:
                out[name] = array
                continue
            missing = [a for a in holders if DC_PREFIX + name not in a]
            if missing:
                raise ValueError(f"strategy=scaffold: a client sent {name} without "
                                 f"{DC_PREFIX + name} (its client side is SCAFFOLD's)")
            x = as_numpy(array).astype(np.float64)
            step = sum(as_numpy(a[name]).astype(np.float64) - x for a in holders) / len(holders)
            out[name] = to_array((x + self.server_lr * step).astype(np.dtype(array.dtype)))
            dc = sum(as_numpy(a[DC_PREFIX + name]).astype(np.float64) for a in holders)
            self.c[name] = self.c[name] + dc / self.num_clients
        contents = [msg.content for msg in valid]
        return out, self.train_metrics_aggr_fn(contents, self.weighted_by_key)


__all__ = ["C_PREFIX", "DC_PREFIX", "OPTIONS", "Scaffold", "check_drift"]
