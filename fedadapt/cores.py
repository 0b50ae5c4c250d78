"""The cores a run can use on a machine that does other work, and how torch's threads wait there.

On the CPU, a worker's torch threads split every operator between them and meet at its end.
When another process holds one of those cores, the thread that shares it is descheduled for a
time slice while its partner waits; with OpenMP's default (libgomp spins about 300,000 times
before it sleeps) the waiting thread also burns the very core the late one needs. A 0.1 s round
took 10.5 s beside a busy loop (docs/scaling.md, "A core taken by another job"). Two decisions,
both stated in the run's layout line and kept in its summary (``layout``):

* **Threads.** With ``federation.num_cpus`` unset, each worker's torch threads (and, when they
  are capped, the server's evaluation's) are at most the cores free for the run: the cores
  this process may use, less those other processes used between fedadapt's start (or the
  previous run's layout) and this run's layout, averaged over that time (``/proc/stat``, less
  this process's own CPU time). A core that others keep busy costs a thread; on an idle
  machine nothing changes.
  ``FEDADAPT_FREE_CORES=N`` fixes what is taken as free (runs that must use the same threads
  whatever else the machine does: the test suite sets it); ``federation.num_cpus`` fixes the
  threads themselves. Torch's thread count can change a run's last bits (fine-tuning's), so the
  threads are recorded and a resumed run uses its first part's.
* **Wait policy**, decided when fedadapt is imported, before torch (OpenMP reads it once, when
  torch loads it): on a quiet machine libgomp's default spinning, the fastest there (a
  fine-tuning step 0.45 s against 0.55-0.85 s throttled or passive); when other processes at
  its priority are runnable at that moment, ``GOMP_SPINCOUNT=1000`` (the count libgomp itself
  uses when it has more threads than cores), so that a thread whose partner is descheduled
  sleeps instead of spinning against it (the same step beside a busy loop: 0.8 s against
  1.6-1.8 s). A user's own ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` is kept. Ray's workers
  inherit it.

And once a run is under way, :class:`SlowdownWatch` says once when a round takes far longer than
the run's first rounds of its kind while other processes use the cores, with the key that helps.

Nothing here imports torch: :mod:`fedadapt` calls :func:`choose_wait_policy` before anything
loads it. Off Linux (no ``/proc/stat``) every core counts as free and the default policy stays.
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Optional

#: libgomp's spin count when it has more threads than cores; ours on a busy machine.
THROTTLED_SPINS = "1000"
#: Other processes' CPU use that costs a thread: a core counts as taken once they use half of it.
TAKEN_AT = 0.5
#: A round this many times its kind's first rounds, with others on the cores, is reported.
SLOWDOWN = 3.0
#: Seconds between :class:`SlowdownWatch`'s reads of the machine's counters while rounds are not
#: slow.
WATCH_REFRESH_S = 1.0
ENV_FREE = "FEDADAPT_FREE_CORES"

#: What :func:`choose_wait_policy` decided, for the layout line: ``(policy, why)``.
WAIT_POLICY: tuple[str, str] = ("OpenMP's default", "not decided by fedadapt")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; every core where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _stat() -> Optional[list[str]]:
    try:
        with open("/proc/stat") as fh:
            return fh.read().splitlines()
    except OSError:
        return None


def _read(path: str) -> Optional[bytes]:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError:  # gone meanwhile, or no /proc
        return None


def _autogroup(proc: str) -> Optional[tuple[bytes, int]]:
    """``(group, nice)`` of the scheduler autogroup ``proc`` is in (``/proc/<id>/autogroup``:
    ``/autogroup-6 nice 19``); None where the kernel has none."""
    text = _read(f"/proc/{proc}/autogroup")
    parts = text.split() if text else []
    return (parts[0], int(parts[2])) if len(parts) == 3 else None


_NICE = os.nice(0) if hasattr(os, "nice") else 0
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_AUTOGROUPS = _read("/proc/sys/kernel/sched_autogroup_enabled") == b"1\n"
_MY_GROUP = _autogroup(str(os.getpid())) if _AUTOGROUPS else None


def _process(proc: str) -> Optional[tuple[bool, bool, float]]:
    """``(runnable, yields, cpu seconds)`` of process ``proc``: whether it is running or waiting
    for a core, whether it yields the core to this process (a higher nice in this process's
    scheduler autogroup, or another autogroup of a higher nice: across autogroups the kernel
    weighs the groups, not the processes), and the CPU time it has used; None when gone."""
    text = _read(f"/proc/{proc}/stat")
    if text is None:
        return None
    fields = text[text.rfind(b")") + 2:].split()  # after "<id> (name) "
    if len(fields) < 17:
        return None
    group = _autogroup(proc) if _MY_GROUP is not None else None
    if group is not None and group[0] != _MY_GROUP[0]:
        yields = group[1] > _MY_GROUP[1]
    else:
        yields = int(fields[16]) > _NICE
    return fields[0] == b"R", yields, (int(fields[11]) + int(fields[12])) / _TICKS



def _others() -> Optional[list[str]]:
    try:
        me = str(os.getpid())
        return [p for p in os.listdir("/proc") if p.isdigit() and p != me]
    except OSError:
        return None


def runnable_others() -> Optional[int]:
    """Other processes runnable now that compete with this one for a core (not those that
    yield it: :func:`_process`); None where there is no ``/proc``."""
    procs = _others()
    if procs is None:
        return None
    return sum(1 for proc in procs if (p := _process(proc)) is not None and p[0] and not p[1])


def choose_wait_policy() -> tuple[str, str]:
    """Set OpenMP's wait policy for this process and its children before torch loads (see the
    module docstring); ``(policy, why)``, also kept in :data:`WAIT_POLICY`."""
    global WAIT_POLICY
    mine = {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ}
    if "torch" in sys.modules and not mine:
        WAIT_POLICY = ("OpenMP's default", "torch was loaded before fedadapt")
    elif mine:
        WAIT_POLICY = (" ".join(f"{k}={v}" for k, v in mine.items()), "set in the environment")
    else:
        seen = []
        for _ in range(3):  # the least of three looks 2 ms apart: a passing daemon is not load
            seen.append(runnable_others())
            time.sleep(0.002)
        others = None if None in seen else min(seen)
        if others:
            os.environ["GOMP_SPINCOUNT"] = THROTTLED_SPINS
            WAIT_POLICY = (f"GOMP_SPINCOUNT={THROTTLED_SPINS}",
                           f"{others} other process(es) runnable at start-up")
        else:
            WAIT_POLICY = ("OpenMP's default spinning", "the machine was quiet at start-up")
    return WAIT_POLICY


@dataclass(frozen=True)
class Sample:
    """A moment's CPU counters: the machine's busy seconds (every core), this process's, and
    the CPU seconds of each process that yields its core to this one (None: not looked at)."""

    wall: float
    busy: Optional[float]
    own: float
    yielding: Optional[dict] = None


def sample(*, processes: bool = True) -> Sample:
    """The counters now; ``processes``: also every yielding process's (a look at each
    process, about 3 ms for 100 of them)."""
    busy = None
    lines = _stat()
    if lines and lines[0].startswith("cpu "):
        f = [int(x) for x in lines[0].split()[1:]]
        # user nice system idle iowait irq softirq steal: all but idle and iowait are busy
        # (steal too: a core another guest holds is not free)
        busy = (sum(f[:8]) - f[3] - f[4]) / _TICKS
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    yielding = None
    if processes and busy is not None:
        yielding = {proc: p[2] for proc in _others() or []
                    if (p := _process(proc)) is not None and p[1]}
    return Sample(time.monotonic(), busy,
                  me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, yielding)


def others_load(since: Sample, now: Optional[Sample] = None) -> Optional[float]:
    """Cores that other processes which compete with this one kept busy, on average, from
    ``since`` to ``now``: the machine's busy time less this process's and less what yielding
    processes used (those seen at both ends); None where it cannot be known."""
    now = now or sample()
    span = now.wall - since.wall
    if since.busy is None or now.busy is None or span <= 0:
        return None
    yielded = sum(max(0.0, now.yielding[p] - t) for p, t in since.yielding.items()
                  if p in now.yielding) if since.yielding and now.yielding else 0.0
    return max(0.0, (now.busy - since.busy - (now.own - since.own) - yielded) / span)


_MARK = sample()  # fedadapt's import: the first run's window starts here
MIN_WINDOW = 0.3
#: The last measured answer of :func:`free_cores` and the mark that ended its window: a second
#: question within :data:`MIN_WINDOW` of that mark, with no new mark since (one run's start-up
#: asks twice), gets the same answer at once instead of waiting out and measuring a new window.
_ANSWER: Optional[tuple[Sample, tuple[float, str]]] = None


def mark() -> None:
    """Start the next run's window now (a run's own Ray workers are not this process)."""
    global _MARK
    _MARK = sample()


def fixed_free_cores() -> Optional[float]:
    """``FEDADAPT_FREE_CORES`` as a number of cores, None when unset; a value that is not a
    number > 0 raises ``ValueError`` saying so (:func:`fedadapt.config.validate` reports it in
    one line before a run starts)."""
    text = os.environ.get(ENV_FREE)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{ENV_FREE}={text!r} is invalid: the cores taken as free for a run, "
                         f"a number > 0 (or unset: measured)")
    return value


def free_cores() -> tuple[float, str]:
    """``(cores, how)``: the cores free for a run starting now (see the module docstring)."""
    usable = usable_cores()
    fixed = fixed_free_cores()
    if fixed is not None:
        return min(fixed, usable), f"{ENV_FREE}={os.environ[ENV_FREE]}"
    global _ANSWER
    if (_ANSWER is not None and _ANSWER[0] is _MARK
            and time.monotonic() - _MARK.wall < MIN_WINDOW):
        return _ANSWER[1]
    wait = MIN_WINDOW - (time.monotonic() - _MARK.wall)
    if wait > 0:
        time.sleep(wait)
    load = others_load(_MARK)
    mark()
    if load is None:
        answer = float(usable), f"{usable} core(s); no /proc/stat to see other processes"
    else:
        answer = max(0.0, usable - load), (f"{usable} core(s), other processes using "
                                           f"{load:.1f} of them")
    _ANSWER = (_MARK, answer)
    return answer


def threads_for(per_worker: float, local_workers: int) -> tuple[int, str]:
    """Torch threads for each of ``local_workers`` on this machine that may use
    ``per_worker`` CPUs, capped by the free cores; ``(threads, why)``."""
    want = max(1, int(per_worker))
    free, how = free_cores()
    cap = max(1, math.floor((free + TAKEN_AT) / max(local_workers, 1)))
    threads = min(want, cap)
    why = how if threads == want else f"{how}: {threads} instead of {want}"
    return threads, why


def describe_policy() -> str:
    policy, why = WAIT_POLICY
    return f"{policy} ({why})"


def evaluated_round(row: dict) -> bool:
    """Whether a round's metrics row says it evaluated: its clients, or the global model on
    the server (a row holds both keys, None when not measured). :class:`SlowdownWatch` compares
    such rounds with each other: the final evaluation of a long test set is not a slowdown."""
    return any(row.get(key) is not None for key in ("client_acc", "global_acc"))


class SlowdownWatch:
    """Says once when a round takes :data:`SLOWDOWN` times the run's first rounds of its kind
    (evaluated or not) while other processes keep at least half a core busy."""

    def __init__(self, threads: int, key: str = "federation.num_cpus=1") -> None:
        self.threads = threads
        self.key = key
        self.first: dict[bool, list[float]] = {True: [], False: []}
        self.since = sample(processes=False)  # cheap: rounds can take milliseconds
        self.said = False

    def round(self, server_round: int, seconds: float, evaluated: bool) -> Optional[str]:
        """The warning for this round, once; None otherwise. The machine's counters are read
        only for a slow round, and otherwise once every :data:`WATCH_REFRESH_S` (reading them
        took 0.14 ms, a round of benchmarks/investigations/peer_pfl.py's W3 12 ms): a slow
        round's others' load is measured from the latest read, at most that long before it
        began."""
        first = self.first[evaluated]
        if len(first) < 3:
            first.append(seconds)
        base = statistics.median(first)
        if self.said or len(first) < 2 or base <= 0 or seconds < SLOWDOWN * base:
            if time.monotonic() - self.since.wall >= WATCH_REFRESH_S:
                self.since = sample(processes=False)
            return None
        now = sample(processes=False)
        load = others_load(self.since, now)
        self.since = now
        if load is None or load < 0.5:
            return None
        self.said = True
        cause = (f"other processes kept {load:.1f} core(s) busy during it, and this run's "
                 f"{self.threads} torch threads per worker wait for each other whenever one is "
                 f"descheduled; {self.key} (one thread per worker) avoids that"
                 if self.threads > 1 else
                 f"other processes kept {load:.1f} core(s) busy during it; its one thread per "
                 f"worker shares a core with them (fewer jobs on the machine is the remedy)")
        return (f"round {server_round} took {seconds:.2f} s, {seconds / base:.1f}x this run's "
                f"first rounds ({base:.2f} s): {cause}")
