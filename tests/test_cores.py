"""Threads sized to the cores free for a run, the wait policy chosen at start-up, the word said
when a round slows under other processes' load (fedadapt.cores), and how a run records and
resumes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from fedadapt import cores
from fedadapt.cores import Sample


def _loop(*prefix: str) -> subprocess.Popen:
    return subprocess.Popen([*prefix, sys.executable, "-c", "while True: pass"])


@pytest.fixture
def measured(monkeypatch):
    """The free cores measured, not fixed (the suite fixes them: conftest.py)."""
    monkeypatch.delenv(cores.ENV_FREE, raising=False)


def test_others_load_is_the_machines_busy_time_less_this_process_over_the_window():
    # 3 busy core-seconds on the machine in 2 s, 1 of them this process's: others kept 1 core
    assert cores.others_load(Sample(0.0, 10.0, 1.0), Sample(2.0, 13.0, 2.0)) == 1.0
    # this process's own work is never others' (rounding of the two clocks: not below 0)
    assert cores.others_load(Sample(0.0, 10.0, 1.0), Sample(1.0, 11.0, 2.05)) == 0.0
    assert cores.others_load(Sample(0.0, None, 1.0), Sample(1.0, 11.0, 2.0)) is None


@pytest.mark.parametrize("others,want,workers,threads", [
    (0.0, 2, 1, 2),     # idle: as before
    (0.49, 2, 1, 2),    # under half a core taken: still both
    (0.51, 2, 1, 1),    # over half: that core is taken
    (1.0, 2, 1, 1),     # a busy loop
    (2.0, 2, 1, 1),     # everything taken: still one thread
    (0.0, 1, 1, 1),     # never more than the worker's CPUs
    (0.0, 2, 2, 1),     # two workers share the two cores
])
def test_threads_are_the_workers_cpus_capped_by_the_free_cores(monkeypatch, measured, others,
                                                               want, workers, threads):
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    monkeypatch.setattr(cores, "_MARK", Sample(time.monotonic() - 10, 0.0, 0.0))
    monkeypatch.setattr(cores, "sample",
                        lambda **_: Sample(cores._MARK.wall + 10, others * 10, 0.0))
    got, why = cores.threads_for(want, workers)
    assert got == threads
    assert f"other processes using {others:.1f}" in why
    assert ("instead of" in why) == (threads < want)


def test_a_second_question_within_the_window_gets_the_first_answer_without_waiting(
        monkeypatch, measured):
    # a run's start-up asks twice (whether workers train at once, then their threads): the
    # second must not wait out and measure a window of its own, nor differ from the first
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    monkeypatch.setattr(cores, "_MARK", Sample(time.monotonic() - 10, 0.0, 0.0))
    load = iter([1.0, 0.0])  # others kept a core busy in the first window, none after
    monkeypatch.setattr(cores, "others_load", lambda since, now=None: next(load))
    slept = []
    monkeypatch.setattr(cores.time, "sleep", slept.append)
    first = cores.free_cores()
    assert first[0] == 1.0 and cores.free_cores() == first and slept == []
    cores.mark()  # a new window (the next run's): measured again, after its wait
    assert cores.free_cores()[0] == 2.0 and len(slept) == 1


def test_the_fixed_free_cores_override_the_measurement(monkeypatch):
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    monkeypatch.setenv(cores.ENV_FREE, "1")
    assert cores.threads_for(2, 1) == (1, f"{cores.ENV_FREE}=1: 1 instead of 2")
    monkeypatch.setenv(cores.ENV_FREE, "2")
    assert cores.threads_for(2, 1) == (2, f"{cores.ENV_FREE}=2")


@pytest.mark.parametrize("value", ["two", "0", "-1"])
def test_a_bad_fixed_free_cores_is_one_line_naming_it(monkeypatch, value, tmp_path):
    from conftest import tiny_run

    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.config import ConfigError, validate

    monkeypatch.setenv(cores.ENV_FREE, value)
    with pytest.raises(ConfigError, match=f"^FEDADAPT_FREE_CORES='{value}' is invalid: "):
        validate(tiny_run(str(tmp_path), LinearHeadConfig()))  # before a run writes anything


def test_a_busy_loop_is_seen_as_a_core_taken_and_a_niced_one_is_not(measured):
    busy, niced, asleep = _loop(), _loop("nice", "-n", "19"), subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)
        # (runnable, yields its core to this process, CPU seconds)
        assert cores._process(str(busy.pid))[:2] == (True, False)
        assert cores._process(str(niced.pid))[:2] == (True, True)  # same autogroup: nice counts
        assert cores._process(str(asleep.pid))[0] is False
        assert cores.runnable_others() >= 1
        first = cores.sample()
        assert str(niced.pid) in first.yielding and str(busy.pid) not in first.yielding
        time.sleep(0.5)
        later = cores.sample()
        assert str(niced.pid) in later.yielding  # (it may get no tick at all in 0.5 s)
        assert cores.others_load(first, later) > 0.5  # the busy loop's core is taken, at least
    finally:
        for p in (busy, niced, asleep):
            p.kill()
            p.wait()


@pytest.mark.parametrize("others,policy", [(0, "OpenMP's default spinning"),
                                           (2, f"GOMP_SPINCOUNT={cores.THROTTLED_SPINS}")])
def test_the_wait_policy_throttles_spinning_when_others_run_at_start_up(monkeypatch, others,
                                                                      policy):
    for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # as before torch loads (restored after)
    monkeypatch.setattr(cores, "runnable_others", lambda: others)
    monkeypatch.setattr(cores, "WAIT_POLICY", cores.WAIT_POLICY)
    assert cores.choose_wait_policy()[0] == policy
    assert ("GOMP_SPINCOUNT" in os.environ) == bool(others)


def test_the_users_wait_policy_is_kept_and_a_late_import_says_so(monkeypatch):
    monkeypatch.setattr(cores, "WAIT_POLICY", cores.WAIT_POLICY)
    monkeypatch.setattr(cores, "runnable_others", lambda: 3)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert cores.choose_wait_policy() == ("OMP_WAIT_POLICY=PASSIVE", "set in the environment")
    assert "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    assert cores.choose_wait_policy() == ("OpenMP's default", "torch was loaded before fedadapt")
    assert "GOMP_SPINCOUNT" not in os.environ


def test_a_fresh_process_under_load_throttles_and_a_quiet_one_spins():
    code = "import fedadapt; from fedadapt import cores; print(cores.WAIT_POLICY[0])"
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    busy = _loop()
    try:
        time.sleep(0.3)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
    finally:
        busy.kill()
        busy.wait()
    assert out.strip() == f"GOMP_SPINCOUNT={cores.THROTTLED_SPINS}"


def _watch(monkeypatch, threads: int, loads: list[float]) -> tuple[cores.SlowdownWatch, list]:
    """A watch whose rounds see ``loads`` (others' cores) in turn, one second a round."""
    clock = iter(range(1, 100))
    busy = [0.0]

    def sample(**_):
        t = next(clock)
        busy[0] += loads.pop(0) if loads else 0.0
        return Sample(float(t), busy[0], 0.0)

    monkeypatch.setattr(cores, "sample", sample)
    return cores.SlowdownWatch(threads), loads


def test_a_round_far_slower_than_the_first_ones_under_load_is_said_once(monkeypatch):
    watch, _ = _watch(monkeypatch, 2, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0])
    said = [watch.round(r, s, False) for r, s in enumerate([1.0, 1.2, 1.1, 3.2, 9.0, 9.0], 1)]
    assert said[:4] == [None, None, None, None]  # 3.2 s is under 3x the first rounds' 1.1 s
    assert said[4] == ("round 5 took 9.00 s, 8.2x this run's first rounds (1.10 s): other "
                       "processes kept 1.0 core(s) busy during it, and this run's 2 torch "
                       "threads per worker wait for each other whenever one is descheduled; "
                       "federation.num_cpus=1 (one thread per worker) avoids that")
    assert said[5] is None  # once


