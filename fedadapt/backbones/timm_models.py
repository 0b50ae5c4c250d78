"""Backbones from ``timm``: EfficientNet-B0, ICIIA's iNaturalist backbone, and any other timm
classifier's pooled feature.

``backbone.arch.model`` names the timm model (``efficientnet_b0``); ``backbone.weights`` is
``pretrained`` (timm's default pretrained tag for that model, ``efficientnet_b0.ra_in1k`` from
the Hugging Face hub: ``timm.create_model(model, pretrained=True)``), a local state-dict file
(what the original-model phase writes after fine-tuning), or null for random weights. The model
is built with ``num_classes=0``: its forward is the pooled feature (D = 1,280 for B0); the
classifier is the *original model*'s (:mod:`fedadapt.federation.server.original`). Preprocessing is
timm's data config for the model unless the preset sets ``crop_pct`` / ``interpolation``.
"""

from __future__ import annotations

import torch
from torch import nn

from fedadapt.assets import MissingAssetError, prefetch_hint
from fedadapt.backbones.base import (
    Backbone,
    file_weights_id,
    load_state_file,
    register_backbone_family,
)
from fedadapt.config import BackboneConfig, ConfigError


class TimmBackbone(Backbone):
    """A timm model without its classifier; ``forward`` returns the pooled feature."""

    has_batchnorm = True

    def __init__(self, *, model: nn.Module, weights_id: str, image_size: int) -> None:
        super().__init__()
        from timm.data import resolve_model_data_config

        self.model = model
        self.embed_dim = int(model.num_features)
        self.image_size = image_size
        self.weights_id = weights_id
        data = resolve_model_data_config(model)
        self.mean, self.std = tuple(data["mean"]), tuple(data["std"])
        self.crop_pct = float(data.get("crop_pct", 1.0))
        self.interpolation = "bicubic" if data.get("interpolation") == "bicubic" else "bilinear"

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,D]
        return self.model(images)

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The timm model's own state dict (what ``backbone.weights=<file>`` loads)."""
        return self.model.state_dict()


@register_backbone_family("timm")
def build_timm(cfg: BackboneConfig, load_weights: bool) -> TimmBackbone:
    import timm

    name = str(cfg.arch.get("model", "efficientnet_b0"))
    if name not in timm.list_models():
        raise ConfigError(f"backbone.arch.model={name!r} is invalid: not a timm model "
                          f"(e.g. efficientnet_b0)")
    weights = cfg.weights if load_weights else None
    if weights == "pretrained":
        try:
            model = timm.create_model(name, pretrained=True, num_classes=0)
        except Exception as err:  # offline and not cached (huggingface_hub's errors vary)
            raise MissingAssetError(
                prefetch_hint(f"The pretrained {name} (timm, ImageNet)", backbone=cfg.name)
            ) from err
        tag = model.pretrained_cfg.get("hf_hub_id") or name
        return TimmBackbone(model=model, weights_id=f"timm:{tag}", image_size=cfg.image_size)
    model = timm.create_model(name, pretrained=False, num_classes=0)
    if weights:  # a local state dict (the original-model phase's fine-tuned backbone)
        model.load_state_dict(load_state_file(weights))
        return TimmBackbone(model=model, weights_id=file_weights_id(weights, name),
                            image_size=cfg.image_size)
    return TimmBackbone(model=model, weights_id=f"{name}:random", image_size=cfg.image_size)
