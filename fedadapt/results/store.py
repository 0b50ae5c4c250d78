"""Run directories: per-round metrics, the summary, written whole (:mod:`fedadapt.files`).

A run directory holds ``config.yaml`` (resolved), ``partition.json``, ``metrics.jsonl`` (one line
per round, appended as rounds finish; not fsynced: a crash of the process loses no row, and the
rows a crash of the machine could lose come after the last checkpoint, which holds the history,
is fsynced, and rewrites the file when the run resumes), and at the end ``table.md``,
``curves.png`` and ``summary.json``. Each final file is written to a temporary name, fsynced and
renamed, and ``summary.json`` is written last: a run directory without it holds no result (the
run stopped).
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import tempfile
from pathlib import Path

from fedadapt.files import atomic_write

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"


def check_writable(folder: str | Path, key: str) -> None:
    """Raise :class:`~fedadapt.config.ConfigError` naming ``key`` unless ``folder`` can be
    created and written (a read-only file system, a path through a file, no permission)."""
    import errno

    from fedadapt.config import ConfigError

    path = Path(folder).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".fedadapt-probe-"):
            pass
    except OSError as err:
        why = err.strerror or str(err)
        hint = " (the disk is full)" if err.errno == errno.ENOSPC else ""
        raise ConfigError(f"{key}={str(folder)!r} is not writable: {why}{hint}: "
                          f"{err.filename or path}") from err


def _clean(obj):
    """JSON-safe: NaN/inf become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json(path: str | Path, obj) -> None:
    atomic_write(path, lambda fh: json.dump(_clean(obj), fh, indent=2, sort_keys=False))


def append_jsonl(path: str | Path, row: dict) -> None:
    try:
        with open(path, "a") as fh:
            fh.write(json.dumps(_clean(row)) + "\n")  # not fsynced: the module's docstring
    except OSError as err:  # name the file (a full disk)
        if err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Replace a JSON-lines file atomically (same formatting as :func:`append_jsonl`)."""
    atomic_write(path, lambda fh: fh.writelines(json.dumps(_clean(r)) + "\n" for r in rows))


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("fedadapt", "torch", "torchvision", "flwr", "ray", "flwr-datasets", "datasets",
                "transformers", "open_clip_torch", "timm", "hydra-core", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def git_commit() -> str | None:
    """The commit of the fedadapt source checkout this code runs from (``+dirty`` when it has
    changes); None for an installed wheel, which has no checkout (``versions()`` names it)."""
    import fedadapt

    repo = Path(fedadapt.__file__).resolve().parents[1]
    if not ((repo / ".git").exists() and (repo / "pyproject.toml").is_file()):
        return None  # site-packages: an unrelated repository above it must not be named
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                             text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=repo, capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (sha + ("+dirty" if dirty else "")) or None
