"""A cosine classifier head: the worked example of docs/adding-a-method.md.

The logits are the cosine similarities between the pooled feature and one learned weight vector
per class, times a scale ``s``: ``s * cos(f, w_c)``. Normalising both sides removes the feature
norm from the decision, so a client whose classes are few cannot inflate their weights' norms
(the usual remedy for label skew in federated heads); ``s`` sets how peaked the softmax is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import register_method
from fedadapt.config import ConfigError, MethodConfig
from fedadapt.grouping import forms


@dataclass
class CosineHeadConfig(MethodConfig):
    """``method=cosine_head``: its keys, their defaults, and their domains (:meth:`check`)."""

    name: str = "cosine_head"
    #: The scale ``s`` of the cosine logits.
    scale: float = 16.0
    #: Learn ``s`` (initialised at ``scale``) with the weights, or keep it fixed.
    learn_scale: bool = False

    def check(self) -> None:
        if not self.scale > 0:
            raise ConfigError(f"method.scale={self.scale} is invalid: must be > 0")


class CosineClassifier(nn.Module):
    """``[B, D] -> [B, C]``: ``s * cos(feature, w_c)`` for every class ``c``."""

    #: Its tensors are the classifier (:func:`fedadapt.adapters.personal.head_names`).
    is_class_weights = True

    def __init__(self, dim: int, num_classes: int, scale: float, learn_scale: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_classes, dim) / dim ** 0.5)
        self.scale = nn.Parameter(torch.tensor(float(scale)), requires_grad=learn_scale)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.scale * F.linear(F.normalize(feats, dim=-1), F.normalize(self.weight, dim=-1))


def grouped_forward(m: CosineClassifier, prefix: str, slots: forms.Slots, feats: torch.Tensor
                    ) -> torch.Tensor:
    """Clients side by side (:mod:`fedadapt.grouping.forms`): ``feats`` holds ``n`` clients'
    rows, ``slots.rows`` each; every client's rows against its own weights (and scale)."""
    n = len(feats) // slots.rows
    weight = slots.take(prefix + ".weight", n)  # [n, C, D], or None where it does not train
    if weight is None:
        return CosineClassifier.forward(m, feats)
    scale = slots.take(prefix + ".scale", n)  # [n] when learned
    scale = m.scale if scale is None else scale.view(n, 1, 1)
    rows = F.normalize(feats, dim=-1).view(n, slots.rows, -1)  # [n, B, D]
    logits = scale * forms.slot_matmul(rows, F.normalize(weight, dim=-1))  # [n, B, C]
    return logits.reshape(len(feats), -1)


forms.register_form(CosineClassifier, grouped_forward)


@register_method("cosine_head", CosineHeadConfig)
def build_cosine_head(cfg: CosineHeadConfig, backbone, num_classes: int, with_backbone: bool
                      ) -> AdaptedModel:
    """The frozen backbone (None when the run trains from cached features) and the head."""
    head = CosineClassifier(backbone.embed_dim, num_classes, cfg.scale, cfg.learn_scale)
    return AdaptedModel(head=head, backbone=backbone if with_backbone else None)
