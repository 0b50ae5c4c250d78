"""Clean stops: Ctrl-C (SIGINT) and SIGTERM end a run without a traceback, a hang or a damaged
checkpoint.

Within :func:`stop_on_signals` (the ``fedadapt`` command wraps every job in it) the first
SIGINT or SIGTERM sets :data:`STOP` and raises :class:`RunInterrupted` in the main thread, the
way Ctrl-C raises ``KeyboardInterrupt``; everything on the way out runs its ``finally`` blocks
(Flower's simulation engine terminates its Ray actors and shuts Ray down). The ServerApp runs in
a thread of its own, which a signal does not interrupt: its grid (:class:`StoppableGrid`)
raises :class:`RunStopped` at the next message it would send or wait for, so a checkpoint being
written is finished first, and no new round starts. Checkpoints are written under a temporary
name and renamed (:mod:`fedadapt.federation.server.checkpoint`), so the last complete one stays
valid whenever the process ends. :func:`exit_stopped` then gives the remaining busy threads until
:data:`GRACE_S` after the signal and ends the process with 128 + the signal's number. A second
signal ends the process at once.

A Python signal handler runs only when the main thread runs Python code: not while it waits in
C (``ray.init``, a Ray call, a long torch op), and an exception it raises inside a garbage
collector callback is swallowed. So the signal also reaches a *watch* thread at once, through
``signal.set_wakeup_fd`` (written by the C-level handler): it sets :data:`STOP`, and if the
process is still alive :data:`WATCH_S` after the signal, it says the run's last words itself
(the stop line, the lock released: :func:`last_words`) and ends the process with the same code.
Every stop, wherever it lands (process or process group, under ``timeout``), is over within
about :data:`WATCH_S` seconds.

``ray.init`` replaces the driver's SIGTERM handler by its own (``sys.exit(15)``):
:func:`ray_keeps_our_handlers` stops it from doing so during a run (else Flower's engine would
tear the actors down before this module knew of the stop); should it happen anyway,
:func:`reinstall` puts ours back after the simulation, and :func:`from_ray_exit` reads Ray's exit
as the SIGTERM it was. Flower's engine threads log an actor that a signal ended mid-message as an
ERROR with a traceback (Ctrl-C reaches the whole process group, Ray's workers too): that is the
stop itself, so :class:`StopFilter` holds such a record until the stop is known and drops it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Iterable, Iterator, Optional

from fedadapt.config import FedadaptError

#: Set by the first SIGINT / SIGTERM of a run: every loop that can wait checks it.
STOP = threading.Event()
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_ACTIVE: list[bool] = [False]
#: The seconds after the signal that a stop waits for the run's busy threads (a checkpoint
#: being written finishes well within it; an unfinished one stays under its temporary name).
GRACE_S = 1.5
#: The seconds after the signal at which the watch thread ends a stop the main thread has not.
WATCH_S = 2.0
#: ``(signal number, time.monotonic() when it came)`` of the run's first stop signal.
_SIGNALLED: list[tuple[int, float]] = []
#: Said (stop line, lock released) by whichever thread ends the process; see :func:`last_words`.
_LAST_WORDS: list = []
_ENDING = threading.Lock()
#: The signal the main thread's handler has raised for (once): a second one exits at once.
_RAISED: list[int] = []
#: Depth of :func:`signals_deferred` blocks, and the signals that came within them.
_DEFER: list[int] = [0]
_DEFERRED: list[int] = []


class RunInterrupted(BaseException):
    """A run stopped by a signal (a ``BaseException``, as ``KeyboardInterrupt``: code that
    handles ``Exception`` lets it through). ``exit_code`` is 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum
        self.at = time.monotonic()


class RunStopped(FedadaptError, RuntimeError):
    """Raised in the ServerApp's thread when the run has been told to stop."""


def _handler(signum: int, frame) -> None:
    if _DEFER[0]:  # within signals_deferred(): stop when the block ends
        _DEFERRED.append(signum)
        return
    if _RAISED:  # a second signal: no more waiting
        os.write(2, f"fedadapt: {signal.Signals(signum).name} again: exiting now\n".encode())
        os._exit(128 + signum)
    _RAISED.append(signum)
    _noticed(signum)
    raise RunInterrupted(signum)



def _noticed(signum: int) -> None:
    """The first stop signal: the run stops (:data:`STOP`), Flower goes quiet."""
    if not _SIGNALLED:
        _SIGNALLED.append((signum, time.monotonic()))
        STOP.set()
        quiet_flower()


def last_words(say) -> None:
    """Within a run, ``say(interrupted)`` prints the stop line and releases the run's lock;
    whichever of the main thread (:func:`exit_stopped`) and the watch thread ends the process
    calls it, once."""
    _LAST_WORDS[:] = [say]


def _end(interrupted: "RunInterrupted") -> None:
    """Say the last words (once) and end the process with the stop's exit code."""
    with _ENDING:
        for say in _LAST_WORDS:
            try:
                say(interrupted)
            except BaseException as err:  # noqa: BLE001  (ending anyway)
                os.write(2, f"fedadapt: {interrupted} ({type(err).__name__}: {err})\n".encode())
        _LAST_WORDS.clear()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(interrupted.exit_code)


