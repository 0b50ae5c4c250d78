"""Files written whole or not at all: written to a temporary name in the same folder, fsynced,
then renamed over the target, so a reader sees the old file or the new one, never a part."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable


def atomic_write(path: str | Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Write via ``write(fileobj)`` to a temporary file in the same folder, fsync, rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:  # a failed write names no file (a full disk): name it
        Path(tmp).unlink(missing_ok=True)
        if err.filename is None:
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
