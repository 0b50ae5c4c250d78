"""FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated and Efficient
Fine-Tuning of Foundation Models", ACL 2025; ``strategy=fedex_lora``): FedAvg of the factors and
the residual to the exact mean of the products folded into the frozen weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedadapt.adapters.lora import base_delta_name, pair_of
from fedadapt.strategies.capabilities import FOLD_NO_DP, Capabilities
from fedadapt.strategies.lora_rank import (
    LoRARankStrategy,
    array_of,
    as_torch,
    matrix_a,
    matrix_b,
    normalise,
    pad_rank,
    torch_dtype,
    weighted_product_sum,
)

__all__ = ["FedExLoRA", "fedex_aggregate"]

Tensor = torch.Tensor


def fedex_aggregate(As: Sequence[Tensor], Bs: Sequence[Tensor], p: Sequence[float],
                    r_max: int) -> tuple[Tensor, Tensor, Tensor]:
    """FedEx-LoRA: ``A = sum_k p_k pad(A_k)``, ``B = sum_k p_k pad(B_k)`` (FedAvg) and the
    residual ``R = sum_k p_k B_k A_k - B A``, so that ``B A + R = sum_k p_k B_k A_k``;
    returns ``(A, B, R)``."""
    padded = [pad_rank(a, b, r_max) for a, b in zip(As, Bs)]
    a = sum(pk * x for pk, (x, _) in zip(p, padded))
    b = sum(pk * y for pk, (_, y) in zip(p, padded))
    return a, b, weighted_product_sum(As, Bs, p) - b @ a


class FedExLoRA(LoRARankStrategy):
    """FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated and Efficient
    Fine-Tuning of Foundation Models", ACL 2025).

    Per layer, over the clients that sent it (``p_k``: the replies' ``weighted_by_key``
    weights, normalised)::

        A = sum_k p_k A_k,   B = sum_k p_k B_k                (FedAvg)
        R = sum_k p_k B_k A_k - B A                           (the residual)
        base_delta <- base_delta + R

    so that the global model, ``W0 + s (base_delta + B A)``, moves by exactly
    ``s sum_k p_k B_k A_k`` (raw products; ``s`` the client's scaling), and with one rank the
    new global model is exactly the ``p``-weighted mean of the clients' models.

    Heterogeneous ranks (not in the paper): client k is sent ``A[:r_k]``, ``B[:, :r_k]`` and
    ``D_k = base_delta + B[:, r_k:] A[r_k:]`` (the components it cannot hold folded in, so it
    starts from the exact global model); A_k and B_k are zero-padded to ``r_max`` before the
    means, and the folded tails are kept::

        base_delta <- sum_k p_k D_k + R = base_delta + R + sum_k p_k B[:, r_k:] A[r_k:]

    (``B``, ``A`` on the right: the global factors sent), so the new global model is again
    exactly the mean of the clients' models ``W0 + s (D_k + B_k A_k)``. Every other tensor:
    FedAvg's mean."""

    capabilities = Capabilities(each_tensor=True, rank_aware=True, folds_into_base=True,
                                global_fold=True, no_dp=FOLD_NO_DP)

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for a_name, b_name in pairs.items():
            a_now, b_now = arrays[a_name], arrays[b_name]
            d_name = base_delta_name(a_name)
            if d_name in arrays and rank == a_now.shape[0]:
                continue  # as it is
            delta = self._base_delta(arrays, a_name, b_name)
            if rank < a_now.shape[0]:
                a = matrix_a(as_torch(a_now))
                b = matrix_b(as_torch(b_now), b_name)
                delta = delta + b[:, rank:] @ a[rank:]
            dtype = torch_dtype(arrays[d_name]) if d_name in arrays else torch_dtype(a_now)
            out[d_name] = array_of(delta, (b_now.shape[0], *a_now.shape[1:]), dtype)
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        p = normalise(weights)
        a, b, residual = fedex_aggregate(As, Bs, p, current[a_name].shape[0])
        if min(ranks) < current[a_name].shape[0]:  # the tails the clients were sent folded
            b_name = pair_of(a_name)
            a_now = matrix_a(as_torch(current[a_name]))
            b_now = matrix_b(as_torch(current[b_name]), b_name)
            residual = residual + sum(pk * (b_now[:, r:] @ a_now[r:]) for pk, r in zip(p, ranks))
        return a, b, residual
