"""How fedadapt's commands end: their work done, without tearing the interpreter down.

A process that has loaded torch, Flower, Ray's client, Hugging Face ``datasets`` and Hydra
spends most of a second after its last line of work on Python's own shutdown: every module's
dictionary cleared, millions of objects freed one by one, the native libraries' static
destructors (0.9 s after ``fedadapt``'s main job returned, against 0.1 s without them: the
quickstart's fine-tuning on the 2-core EPYC, docs/speed.md). None of it is the run's work. A
console command (``fedadapt`` and ``python -m fedadapt.cli``, ``fedadapt-bench``,
``fedadapt-evidence``, ``fedadapt-report``: each module's ``command``) therefore ends with
:func:`finish`: it waits for the threads Python would wait for, runs every
``atexit`` handler (the logging handlers' flush and close, Ray's shutdown, W&B's and MLflow's,
multiprocessing's), flushes every file still open for writing, then leaves with the exit code.
Results are written atomically and fsynced already (:mod:`fedadapt.files`); nothing waits on a
finaliser. Called in-process (``fedadapt.cli.main()`` from a test or a notebook), the same
functions return as before: only the console entry points end the process.
"""

from __future__ import annotations

import atexit
import gc
import io
import os
import sys
import threading
from typing import Callable, NoReturn


def _exit_code(code: object) -> int:
    """``SystemExit.code`` as the interpreter turns it into a status (None: 0; a message: 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def finish(code: object = 0) -> NoReturn:
    """End the process as the interpreter would, less its teardown (module docstring). Under
    a profiler or a debugger (``python -m cProfile``, ``pdb``: writes its output after the
    command returns) the interpreter ends it as usual."""
    if sys.getprofile() is not None or sys.gettrace() is not None:
        raise SystemExit(code)
    # as the interpreter's exit: the threading module's own exit hooks (an executor's, such
    # as joblib's loky workers', ends there; joining its threads first waited forever), then
    # every non-daemon thread joined, then the atexit handlers
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    else:
        me = threading.current_thread()
        for thread in threading.enumerate():
            if thread is not me and not thread.daemon:
                thread.join()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():  # a file a library left open: its buffer reaches the disk
        # the object's type, not isinstance: no instance hook runs (torch warns from one)
        if issubclass(type(obj), io.IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except (OSError, ValueError):  # detached, or its disk gone: as Python's exit
                pass
    status = _exit_code(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def console(main: Callable[[], object]) -> Callable[[], NoReturn]:
    """A console entry point: ``main``, then :func:`finish` with its exit status. An exception
    other than ``SystemExit`` propagates (its traceback, Python's own exit)."""
    def command() -> NoReturn:
        try:
            main()
        except SystemExit as stop:
            finish(stop.code)
        finish(0)

    command.__doc__ = f"{main.__module__}.main, then :func:`fedadapt.ending.finish`."
    return command

