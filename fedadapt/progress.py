"""Progress for the user: one live display per job, a bar for every long loop, plain lines in
files.

On a terminal (standard error is a TTY, and neither ``NO_COLOR`` nor ``TERM=dumb`` is set) one
`rich <https://rich.readthedocs.io>`_ live display on standard error shows the job line (methods
done / total and an estimate for the whole job), the current method's round bar (loss, accuracy)
and a bar for each long loop that is running (feature caching, image-store building, prefetch);
status lines (:func:`fedadapt.log.log`) scroll above it. Anywhere else (``> file 2>&1``, a pipe,
CI) the same information comes as plain lines without escape codes: one per ``interval`` seconds
and one at the end of each bar (every round for the round bar).

Library code reports a loop with::

    from fedadapt import progress

    with progress.task("features digits/train", total=n, unit="img") as bar:
        for batch in batches:
            ...
            bar.advance(len(batch))

and an entry point wraps the methods of a job in :func:`job` (``with progress.job(name,
{method: units}) as j: j.start(method) ... j.finish(method)``); bars opened with
``for_job=True`` (the round bar) move the job forward as they advance.

:func:`configure_output` (called by the entry points) decides the mode once per process and,
for plain output, makes sure nothing writes escape codes into the file: Flower's console colours
off, Ray's coloured worker prefixes off (``RAY_COLOR_PREFIX=0``), ``NO_COLOR=1`` for child
processes, and standard output and error wrapped so that any colour code another library still
writes is dropped.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Optional

#: CSI sequences (colours, cursor moves) and OSC sequences (titles, links).
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences."""
    return ANSI.sub("", text)


class PlainStream:
    """A text stream that drops terminal escape sequences on their way to ``raw``.

    Everything else (``fileno``, ``isatty``, ``encoding``, ...) is ``raw``'s, so it can stand in
    for ``sys.stdout`` / ``sys.stderr``.
    """

    def __init__(self, raw) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        self.raw.write(strip_ansi(text))
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str):
        return getattr(self.raw, name)


def fmt_seconds(s: Optional[float]) -> str:
    """``"42 s"``, ``"3 min 05 s"``, ``"1 h 02 min"``; ``"?"`` when unknown."""
    if s is None:
        return "?"
    s = max(0.0, s)
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def _terminal() -> bool:
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


@dataclass
class _State:
    interactive: Optional[bool] = None
    configured: bool = False
    rich: object = None  # rich.progress.Progress while a live display runs
    open_tasks: int = 0
    job: Optional["Job"] = None
    lock: threading.RLock = field(default_factory=threading.RLock)
    retargeted: list = field(default_factory=list)


_STATE = _State()


def interactive() -> bool:
    """Whether progress is drawn live (a terminal) rather than written as plain lines."""
    if _STATE.interactive is None:
        _STATE.interactive = _terminal()
    return _STATE.interactive


def configure_output(*, force_plain: bool = False) -> bool:
    """Decide once per process between a live display and plain lines; return ``interactive``.

    For plain output, colour is switched off at its sources (Flower's console handler, Ray's
    worker prefixes, ``NO_COLOR`` for child processes) and ``sys.stdout`` / ``sys.stderr`` are
    wrapped in :class:`PlainStream`, so a file written with ``> file 2>&1`` holds no escape code.
    """
    if _STATE.configured:
        return _STATE.interactive
    _STATE.configured = True
    _STATE.interactive = False if force_plain else _terminal()
    if _STATE.interactive:
        return True
    os.environ.setdefault("NO_COLOR", "1")
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    plain_flower_console()
    originals = (sys.stdout, sys.stderr)
    if not isinstance(sys.stdout, PlainStream):
        sys.stdout = PlainStream(sys.stdout)
    if not isinstance(sys.stderr, PlainStream):
        sys.stderr = PlainStream(sys.stderr)
    # handlers created before this point hold the raw streams
    for logger in (logging.getLogger(), logging.getLogger("flwr")):
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in originals:
                h.setStream(sys.stdout if h.stream is originals[0] else sys.stderr)
    return False


def plain_flower_console() -> None:
    """Flower's console log handler without colours (its default colours every level name)."""
    from flwr.supercore.logger import update_console_handler

    update_console_handler(colored=False)


