"""What a client reads its batches from: cached features or images through the backbone."""

from __future__ import annotations

from dataclasses import dataclass
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
        return self.transform.apply(images), y


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
