"""Image transforms, described by a small picklable spec (part of the feature-cache key)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class TransformSpec:
    """Resize to ``image_size`` square, RGB, to tensor, normalise with the backbone's stats."""

    image_size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def for_backbone(cls, backbone) -> "TransformSpec":
        return cls(int(backbone.image_size), tuple(map(float, backbone.mean)),
                   tuple(map(float, backbone.std)))

    def build(self):
        import torchvision.transforms as T

        return T.Compose([
            T.Lambda(lambda im: im.convert("RGB")),
            T.Resize((self.image_size, self.image_size)),
            T.ToTensor(),
            T.Normalize(self.mean, self.std),
        ])

    def apply(self, images) -> torch.Tensor:  # list of PIL -> [B, 3, S, S]
        tf = _built(self)
        return torch.stack([tf(im) for im in images])


@lru_cache(maxsize=8)
def _built(spec: TransformSpec):
    return spec.build()