class Bar:
    """One bar of the display (or its plain lines); made by :func:`task`."""

    def __init__(self, description: str, total: Optional[int], *, unit: str, interval: float,
                 for_job: bool) -> None:
        self.description, self.total, self.unit = description, total, unit
        self.interval, self.for_job = interval, for_job
        self.completed = 0
        self.info = ""
        self.started = time.time()
        self._first: Optional[tuple[float, int]] = None  # (time, completed) at the first unit
        self._printed = 0.0
        self._printed_done: Optional[int] = None  # units done at the last plain line
        self._id = None

    # -- the caller's API --------------------------------------------------------------------
    def advance(self, k: int = 1, *, info: Optional[str] = None) -> None:
        """``k`` more units done (``info``: a short text shown beside the bar)."""
        self.update(completed=self.completed + k, info=info)

    def update(self, *, completed: Optional[int] = None, total: Optional[int] = None,
               info: Optional[str] = None) -> None:
        """Set what is done, the total or the text beside the bar."""
        with _STATE.lock:
            step = 0 if completed is None else completed - self.completed
            if completed is not None:
                self.completed = completed
                if self._first is None and completed > 0:
                    self._first = (time.time(), completed)
            if total is not None:
                self.total = total
            if info is not None:
                self.info = info
            if self.for_job and _STATE.job is not None and step > 0:
                _STATE.job.advance(step, self)
            self._show()

    @property
    def seconds_per_unit(self) -> Optional[float]:
        """Time per unit since the first unit (a loop's start-up, e.g. Ray's, left out), or
        over the whole time while only the first unit is known (not for a job's round bar,
        whose first round carries the start-up); None before."""
        if self._first is None:
            return None
        t1, n1 = self._first
        if self.completed > n1:
            return (time.time() - t1) / (self.completed - n1)
        return None if self.for_job else (t1 - self.started) / n1

    @property
    def eta(self) -> Optional[float]:
        """Seconds left at :attr:`seconds_per_unit` (None before the first unit or without a
        total)."""
        per = self.seconds_per_unit
        if not self.total or per is None:
            return None
        return per * (self.total - self.completed)

    def line(self) -> str:
        """The plain-text form of the bar."""
        done = f"{self.completed}/{self.total}" if self.total else f"{self.completed}"
        parts = [f"{self.description} {done}{' ' + self.unit if self.unit else ''}"]
        if self.info:
            parts.append(self.info)
        per = self.seconds_per_unit
        if self.unit and per:
            parts.append(f"{1 / per:.0f} {self.unit}/s" if per < 1 else f"{per:.1f} s each")
        if self.total and self.completed < self.total:
            parts.append(f"~{fmt_seconds(self.eta)} left")
        elif self.total:
            parts.append(f"{fmt_seconds(time.time() - self.started)}")
        job = _STATE.job
        if self.for_job and job is not None:
            parts.append(job.short())
        return " | ".join(parts)

    # -- drawing -------------------------------------------------------------------------------
    def _show(self, final: bool = False) -> None:
        if _STATE.rich is not None and self._id is not None:
            _STATE.rich.update(self._id, completed=self.completed, total=self.total,
                               info=self.info)
            return
        now = time.time()
        finished = self.total is not None and self.completed >= self.total
        if final or finished or now - self._printed >= self.interval:
            if final and self._printed and self._printed_done == self.completed:
                return  # the last line printed says what the loop did (a stopped run's last
                # round too)
            self._printed, self._printed_done = now, self.completed
            _emit(self.line())


def _job_eta_text(job: "Job") -> str:
    eta = job.eta if len(job.finished) < len(job.units) else None
    return f"~{fmt_seconds(eta)} left" if eta is not None else ""


def _eta_text(bar: Bar) -> str:
    if bar.total and bar.completed >= bar.total:
        return ""
    return f"~{fmt_seconds(bar.eta)} left" if bar.eta is not None else ""


def _emit(text: str) -> None:
    from fedadapt.log import log

    log(text)  # whole, never interleaved with another thread's line


def _start_live() -> None:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )
    from rich.text import Text

    class Eta(ProgressColumn):
        """The estimate, computed at each refresh (it keeps falling between updates)."""

        def render(self, task) -> Text:
            return Text(task.fields["eta"]())

    # markup off: "[linear_head] round" is a label, not rich markup
    live = Progress(TextColumn("{task.description}", markup=False), BarColumn(bar_width=24),
                    MofNCompleteColumn(), TextColumn("{task.fields[info]}", markup=False),
                    TimeElapsedColumn(), Eta(),
                    console=Console(stderr=True), transient=False)
    live.start()
    _STATE.rich = live
    # log handlers hold the real streams; send them through the live display's redirection
    for logger in (logging.getLogger(), logging.getLogger("flwr")):
        for h in logger.handlers:
            if isinstance(h, logging.StreamHandler) and h.stream in (sys.__stderr__,
                                                                     sys.__stdout__):
                _STATE.retargeted.append((h, h.stream))
                h.setStream(sys.stderr if h.stream is sys.__stderr__ else sys.stdout)


