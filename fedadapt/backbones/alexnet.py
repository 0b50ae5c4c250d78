"""AlexNet, torchvision's definition: FedCLIP's small-network baseline (FedAvg / FedProx over the
whole network).

``backbone.weights``: null trains it from its random initialisation (the default: no AlexNet
weights exist offline), ``IMAGENET1K_V1`` takes torchvision's ImageNet weights (downloaded by
torchvision on a connected machine), or a local state-dict path. The pooled feature is the output
of the second 4,096-wide fully connected layer (after its ReLU): torchvision's classifier without
its last ``Linear(4096, 1000)``, so the method's head maps 4,096 features to the classes.
"""

from __future__ import annotations

import hashlib
import os

import torch
from torch import nn

from fedadapt.assets import MissingAssetError, prefetch_hint
from fedadapt.backbones.base import Backbone, register_backbone_family
from fedadapt.config import BackboneConfig


class AlexNetBackbone(Backbone):
    """torchvision's AlexNet up to its penultimate layer; D = 4,096.

    Preprocessing as torchvision's ImageNet weights: bilinear resize to 256, centre crop 224.
    """

    crop_pct = 224 / 256

    def __init__(self, *, model: nn.Module, weights_id: str, image_size: int) -> None:
        super().__init__()
        model.classifier = model.classifier[:-1]  # drop Linear(4096, 1000)
        self.model = model
        self.embed_dim = model.classifier[-2].out_features
        self.image_size = image_size
        self.weights_id = weights_id

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,4096]
        return self.model(images)


@register_backbone_family("alexnet")
def build_alexnet(cfg: BackboneConfig, load_weights: bool) -> AlexNetBackbone:
    from torchvision.models import AlexNet_Weights, alexnet

    model = alexnet(weights=None)
    weights_id = "random"
    if load_weights and cfg.weights:
        if os.path.isfile(cfg.weights):
            try:
                model.load_state_dict(torch.load(cfg.weights, map_location="cpu",
                                                 weights_only=True))
            except Exception as err:  # corrupt or foreign file
                raise MissingAssetError(f"backbone.weights: {cfg.weights} is not a valid "
                                        f"AlexNet state dict ({err})") from err
            with open(cfg.weights, "rb") as fh:
                weights_id = f"alexnet:{hashlib.sha256(fh.read()).hexdigest()[:16]}"
        else:
            try:
                weights = AlexNet_Weights[cfg.weights]
            except KeyError as err:
                raise MissingAssetError(f"backbone.weights={cfg.weights!r} is neither a file nor "
                                        f"one of {[w.name for w in AlexNet_Weights]}") from err
            try:
                model = alexnet(weights=weights)
            except Exception as err:  # offline: torchvision cannot download
                raise MissingAssetError(prefetch_hint(f"AlexNet weights {cfg.weights}",
                                                      backbone=cfg.name)) from err
            weights_id = f"alexnet:{cfg.weights}"
    return AlexNetBackbone(model=model, weights_id=weights_id, image_size=cfg.image_size)