def _watch(reader) -> None:
    """The watch thread: a stop signal's number arrives through the wakeup fd as it lands."""
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        signums = [b for b in data if b in (int(signal.SIGINT), int(signal.SIGTERM))]
        if not signums or not _ACTIVE[0]:
            continue
        _noticed(signums[0])
        signum, at = _SIGNALLED[0]
        time.sleep(max(0.0, at + WATCH_S - time.monotonic()))
        if _ACTIVE[0] or _LAST_WORDS:  # the main thread has not ended the stop: end it here
            stop = RunInterrupted(signum)
            stop.at = at
            _end(stop)
        return


def _unraisable(hook):
    """``sys.unraisablehook`` that drops a :class:`RunInterrupted` a garbage collector callback
    swallowed (the watch thread ends that stop); anything else goes to ``hook``."""
    def unraisable(info) -> None:
        if not isinstance(info.exc_value, RunInterrupted):
            hook(info)
    return unraisable


class StopFilter(logging.Filter):
    """On Flower's logger: an ERROR about a dead Ray actor waits up to ``wait_s`` for the run's
    stop (the signal that killed the actor reaches the main thread a moment later) and is
    dropped if one comes; otherwise it is shown, ``wait_s`` late. It runs in the engine's worker
    thread, which has nothing else to do with a dead actor's message."""

    MARKS = ("ActorDiedError", "actor died", "RayActorError")

    def __init__(self, wait_s: float = 1.0) -> None:
        super().__init__()
        self.wait_s = wait_s

    def filter(self, record: logging.LogRecord) -> bool:
        if STOP.is_set():
            return False
        if record.levelno < logging.ERROR or not _ACTIVE[0]:
            return True
        text = record.getMessage()
        if any(mark in text for mark in self.MARKS):
            return not STOP.wait(self.wait_s)
        return True


def filter_flower() -> None:
    """Install :class:`StopFilter` on Flower's logger (idempotent)."""
    logger = logging.getLogger("flwr")
    if not any(isinstance(f, StopFilter) for f in logger.filters):
        logger.addFilter(StopFilter())


@contextlib.contextmanager
def ray_keeps_our_handlers() -> Iterator[None]:
    """Within, ``ray.init`` leaves the SIGTERM handler of :func:`stop_on_signals` in place (it
    would install ``sys.exit(15)``), and the Ray processes it starts (GCS, raylet, and the
    workers the raylet starts) leave the driver's process group: a SIGTERM to the group (as
    ``timeout`` sends it) is then the driver's alone, which stops the run and shuts Ray down in
    order, instead of killing the raylet under a running driver (whose core worker then exits
    with 1 before the stop line). They still end with the driver however it ends: a reaper
    process (:data:`REAPER`, in a session of its own) holds a pipe from the driver and, when the
    pipe closes without the word ``done`` (the driver was killed, or a stop ended it before
    Ray's shutdown finished), kills their process groups, which a SIGKILL to the driver's group
    reached before. Outside a run of ours nothing is changed."""
    try:
        from ray._private import utils as ray_utils
    except ImportError:  # another Ray layout: from_ray_exit still reads its exit
        yield
        return
    from ray._private import services

    original = getattr(ray_utils, "set_sigterm_handler", None)
    fate_shared = getattr(ray_utils, "set_kill_on_parent_death_linux", None)
    start_process = getattr(services, "start_ray_process", None)
    reaper: list = []

    def set_sigterm_handler(handler) -> None:
        if not _ACTIVE[0] and original is not None:
            original(handler)

    def own_group_fate_shared() -> None:  # runs in the child, before it executes Ray
        os.setpgrp()
        fate_shared()

    def start_ray_process(*args, **kwargs):
        info = start_process(*args, **kwargs)
        started = getattr(info, "process", None)  # its process, leader of its own group
        if started is not None:
            if not reaper:
                reaper.append(_start_reaper())
            _tell(reaper[0], f"{started.pid}\n")  # its process id: its group id
        return info

    ray_utils.set_sigterm_handler = set_sigterm_handler
    if fate_shared is not None and start_process is not None:
        ray_utils.set_kill_on_parent_death_linux = own_group_fate_shared
        services.start_ray_process = start_ray_process
    try:
        yield
    finally:
        if original is not None:
            ray_utils.set_sigterm_handler = original
        if fate_shared is not None and start_process is not None:
            ray_utils.set_kill_on_parent_death_linux = fate_shared
            services.start_ray_process = start_process
        for proc in reaper:  # Ray has shut down in order: nothing left to reap
            _tell(proc, "done\n")
            proc.stdin.close()