def _stop_live() -> None:
    live, _STATE.rich = _STATE.rich, None
    if live is not None:
        live.stop()
    for h, stream in _STATE.retargeted:
        h.setStream(stream)
    _STATE.retargeted.clear()


@contextmanager
def task(description: str, total: Optional[int] = None, *, unit: str = "",
         interval: float = 5.0, for_job: bool = False) -> Iterator[Bar]:
    """A bar for a loop of ``total`` units (None: unknown) while the block runs.

    ``interval``: seconds between plain lines (0: a line per update). ``for_job``: its progress
    also moves the current :func:`job` (the round bar).
    """
    bar = Bar(description, total, unit=unit, interval=interval, for_job=for_job)
    with _STATE.lock:
        if interactive():
            if _STATE.rich is None:
                _start_live()
            bar._id = _STATE.rich.add_task(description, total=total, info="",
                                           eta=lambda: _eta_text(bar))
        _STATE.open_tasks += 1
    try:
        yield bar
    finally:
        with _STATE.lock:
            _STATE.open_tasks -= 1
            if _STATE.rich is not None and bar._id is not None:
                _STATE.rich.remove_task(bar._id)
                bar._id = None
                _emit(bar.line())  # scrolls above the display: what the loop did
            else:
                bar._show(final=True)
            if _STATE.open_tasks == 0 and _STATE.job is None:
                _stop_live()


class Job:
    """Methods done / total and an estimate for the whole job; made by :func:`job`.

    The estimate adds, for the current method, its rounds left at its own time per round, and
    for each method still to come, the mean start-up (from its start to the end of its first
    round: Ray, workers, the first round) and its other rounds at its own cost: its time per
    round measured earlier (``measured``: a resumed run's rounds), else the mean time per round
    measured so far plus its estimated extra seconds per round (``extra``: a method that runs
    the backbone every round, where the others read cached features).
    """

    def __init__(self, name: str, units: dict[str, int], *,
                 measured: Optional[dict[str, float]] = None,
                 extra: Optional[dict[str, float]] = None) -> None:
        self.name, self.units = name, {m: max(1, u) for m, u in units.items()}
        self.measured, self.extra = dict(measured or {}), dict(extra or {})
        self.done: dict[str, int] = {m: 0 for m in units}
        self.finished: list[str] = []
        self.current: Optional[str] = None
        self.started = time.time()
        self._method_t0 = self.started
        self._startups: list[float] = []  # seconds from a method's start to its first unit
        self._per_unit: list[float] = []  # seconds per unit of each finished method
        self._bar: Optional[Bar] = None  # the current method's bar (for_job)
        self._id = None

    @property
    def total(self) -> int:
        return sum(self.units.values())

    @property
    def completed(self) -> int:
        return sum(self.done.values())

    @property
    def eta(self) -> Optional[float]:
        """Whole-job seconds left (None until a time per unit is known)."""
        per_now = self._bar.seconds_per_unit if self._bar is not None else None
        per = [*self._per_unit, *([per_now] if per_now is not None else [])]
        if not per:
            return None
        mean_per = sum(per) / len(per)
        startup = (sum(self._startups) / len(self._startups)) if self._startups else 0.0
        left = 0.0
        if self.current is not None:
            units_left = self.units[self.current] - self.done[self.current]
            if self.done[self.current] == 0:  # start-up (with the first unit) still running
                units_left -= 1
                left += max(0.0, startup - (time.time() - self._method_t0))
            left += (per_now or self.cost(self.current, mean_per)) * units_left
        todo = [m for m in self.units if m not in self.finished and m != self.current]
        return left + sum(startup + self.cost(m, mean_per) * (self.units[m] - 1) for m in todo)

    def cost(self, method: str, mean_per: float) -> float:
        """Seconds per unit of a method not measured in this job yet (see the class)."""
        if method in self.measured:
            return self.measured[method]
        return mean_per + self.extra.get(method, 0.0)

    def short(self) -> str:
        eta = self.eta if len(self.finished) < len(self.units) else None
        left = f", ~{fmt_seconds(eta)} left" if eta is not None else ""
        return f"job {len(self.finished)}/{len(self.units)} methods{left}"

    def start(self, method: str) -> None:
        """``method`` starts now (one status line says so)."""
        with _STATE.lock:
            self.current, self._method_t0 = method, time.time()
            i = len(self.finished) + 1
            _emit(f"[job] method {i}/{len(self.units)}: {method} starts | {self.short()}")
            self._refresh()

    def advance(self, k: int, bar: Optional[Bar] = None) -> None:
        if self.current is None:
            return
        if self.done[self.current] == 0 and k > 0:  # start to first unit, that unit included
            self._startups.append(time.time() - self._method_t0)
        self._bar = bar or self._bar
        self.done[self.current] = min(self.units[self.current], self.done[self.current] + k)
        self._refresh()

    def finish(self, method: str, *, skipped: bool = False) -> None:
        """``method`` is done (``skipped``: it was complete already)."""
        with _STATE.lock:
            if self._bar is not None and self._bar.seconds_per_unit is not None:
                self._per_unit.append(self._bar.seconds_per_unit)
            self._bar = None
            self.done[method] = self.units[method]
            self.finished.append(method)
            self.current = None
            took = "complete already" if skipped else "done"
            _emit(f"[job] method {len(self.finished)}/{len(self.units)}: {method} {took} | "
                  f"{self.short()} (elapsed {fmt_seconds(time.time() - self.started)})")
            self._refresh()

    def _refresh(self) -> None:
        if _STATE.rich is not None and self._id is not None:
            current = f" | {self.current}" if self.current else ""
            _STATE.rich.update(self._id, completed=len(self.finished),
                               info=f"{self.completed}/{self.total} rounds{current}")


