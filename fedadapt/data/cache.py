"""Pooled features of a frozen backbone, computed once and memory-mapped everywhere.

The key is exact: a hash of the backbone's weights (whatever their source: hub, local folder,
random), the prepared data set's fingerprint, the split and the transform. Files are
``.npy`` (``np.load(mmap_mode='r')`` in every Ray worker) written to a temporary name, fsynced and
renamed, so a reader never sees a partial file.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fedadapt.data.loading import PreparedDataset
from fedadapt.data.transforms import TransformSpec
from fedadapt.results.store import atomic_write


def backbone_fingerprint(backbone) -> str:
    """Weights identity: a hash of the weights themselves, so retrained weights in the same folder
    (or a changed hub revision) never reuse stale features, and two random inits never share a key
    (DeiT-S hashes in about 0.1 s)."""
    h = hashlib.sha256()
    for name, t in sorted(backbone.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return f"{type(backbone).__name__}:{h.hexdigest()[:16]}"


def feature_key(backbone, prepared: PreparedDataset, split: str, transform: TransformSpec) -> str:
    blob = json.dumps({"backbone": backbone_fingerprint(backbone), "data": prepared.fingerprint,
                       "split": split, "transform": repr(transform)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@torch.no_grad()
def extract_features(backbone, images_of, n: int, transform: TransformSpec, *,
                     batch_size: int = 128, device: str = "cpu", label: str = "") -> np.ndarray:
    """Run ``backbone`` over ``n`` images (``images_of(start, stop)`` gives PIL images)."""
    backbone = backbone.to(device).eval()
    out = np.empty((n, backbone.embed_dim), dtype=np.float32)
    t0, last = time.time(), 0.0
    for start in range(0, n, batch_size):
        stop = min(n, start + batch_size)
        x = transform.apply(images_of(start, stop)).to(device)
        out[start:stop] = backbone(x).float().cpu().numpy()
        if time.time() - last > 5 or stop == n:
            last = time.time()
            rate = stop / max(last - t0, 1e-9)
            print(f"  features {label}: {stop}/{n} images, {rate:.0f} img/s, "
                  f"~{(n - stop) / max(rate, 1e-9):.0f} s left", file=sys.stderr, flush=True)
    return out


def cached_features(backbone, prepared: PreparedDataset, split: str, transform: TransformSpec,
                    cache_dir: str, *, device: str = "cpu") -> str:
    """Path of the ``.npy`` feature file for this (backbone, data, split, transform)."""
    key = feature_key(backbone, prepared, split, transform)
    folder = Path(cache_dir).expanduser() / "features"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prepared.name}-{split}-{key}.npy"
    if path.is_file():
        return str(path)
    ds = prepared.load()[split]
    feats = extract_features(backbone, lambda a, b: ds[a:b]["image"], len(ds), transform,
                             device=device, label=f"{prepared.name}/{split}")
    atomic_write(path, lambda fh: np.save(fh, feats), mode="wb")
    return str(path)
