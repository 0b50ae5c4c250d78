"""Checkpoints: everything a run needs to continue, written atomically and verified on load.

Server side, ``<run_dir>/checkpoints/round-<r>/`` holds

* ``arrays.safetensors``: the global communicated tensors;
* ``state.json``: the round, the metrics so far, the cumulative bytes, the strategy's state
  (the seeded sampling and noise streams, and the Flower strategy's attributes:
  :mod:`fedadapt.strategies.state`) and the checksum of the run's ``config.yaml``;
* ``strategy.safetensors``: the strategy's arrays (FedAdam's moments, FedAvgM's momentum, ...);
* ``manifest.json``: the SHA-256 of the files above, written last.

The folder is written under a temporary name, fsynced and renamed; then ``checkpoints/LATEST``
is replaced atomically to point at it, and only then are older checkpoints removed: a kill at
any moment leaves the previous complete checkpoint in place.

Client side, each client's personal tensors (a local-only head, later client tokens) are saved by
the client itself, in ``<run_dir>/clients/<partition-id>/round-<r>.safetensors``, with the
SHA-256 of the tensor data in the file's metadata; on resume a client loads its newest file not
after the checkpoint's round. Nothing is unpickled: tensors are safetensors, the rest JSON.

Randomness needs no saved state beyond the sampling RNG: training seeds are derived from
``(seed, round, client)`` and initial weights from ``seed``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Optional

import torch

from fedadapt.config import FedadaptError
from fedadapt.files import atomic_write

CHECKPOINTS = "checkpoints"
LATEST = "LATEST"
ARRAYS = "arrays.safetensors"
STATE = "state.json"
STRATEGY_ARRAYS = "strategy.safetensors"
MANIFEST = "manifest.json"


class CheckpointError(FedadaptError, RuntimeError):
    """A checkpoint file is missing, truncated or tampered with; the message names it."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: Path, data: bytes) -> None:
    try:
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as err:  # a failed write names no file: name it (a full disk)
        if err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, *, server_round: int, arrays: dict[str, torch.Tensor],
                    state: dict, config_sha: str, strategy_arrays: Optional[dict] = None
                    ) -> Path:
    """Write the checkpoint of ``server_round`` (``strategy_arrays``: the strategy's numpy
    arrays by name); return its folder."""
    from safetensors.torch import save

    from fedadapt.strategies.state import pack_arrays

    root = Path(run_dir) / CHECKPOINTS
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".round-*.tmp*"):  # left by a process killed mid-write
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"round-{server_round:06d}"
    tmp = root / f".round-{server_round:06d}.tmp{os.getpid()}"
    tmp.mkdir()
    try:  # a full disk or a stop mid-write leaves no partial folder, and LATEST as it was
        tensors = {k: v.detach().cpu().contiguous() for k, v in arrays.items()}
        _fsync_write(tmp / ARRAYS, save(tensors))
        body = {"round": server_round, "config_sha256": config_sha, **state}
        _fsync_write(tmp / STATE, json.dumps(body).encode())
        _fsync_write(tmp / STRATEGY_ARRAYS, pack_arrays(strategy_arrays or {}))
        manifest = {"round": server_round, "files": {
            name: sha256_file(tmp / name) for name in (ARRAYS, STATE, STRATEGY_ARRAYS)}}
        _fsync_write(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _fsync_dir(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    atomic_write(root / LATEST, lambda fh: fh.write(final.name))
    _fsync_dir(root)
    for old in root.iterdir():  # the new checkpoint is complete: drop the older ones
        if old.is_dir() and old.name.startswith("round-") and old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The folder ``LATEST`` points at, or None when the run has no checkpoint yet."""
    pointer = Path(run_dir) / CHECKPOINTS / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as err:
        name = f"<unreadable: {err}>"
    folder = pointer.parent / name
    if not re.fullmatch(r"round-\d{6}", name):
        found = sorted(d.name for d in pointer.parent.glob("round-*") if d.is_dir())
        raise CheckpointError(
            f"{pointer} is garbled ({name[:40]!r} names no checkpoint folder round-<r>); "
            f"checkpoints there: {', '.join(found) or 'none'}; write the one to continue from "
            f"into it, or delete {pointer.parent} to start the run over")
    if not folder.is_dir():
        raise CheckpointError(f"{pointer} points at {folder.name}, which does not exist")
    return folder


def load_checkpoint(folder: Path, *, config_sha: Optional[str] = None
                    ) -> tuple[dict[str, torch.Tensor], dict]:
    """Verify every file against the manifest, then load ``(arrays, state)``; the strategy's
    arrays are ``state["strategy_arrays"]``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load as load_numpy
    from safetensors.torch import load

    manifest_path = folder / MANIFEST
    expected = {ARRAYS, STATE, STRATEGY_ARRAYS}
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if set(files) != expected:
            raise ValueError(f"it lists {sorted(files)}, not {sorted(expected)}")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is missing or unreadable "
                              f"({err}); the checkpoint is incomplete") from err
    for name, digest in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"checkpoint file {path} is missing")
        if sha256_file(path) != digest:
            raise CheckpointError(f"checkpoint file {path} fails its checksum (truncated or "
                                  f"modified); refusing to resume from it")
    state = json.loads((folder / STATE).read_text())
    if config_sha is not None and state.get("config_sha256") != config_sha:
        raise CheckpointError(f"checkpoint {folder} belongs to a different config.yaml than the "
                              f"run directory's; refusing to resume")
    loaded = []
    for name, loader in ((ARRAYS, load), (STRATEGY_ARRAYS, load_numpy)):
        try:
            loaded.append(loader((folder / name).read_bytes()))
        except SafetensorError as err:
            raise CheckpointError(f"checkpoint file {folder / name} is not valid safetensors "
                                  f"({err})") from err
    arrays, state["strategy_arrays"] = loaded
    return arrays, state