def test_the_watch_reads_the_machine_only_for_a_slow_round_or_once_in_a_while(monkeypatch):
    """Fast rounds read no counters within WATCH_REFRESH_S of the last read; a slow round reads
    them, and its load is measured from the last read."""
    watch, loads = _watch(monkeypatch, 2, [0.0, 1.0, 1.0, 1.0])  # the start, then each read
    monkeypatch.setattr(cores, "WATCH_REFRESH_S", 1e9)
    said = [watch.round(r, s, False) for r, s in enumerate([1.0, 1.1, 1.0, 1.2], 1)]
    assert said == [None] * 4 and loads == [1.0, 1.0, 1.0]  # no read since the start
    assert watch.round(5, 9.0, False).startswith("round 5 took 9.00 s")
    assert loads == [1.0, 1.0]  # one read, for the slow round
    monkeypatch.setattr(cores, "WATCH_REFRESH_S", 0.0)  # a read after every round
    assert watch.round(6, 1.0, False) is None and loads == [1.0]


def test_no_word_without_others_load_and_rounds_are_compared_with_their_kind(monkeypatch):
    watch, _ = _watch(monkeypatch, 2, [0.0] * 8)
    # evaluated rounds (True) take longer by nature: compared with evaluated ones only
    said = [watch.round(r, s, ev) for r, (s, ev) in enumerate(
        [(1.0, False), (5.0, True), (1.0, False), (5.2, True), (9.0, False)], 1)]
    assert said == [None] * 5  # round 5 is 9x, but no other process used the cores
    watch, _ = _watch(monkeypatch, 1, [0.0, 0.0, 0.0, 2.0])  # the start, then each round
    said = [watch.round(r, s, False) for r, s in enumerate([1.0, 1.0, 4.0], 1)]
    assert said[2].endswith("its one thread per worker shares a core with them (fewer jobs on "
                            "the machine is the remedy)")


