"""Work done once per row of a data set's source: its decoded images and its backbone features,
shared by every prepared copy that holds the row.

A prepared copy (:func:`fedadapt.data.loading.prepare_dataset`) depends on the run's seed (the
global test split drawn from the training data, the ``dataset.max_samples`` subsample), so a
sweep over seeds or subsamples makes one copy per point. Each copy records, per split, the row
of its source every row came from (:meth:`PreparedDataset.source_rows`) and the key of that
source (card and path: not the seed). The image store and the feature file of a copy are then
gathered from a :class:`RowCache` of the source's rows, and only the rows no earlier copy held
are decoded or run through the backbone: a sweep over three seeds decodes and extracts each
image once.

A row cache is a folder of immutable parts, each two sealed ``.npy`` files (its values and the
source rows they belong to, :mod:`fedadapt.data.integrity`): a part that fails its digest is
deleted and its rows are computed again; two processes that fill the same rows at once write
two parts with the same values.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from fedadapt.log import log

#: Rows copied at a time (2,048 images of 224 x 224 x 3: 300 MB).
CHUNK = 2048


def row_cache_key(**fields) -> str:
    """A key of what the cached values are (the source's key, its split, the geometry or the
    backbone and preprocessing...)."""
    import json

    blob = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


class RowCache:
    """The values of a source's rows computed so far (``folder``: one per source split and what
    is computed). Rows are non-negative ints; every value has one shape and dtype."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()

    def _parts(self) -> list[tuple[Path, np.ndarray]]:
        """Each valid part's values file and its rows (a part failing its digest is removed)."""
        from fedadapt.data.integrity import remove, valid_or_removed

        out = []
        for rows_path in sorted(self.folder.glob("part-*.rows.npy")):
            values = rows_path.with_name(rows_path.name.replace(".rows.npy", ".npy"))
            if not (valid_or_removed(rows_path) and valid_or_removed(values)):
                remove(rows_path)
                remove(values)
                continue
            out.append((values, np.load(rows_path)))
        return out

    def _lookup(self, parts, size: int) -> tuple[np.ndarray, np.ndarray]:
        """For each source row below ``size``: the part holding it (-1: none) and where."""
        part = np.full(size, -1, dtype=np.int64)
        pos = np.zeros(size, dtype=np.int64)
        for i, (_, rows) in enumerate(parts):
            keep = rows < size
            part[rows[keep]] = i
            pos[rows[keep]] = np.flatnonzero(keep)
        return part, pos

    def missing(self, rows: np.ndarray) -> np.ndarray:
        """Where in ``rows`` the distinct rows no part holds first occur (ascending): the
        positions to compute, in the order a copy with nothing cached computes everything."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return rows
        part, _ = self._lookup(self._parts(), int(rows.max()) + 1)
        _, first = np.unique(rows, return_index=True)
        return np.sort(first[part[rows[first]] < 0])

    def add(self, rows: np.ndarray, fill: Callable[[Path], None]) -> None:
        """A new part for ``rows``: ``fill(tmp_path)`` writes its values as an ``.npy`` (row i's
        value at position i), which is then sealed and renamed."""
        from fedadapt.data.integrity import save_npy, seal_and_rename

        self.folder.mkdir(parents=True, exist_ok=True)
        name = f"part-{uuid.uuid4().hex[:16]}"
        values = self.folder / f"{name}.npy"
        tmp = self.folder / f".{name}.{os.getpid()}.tmp"
        try:
            fill(tmp)
            seal_and_rename(tmp, values)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        save_npy(self.folder / f"{name}.rows.npy", np.asarray(rows, dtype=np.int64))

    def gather(self, rows: np.ndarray, out: np.ndarray) -> None:
        """``out[i]`` = the value of source row ``rows[i]`` (every row must be held)."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            return
        parts = self._parts()
        part, pos = self._lookup(parts, int(rows.max()) + 1)
        where = part[rows]
        if (where < 0).any():
            raise RuntimeError(f"row cache {self.folder}: rows {rows[where < 0][:5]} are missing")
        for i, (values, _) in enumerate(parts):
            at = np.flatnonzero(where == i)
            if len(at):
                arr = np.load(values, mmap_mode="r")
                at = at[np.argsort(pos[rows[at]], kind="stable")]  # read the part in order
                for a in range(0, len(at), CHUNK):  # images: a chunk in memory at a time
                    chunk = at[a:a + CHUNK]
                    out[chunk] = arr[pos[rows[chunk]]]


def gathered_file(path: Path, shape: tuple, dtype, cache: RowCache, rows: np.ndarray,
                  what: str) -> None:
    """Write the sealed ``.npy`` ``path`` (``shape``, ``dtype``) whose row i is the cached value
    of source row ``rows[i]``."""
    from fedadapt.data.integrity import seal_and_rename

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
        cache.gather(rows, out)
        out.flush()
        del out
        seal_and_rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    log(f"[cache] {what}: {len(rows)} rows gathered from {cache.folder.name} into {path.name}")


__all__ = ["RowCache", "gathered_file", "row_cache_key"]
