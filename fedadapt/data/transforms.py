"""Image transforms, described by a small picklable spec (part of the feature-cache key)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Optional

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
        """``(to_tensor, normalize)``: PIL -> ``[3, S, S]`` in [0, 1], then the backbone's
        normalisation (corruptions apply in between, on the [0, 1] image)."""
        import torchvision.transforms as T

        to_tensor = T.Compose([
            T.Lambda(lambda im: im.convert("RGB")),
            T.Resize((self.image_size, self.image_size)),
            T.ToTensor(),
        ])
        return to_tensor, T.Normalize(self.mean, self.std)

    def apply(self, images, edit: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None
              ) -> torch.Tensor:
        """PIL images -> ``[B, 3, S, S]``; ``edit(i, image)`` changes image ``i`` in [0, 1]
        space before normalisation (e.g. a corruption)."""
        to_tensor, normalize = _built(self)
        out = []
        for i, im in enumerate(images):
            x = to_tensor(im)
            out.append(normalize(edit(i, x) if edit is not None else x))
        return torch.stack(out)


@lru_cache(maxsize=8)
def _built(spec: TransformSpec):
    return spec.build()
