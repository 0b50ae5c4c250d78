"""What a client reads its batches from: cached features or images through the backbone."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch

from fedadapt.data.loading import PreparedDataset
from fedadapt.data.transforms import TransformSpec


@dataclass(frozen=True)
class DataSource:
    """Picklable description of one split: features from the cache or images + transform.

    ``get(indices)`` returns ``(x, y)``: ``x`` is ``[B, D]`` features or ``[B, 3, S, S]`` images.
    """

    prepared: PreparedDataset
    split: str
    features_path: Optional[str] = None
    transform: Optional[TransformSpec] = None
    #: A corruption applied to every image (``fedadapt.data.corruptions``), its severity and
    #: the seed of its randomness (each image draws from its own seeded generator).
    corruption: Optional[str] = None
    severity: int = 0
    corruption_seed: int = 0
    #: Training augmentation: ``RandomResizedCrop`` with this area scale range (e.g. the
    #: Accumulator paper's ``(0.05, 1.0)``), drawn per image from ``crop_seed``; None = none.
    crop_scale: Optional[tuple[float, float]] = None
    crop_seed: int = 0

    def augmented(self, scale, seed: int) -> "DataSource":
        """The same split with a seeded ``RandomResizedCrop(scale)`` on each image."""
        if self.kind != "images":
            raise ValueError("augmentation applies to images, not to cached features")
        return replace(self, crop_scale=(float(scale[0]), float(scale[1])), crop_seed=int(seed))

    def corrupted(self, kind: str, severity: int, seed: int) -> "DataSource":
        """The same split with ``kind`` at ``severity`` applied to each image."""
        if self.kind != "images":
            raise ValueError("corruptions apply to images, not to cached features")
        return replace(self, corruption=kind, severity=int(severity), corruption_seed=int(seed))

    @property
    def kind(self) -> str:
        return "features" if self.features_path else "images"

    def labels(self) -> np.ndarray:
        return _labels(self.prepared.path, self.split)

    def get(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = np.asarray(indices, dtype=np.int64)
        y = torch.from_numpy(self.labels()[idx])
        if self.features_path:
            feats = _memmap(self.features_path)
            return torch.from_numpy(np.ascontiguousarray(feats[idx], dtype=np.float32)), y
        ds = self.prepared.load()[self.split]
        images = ds.select(idx.tolist())["image"] if len(idx) else []
        corrupt_on = bool(self.corruption) and self.severity > 0
        if not corrupt_on and self.crop_scale is None:
            return self.transform.apply(images), y
        from fedadapt.data.corruptions import corrupt, image_seed

        def edit(i: int, x: torch.Tensor) -> torch.Tensor:
            if corrupt_on:  # the client's data as it is ...
                gen = torch.Generator().manual_seed(image_seed(self.corruption_seed, int(idx[i])))
                x = corrupt(x, self.corruption, self.severity, gen)
            if self.crop_scale is not None:  # ... then training's augmentation
                gen = torch.Generator().manual_seed(image_seed(self.crop_seed, int(idx[i])))
                x = random_resized_crop(x, self.crop_scale, gen)
            return x

        return self.transform.apply(images, edit), y


def random_resized_crop(x: torch.Tensor, scale: tuple[float, float], gen: torch.Generator
                        ) -> torch.Tensor:
    """torchvision's ``RandomResizedCrop(size, scale, ratio=(3/4, 4/3))`` on ``[3, H, W]``, with
    its parameters drawn from ``gen`` (torchvision's own draw uses the global RNG)."""
    import math

    from torchvision.transforms import functional as TF

    _, height, width = x.shape
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):  # torchvision's rejection sampling, then its centre-crop fallback
        target = area * (scale[0] + (scale[1] - scale[0]) * float(torch.rand(1, generator=gen)))
        ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0])
                         * float(torch.rand(1, generator=gen)))
        w = int(round(math.sqrt(target * ratio)))
        h = int(round(math.sqrt(target / ratio)))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, (1,), generator=gen))
            left = int(torch.randint(0, width - w + 1, (1,), generator=gen))
            return TF.resized_crop(x, top, left, h, w, [height, width], antialias=True)
    return x

_CACHE: dict[tuple, object] = {}


def _memmap(path: str) -> np.ndarray:
    key = ("mm", path)
    if key not in _CACHE:
        _CACHE[key] = np.load(path, mmap_mode="r")
    return _CACHE[key]


def _labels(path: str, split: str) -> np.ndarray:
    key = ("labels", path, split)
    if key not in _CACHE:
        from fedadapt.data.loading import _open

        _CACHE[key] = np.asarray(_open(path)[split]["label"], dtype=np.int64)
    return _CACHE[key]
