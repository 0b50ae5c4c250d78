"""Decoded image store: every image of a prepared split decoded once into one memory-mapped
``uint8`` array ``[N, H, W, C]``, shared by every process that trains or evaluates on it.

* **Fixed-size data sets** (the card declares ``image_size`` and ``channels``: CIFAR-100,
  FEMNIST, Fashion-MNIST, digits): the images at their native resolution (``C = 1`` for grey
  images, expanded to RGB on the device). Resizing to the backbone's input and the training
  crop then run on the device, on native pixels; the CIFAR-100-C corruptions run before that,
  in CPU torch on the native pixels, once per process (``sources.corrupted_rows`` keeps them).
* **Variable-size data sets** (PACS, Office-Home, VLCS, iNaturalist): one stored resolution per
  backbone preprocessing: the shortest side resized to the backbone's ``resize`` (``size /
  crop_pct``) with its interpolation (PIL, as torchvision's ``Resize``), then centre-cropped to
  a ``resize`` x ``resize`` square. Evaluation then only centre-crops ``size``; the training crop
  draws from the stored square (torchvision's ``RandomResizedCrop`` on the full image would also
  see the parts of a non-square image outside that square).

Files live in ``<cache_dir>/images/`` named by the data set, split and a key of (the prepared
data set's fingerprint, split, stored geometry, format version), like the feature cache. Each is
built under a temporary name (decoding in parallel processes for variable-size data), sealed with
its SHA-256 (:mod:`fedadapt.data.integrity`) and renamed; a file that fails its digest is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from fedadapt import progress
from fedadapt.config import ConfigError
from fedadapt.data.loading import PreparedDataset
from fedadapt.log import log

_VERSION = 1
DECODE_CHUNK = 2048


@dataclass(frozen=True)
class Geometry:
    """What is stored: ``native`` (the card's fixed ``image_size``) or a ``resize`` square."""

    native: bool
    height: int
    width: int
    channels: int
    #: Variable-size data: PIL interpolation of the shortest-side resize.
    interpolation: str = "bicubic"


@dataclass(frozen=True)
class ImageStore:
    """A sealed ``.npy`` of ``uint8 [N, H, W, C]`` (picklable; Ray workers open it themselves)."""

    path: str
    shape: tuple[int, int, int, int]

    def array(self) -> np.ndarray:
        """The memory-mapped images, checked against their digest once per process."""
        from fedadapt.data.integrity import mapped

        return mapped(self.path, "decoded image store")


def geometry(card, preprocess) -> Geometry:
    """The stored geometry of a data set for a backbone's :class:`Preprocess`."""
    if card.image_size:
        h, w = (int(v) for v in card.image_size)
        return Geometry(native=True, height=h, width=w, channels=int(card.channels or 3))
    return Geometry(native=False, height=preprocess.resize, width=preprocess.resize, channels=3,
                    interpolation=preprocess.interpolation)


def store_key(prepared: PreparedDataset, split: str, geo: Geometry) -> str:
    blob = json.dumps({"v": _VERSION, "data": prepared.fingerprint, "split": split,
                       "geometry": geo.__dict__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def image_store(prepared: PreparedDataset, split: str, geo: Geometry, cache_dir: str,
                *, workers: Optional[int] = None) -> ImageStore:
    """The store of ``split`` at ``geo``, built (once) if missing or failing its digest."""
    from fedadapt.data.integrity import valid_or_removed

    folder = Path(cache_dir).expanduser() / "images"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prepared.name}-{split}-{store_key(prepared, split, geo)}.npy"
    n = prepared.num_train if split == "train" else prepared.num_test
    shape = (n, geo.height, geo.width, geo.channels)
    if not valid_or_removed(path):
        if workers is None:  # decoding big JPEGs is worth processes; 32x32 PNGs are not
            workers = 1 if geo.native else min(16, os.cpu_count() or 1)
        source = prepared.source_rows(split)
        if source is None:
            _build(prepared, split, geo, path, shape, workers, np.arange(shape[0]))
        else:
            _gather(prepared, split, geo, path, shape, workers, *source, folder)
    return ImageStore(path=str(path), shape=shape)


#: A store is also kept at the model's input size (:func:`input_store`) when that copy is at
#: most this big: Fashion-MNIST at 32 px is 61 MB; CIFAR-100 at DeiT's 224 px would be 7.5 GB
#: (its batches are resized on the device, as before).
INPUT_STORE_MAX_BYTES = 1 << 30


def input_store(store: ImageStore, preprocess) -> Optional[ImageStore]:
    """Where ``store`` resized and centre-cropped to the model's input is kept, as bytes
    (:meth:`~fedadapt.data.transforms.Preprocess.resized_bytes`; built next to it by
    :func:`build_input_store` when a batch first needs it, so a run on cached features never
    makes one); None when the store already is the input size or the copy would be larger
    than :data:`INPUT_STORE_MAX_BYTES`. Batches then only normalise: the model's input is the
    one made per batch, to the bit. A small CNN on Fashion-MNIST (28 px into 32) spent 13 ms
    of a 106 ms round resizing images."""
    n, h, w, c = store.shape
    size = int(preprocess.size)
    if (h, w) == (size, size) or n * size * size * c > INPUT_STORE_MAX_BYTES:
        return None
    blob = json.dumps({"v": _VERSION, "size": size, "resize": preprocess.resize,
                       "interpolation": preprocess.interpolation}, sort_keys=True)
    key = hashlib.sha256(blob.encode()).hexdigest()[:12]
    path = Path(store.path).with_name(f"{Path(store.path).stem}-input-{key}.npy")
    return ImageStore(path=str(path), shape=(n, size, size, c))


def build_input_store(inputs: ImageStore, store: ImageStore, preprocess) -> None:
    """Build ``inputs`` (:func:`input_store`) from ``store`` once, sealed; a valid one is
    kept."""
    from fedadapt.data.integrity import valid_or_removed

    path = Path(inputs.path)
    if not valid_or_removed(path):
        log(f"[images] resizing {inputs.shape[0]} images of {Path(store.path).name} once to "
            f"the model's {inputs.shape[1]} px input")
        build_sealed(path, inputs.shape, np.uint8, _resize_chunk, (store.path, preprocess),
                     workers=1, label=f"input {Path(store.path).stem}", unit="images")


def _resize_chunk(args) -> int:
    """Rows ``[a, b)`` of a store resized into the memory-mapped file."""
    import torch

    out_path, store_path, preprocess, a, b = args
    out = np.load(out_path, mmap_mode="r+")
    rows = np.array(np.load(store_path, mmap_mode="r")[a:b])  # a writable copy for torch
    out[a:b] = preprocess.resized_bytes(torch.from_numpy(rows)).numpy()
    out.flush()
    return b - a


def _gather(prepared: PreparedDataset, split: str, geo: Geometry, path: Path, shape: tuple,
            workers: int, base: str, rows: np.ndarray, folder: Path) -> None:
    """The store of a split gathered from the decoded rows of its source
    (:class:`~fedadapt.data.rows.RowCache`), decoding only the rows no other prepared copy of
    that source (another seed, another subsample) decoded before."""
    from fedadapt.data.rows import RowCache, gathered_file, row_cache_key

    key = row_cache_key(v=_VERSION, source=prepared.source_key, split=base,
                        geometry=geo.__dict__)
    cache = RowCache(folder / f"{prepared.name}-rows-{base}-{key}")
    at = cache.missing(rows)  # the split's images whose source rows nobody decoded
    if len(at):
        cache.add(rows[at], lambda tmp: _build(prepared, split, geo, tmp,
                                               (len(at), *shape[1:]), workers, at, seal=False,
                                               into=cache.folder.name))
    gathered_file(path, shape, np.uint8, cache, rows, f"images {prepared.name}/{split}")


def _build(prepared: PreparedDataset, split: str, geo: Geometry, path: Path, shape: tuple,
           workers: int, indices: np.ndarray, *, seal: bool = True,
           into: Optional[str] = None) -> None:
    """Decode rows ``indices`` of the split into the ``.npy`` ``path`` (row i: image
    ``indices[i]``; ``into``: what the log calls it)."""
    label = f"{prepared.name}/{split}"
    log(f"[images] decoding {shape[0]} images of {label} once into {into or path.name} "
        f"({'native' if geo.native else geo.height} px, {workers} process(es))")
    build_sealed(path, shape, np.uint8, _decode_chunk, (prepared.path, split, geo, indices),
                 workers=workers, label=f"images {label}", unit="images", seal=seal)


def build_sealed(path: Path, shape: tuple, dtype, fill: Callable[[tuple], int], args: tuple,
                 *, workers: int, label: str, unit: str, seal: bool = True) -> None:
    """Write the ``.npy`` ``path`` of ``shape`` and ``dtype`` once: under a temporary name,
    chunk by chunk (``fill((tmp_path, *args, a, b))`` writes rows ``[a, b)`` through its own
    mapping and returns how many; in ``workers`` processes when > 1), then sealed with its
    SHA-256 and renamed (:func:`fedadapt.data.integrity.seal_and_rename`); ``seal=False``:
    written at ``path`` itself, which the caller seals."""
    from fedadapt.data.integrity import seal_and_rename

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp") if seal else path
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    del out  # workers (or the loop below) write through their own mappings
    jobs = [(str(tmp), *args, a, min(shape[0], a + DECODE_CHUNK))
            for a in range(0, shape[0], DECODE_CHUNK)]
    try:
        with progress.task(label, total=shape[0], unit=unit) as bar:
            if workers > 1 and len(jobs) > 1:
                with ProcessPoolExecutor(max_workers=workers) as pool:
                    for n in pool.map(fill, jobs):
                        bar.advance(n)
            else:
                for job in jobs:
                    bar.advance(fill(job))
        if seal:
            seal_and_rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _decode_chunk(args) -> int:
    """Decode images ``indices[a:b]`` of a split into rows ``[a, b)`` of the memory-mapped
    file (runs in a worker)."""
    from fedadapt.data.loading import open_prepared

    out_path, data_path, split, geo, indices, a, b = args
    out = np.load(out_path, mmap_mode="r+")
    rows = open_prepared(data_path)[split]
    which = [int(i) for i in indices[a:b]]
    contiguous = which == list(range(which[0], which[0] + len(which)))
    try:  # datasets decodes (PIL's load()) the whole slice here
        images = (rows[which[0]:which[-1] + 1] if contiguous else rows.select(which))["image"]
    except (OSError, ValueError):  # one of them is broken: find it, one at a time below
        images = None
    for i, index in enumerate(which):
        try:
            im = images[i] if images is not None else rows[index]["image"]
            out[a + i] = decode(im, geo, index)
        except ConfigError as err:  # another size than the card's
            raise ConfigError(f"{source_file(data_path, split, index)} {err}") from err
        except (OSError, ValueError) as err:  # PIL: a truncated or garbled file
            raise ConfigError(f"{source_file(data_path, split, index)} cannot be decoded: "
                              f"{err}") from err
    out.flush()
    return b - a


def source_file(data_path: str, split: str, index: int) -> str:
    """Which file image ``index`` of a prepared split came from, for an error: its file name
    and class folder as the data set recorded them."""
    from datasets import Image
    from fedadapt.data.loading import open_prepared

    ds = open_prepared(data_path)[split]
    record = ds.cast_column("image", Image(decode=False))[index]
    name = (record["image"] or {}).get("path") or "an image without a file name"
    label = ds.features["label"].names[record["label"]] if "label" in ds.features else None
    where = f"class folder {label!r}, " if label is not None else ""
    return f"{name} ({where}image {index} of {Path(data_path).name}/{split})"


def decode(im, geo: Geometry, index: int) -> np.ndarray:
    """One PIL image as ``uint8 [H, W, C]`` in the store's geometry."""
    from PIL import Image

    if geo.native:
        arr = np.asarray(im.convert("L" if geo.channels == 1 else "RGB"), dtype=np.uint8)
        if arr.shape[:2] != (geo.height, geo.width):
            raise ConfigError(f"is {arr.shape[1]}x{arr.shape[0]}, but the dataset card declares "
                              f"image_size {geo.height}x{geo.width} (remove image_size from the "
                              f"card for data of mixed sizes)")
        return arr.reshape(geo.height, geo.width, geo.channels)
    im = im.convert("RGB")  # decodes: a truncated file raises here (OSError)
    w, h = im.size
    size = geo.height
    nw, nh = (size, int(size * h / w)) if w <= h else (int(size * w / h), size)
    resample = Image.BICUBIC if geo.interpolation == "bicubic" else Image.BILINEAR
    im = im.resize((nw, nh), resample)
    top, left = int(round((nh - size) / 2.0)), int(round((nw - size) / 2.0))
    return np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.uint8)
