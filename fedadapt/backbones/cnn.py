"""A small convolutional backbone (random init) for fast tests and toy runs."""

from __future__ import annotations

import torch
from torch import nn

from fedadapt.backbones.base import Backbone, load_state_file, register_family
from fedadapt.config import BackboneConfig


class SmallCNN(Backbone):
    """Two conv blocks and global average pooling: ``[B,3,H,W] -> [B, width*2]``."""

    def __init__(self, *, width: int = 16, image_size: int = 32, weights_id: str = "random"):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.embed_dim = 2 * width
        self.image_size = image_size
        self.weights_id = weights_id
        self.mean, self.std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images)


@register_family("small_cnn")
def build_small_cnn(cfg: BackboneConfig, load_weights: bool) -> SmallCNN:
    model = SmallCNN(width=int(cfg.arch.get("width", 16)), image_size=cfg.image_size)
    if load_weights and cfg.weights:
        model.load_state_dict(load_state_file(cfg.weights))
        model.weights_id = cfg.weights
    else:
        # Seeded init so "random" weights are the same in every process (cache key "random").
        gen = torch.Generator().manual_seed(int(cfg.arch.get("init_seed", 0)))
        for p in model.parameters():
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 0.01))
        model.weights_id = f"random-seed{int(cfg.arch.get('init_seed', 0))}"
    return model
