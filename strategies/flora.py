"""FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous
Low-Rank Adaptations", NeurIPS 2024; ``strategy=flora``): the clients' factors stacked, their
product folded into the frozen weights, a fresh LoRA each round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from fedadapt.adapters.lora import base_delta_name
from fedadapt.strategies.capabilities import FOLD_NO_DP, Capabilities
from fedadapt.strategies.lora_rank import LoRARankStrategy, array_of, normalise, torch_dtype

__all__ = ["FLoRA", "flora_stack"]

Tensor = torch.Tensor


def flora_stack(As: Sequence[Tensor], Bs: Sequence[Tensor], p: Sequence[float]
                ) -> tuple[Tensor, Tensor]:
    """FLoRA's stacking: ``A_stack = [A_1; ...; A_K]`` (rows, ``sum r_k x in``),
    ``B_stack = [p_1 B_1, ..., p_K B_K]`` (columns, ``out x sum r_k``), so that
    ``B_stack A_stack = sum_k p_k B_k A_k`` exactly."""
    return torch.cat(list(As), dim=0), torch.cat([pk * b for pk, b in zip(p, Bs)], dim=1)


class FLoRA(LoRARankStrategy):
    """FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with
    Heterogeneous Low-Rank Adaptations", NeurIPS 2024).

    Per layer, over the clients that sent it (``p_k``: the replies' ``weighted_by_key``
    weights, normalised)::

        A_stack = [A_1; ...; A_K]            (the A_k stacked as rows)
        B_stack = [p_1 B_1, ..., p_K B_K]    (the p_k B_k stacked as columns)
        base_delta <- base_delta + B_stack A_stack       (= sum_k p_k B_k A_k, exactly)

    then a fresh LoRA: A drawn as peft initialises it (Kaiming-uniform with a = sqrt(5):
    uniform(-1/sqrt(in), 1/sqrt(in)), from the strategy's own generator, ``seed``), B = 0,
    at ``r_max``. Each round client k is sent ``X.base_delta`` (accumulated over the rounds;
    zero before the first) and the fresh factors truncated to ``r_k``; it folds
    ``s * base_delta`` into its frozen weight (``W0 + s * base_delta``, ``s`` its LoRA scaling)
    and trains the new LoRA. ``base_delta`` stands for the stacked factors, which the paper
    sends instead (``sum r_k`` ranks: fewer numbers than the dense ``out x in`` when
    ``sum r_k < out in / (out + in)``). Every other tensor: FedAvg's mean."""

    capabilities = Capabilities(each_tensor=True, rank_aware=True, folds_into_base=True,
                                global_fold=True, no_dp=FOLD_NO_DP)

    def __init__(self, rank_of: Callable[[int], int], seed: int = 0, **kwargs) -> None:
        super().__init__(rank_of, **kwargs)
        self.rng = np.random.default_rng(seed)  # numpy Generator: checkpointed with the state

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for a_name, b_name in pairs.items():
            d_name = base_delta_name(a_name)
            if d_name not in arrays:
                out[d_name] = array_of(self._base_delta(arrays, a_name, b_name),
                                     (arrays[b_name].shape[0], *arrays[a_name].shape[1:]),
                                     torch_dtype(arrays[a_name]))
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        a_stack, b_stack = flora_stack(As, Bs, normalise(weights))
        r_max, width = current[a_name].shape[0], As[0].shape[1]
        bound = 1.0 / math.sqrt(width)
        fresh_a = torch.from_numpy(self.rng.uniform(-bound, bound, size=(r_max, width)))
        fresh_b = torch.zeros(Bs[0].shape[0], r_max, dtype=torch.float64)
        return fresh_a, fresh_b, b_stack @ a_stack
