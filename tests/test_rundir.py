"""Every run gets its own directory (fedadapt.rundir), and the Hydra launchers: the
joblib launcher's parallel sweep gives the metrics of the same runs done alone, the slurm
preset composes, a launcher whose plugin is missing names the pip package."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fedadapt import rundir

TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=300", "partition.num_clients=3", "partition.fraction_fit=1.0",
        "rounds=2", "federation.eval_every=1", "train.lr=0.05"]


@pytest.mark.slow
def test_simultaneous_claims_get_distinct_directories(tmp_path):
    """Six processes claim one name at once. They are forked from a fresh fork server, not from
    this pytest worker: a fork of a worker that still held Ray's gRPC threads from an earlier
    test hung (five children gone, the sixth waiting for ever on the pool's lock)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["fedadapt.rundir"])
    with ctx.Pool(6) as pool:
        names = pool.map(rundir.claim_new_dir, [tmp_path / "2026-01-01_00-00-00"] * 6)
    assert len(set(names)) == 6
    assert sorted(Path(n).name for n in names) == ["2026-01-01_00-00-00"] + [
        f"2026-01-01_00-00-00_{i}" for i in range(2, 7)]


def test_lock_refuses_a_live_holder_and_an_existing_job(tmp_path):
    run = tmp_path / "run"
    lock = rundir.lock_run_dir(run)
    other = json.loads(lock.read_text())
    other["pid"] = os.getppid()  # a live process that is not us
    lock.write_text(json.dumps(other))
    with pytest.raises(rundir.RunDirError, match=f"run directory {run} is in use by pid"):
        rundir.lock_run_dir(run)
    rundir.unlock_run_dir(run)  # not ours: left in place
    assert lock.exists()
    other["pid"] = 2**22 + 12345  # a process that is gone: its lock is taken over
    lock.write_text(json.dumps(other))
    rundir.lock_run_dir(run)
    (run / rundir.JOB).write_text("{}")
    rundir.unlock_run_dir(run)
    assert not lock.exists()
    with pytest.raises(rundir.RunDirError, match="holds a job already.*resume="):
        rundir.lock_run_dir(run)
    assert not lock.exists()
    rundir.lock_run_dir(run, resume=True)  # resume= continues it
    rundir.unlock_run_dir(run)


def test_a_signal_while_the_lock_is_taken_leaves_no_lock(tmp_path, monkeypatch):
    """Ctrl-C landing between the lock's creation and its first byte (CI saw a stray lock
    once): the stop waits until the lock is whole, and the job's ``_holding`` releases it. In a
    process with other threads (Ray's, Flower's), which a signal may reach first."""
    from fedadapt.cli import _holding
    from fedadapt.federation.server.interrupt import STOP, RunInterrupted, stop_on_signals

    owner = rundir._owner

    def signalled_midway() -> dict:
        os.kill(os.getpid(), signal.SIGINT)  # the lock file exists, empty
        return owner()

    monkeypatch.setattr(rundir, "_owner", signalled_midway)
    run = tmp_path / "run"
    done = threading.Event()
    other = threading.Thread(target=done.wait, daemon=True)
    other.start()
    try:
        with pytest.raises(RunInterrupted), stop_on_signals():
            with _holding(run):
                raise AssertionError("the signal should stop the job before it starts")
    finally:
        done.set()
        STOP.clear()  # the stop is this test's: later runs in this process go on
    assert list(run.iterdir()) == []


@pytest.mark.slow
def test_a_run_into_a_directory_holding_a_job_is_refused(tmp_path, cache_dir):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / rundir.JOB).write_text('{"overrides": []}')
    proc = _fedadapt([*TINY, f"hydra.run.dir={taken}", f"output_dir={tmp_path}"], cache_dir)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and "Traceback" not in err
    assert f"run directory {taken} holds a job already" in err.strip().splitlines()[-1]
    assert sorted(p.name for p in taken.iterdir()) == [rundir.JOB]


def _compose(overrides, tmp_path):
    from hydra import compose, initialize_config_module

    from fedadapt.entry import register_configs

    register_configs()
    with initialize_config_module(config_module="fedadapt.conf", version_base=None):
        return compose(config_name="config", return_hydra_config=True,
                       overrides=[f"output_dir={tmp_path}", *overrides])


def test_run_and_sweep_folders_are_claimed_once(tmp_path):
    cfg = _compose([], tmp_path)
    first = cfg.hydra.run.dir
    assert Path(first).is_dir() and cfg.hydra.run.dir == first  # cached: claimed once
    assert Path(first).parent == tmp_path / "quickstart"
    fixed = [f"hydra.run.dir=${{unique_dir:{tmp_path}/same}}"]  # two runs, one name
    assert [_compose(fixed, tmp_path).hydra.run.dir for _ in range(2)] == [
        f"{tmp_path}/same", f"{tmp_path}/same_2"]
    sweep = cfg.hydra.sweep.dir
    assert Path(sweep).name.startswith("multirun_") and Path(sweep).is_dir()