#: The reaper: reads process group ids until ``done`` (exit) or the end of its input (the
#: driver is gone), then kills those groups.
REAPER = """
import os, signal, sys
groups = []
for line in sys.stdin:
    if line.strip() == "done":
        sys.exit(0)
    groups.append(int(line))
for group in groups:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


def _start_reaper():
    import subprocess

    return subprocess.Popen([sys.executable, "-c", REAPER], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)


def _tell(proc, line: str) -> None:
    try:
        proc.stdin.write(line)
        proc.stdin.flush()
    except (OSError, ValueError):  # the reaper is gone: Ray's fate-sharing still holds
        pass


def quiet_flower() -> None:
    """Silence Flower's logger for the rest of a stopping run (see :class:`StopFilter`)."""
    logging.getLogger("flwr").setLevel(logging.CRITICAL + 1)


def reinstall() -> None:
    """Put the handlers back (``ray.init`` replaces SIGTERM's); main thread only."""
    if _ACTIVE[0] and threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handler)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """A SIGINT / SIGTERM that comes within the block stops the run when the block ends, not
    in the middle: for file operations that must not be left half-done (the run directory's
    lock file: created and written, or removed). Python runs signal handlers in the main
    thread whichever thread the signal reached, so this holds with Ray's and Flower's threads
    about, which a per-thread signal mask would not."""
    _DEFER[0] += 1
    try:
        yield
    finally:
        _DEFER[0] -= 1
        if not _DEFER[0] and _DEFERRED:
            signum = _DEFERRED[0]
            _DEFERRED.clear()
            _handler(signum, None)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGINT / SIGTERM stop the run cleanly (see the module docstring). A no-op
    outside the main thread, where Python delivers no signal."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    import socket

    STOP.clear()
    _SIGNALLED.clear()
    _RAISED.clear()
    old = {sig: signal.getsignal(sig) for sig in SIGNALS}
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    old_hook = sys.unraisablehook
    sys.unraisablehook = _unraisable(old_hook)
    threading.Thread(target=_watch, args=(reader,), name="fedadapt-stop-watch",
                     daemon=True).start()
    _ACTIVE[0] = True
    reinstall()
    try:
        yield
    finally:
        _ACTIVE[0] = False
        for sig, handler in old.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(old_fd)
        sys.unraisablehook = old_hook
        writer.close()  # the watch thread's recv ends
        _LAST_WORDS.clear()


def from_ray_exit(err: SystemExit) -> Optional[RunInterrupted]:
    """The :class:`RunInterrupted` that ``ray.init``'s SIGTERM handler (``sys.exit(15)``)
    stands for during a run, or None for any other exit."""
    if _ACTIVE[0] and err.code == signal.SIGTERM:
        _noticed(signal.SIGTERM)
        return RunInterrupted(signal.SIGTERM)
    return None


def check_stop() -> None:
    """Raise :class:`RunStopped` when the run has been told to stop (for worker threads)."""
    if STOP.is_set():
        raise RunStopped("the run was stopped by a signal")


class StoppableGrid:
    """A Flower ``Grid`` whose waits end when the run is told to stop: ``send_and_receive``
    pushes the messages and polls for the replies (as Flower's own grids do), checking
    :data:`STOP` between polls; everything else is the wrapped grid's."""

    def __init__(self, grid, poll_s: float = 0.1) -> None:
        self._grid = grid
        self.poll_s = poll_s  # seconds between polls for replies (Flower's grids: 0.1)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)

    def get_node_ids(self) -> Iterable[int]:
        check_stop()
        return self._grid.get_node_ids()

    def send_and_receive(self, messages: Iterable, *, timeout: Optional[float] = None) -> list:
        check_stop()
        pending = set(self._grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list = []
        while pending and (deadline is None or time.monotonic() < deadline):
            got = list(self._grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if pending:
                check_stop()
                time.sleep(self.poll_s)
        return replies


def _idle(thread: threading.Thread) -> bool:
    """Whether ``thread`` is an executor's worker waiting for work (``concurrent.futures``
    leaves them running, non-daemon, until the interpreter exits): nothing to wait for."""
    frame = sys._current_frames().get(thread.ident)
    waiting = False
    while frame is not None:
        code = frame.f_code
        if code.co_name == "get" and code.co_filename.endswith("queue.py"):
            waiting = True
        if code.co_name == "_worker" and code.co_filename.endswith(
                os.path.join("concurrent", "futures", "thread.py")):
            return waiting
        frame = frame.f_back
    return False


def exit_stopped(interrupted: RunInterrupted) -> None:
    """End the process with ``interrupted.exit_code`` (130 for SIGINT, 143 for SIGTERM).

    The run's other threads (the ServerApp finishing a checkpoint, Flower's workers) get until
    :data:`GRACE_S` after the signal; then the process ends without the interpreter's exit
    sequence, which would wait for a thread that still hangs, and in which Ray's C++ signal
    handler, having seen a SIGTERM, aborts the process. Every file is complete by then or
    under a temporary name."""

    if _SIGNALLED:  # the stop began with the signal, not when the main thread saw it
        interrupted.at = min(interrupted.at, _SIGNALLED[0][1])
    for t in threading.enumerate():
        if t is threading.main_thread() or t.daemon or _idle(t):
            continue
        t.join(timeout=max(0.0, interrupted.at + GRACE_S - time.monotonic()))
    _end(interrupted)
