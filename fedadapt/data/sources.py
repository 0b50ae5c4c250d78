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
        if not self.corruption or self.severity == 0:
            return self.transform.apply(images), y
        from fedadapt.data.corruptions import corrupt, image_seed

        def edit(i: int, x: torch.Tensor) -> torch.Tensor:
            gen = torch.Generator().manual_seed(image_seed(self.corruption_seed, int(idx[i])))
            return corrupt(x, self.corruption, self.severity, gen)

        return self.transform.apply(images, edit), y


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