def test_slurm_preset_composes_on_submitit_slurm(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    cfg = _compose(["hydra/launcher=slurm", "hydra.launcher.partition=gpu"], tmp_path)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.partition, launcher.gpus_per_node, launcher.cpus_per_task,
            launcher.timeout_min, launcher.name) == ("gpu", 1, 8, 240, "fedadapt")
    assert launcher.submitit_folder == f"{cfg.hydra.sweep.dir}/.submitit/%j"
    joblib = _compose(["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], tmp_path)
    assert joblib.hydra.launcher._target_.endswith("JoblibLauncher")


def test_missing_launcher_names_the_pip_package():
    from fedadapt.argv import missing_launcher

    absent = missing_launcher(["-m", "hydra/launcher=joblib"], installed=lambda m: False)
    assert absent == ("hydra/launcher=joblib needs the Hydra plugin hydra-joblib-launcher, "
                      "which is not installed: pip install hydra-joblib-launcher (or pip "
                      "install 'fedadapt[joblib]')")
    slurm = missing_launcher(["hydra/launcher=slurm"], installed=lambda m: False)
    assert "pip install hydra-submitit-launcher" in slurm
    assert missing_launcher(["hydra/launcher=joblib"], installed=lambda m: True) is None
    assert missing_launcher(["hydra/launcher=basic"], installed=lambda m: False) is None


def _metrics(job: Path) -> list[dict]:
    """The metrics of the one run in the job folder ``job`` (its ``linear_head/``)."""
    (path,) = job.rglob("metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keys = ("round", "train_loss", "global_acc", "global_loss", "client_acc",
            "client_acc_weighted", "bytes_up", "bytes_down")
    return [{k: r[k] for k in keys} for r in rows]


def _fedadapt(args, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir,
           "FLWR_TELEMETRY_ENABLED": "0"}
    return subprocess.Popen([sys.executable, "-m", "fedadapt.cli", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def two_at_once(tmp_path_factory, cache_dir) -> list[Path]:
    """Two ``fedadapt`` processes started together into the same folder name."""
    out = tmp_path_factory.mktemp("same")
    args = [*TINY, f"output_dir={out}", f"hydra.run.dir=${{unique_dir:{out}/run}}"]
    procs = [_fedadapt(args, cache_dir) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    return sorted(out.glob("run*"))


@pytest.mark.slow
def test_runs_started_together_get_separate_complete_directories(two_at_once):
    assert [d.name for d in two_at_once] == ["run", "run_2"]
    for d in two_at_once:
        assert (d / "linear_head" / "summary.json").is_file() and (d / "job.json").is_file()
        assert not (d / rundir.LOCK).exists()
    assert _metrics(two_at_once[0]) == _metrics(two_at_once[1])  # same config and seed


@pytest.mark.slow
def test_joblib_sweep_gives_the_metrics_of_runs_done_alone(two_at_once, tmp_path, cache_dir):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    proc = _fedadapt(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=1,0",
                      *TINY, f"output_dir={tmp_path}"], cache_dir)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    (sweep,) = (tmp_path / "quickstart").glob("multirun_*")
    points = {json.loads((d / "linear_head" / "summary.json").read_text())["seed"]: d
              for d in sweep.iterdir() if (d / "linear_head" / "summary.json").is_file()}
    assert sorted(points) == [0, 1]
    assert _metrics(points[0]) == _metrics(two_at_once[0])
    assert _metrics(points[1]) != _metrics(points[0])


def test_a_sweep_points_folder_name_stays_within_what_file_systems_take(tmp_path):
    from omegaconf import OmegaConf, open_dict

    from fedadapt.rundir import POINT_NAME_MAX, point_dir

    assert point_dir(3, "seed=0,strategy=hetlora") == "3_seed=0,strategy=hetlora"  # as Hydra's
    long = ",".join(f"key{i}.setting=value{i}" for i in range(20))
    names = {point_dir(n, long + extra) for n in (0, 1) for extra in ("", ",seed=1")}
    assert len(names) == 4 and all(len(n.encode()) == POINT_NAME_MAX for n in names)
    assert point_dir(0, long).startswith("0_key0.setting=value0,")
    cfg = _compose([], tmp_path)  # the shipped config names each point so
    with open_dict(cfg):
        cfg.hydra.job.num, cfg.hydra.job.override_dirname = 7, long + ",method.ranks=[2,4,8]"
    subdir = OmegaConf.to_container(cfg.hydra.sweep, resolve=True)["subdir"]
    assert subdir == point_dir(7, long + ",method.ranks=[2,4,8]")
