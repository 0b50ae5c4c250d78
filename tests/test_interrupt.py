"""Ctrl-C (SIGINT) and SIGTERM stop a run cleanly: one line that says how to resume, exit code
130 / 143 with no hang (docs/reliability.md gives the seconds), Ray gone, the last checkpoint
valid; the resumed run ends with the metrics of a run that was never interrupted."""

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from test_resume import ROUNDS, TINY, fedadapt, metrics, same, straight_through

from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
from fedadapt.federation.server.interrupt import STOP, RunStopped, StoppableGrid

#: Flower's simulation engine on Ray: what these stops must end cleanly (the default,
#: federation.backend=auto, runs a one-worker job in process, without Ray). Its worker has one
#: CPU (one torch thread): the default two threads made each round 100x slower whenever the
#: other pytest worker kept a core busy (tests/test_faults.py, LATE_TIMEOUT).
RAY = ["federation.backend=simulation", "federation.ray_num_cpus=1"]


def started(out: Path, rounds: int, proc, timeout: float = 300) -> Path:
    """The run directory once ``rounds`` rounds are in its metrics.jsonl."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = list(out.rglob("metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= rounds:
            return found[0].parent
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"the run never reached round {rounds}")


def stop(proc, sig, *, group: bool) -> tuple[int, str]:
    (os.killpg if group else os.kill)(proc.pid, sig)
    try:
        rc = proc.wait(timeout=120)  # a guard against a hang, not a timing
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the run hung after the signal") from None
    return rc, proc.stderr.read()


def left_in_group(pgid: int, wait: float = 15.0) -> list[str]:
    """Processes of the run's process group (Ray's workers) still alive after ``wait`` s."""
    deadline = time.time() + wait
    while True:
        ps = subprocess.run(["ps", "-eo", "pgid=,pid=,args="], capture_output=True, text=True)
        alive = [ln for ln in ps.stdout.splitlines() if ln.split()[0] == str(pgid)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def one_line(err: str, sig: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("fedadapt: ")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"fedadapt: stopped by {sig}; continue with: fedadapt resume=")
    return lines[0]


@pytest.mark.slow
def test_sigint_at_round_3_exits_130_and_resumes_to_the_same_metrics(tmp_path, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    args = ["method=linear_head", *TINY, *RAY, "partition.fraction_fit=0.5"]
    victim = fedadapt(args + [f"output_dir={tmp_path}/stopped"], env)
    run_dir = started(tmp_path / "stopped", 3, victim)
    rc, err = stop(victim, signal.SIGINT, group=True)  # Ctrl-C: the whole group
    assert rc == 130, (rc, err[-3000:])
    line = one_line(err, "SIGINT")
    assert f"resume={run_dir.parent} (linear_head: " in line
    assert "from its checkpoint of round" in line
    assert left_in_group(victim.pid) == []  # Ray and its workers are gone
    assert not (run_dir / "summary.json").exists()
    load_checkpoint(latest_checkpoint(run_dir))  # the last complete checkpoint is valid
    assert len(metrics(run_dir)) < ROUNDS

    # continued in this process, without a second Ray start (15-20 s): `fedadapt resume=`
    # through Ray is test_resume.py's, after a SIGKILL; the two backends give the same run
    args = [*args, f"output_dir={tmp_path}/stopped", f"cache_dir={cache_dir}"]  # as it ran
    assert same(straight_through(args, run_dir, resume=True), straight_through(args,
                                                                               tmp_path / "ref"))


@pytest.mark.slow
def test_sigterm_to_the_process_exits_143_with_one_line(tmp_path, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    proc = fedadapt(["method=linear_head", *TINY, *RAY, f"output_dir={tmp_path}/out"], env)
    run_dir = started(tmp_path / "out", 2, proc)
    rc, err = stop(proc, signal.SIGTERM, group=False)  # `kill PID`, `timeout`, ...
    assert rc == 143, (rc, err[-3000:])
    assert f"resume={run_dir.parent} " in one_line(err, "SIGTERM")
    assert left_in_group(proc.pid) == []


@pytest.mark.slow
def test_sigint_before_the_run_writes_anything(tmp_path, cache_dir):
    """Stopped while it loads (no job.json yet): nothing is left behind."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    proc = fedadapt(["method=linear_head", *TINY, f"output_dir={tmp_path}/out"], env)
    deadline = time.time() + 120
    while not list((tmp_path / "out").rglob("*")) and time.time() < deadline:
        time.sleep(0.02)  # Hydra made the job folder: the job is being prepared
    rc, err = stop(proc, signal.SIGINT, group=True)
    assert rc == 130, (rc, err[-3000:])
    if "before writing anything" in err:  # (or it was quicker: then resumable as above)
        left = [str(p) for p in (tmp_path / "out").rglob("*") if p.is_file()]
        assert not left, (left, err[-3000:])
    assert "Traceback" not in err


