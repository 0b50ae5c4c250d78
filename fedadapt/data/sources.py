"""What a client reads its batches from: cached features, or decoded images transformed on the
model's device.

:meth:`DataSource.stream` is the one data path of every training and evaluation loop: given the
batches' indices (a round's shuffled order cut into batches), it yields ``(x, y)`` on the device,

* **features**: the rows of every batch moved to the device once (one copy per call, i.e. per
  client and round), then indexed there;
* **images**: each batch's ``uint8`` rows gathered from the memory-mapped store
  (:mod:`fedadapt.data.store`), copied to the device (pinned memory and a side stream on CUDA),
  then resized / cropped / normalised there (:mod:`fedadapt.data.transforms`). Audio data
  takes the same path (``kind`` is ``images`` too: the backbone's raw input from a store): its
  store holds the clips' spectrograms (:mod:`fedadapt.data.audio`), its ``preprocess`` is an
  :class:`~fedadapt.data.audio.AudioPreprocess`; ``modality`` tells them apart.

On CUDA the next batch is prepared in a background thread (on a side stream) while the caller
trains on the current one; on the CPU the batches are made in turn (:func:`prefetched`).
A corrupted source (the personalization setting's CIFAR-100-C corruptions) corrupts its images
once, at native resolution, before any resize; a corrupted audio source mixes background noise
into the waveforms before the spectrogram (:func:`corrupted_rows`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from fedadapt.config import ConfigError
from fedadapt.data.loading import PreparedDataset
from fedadapt.data.store import ImageStore
from fedadapt.data.transforms import Preprocess, model_input, to_float

if TYPE_CHECKING:
    from fedadapt.data.audio import AudioPreprocess, SpectrogramStore

#: ``(crop scale, per-image seeds)`` of a batch's training crop, or None.
Crop = Optional[tuple[tuple[float, float], np.ndarray]]


@dataclass(frozen=True)
class DataSource:
    """Picklable description of one split: cached features, or a decoded image store and the
    backbone's preprocessing (optionally corrupted: the client's data as it is)."""

    prepared: PreparedDataset
    split: str
    features_path: Optional[str] = None
    store: Optional[Union[ImageStore, "SpectrogramStore"]] = None
    preprocess: Optional[Union[Preprocess, "AudioPreprocess"]] = None
    #: A corruption applied to every image (``fedadapt.data.corruptions``) at its native
    #: resolution, its severity and the seed of its randomness (per image).
    corruption: Optional[str] = None
    severity: int = 0
    corruption_seed: int = 0
    #: The store resized to the model's input (:func:`fedadapt.data.store.input_store`), when
    #: one is kept: batches without a training crop are read from it and only normalised.
    inputs: Optional[ImageStore] = None

    @property
    def kind(self) -> str:
        return "features" if self.features_path else "images"

    @property
    def modality(self) -> str:
        """``image`` or ``audio`` (the store's content); ``features`` for cached features."""
        return "features" if self.features_path else self.preprocess.modality

    def corrupted(self, kind: str, severity: int, seed: int) -> "DataSource":
        """The same split with ``kind`` at ``severity`` applied to each image (or clip)."""
        if self.kind != "images":
            raise ValueError("corruptions apply to images, not to cached features")
        return replace(self, corruption=kind, severity=int(severity), corruption_seed=int(seed))

    def labels(self) -> np.ndarray:
        return _labels(self.prepared, self.split)

    def features(self) -> np.ndarray:
        """The memory-mapped feature matrix ``[N, D]`` (checked once per process and file)."""
        from fedadapt.data.integrity import mapped

        return mapped(self.features_path, "feature cache")

    def images(self, indices: np.ndarray) -> np.ndarray:
        """``uint8 [B, H, W, C]`` rows (corrupted if this source is); audio: ``float16
        [B, T, F]`` spectrograms."""
        idx = np.asarray(indices, dtype=np.int64)
        if self.corruption and self.severity > 0:
            return corrupted_rows(self, idx)
        return self.store.array()[idx]

    def get(self, indices: np.ndarray, device: str | torch.device = "cpu",
            crop: Crop = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One batch ``(x, y)`` on ``device`` (outside hot loops; they use :meth:`stream`)."""
        return next(self.stream([np.asarray(indices, dtype=np.int64)], device,
                                crops=None if crop is None else [crop]))

    def stream(self, batches: Sequence[np.ndarray], device: str | torch.device,
               crops: Optional[Sequence[Crop]] = None
               ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(x, y)`` on ``device`` for each index array of ``batches``, the next one prepared
        while the caller uses the current one. ``crops[i]`` (images only) is batch ``i``'s
        training crop: ``(scale, seeds)`` with one seed per image."""
        device = torch.device(device)
        batches = [np.asarray(b, dtype=np.int64) for b in batches]
        if not batches:
            return iter(())
        if self.kind == "features":
            return feature_stream(self, batches, device)
        return stream_parts([[(self, b)] for b in batches], device, crops)


def stream_parts(batches: Sequence[Sequence[tuple[DataSource, np.ndarray]]],
                 device: str | torch.device, crops: Optional[Sequence[Crop]] = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Image batches each assembled from parts ``(source, indices)`` of one split, e.g. clients
    trained side by side whose data carry their own corruptions; otherwise as
    :meth:`DataSource.stream`."""
    device = torch.device(device)
    first = batches[0][0][0] if batches else None
    if first is None:
        return iter(())
    if crops is not None and any(c is not None for c in crops) and first.preprocess is None:
        raise ValueError("training crops need an image source")
    labels = first.labels()

    def make(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts = batches[i]
        idx = np.concatenate([ix for _, ix in parts]) if len(parts) > 1 else parts[0][1]
        crop = crops[i] if crops is not None else None
        y = _to_device(torch.from_numpy(labels[idx]), device)
        resized = None if crop is not None else [input_rows(src, ix) for src, ix in parts]
        if resized is not None and all(r is not None for r in resized):  # resized once
            x = _to_device(torch.from_numpy(np.concatenate(resized) if len(resized) > 1
                                            else resized[0]), device)
            return first.preprocess.normalize(to_float(x)), y
        rows = [src.images(ix) for src, ix in parts]
        if len({r.shape[-1] for r in rows}) > 1:  # clean grey beside corrupted RGB rows
            rows = [np.repeat(r, 3, axis=-1) if r.shape[-1] == 1 else r for r in rows]
        x = _to_device(torch.from_numpy(np.concatenate(rows)), device)
        return model_input(x, first.preprocess,
                           None if crop is None else (crop[0], crop[1], idx)), y

    return prefetched(len(batches), make, device)


#: How many bytes of features :func:`feature_stream` gathers at once on the CPU.
FEATURE_CHUNK_BYTES = 8 << 20


def feature_stream(source: DataSource, batches: list[np.ndarray], device: torch.device, *,
                   move_once: Optional[bool] = None
                   ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Features of every batch's rows: read from the mapped file a few batches at a time
    (:data:`FEATURE_CHUNK_BYTES`), or with ``move_once`` (the default off the CPU) the rows of
    all the batches moved to the device at once, then indexed there. Both give the same
    batches."""
    if move_once is None:
        move_once = device.type != "cpu"
    if not move_once:  # no transfer to save: the union and its positions cost more
        feats, labels = source.features(), source.labels()
        # the rows of consecutive batches read in one gather (up to FEATURE_CHUNK_BYTES), each
        # batch a view of it: a gather per batch from the mapped file cost 45 us a batch
        per_chunk = max(1, FEATURE_CHUNK_BYTES // max(1, feats.strides[0]))
        start = 0
        while start < len(batches):
            stop, rows = start + 1, len(batches[start])
            while stop < len(batches) and rows + len(batches[stop]) <= per_chunk:
                rows += len(batches[stop])
                stop += 1
            part = batches[start:stop]
            idx = np.concatenate(part) if len(part) > 1 else part[0]
            x = torch.from_numpy(np.ascontiguousarray(feats[idx], dtype=np.float32))
            y = torch.from_numpy(labels[idx])
            if len(part) == 1:
                yield x, y
            else:
                sizes = [len(b) for b in part]
                yield from zip(x.split(sizes), y.split(sizes))
            start = stop
        return
    union = np.unique(np.concatenate(batches))
    feats = _to_device(torch.from_numpy(np.ascontiguousarray(source.features()[union],
                                                             dtype=np.float32)), device)
    labels = _to_device(torch.from_numpy(source.labels()[union]), device)
    for idx in batches:
        pos = torch.from_numpy(np.searchsorted(union, idx)).to(device)
        yield feats[pos], labels[pos]


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def prefetched(n: int, make: Callable[[int], tuple], device: torch.device) -> Iterator[tuple]:
    """Yield ``make(0), ..., make(n - 1)``. On CUDA, ``make(i + 1)`` runs in a background
    thread on a side stream (the caller's stream waits for it) while the caller uses item ``i``.
    On a CPU the batches are made in turn: the training step already uses every core, and a
    second thread running torch ops beside it oversubscribes them (two OpenMP teams on the same
    cores: one client's local training at 139 images/s with the thread against 341 without, the
    bare loop's 325, ``fedadapt-bench --throughput`` on 2 cores)."""
    if device.type != "cuda":
        for i in range(n):
            yield make(i)
        return
    side = torch.cuda.Stream(device)

    def work(i: int):
        with torch.cuda.stream(side):
            out = make(i)
            done = torch.cuda.Event()
            done.record(side)
        return out, done

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedadapt-prefetch") as pool:
        pending = pool.submit(work, 0)
        for i in range(n):
            out, done = pending.result()
            if i + 1 < n:
                pending = pool.submit(work, i + 1)
            current = torch.cuda.current_stream(device)
            current.wait_event(done)
            for t in out:
                t.record_stream(current)
            yield out


# -- per-process caches -----------------------------------------------------------------------
_CACHE: dict[tuple, object] = {}


def clear_cache() -> None:
    """Forget this process's labels, input stores and corrupted rows (made again on use), and
    the feature and store mappings (:func:`fedadapt.data.integrity.unmap_all`)."""
    from fedadapt.data.integrity import unmap_all

    _CACHE.clear()
    unmap_all()


def labels_path(prepared: PreparedDataset, split: str) -> Path:
    """Where a split's labels are kept as a sealed ``.npy`` (``<cache_dir>/labels/``, keyed by
    the prepared copy's fingerprint), so that a run whose inputs are cached (features, image
    stores) never opens the copy through ``datasets`` (its import: about 0.9 s of start-up)."""
    folder = Path(prepared.path)
    return folder.parent.parent / "labels" / f"{prepared.fingerprint}-{split}.npy"


def _labels(prepared: PreparedDataset, split: str) -> np.ndarray:
    key = ("labels", prepared.path, split)
    if key not in _CACHE:
        from fedadapt.data.integrity import load_npy, save_npy, valid_or_removed

        path = labels_path(prepared, split)
        if valid_or_removed(path):
            _CACHE[key] = load_npy(path, "labels cache", mmap=False)
        else:
            from fedadapt.data.loading import column, open_prepared

            _CACHE[key] = column(open_prepared(prepared.path)[split], "label", np.int64)
            try:
                save_npy(path, _CACHE[key])
            except OSError:  # a read-only cache: the labels are read from the copy each time
                pass
    return _CACHE[key]


def input_rows(source: DataSource, indices: np.ndarray) -> Optional[np.ndarray]:
    """``uint8 [B, S, S, C]``: the rows at the model's input size from the source's
    :attr:`~DataSource.inputs`, or None where it keeps none or its rows are corrupted (they are
    corrupted at native resolution, then resized per batch)."""
    if source.inputs is None or (source.corruption and source.severity > 0):
        return None
    key = ("inputs", source.inputs.path)
    if key not in _CACHE:  # built (once, on disk) when a batch first needs it
        from fedadapt.data.store import build_input_store

        build_input_store(source.inputs, source.store, source.preprocess)
        _CACHE[key] = True
    return source.inputs.array()[np.asarray(indices, dtype=np.int64)]


def corrupted_rows(source: DataSource, indices: np.ndarray) -> np.ndarray:
    """The source's corruption applied to each row with the row's own seed: ``uint8
    [B, H, W, 3]`` images corrupted at native resolution, or audio's ``float16 [B, T, F]``
    spectrograms of noisy clips. Rows are corrupted once per process and kept (a personalizing
    client reads its data for ten epochs)."""
    key = ("corrupted", source.store.path, source.corruption, source.severity,
           source.corruption_seed)
    known, rows = _CACHE.get(key, (np.zeros(0, np.int64), None))
    missing = np.setdiff1d(indices, known)
    if len(missing):
        new = _corrupt(source, missing)
        known = np.concatenate([known, missing])
        rows = new if rows is None else np.concatenate([rows, new])
        order = np.argsort(known, kind="stable")
        known, rows = known[order], rows[order]
        _CACHE[key] = (known, rows)
    if rows is None:  # nothing asked, nothing corrupted yet
        if source.modality == "audio":
            return np.zeros((0, *source.store.shape[1:]), source.store.array().dtype)
        return np.zeros((0, *source.store.shape[1:3], 3), np.uint8)
    return rows[np.searchsorted(known, indices)]


def _corrupt(source: DataSource, indices: np.ndarray) -> np.ndarray:
    if source.modality == "audio":
        from fedadapt.data.audio import corrupted_spectrograms

        return corrupted_spectrograms(source, indices)
    from fedadapt.data.corruptions import corrupt_images

    return corrupt_images(source.store.array()[indices], source.corruption, source.severity,
                          source.corruption_seed, indices)


def input_source(card, backbone, prepared: PreparedDataset, split: str, cache_dir: str, *,
                 backbone_name: str = "") -> DataSource:
    """A split as the backbone's raw input: images decoded once into their store (at the
    backbone's preprocessing), or audio clips turned into the backbone's spectrograms once.
    A data set whose modality the backbone does not take fails with one line."""
    data, takes = card.modality, getattr(backbone, "modality", "image")
    if data != takes:
        name = backbone_name or type(backbone).__name__
        need = ("an audio backbone (backbone=ast_deit_small)" if data == "audio"
                else "an image backbone")
        raise ConfigError(f"backbone={name} is invalid for dataset={card.name}: the data are "
                          f"{data} {'clips' if data == 'audio' else 'images'} and need {need}; "
                          f"backbone={name} takes {takes}")
    if data == "audio":
        from fedadapt.data.audio import AudioPreprocess, spectrogram_store

        pre = AudioPreprocess.for_backbone(backbone)
        return DataSource(prepared, split, store=spectrogram_store(prepared, split, pre,
                                                                   cache_dir),
                          preprocess=pre)
    from fedadapt.data.store import geometry, image_store, input_store

    pre = Preprocess.for_backbone(backbone)
    store = image_store(prepared, split, geometry(card, pre), cache_dir)
    return DataSource(prepared, split, store=store, preprocess=pre,
                      inputs=input_store(store, pre))
