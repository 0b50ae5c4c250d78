"""Every run gets its own directory, however many ``fedadapt`` processes start at once.

Two mechanisms, both atomic on a local or network file system:

* **New names are claimed** (:func:`claim_new_dir`): Hydra's default run and sweep folders are
  ``${unique_dir:<output_dir>/<experiment>/<time>}`` (the resolver registered by
  :func:`fedadapt.entry.register_configs`), which creates the folder with an exclusive
  ``mkdir``; when another process took that name in the same second, the next free one
  (``<time>_2``, ``<time>_3``, ...) is claimed instead. Hydra's resolver cache hands the claimed
  name to every job of a sweep (also to joblib and Slurm workers), so a sweep claims one folder.
* **A run holds a lock** (:func:`lock_run_dir`) on its run directory from before the first file
  is written until it ends: ``.fedadapt.lock``, created with ``O_EXCL`` and naming the host and
  process. A second run into a directory another run holds, or into one that already holds a
  job (``job.json``: use ``resume=``), is refused with one line; a lock left by a process that
  died on this host is taken over (``resume=`` continues a killed run).
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import time
from pathlib import Path

from fedadapt.config import FedadaptError
from fedadapt.federation.server.interrupt import signals_deferred

#: The lock file a running ``fedadapt`` holds in its run directory.
LOCK = ".fedadapt.lock"
#: The job record (overrides, argv) that marks a directory as a job's.
JOB = "job.json"


def resume_command(folder: str | os.PathLike) -> str:
    """``fedadapt resume=FOLDER``, quoted for a shell (a pasted command works as printed)."""
    return f"fedadapt resume={shlex.quote(str(folder))}"


class RunDirError(FedadaptError):
    """The run directory belongs to another run."""


def claim_new_dir(path: str | os.PathLike, *, attempts: int = 1000) -> str:
    """Create ``path`` (or ``path_2``, ``path_3``, ... if taken) exclusively; return its name."""
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1, attempts + 1):
        candidate = base if i == 1 else base.with_name(f"{base.name}_{i}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return str(candidate)
    raise RunDirError(f"{base}: {attempts} run directories with this name exist already; "
                      f"choose another output_dir")


#: The longest sweep-point folder name :func:`point_dir` gives (file systems allow 255 bytes).
POINT_NAME_MAX = 200


def point_dir(num, overrides: str) -> str:
    """A sweep point's folder name, ``<num>_<its overrides>`` (Hydra's ``override_dirname``),
    cut to :data:`POINT_NAME_MAX` bytes where it would be longer, with the first 10 hex digits
    of the whole name's SHA-1 after the cut, so that points stay apart (their overrides are in
    each point's ``job.json`` and ``config.yaml``)."""
    import hashlib

    name = f"{num}_{overrides}"
    raw = name.encode()
    if len(raw) <= POINT_NAME_MAX:
        return name
    digest = hashlib.sha1(raw).hexdigest()[:10]
    head = raw[:POINT_NAME_MAX - len(digest) - 1].decode(errors="ignore")
    return f"{head}_{digest}"


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except OSError as err:
        return err.errno == errno.EPERM
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _holder(lock: Path) -> dict | None:
    """The lock's owner, or None when the lock is gone or unreadable (being written)."""
    try:
        return json.loads(lock.read_text())
    except (OSError, ValueError):
        return None


def _stale(owner: dict | None) -> bool:
    """A lock left by a process of this host that no longer runs."""
    return (owner is not None and owner.get("host") == socket.gethostname()
            and not _alive(int(owner.get("pid", -1))))


def _create(lock: Path) -> bool:
    with signals_deferred():
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as fh:
            json.dump(_owner(), fh)
            fh.flush()
            os.fsync(fh.fileno())
    return True


def lock_run_dir(run_dir: str | os.PathLike, *, resume: bool = False) -> Path:
    """Take the run directory for this process (created if missing); return the lock file.

    Refuses (:class:`RunDirError`, one line) when another live run holds it, or, unless
    ``resume``, when it already holds a job.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = run_dir / LOCK
    for _ in range(3):
        if _create(lock):
            break
        owner = _holder(lock)
        if not _stale(owner):
            who = (f"pid {owner.get('pid')} on {owner.get('host')}" if owner
                   else "another process")
            raise RunDirError(f"run directory {run_dir} is in use by {who} ({lock}); choose "
                              f"another output_dir / hydra.run.dir, or delete {lock} if that "
                              f"run is gone")
        lock.unlink(missing_ok=True)  # left by a process that died here: take it over
    else:
        raise RunDirError(f"run directory {run_dir}: could not take {lock}")
    if not resume and (run_dir / JOB).exists():
        unlock_run_dir(run_dir)
        raise RunDirError(f"run directory {run_dir} holds a job already ({JOB}); continue it "
                          f"with `{resume_command(run_dir)}`, or choose another output_dir / "
                          f"hydra.run.dir")
    return lock


def unlock_run_dir(run_dir: str | os.PathLike) -> None:
    """Release this process's lock on ``run_dir`` (a lock of another process is left)."""
    lock = Path(run_dir) / LOCK
    with signals_deferred():
        owner = _holder(lock)
        if owner is not None and owner.get("pid") == os.getpid() \
                and owner.get("host") == socket.gethostname():
            lock.unlink(missing_ok=True)