@contextmanager
def job(name: str, units: dict[str, int], **costs) -> Iterator[Job]:
    """The job-level display while the block runs: ``units`` maps each method to its rounds
    (1 for a method trained once on the server); ``costs``: :class:`Job`'s ``measured`` and
    ``extra`` seconds per unit."""
    j = Job(name, units, **costs)
    with _STATE.lock:
        _STATE.job = j
        if interactive():
            if _STATE.rich is None:
                _start_live()
            j._id = _STATE.rich.add_task(f"job {name}", total=len(units), info="",
                                         eta=lambda: _job_eta_text(j))
    try:
        yield j
    finally:
        with _STATE.lock:
            _STATE.job = None
            if _STATE.rich is not None and j._id is not None:
                _STATE.rich.remove_task(j._id)
            if _STATE.open_tasks == 0:
                _stop_live()


class _NoiseFilter(logging.Filter):
    """Drop Flower's records that say nothing a fedadapt user can act on: ``run_simulation``'s
    deprecation notice (five lines per method of a job; fedadapt runs Flower's simulation
    engine through it on purpose, with Flower pinned: docs/deployment.md) and the actors'
    ``Manually terminating ClientAppActor`` at the end of every simulation. Everything else
    passes untouched."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg, args = str(record.msg), str(record.args)
        if msg.startswith("DEPRECATED FEATURE") and "run_simulation" in args:
            return False
        return not msg.startswith("Manually terminating")


_QUIETED: list[bool] = []


def quiet_libraries() -> None:
    """Silence the libraries' noise in this process (the driver, or a Ray worker): Flower's
    (:class:`_NoiseFilter`) and the progress bars of datasets, transformers ("Loading
    weights") and the Hub, which write ``\\r`` lines into logs. Once per process. The bars
    of a library not imported yet are turned off by its environment variable (read when it is
    imported, here and in the processes this one starts): importing ``datasets`` only to
    silence it took 1.5-2.8 s of a run that never reads a Hugging Face data set."""
    if _QUIETED:
        return
    _QUIETED.append(True)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger("flwr").addFilter(_NoiseFilter())
    # tqdm's shared lock, made now and never dropped: datasets' thread_map (tqdm's
    # ensure_lock) deletes tqdm._lock when it finds none, and a bar closing in another thread
    # at that moment (a client's handshake beside the rounds' start) raised "type object
    # 'tqdm' has no attribute '_lock'" (seen twice in an evidence sweep's first local-only run)
    from tqdm import tqdm

    tqdm.get_lock()
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    # "Parameter 'indices'=[...] couldn't be hashed properly, a random hash was used": datasets
    # fingerprints a select() for its cache, which fedadapt does not use
    logging.getLogger("datasets.fingerprint").setLevel(logging.ERROR)
    # transformers reads the Hub's setting when imported; importing it here only to silence it
    # took a second of a small CNN's start-up
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()