# -- client-side personal state ---------------------------------------------------------------
def _tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def _client_files(folder: Path, suffix: str = "safetensors") -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in folder.iterdir()
                  if (m := re.fullmatch(rf"round-(\d+)\.{re.escape(suffix)}", p.name)))


def _prune(folder: Path, checkpoint_round: int, suffix: str) -> None:
    """All but the newest file not after ``checkpoint_round`` (a resume starts after it; every
    file after it stays)."""
    kept = [(r, p) for r, p in _client_files(folder, suffix) if r <= checkpoint_round]
    for _, old in kept[:-1]:
        old.unlink(missing_ok=True)


#: A client's Flower ``Context.state`` (mods' per-client state), as Flower's own protobuf.
CONTEXT_SUFFIX = "recorddict.pb"


def save_client_context(folder: Path, server_round: int, data: bytes,
                        checkpoint_round: int = 0) -> None:
    """A client's ``context.state`` (serialised) after ``server_round``, atomically; files a
    resume can no longer need are removed as for :func:`save_client_state`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / f"round-{server_round:06d}.{CONTEXT_SUFFIX}", lambda fh: fh.write(data),
                 mode="wb")
    _prune(folder, checkpoint_round, CONTEXT_SUFFIX)


def load_client_context(folder: Path, up_to_round: int) -> Optional[bytes]:
    """The newest ``context.state`` a client saved at a round <= ``up_to_round``."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    saved = [p for r, p in _client_files(folder, CONTEXT_SUFFIX) if r <= up_to_round]
    return saved[-1].read_bytes() if saved else None


def client_rounds(folder: Path) -> list[int]:
    """The rounds a client saved personal tensors after, oldest first."""
    folder = Path(folder)
    return [r for r, _ in _client_files(folder)] if folder.is_dir() else []


def save_client_state(folder: Path, server_round: int, tensors: dict[str, torch.Tensor],
                      checkpoint_round: int = 0) -> None:
    """A client's personal tensors after ``server_round`` (atomic, checksummed).

    Files a resume can no longer need are removed: all but the newest one not after
    ``checkpoint_round`` (the server's last complete checkpoint), and everything after it stays.
    """
    from safetensors.torch import save

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    data = save(tensors, metadata={"round": str(server_round),
                                   "sha256": _tensor_digest(tensors)})
    atomic_write(folder / f"round-{server_round:06d}.safetensors", lambda fh: fh.write(data),
                 mode="wb")
    _prune(folder, checkpoint_round, "safetensors")


def load_client_state(folder: Path, up_to_round: int) -> Optional[dict[str, torch.Tensor]]:
    """The client's newest personal tensors saved at a round <= ``up_to_round``, verified."""
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    if not folder.is_dir():
        return None
    rounds = [(r, p) for r, p in _client_files(folder) if r <= up_to_round]
    if not rounds:
        return None
    path = rounds[-1][1]
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"client state {path} is unreadable ({err})") from err
    if meta.get("sha256") != _tensor_digest(tensors):
        raise CheckpointError(f"client state {path} fails its checksum (modified); refusing it")
    return tensors
