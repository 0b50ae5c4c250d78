"""Cache files that prove their content: every array fedadapt caches on disk (decoded images,
features) is written with a sidecar ``<file>.sha256`` holding its size and SHA-256, recorded at
write time, and checked before it is used. Cached folders (a prepared data set, a pretrained
backbone) carry one record for all their files (:func:`seal_folder`, :func:`folder_problem`).

The full digest is checked once per process and file (a file is identified by its path, size,
modification time and inode; a Ray worker that opens a file the driver already checked checks it
again once, a few hundred MB/s); later opens in the same process cost a ``stat``. A file altered
in place at the same size fails the digest; a truncated one fails the size. Callers either
rebuild a failing file or refuse it with one line naming it (:class:`CacheIntegrityError`).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from fedadapt.config import FedadaptError

SUFFIX = ".sha256"
_CHUNK = 16 << 20
#: ``(path, size, mtime_ns, inode)`` of files whose digest this process has checked.
_CHECKED: set[tuple] = set()


class CacheIntegrityError(FedadaptError, OSError):
    """A cache file does not match the digest recorded when it was written."""


def sidecar(path: str | Path) -> Path:
    return Path(str(path) + SUFFIX)


def digest(path: str | Path) -> str:
    """SHA-256 of a file, read in 16 MB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _identity(path: Path) -> tuple:
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino)


def seal(path: str | Path) -> None:
    """Record ``path``'s size and digest in its sidecar (atomically: temporary name, rename)."""
    _write_record(Path(path), Path(path))


def _write_record(content: Path, path: Path) -> None:
    from fedadapt.files import atomic_write

    record = {"size": content.stat().st_size, "sha256": digest(content)}
    atomic_write(sidecar(path), lambda fh: json.dump(record, fh))


def seal_and_rename(tmp: str | Path, path: str | Path) -> None:
    """Finish a cache file written at ``tmp``: fsync it, record its digest under ``path``'s
    sidecar, then rename it to ``path``. A reader that sees ``path`` always finds its record
    (processes building the same file at once write the same content)."""
    tmp, path = Path(tmp), Path(path)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    _write_record(tmp, path)
    os.replace(tmp, path)
    _CHECKED.add(_identity(path))


def problem(path: str | Path) -> Optional[str]:
    """None when ``path`` matches its sidecar, else what is wrong (missing sidecar, size,
    digest). Checked once per process and file version."""
    path = Path(path)
    if not path.is_file():
        return "missing"
    ident = _identity(path)
    if ident in _CHECKED:
        return None
    try:
        record = json.loads(sidecar(path).read_text())
        size, expected = int(record["size"]), str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"no readable digest record {sidecar(path).name}"
    if ident[1] != size:
        return f"size {ident[1]} bytes, {size} recorded when it was written (truncated?)"
    if digest(path) != expected:
        return "content differs from the SHA-256 recorded when it was written (modified?)"
    _CHECKED.add(ident)
    return None


def check(path: str | Path, what: str = "cache file") -> None:
    """Raise :class:`CacheIntegrityError` naming ``path`` unless it matches its digest."""
    bad = problem(path)
    if bad is not None:
        raise CacheIntegrityError(f"{what} {path}: {bad}; delete it (and {sidecar(path).name}) "
                                  f"to rebuild it")


def remove(path: str | Path) -> None:
    """Delete a cache file and its sidecar (before rebuilding it)."""
    for p in (Path(path), sidecar(path)):
        p.unlink(missing_ok=True)


