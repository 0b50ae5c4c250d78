"""LEAF's FEMNIST CNN, the backbone of ICIIA's FEMNIST rows.

Defined from the LEAF paper's description of its FEMNIST model (Caldas et al., 2018, "LEAF: A
Benchmark for Federated Settings", Sec. 4: "a CNN with two 5x5 convolution layers (the first
with 32 channels, the second with 64, each followed with 2x2 max pooling), a fully connected
layer with 2048 units and ReLU activation, and a final softmax output layer"), with "same"
padding so a 28 x 28 image leaves 7 x 7 x 64 for the dense layer, as LEAF's reference model
(``models/femnist/cnn.py``) and the ICIIA authors' port (``code/model/cnn.py``) have it.

The backbone is everything up to the 2,048-unit ReLU layer (D = 2,048); the final layer is the
*original model*'s classifier, trained with it from scratch on the training clients' pooled
data (``original.train_backbone``, :mod:`fedadapt.federation.server.original`), as ICIIA trains it.
Inputs are 28 x 28 grey images; the three channels the data path delivers are averaged (equal
for grey images). Pixels are scaled to [0, 1] and shifted by -0.5 (the ICIIA authors' FEMNIST
input, ``code/dataset/femnist.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from fedadapt.backbones.base import (
    Backbone,
    file_weights_id,
    load_state_file,
    register_backbone_family,
)
from fedadapt.config import BackboneConfig, ConfigError


class LeafCNN(Backbone):
    """LEAF's FEMNIST CNN without its output layer: ``[B, 3, 28, 28] -> [B, 2048]``.

    Parameters
    ----------
    hidden : int
        Units of the dense layer (LEAF: 2,048), the feature dimension D.
    image_size : int
        Input side (LEAF: 28; must be a multiple of 4).
    """

    crop_pct = 1.0
    interpolation = "bilinear"
    mean = (0.5, 0.5, 0.5)
    std = (1.0, 1.0, 1.0)

    def __init__(self, *, hidden: int = 2048, image_size: int = 28,
                 weights_id: str = "random") -> None:
        super().__init__()
        if image_size % 4:
            raise ConfigError(f"backbone.image_size={image_size} is invalid for LEAF's CNN: two "
                              f"2x2 poolings need a multiple of 4 (LEAF: 28)")
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),   # [B, 32, S/2, S/2]
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # [B, 64, S/4, S/4]
            nn.Flatten(),
            nn.Linear(64 * (image_size // 4) ** 2, hidden), nn.ReLU(),   # [B, hidden]
        )
        self.embed_dim = hidden
        self.image_size = image_size
        self.weights_id = weights_id

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,S,S] -> [B,hidden]
        return self.features(images.mean(1, keepdim=True))       # grey: [B, 1, S, S]


@register_backbone_family("leaf_cnn")
def build_leaf_cnn(cfg: BackboneConfig, load_weights: bool) -> LeafCNN:
    """``backbone.weights``: a local state dict (what the original-model phase writes), or null
    for the seeded random initialisation (``build_backbone`` seeds ``arch.init_seed``)."""
    model = LeafCNN(hidden=int(cfg.arch.get("hidden", 2048)), image_size=cfg.image_size)
    if load_weights and cfg.weights:
        model.load_state_dict(load_state_file(cfg.weights))
        model.weights_id = file_weights_id(cfg.weights, "leaf_cnn")
    else:
        model.weights_id = f"random-seed{int(cfg.arch.get('init_seed', 0))}"
    return model
