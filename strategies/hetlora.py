"""HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation
Models", EMNLP 2024; ``strategy=hetlora``): sparsity-weighted means of the clients' LoRA factors,
zero-padded to the largest rank, and the clients' rank self-pruning (:func:`self_prune`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from flwr.app import ConfigRecord

from fedadapt.adapters.lora import is_lora_a
from fedadapt.config import ConfigError
from fedadapt.strategies.capabilities import Capabilities
from fedadapt.strategies.lora_rank import (
    LoRARankStrategy,
    matrix_a,
    matrix_b,
    normalise,
    pad_rank,
    reply_arrays,
    truncate_rank,
)

__all__ = ["HetLoRA", "hetlora_aggregate", "self_prune", "sparsity_weights"]

Tensor = torch.Tensor


def sparsity_weights(As: Sequence[Tensor], Bs: Sequence[Tensor],
                     base: Sequence[float] | None = None) -> list[float]:
    """HetLoRA's sparsity weights: ``w_k ∝ ||B_k A_k||_F`` (times ``base[k]`` when given, the
    data-size weights), normalised to sum 1. When every product is zero (B still at its zero
    initialisation) the weights are ``base`` (or uniform), normalised."""
    base = [1.0] * len(As) if base is None else [float(x) for x in base]
    raw = [float(torch.linalg.matrix_norm(b @ a)) * x for a, b, x in zip(As, Bs, base)]
    return normalise(raw if sum(raw) > 0 else base)


def hetlora_aggregate(As: Sequence[Tensor], Bs: Sequence[Tensor], r_max: int,
                      base: Sequence[float] | None = None, sparsity: bool = True
                      ) -> tuple[Tensor, Tensor, list[float]]:
    """HetLoRA: ``A = sum_k w_k pad(A_k)``, ``B = sum_k w_k pad(B_k)`` with the
    :func:`sparsity_weights` ``w`` (``sparsity=False``: ``w`` is ``base``, or uniform,
    normalised: the plain zero-padded average), every factor zero-padded to ``r_max``; returns
    ``(A, B, w)``."""
    w = (sparsity_weights(As, Bs, base) if sparsity else
         normalise([1.0] * len(As) if base is None else base))
    padded = [pad_rank(a, b, r_max) for a, b in zip(As, Bs)]
    return (sum(wk * a for wk, (a, _) in zip(w, padded)),
            sum(wk * b for wk, (_, b) in zip(w, padded)), w)


def self_prune(a, b, gamma: float):
    """HetLoRA's rank self-pruning on the client (``A``: ``r x in``, ``B``: ``out x r``; numpy
    or torch; peft's conv shapes too): drop the last rank component while its contribution is
    small, ``||B[:, -1] A[-1, :]||_F < gamma * ||B A||_F`` (the norms of the pair as pruned so
    far), keeping rank >= 1; returns ``(A[:r'], B[:, :r'])``. With ``B A = 0`` (B at its zero
    initialisation) nothing is pruned.

    Our reading of Cho et al. (EMNLP 2024), who prune trailing ranks whose contribution has
    become small (their clients also add a norm regulariser on those trailing ranks to the local
    loss; that regulariser is the client's training and is not here). The server accepts a
    reply whose rank is below the rank it sent."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (
            math.isfinite(gamma) and gamma >= 0):
        raise ConfigError(f"gamma={gamma!r} is invalid: a finite number >= 0")
    am, bm = matrix_a(a), matrix_b(b)
    r = am.shape[0]
    while r > 1:
        last = torch.linalg.vector_norm(bm[:, r - 1]) * torch.linalg.vector_norm(am[r - 1])
        if not last < gamma * torch.linalg.matrix_norm(bm[:, :r] @ am[:r]):
            break
        r -= 1
    return truncate_rank(a, b, r)