@pytest.mark.slow
def test_sigterm_to_the_group_while_ray_starts_ends_with_the_stop_line_and_no_lock(
        tmp_path, cache_dir):
    """As ``timeout`` sends it (SIGTERM to the whole process group, Ray's workers included),
    while the job is being prepared or Ray starts: exit 143, one stop line, the lock released,
    no traceback (this once hung after a handler's exception was swallowed by a garbage
    collector callback, or while the main thread waited inside ray.init)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    proc = fedadapt(["method=linear_head", *TINY, *RAY, f"output_dir={tmp_path}/out"], env)
    deadline = time.time() + 300  # a guard against a run that never starts Ray, not a timing
    while not ray_starting(proc.pid):  # the data is prepared; Ray's first process is up
        assert time.time() < deadline and proc.poll() is None, "Ray never started"
        time.sleep(0.02)
    rc, err = stop(proc, signal.SIGTERM, group=True)
    assert rc == 143, (rc, err[-3000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert [ln for ln in err.splitlines() if ln.startswith("fedadapt: ")][0].startswith(
        "fedadapt: stopped by SIGTERM")
    assert not list((tmp_path / "out").rglob(".fedadapt.lock"))


def ray_starting(pid: int) -> bool:
    """Whether a process below ``pid`` is one of Ray's (its GCS server or raylet): the run is
    inside Ray's start, whatever the machine's load made the data preparation take."""
    for child in descendants(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                args = fh.read()
        except OSError:
            continue
        if b"gcs_server" in args or b"raylet" in args:
            return True
    return False


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Ray's GCS, raylet, agents and workers of a run)."""
    ps = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in ps.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pids: set[int], wait: float = 15.0) -> set[int]:
    deadline = time.time() + wait
    while True:
        left = {p for p in pids if os.path.exists(f"/proc/{p}")
                and "zombie" not in open(f"/proc/{p}/status").read().lower()}
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


@pytest.mark.slow
def test_a_sigkill_of_the_driver_alone_leaves_no_ray_process(tmp_path, cache_dir):
    """Ray's processes run in process groups of their own (so a SIGTERM to the run's group is
    the driver's to handle); when the driver dies without a word, even by SIGKILL, the reaper
    kills them, the agents the raylet started included."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    proc = fedadapt(["method=linear_head", *TINY, *RAY, f"output_dir={tmp_path}/out"], env)
    started(tmp_path / "out", 2, proc)
    ray = descendants(proc.pid)
    assert len(ray) >= 3  # GCS, raylet, a worker at least
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert alive(ray) == set()


WATCHED = """
import sys, time
from fedadapt.federation.server.interrupt import last_words, stop_on_signals

with stop_on_signals():
    last_words(lambda stop: print(f"fedadapt: {stop}; said by the watch", file=sys.stderr))
    ready = False
    while True:  # code that swallows the stop, as a garbage collector callback does
        try:  # "ready" only once inside: a signal after it is swallowed, wherever it lands
            if not ready:
                ready = True
                print("ready", flush=True)
            time.sleep(60)
        except BaseException:
            pass
"""


@pytest.mark.slow
def test_a_stop_the_main_thread_swallows_is_ended_by_the_watch_thread():
    """Deterministic: the child says ``ready`` from inside the ``try`` that swallows the stop
    (it once said it just before, and a signal landing in between ended it another way, about
    one run in four on a loaded machine)."""
    import sys

    proc = subprocess.Popen([sys.executable, "-c", WATCHED], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline().strip() == "ready"
    rc, err = stop(proc, signal.SIGTERM, group=False)
    assert rc == 143 and err.strip() == "fedadapt: stopped by SIGTERM; said by the watch", err


class NeverAnswers:
    """A grid whose clients never reply."""

    def push_messages(self, messages):
        return [str(i) for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        return []

    def get_node_ids(self):
        return [1, 2]


def test_the_server_thread_stops_waiting_when_told():
    """Clients that never answer: the wait ends when STOP is set (it would never end
    otherwise), not before; a watchdog, not a wall-clock bound, catches a hang."""
    grid = StoppableGrid(NeverAnswers())
    assert grid.get_node_ids() == [1, 2]
    STOP.clear()
    raised, told = [], threading.Event()

    def wait():
        try:
            grid.send_and_receive([object(), object()])
        except RunStopped:
            raised.append(told.is_set())

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # still waiting: nothing answered, nobody told it
        told.set()
        STOP.set()
        waiter.join(120)
        assert not waiter.is_alive(), "it went on waiting after STOP"
    finally:
        STOP.clear()
    assert raised == [True]  # RunStopped, after it was told
    assert grid.send_and_receive([object()], timeout=0.2) == []  # a timeout still ends it
