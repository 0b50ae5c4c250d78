"""A small convolutional backbone (random init) for fast tests and toy runs."""

from __future__ import annotations

import torch
from torch import nn

from fedadapt.backbones.base import Backbone, load_state_file, register_backbone_family
from fedadapt.config import BackboneConfig, ConfigError


class SmallCNN(Backbone):
    """Two conv blocks and average pooling to a ``pool x pool`` grid:
    ``[B,3,H,W] -> [B, width*2*pool*pool]`` (``pool=1``: global average pooling)."""

    def __init__(self, *, width: int = 16, image_size: int = 32, weights_id: str = "random",
                 pool: int = 1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(pool), nn.Flatten(),
        )
        self.embed_dim = 2 * width * pool * pool
        self.image_size = image_size
        self.weights_id = weights_id
        self.mean, self.std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.features(images)


@register_backbone_family("small_cnn")
def build_small_cnn(cfg: BackboneConfig, load_weights: bool) -> SmallCNN:
    """``arch``: ``width``, ``pool`` (the final pooling grid), ``init_seed``, ``init``
    (``small``: N(0, 0.1) weights, the tests' default; ``kaiming``: He-normal weights and zero
    biases, whose random features a linear head can learn from)."""
    pool, init = int(cfg.arch.get("pool", 1)), str(cfg.arch.get("init", "small"))
    if pool < 1 or init not in ("small", "kaiming"):
        raise ConfigError(f"backbone.arch={dict(cfg.arch)} is invalid: small_cnn takes pool >= 1 "
                          f"and init 'small' or 'kaiming'")
    model = SmallCNN(width=int(cfg.arch.get("width", 16)), image_size=cfg.image_size, pool=pool)
    if load_weights and cfg.weights:
        model.load_state_dict(load_state_file(cfg.weights))
        model.weights_id = cfg.weights
    else:
        # Seeded init so "random" weights are the same in every process (cache key "random").
        seed = int(cfg.arch.get("init_seed", 0))
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if init == "kaiming":
                std = (2.0 / p[0].numel()) ** 0.5 if p.dim() > 1 else 0.0
            else:
                std = 0.1 if p.dim() > 1 else 0.01
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        model.weights_id = f"random-seed{seed}" + ("" if init == "small" else f"-{init}") + (
            "" if pool == 1 else f"-pool{pool}")
    return model
