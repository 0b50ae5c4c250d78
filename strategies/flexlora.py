"""FlexLoRA (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous
Tasks and Client Resources", NeurIPS 2024; ``strategy=flexlora``): the SVD of the mean of the
clients' products ``B A``, split to the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from flwr.app import ArrayRecord

from fedadapt.adapters.lora import base_delta_name, pair_of
from fedadapt.strategies.capabilities import Capabilities
from fedadapt.strategies.lora_rank import (
    LoRARankStrategy,
    array_of,
    as_torch,
    matrix_a,
    matrix_b,
    normalise,
    svd_split,
    torch_dtype,
    weighted_product_sum,
)

__all__ = ["FlexLoRA", "flexlora_aggregate"]

Tensor = torch.Tensor


def flexlora_aggregate(As: Sequence[Tensor], Bs: Sequence[Tensor], p: Sequence[float],
                       r_max: int) -> tuple[Tensor, Tensor]:
    """FlexLoRA's factors: the rank-``r_max`` :func:`svd_split` of ``W = sum_k p_k B_k A_k``
    (:class:`FlexLoRA` keeps ``W - B A`` beside them, as ``X.base_delta``)."""
    return svd_split(weighted_product_sum(As, Bs, p), r_max)


#: Why no ``dp=`` composes with FlexLoRA.
NO_DP = ("its aggregate is the SVD of the mean of the products B_k A_k, quadratic in a client's "
         "update, so clipping the update does not bound what one client moves (the noise's "
         "calibration)")


class FlexLoRA(LoRARankStrategy):
    """FlexLoRA (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous
    Tasks and Client Resources", NeurIPS 2024).

    Per layer, over the clients that sent it (``p_k``: the replies' ``weighted_by_key``
    weights, normalised)::

        W = sum_k p_k B_k A_k                         (full size, out x in)
        W ~ U_r S_r V_r^T                             (truncated SVD)
        B = U_r S_r^{1/2},   A = S_r^{1/2} V_r^T      (the symmetric split)

    The server holds the whole ``W`` (of rank up to ``sum r_k``, above ``r_max``): the global
    record keeps its rank-``r_max`` factors ``B A`` and the rest, ``X.base_delta = W - B A``,
    so that the global model the server evaluates and exports, ``W0 + s (base_delta + B A)``
    (the residual folded into the frozen weight, as FLoRA's and FedEx-LoRA's are), is
    ``W0 + s W`` exactly. Client k is sent the rank-``r_k`` factors of ``W``, its best
    rank-``r_k`` approximation, and no ``base_delta`` (its LoRA holds its whole update; its
    frozen weight stays ``W0``). When ``W`` is zero (round 1: B at its zero initialisation) the
    SVD would give zero A and B, which never train, so the client is sent the truncation of the
    global factors instead. Products of raw factors: the client applies its scaling
    ``alpha / r``. Every other tensor: FedAvg's mean."""

    capabilities = Capabilities(each_tensor=True, rank_aware=True, global_fold=True,
                                no_dp=NO_DP)

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for a_name, b_name in pairs.items():
            out.pop(base_delta_name(a_name), None)  # the server's: the client's LoRA holds W
            a_now, b_now = arrays[a_name], arrays[b_name]
            w = self._whole(arrays, a_name, b_name)
            if not bool(w.any()):
                continue  # the truncation, as sent by super()
            a, b = svd_split(w, rank)
            dtype = torch_dtype(a_now)
            out[a_name] = array_of(a, (rank, *a_now.shape[1:]), dtype)
            out[b_name] = array_of(b, (b_now.shape[0], rank, *b_now.shape[2:]), dtype)
        return out

    def _whole(self, arrays: ArrayRecord, a_name: str, b_name: str) -> Tensor:
        """The layer's whole ``W = base_delta + B A`` (``out x in``, float64)."""
        product = matrix_b(as_torch(arrays[b_name]), b_name) @ matrix_a(as_torch(arrays[a_name]))
        return self._base_delta(arrays, a_name, b_name) + product

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        w = weighted_product_sum(As, Bs, normalise(weights))
        a, b = svd_split(w, current[a_name].shape[0])
        b_name = pair_of(a_name)
        # base_delta accumulates its increments: the new one makes it W - B A
        return a, b, w - b @ a - self._base_delta(current, a_name, b_name)