class HetLoRA(LoRARankStrategy):
    """HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
    Foundation Models", EMNLP 2024).

    The global LoRA has the largest rank ``r_max``. Client k (rank ``r_k``) is sent the
    truncation ``A[:r_k]``, ``B[:, :r_k]``. Per layer, over the clients that sent it::

        w_k = ||B_k A_k||_F * (n_k if data_weighted else 1),   normalised to sum 1
        A = sum_k w_k pad(A_k, r_max),   B = sum_k w_k pad(B_k, r_max)

    ``pad`` appends zero rows to A and zero columns to B (sparsity-weighted aggregation; ``n_k``
    is the reply's ``weighted_by_key``). When every product is zero (B at its zero
    initialisation) ``w_k`` falls back to ``n_k`` (or uniform), normalised. A reply's rank may
    be below the rank sent (the client's :func:`self_prune`); its missing components are zero
    in the padding. Raw factors and products: the client applies its scaling ``alpha / r``.
    With equal ranks and equal norms this is FedAvg (uniform, or weighted by ``n_k`` with
    ``data_weighted``). Every other tensor: FedAvg's mean. With ``prune_gamma > 0`` the
    clients prune their trailing rank components after training (:func:`self_prune`, the
    ``prune-gamma`` in their config) and keep the smaller rank in later rounds (the server
    sends them that rank from then on).

    ``sparsity_weighted=False`` drops the sparsity weights: ``w_k`` is ``n_k`` (or uniform),
    the plain zero-padded average. The new global factors are then the padded truncations
    sent (public) plus the mean of the clients' updates, which is what client-side DP's noise
    is calibrated to (``dp=client_fixed``; the sparsity weights depend on the updates)."""

    capabilities = Capabilities(each_tensor=True, rank_aware=True, prunes_rank=True,
                                fedavg_sensitivity=True)

    @staticmethod
    def check_dp(cfg) -> None:
        """HetLoRA's own refusals of a DP wrapper, from the config alone: under client-side
        DP (whose noise is calibrated to the plain mean of the clipped updates) neither its
        sparsity weights nor its pruning."""
        st, dp = cfg.strategy, cfg.dp
        if st.sparsity_weighted:
            raise ConfigError(f"strategy.sparsity_weighted=true is invalid with dp={dp.name}: "
                              f"HetLoRA's weights ||B_k A_k|| depend on the clients' updates, so "
                              f"one client moves the aggregate by more than clipping_norm / "
                              f"clients (the noise's calibration); set "
                              f"strategy.sparsity_weighted=false (the plain zero-padded mean)")
        if st.prune_gamma > 0:
            raise ConfigError(f"strategy.prune_gamma={st.prune_gamma} is invalid with "
                              f"dp={dp.name}: a client that prunes replies at a smaller rank "
                              f"than it was sent, and the clipping mod measures the update "
                              f"against what was sent; set strategy.prune_gamma=0")

    def __init__(self, rank_of: Callable[[int], int], data_weighted: bool = False,
                 prune_gamma: float = 0.0, sparsity_weighted: bool = True, **kwargs) -> None:
        super().__init__(rank_of, **kwargs)
        self.data_weighted = bool(data_weighted)
        self.sparsity_weighted = bool(sparsity_weighted)
        if isinstance(prune_gamma, bool) or not isinstance(prune_gamma, (int, float)) or not (
                math.isfinite(prune_gamma) and prune_gamma >= 0):
            raise ConfigError(f"prune_gamma={prune_gamma!r} is invalid: a finite number >= 0 "
                              f"(0: no pruning)")
        self.prune_gamma = float(prune_gamma)
        #: Each client's rank after its self-pruning (node id as text -> rank): it keeps it.
        self.pruned: dict[str, int] = {}

    def client_rank(self, node_id: int) -> int:
        """The client's rank, or the smaller one it pruned itself to (it keeps it)."""
        rank = super().client_rank(node_id)
        return min(rank, self.pruned.get(str(node_id), rank))

    def configure_train(self, server_round, arrays, config, grid):
        """As for every rank strategy, with ``prune-gamma`` in the clients' config: a client
        prunes its trailing rank components (:func:`self_prune`) after training."""
        if self.prune_gamma > 0:
            config = ConfigRecord({**dict(config), "prune-gamma": self.prune_gamma})
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        out = super().aggregate_train(server_round, replies)
        for msg in replies:  # the ranks the clients pruned themselves to
            if msg.has_error():
                continue
            arrays = reply_arrays(msg.content)
            a_names = [n for n in arrays.keys() if is_lora_a(n)]
            if a_names:
                node = str(msg.metadata.src_node_id)
                rank = int(arrays[a_names[0]].shape[0])
                self.pruned[node] = min(rank, self.pruned.get(node, rank))
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        a, b, _ = hetlora_aggregate(As, Bs, current[a_name].shape[0],
                                    weights if self.data_weighted else None,
                                    sparsity=self.sparsity_weighted)
        return a, b, None