def test_a_round_that_evaluated_on_the_server_or_its_clients_is_of_the_evaluated_kind():
    """A metrics row holds both accuracies, None where not measured: the last round's
    server-side evaluation of the whole test set is compared with evaluated rounds, not
    called a slowdown of the training rounds."""
    assert not cores.evaluated_round({"round": 3, "client_acc": None, "global_acc": None})
    assert cores.evaluated_round({"round": 40, "client_acc": None, "global_acc": 0.16})
    assert cores.evaluated_round({"round": 2, "client_acc": 0.5, "global_acc": None})
    assert not cores.evaluated_round({"round": 1})


def test_a_run_states_its_threads_and_a_resume_keeps_the_first_parts(tmp_path, cache_dir,
                                                                    monkeypatch, capsys):
    from omegaconf import OmegaConf
    from test_resume import TINY, _Killed, _stopping_after

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config(["method=linear_head", *TINY, "rounds=4", f"cache_dir={cache_dir}"])
    yaml = OmegaConf.to_yaml(composed, resolve=True)
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    monkeypatch.setenv(cores.ENV_FREE, "1")  # a core taken when it starts
    with pytest.raises(_Killed):
        run_experiment(to_run_config(composed), tmp_path / "run", config_yaml=yaml,
                       execute=_stopping_after(2))
    assert "[federation] 1 torch thread(s) per worker (FEDADAPT_FREE_CORES=1: 1 instead of 2)" \
        in capsys.readouterr().err
    monkeypatch.setenv(cores.ENV_FREE, "2")  # idle at the resume: the first part's threads
    run_experiment(to_run_config(composed), tmp_path / "run", config_yaml=yaml,
                   execute=in_process("workers"), resume=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["layout"]["threads"] == 1
    assert summary["layout"]["threads_why"] == "as the run's part before the resume"
    assert summary["reproducibility"]["torch_threads_client"] == 1
    assert summary["reproducibility"]["torch_threads_server"] == 1
