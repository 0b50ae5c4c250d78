"""Pooled features of a frozen backbone, computed once and memory-mapped everywhere.

The key is exact: a hash of the backbone's weights (whatever their source: hub, local folder,
random), the prepared data set's fingerprint, the split, the preprocessing and the precision the
backbone ran in. Images come from the decoded store through the device transforms
(:mod:`fedadapt.data.sources`), batches prepared one ahead. Files are ``.npy`` sealed with their
SHA-256 (:mod:`fedadapt.data.integrity`): a file that fails its digest (truncated, changed in
place) is rebuilt before anything uses it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from fedadapt import progress
from fedadapt.data.loading import PreparedDataset
from fedadapt.data.transforms import Preprocess


def backbone_fingerprint(backbone) -> str:
    """Weights identity: a hash of the weights themselves, so retrained weights in the same folder
    (or a changed hub revision) never reuse stale features, and two random inits never share a key
    (DeiT-S hashes in about 0.1 s)."""
    h = hashlib.sha256()
    for name, t in sorted(backbone.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return f"{type(backbone).__name__}:{h.hexdigest()[:16]}"


def feature_key(backbone, prepared: PreparedDataset, split: str, preprocess: Preprocess,
                precision: str = "fp32", *, weights: Optional[str] = None) -> str:
    """``weights``: :func:`backbone_fingerprint` of ``backbone`` where the caller has it."""
    weights = weights or backbone_fingerprint(backbone)
    blob = json.dumps({"backbone": weights, "data": prepared.fingerprint,
                       "split": split, "preprocess": repr(preprocess), "precision": precision},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@torch.no_grad()
def extract_features(backbone, source, *, batch_size: int = 256, device: str = "cpu",
                     precision: str = "fp32", label: str = "",
                     indices: Optional[np.ndarray] = None) -> np.ndarray:
    """Run ``backbone`` over the images ``indices`` of ``source`` (a :class:`DataSource` of
    images; default every image): row i of the result is image ``indices[i]``'s feature."""
    from fedadapt.devices import autocast

    backbone = backbone.to(device).eval()
    if indices is None:
        indices = np.arange(len(source.labels()))
    n = len(indices)
    out = np.empty((n, backbone.embed_dim), dtype=np.float32)
    starts = range(0, n, batch_size)
    batches = [indices[s:s + batch_size] for s in starts]
    with progress.task(f"features {label}", total=n, unit="images") as bar:
        for s, (x, _) in zip(starts, source.stream(batches, device)):
            with autocast(device, precision):
                feats = backbone(x)
            out[s:s + len(feats)] = feats.float().cpu().numpy()
            bar.advance(len(feats))
    return out


def cached_features(backbone, source, cache_dir: str, *, device: str = "cpu",
                    precision: str = "fp32", weights: Optional[str] = None) -> str:
    """Path of the sealed ``.npy`` feature file of ``source``'s images through ``backbone``,
    computed on ``device`` in ``precision`` (keyed by what the matmuls compute in: TF32 on CUDA
    is not fp32). ``weights``: :func:`backbone_fingerprint` of ``backbone`` where the caller has
    it (the weights are hashed once, not per key)."""
    from fedadapt.data.integrity import save_npy, valid_or_removed
    from fedadapt.devices import compute_precision

    prepared, split = source.prepared, source.split
    weights = weights or backbone_fingerprint(backbone)
    key = feature_key(backbone, prepared, split, source.preprocess,
                      compute_precision(device, precision), weights=weights)
    folder = Path(cache_dir).expanduser() / "features"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prepared.name}-{split}-{key}.npy"
    if valid_or_removed(path):
        return str(path)
    label = f"{prepared.name}/{split}"
    origin = prepared.source_rows(split)
    if origin is None:
        save_npy(path, extract_features(backbone, source, device=device, precision=precision,
                                        label=label))
        return str(path)
    # the source's rows through this backbone, shared by every prepared copy of the source
    # (another seed, another subsample): only the rows none of them held are run
    from fedadapt.data.rows import RowCache, gathered_file, row_cache_key

    base, rows = origin
    key = row_cache_key(backbone=weights, source=prepared.source_key,
                        split=base, preprocess=repr(source.preprocess),
                        precision=compute_precision(device, precision))
    cache = RowCache(folder / f"{prepared.name}-rows-{base}-{key}")
    at = cache.missing(rows)  # the split's images whose source rows nobody ran
    if len(at):
        feats = extract_features(backbone, source, device=device, precision=precision,
                                 label=label, indices=at)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:
                np.save(fh, feats)

        cache.add(rows[at], write)
    gathered_file(path, (len(rows), backbone.embed_dim), np.float32, cache, rows,
                  f"features {label}")
    return str(path)
