"""FedDyn (Acar et al., "Federated Learning Based on Dynamic Regularization", ICLR 2021,
arXiv 2111.04263, Algorithm 1): each client's objective is regularised so that its optimum
agrees with the global one (``strategy=feddyn``).

A client ``k`` minimises ``L_k(theta) - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2``
from the model it received, then updates its ``g_k <- g_k - alpha (theta_k - theta^{t-1})``
(zero at first; its client side is :mod:`fedadapt.pfl.drift`). The server keeps ``h`` (zero at
first) and moves, over the round's clients ``P`` and all ``N`` clients::

    h <- h - alpha/N * sum_{k in P}(theta_k - theta^{t-1}),
    theta^t = mean_{k in P}(theta_k) - h / alpha

over the trained tensors only, each over the clients that sent it (a tensor nobody sent keeps
its value). The mean is plain, as the paper's (``method.weighting`` is not read). ``h`` is
strategy state (checkpointed with the run). Nothing travels beyond FedAvg's tensors. As with
SCAFFOLD, a client whose reply is late or screened out has updated its ``g_k`` all the same,
which ``h`` then does not see.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from fedadapt.codec import as_numpy, to_array
from fedadapt.config import ConfigError, check
from fedadapt.strategies.capabilities import Capabilities
from fedadapt.strategies.scaffold import NO_DP, arrays_of, check_drift


class FedDyn(FedAvg):
    """FedDyn's server (see the module docstring): ``alpha`` the regulariser's weight (the
    clients' too), ``num_clients`` all the clients ``N``."""

    capabilities = Capabilities(each_tensor=True, no_dp=NO_DP, client_rule="feddyn")

    #: Set by ``configure_train`` every round: never part of a checkpoint.
    _transient = ("_sent_arrays",)

    def __init__(self, alpha: float = 0.01, num_clients: int = 1, **kwargs) -> None:
        super().__init__(**kwargs)
        if not alpha > 0:
            raise ConfigError(f"strategy.alpha={alpha} is invalid: must be > 0")
        self.alpha, self.num_clients = float(alpha), int(num_clients)
        #: The server's ``h`` per tensor (float64); None before round 1.
        self.h: Optional[dict[str, np.ndarray]] = None
        self._sent_arrays: Optional[ArrayRecord] = None

    @staticmethod
    def check_run(cfg) -> None:
        """Its refusals, from the config alone (before any data is read)."""
        check(cfg.strategy.alpha > 0, "strategy.alpha", cfg.strategy.alpha,
              "must be > 0 (FedDyn's regulariser; its server divides by it)")
        check_drift(cfg, "feddyn")

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._sent_arrays = arrays  # theta^{t-1}
        if self.h is None:
            self.h = {n: np.zeros(a.shape, np.float64) for n, a in arrays.items()}
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """h and theta per tensor over the clients that sent it (float64); the metrics as
        FedAvg's."""
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if not valid:
            return None, None
        sent = [arrays_of(msg) for msg in valid]
        out = ArrayRecord()
        for name, array in self._sent_arrays.items():
            thetas = [as_numpy(a[name]).astype(np.float64) for a in sent if name in a]
            if not thetas:
                out[name] = array
                continue
            prev = as_numpy(array).astype(np.float64)
            self.h[name] = self.h[name] - self.alpha / self.num_clients * sum(
                t - prev for t in thetas)
            new = sum(thetas) / len(thetas) - self.h[name] / self.alpha
            out[name] = to_array(new.astype(np.dtype(array.dtype)))
        contents = [msg.content for msg in valid]
        return out, self.train_metrics_aggr_fn(contents, self.weighted_by_key)


__all__ = ["FedDyn"]