def save_npy(path: str | Path, array: np.ndarray) -> None:
    """``np.save`` to a temporary name, then :func:`seal_and_rename`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            np.save(fh, array)
        seal_and_rename(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_npy(path: str | Path, what: str = "cache file", *, mmap: bool = True) -> np.ndarray:
    """The checked array (memory-mapped read-only by default)."""
    check(path, what)
    return np.load(path, mmap_mode="r" if mmap else None)


_MAPPED: dict[tuple, np.ndarray] = {}


def mapped(path: str | Path, what: str = "cache file") -> np.ndarray:
    """A sealed ``.npy`` checked and memory-mapped once per process and file version (a file
    rebuilt under the same name is mapped anew, never read through a stale mapping). A plain
    ``ndarray`` over the mapping: ``np.memmap``'s Python-level indexing cost a few microseconds
    a gather."""
    st = os.stat(path)
    key = (str(path), st.st_ino, st.st_mtime_ns, st.st_size)
    if key not in _MAPPED:
        _MAPPED[key] = load_npy(path, what).view(np.ndarray)
    return _MAPPED[key]


def unmap_all() -> None:
    """Forget every mapping :func:`mapped` keeps (mapped again on the next call, unchecked:
    a file's check is kept): the pages a run touched leave the process when nothing else
    holds its arrays."""
    _MAPPED.clear()


def valid_or_removed(path: str | Path) -> bool:
    """True when ``path`` exists and matches its digest; a file that fails is deleted (with its
    sidecar) so the caller rebuilds it. Returns False for a missing file too."""
    bad = problem(path)
    if bad is None:
        return True
    if bad != "missing":
        from fedadapt.log import log

        log(f"[cache] {path}: {bad}; rebuilding it")
        remove(path)
    return False


# -- folders (a prepared data set, a pretrained backbone) ------------------------------------
#: A sealed folder's record: ``{"files": {relative path: {"size", "sha256"}}}``.
SEAL = "fedadapt_seal.json"


def seal_folder(folder: str | Path) -> None:
    """Record the size and digest of every file below ``folder`` in ``<folder>/SEAL`` (written
    last, atomically); call it on the finished folder before renaming it into place."""
    from fedadapt.files import atomic_write

    folder = Path(folder)
    files = {str(f.relative_to(folder)): {"size": f.stat().st_size, "sha256": digest(f)}
             for f in sorted(folder.rglob("*")) if f.is_file() and f.name != SEAL}
    atomic_write(folder / SEAL, lambda fh: json.dump({"files": files}, fh, indent=1))


def folder_problem(folder: str | Path, *, digests: bool = True) -> Optional[str]:
    """None when every file ``<folder>/SEAL`` lists is there with its recorded size (and, with
    ``digests``, content), else what is wrong, naming the file. Files added later (a library's
    own cache files) are not checked. The digests are checked once per process and folder
    version."""
    folder = Path(folder)
    try:
        files = json.loads((folder / SEAL).read_text())["files"]
        records = {name: (int(r["size"]), str(r["sha256"])) for name, r in files.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return f"no readable digest record {SEAL}"
    idents = []
    for name, (size, _) in sorted(records.items()):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        ident = _identity(path)
        if ident[1] != size:
            return f"{path} is {ident[1]} bytes, {size} recorded when it was written (truncated?)"
        idents.append(ident)
    key = ("folder", str(folder), tuple(idents))
    if not digests or key in _CHECKED:
        return None
    for name, (_, expected) in sorted(records.items()):
        if digest(folder / name) != expected:
            return (f"{folder / name}: content differs from the SHA-256 recorded when it was "
                    f"written (modified?)")
    _CHECKED.add(key)
    return None


def check_folder(folder: str | Path, what: str, *, digests: bool = True,
                 fix: str = "delete it to rebuild it") -> None:
    """Raise :class:`CacheIntegrityError` naming the file unless ``folder`` matches its
    :data:`SEAL`."""
    bad = folder_problem(folder, digests=digests)
    if bad is not None:
        raise CacheIntegrityError(f"{what} {folder}: {bad}; {fix}")


__all__ = ["SEAL", "CacheIntegrityError", "check", "check_folder", "digest", "folder_problem",
           "load_npy", "mapped", "problem", "remove", "save_npy", "seal", "seal_and_rename",
           "seal_folder", "sidecar", "valid_or_removed"]
