"""Progress and status lines for the user, on standard error (stdout holds results)."""

from __future__ import annotations

import sys
import threading

#: Lines from several threads (the progress ticker, Flower's, the main one) never interleave.
_LOCK = threading.Lock()


def log(msg: str) -> None:
    """One line on standard error, written whole (``print`` writes the text and its newline in
    two calls, between which another thread's line could land)."""
    with _LOCK:
        sys.stderr.write(f"{msg}\n")
        sys.stderr.flush()
