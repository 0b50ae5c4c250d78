"""FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
Learning", ICLR 2025; ``strategy=fedsa_lora``): only the A matrices are shared and averaged; each
client keeps its own B.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedadapt.adapters.lora import LORA_B, is_lora_a, lora_pairs, pair_of
from fedadapt.strategies.capabilities import Capabilities
from fedadapt.strategies.lora_rank import LoRARankStrategy, normalise, pad_rank

__all__ = ["FedSALoRA", "fedsa_aggregate"]

Tensor = torch.Tensor


def fedsa_aggregate(As: Sequence[Tensor], p: Sequence[float], r_max: int) -> Tensor:
    """FedSA-LoRA: ``A = sum_k p_k pad(A_k)``, zero-padded to ``r_max``; B is not shared."""
    return sum(pk * pad_rank(a, None, r_max)[0] for a, pk in zip(As, p))


class FedSALoRA(LoRARankStrategy):
    """FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
    Learning", ICLR 2025).

    Only the A matrices are shared: client k is sent ``A[:r_k]`` (and every non-LoRA tensor),
    never B, and any B in its reply is ignored; B stays on the client (its own, kept across
    rounds). Per layer, over the clients that sent A (``p_k``: the replies'
    ``weighted_by_key`` weights, normalised)::

        A = sum_k p_k pad(A_k, r_max)

    With heterogeneous ranks (not in the paper) each A_k is zero-padded to ``r_max`` (zero
    rows); with equal ranks this is FedAvg on A. The global record's B keeps its initial value
    and is never sent: the global model has no B of its own (evaluate it on the clients, with
    theirs). Raw A: the scaling ``s`` multiplies the client's own ``B A``. Every other tensor:
    FedAvg's mean."""

    capabilities = Capabilities(each_tensor=True, rank_aware=True, fedavg_sensitivity=True,
                                shares_only_a=True)

    shares_b = False

    def pairs(self, names):
        """Every A with its B's name: the global record may hold no B at all (fedadapt keeps
        B on each client, a personal tensor, so it is not part of the global model)."""
        names = list(names)
        if not any(LORA_B in n.split(".") for n in names):
            return {n: pair_of(n) for n in names if is_lora_a(n)}
        return lora_pairs(names)

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for b_name in pairs.values():
            if b_name in out:
                del out[b_name]
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        return fedsa_aggregate(As, normalise(weights), current[a_name].shape[0]), None, None
