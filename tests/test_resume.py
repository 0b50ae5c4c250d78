"""A run killed with SIGKILL mid-way and resumed ends with the same metrics as a run that was
never interrupted (wall-clock fields aside)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fedadapt.results.store import read_jsonl

#: Rounds of the killed run: enough that the kill, polled after round 5, lands before the end
#: (a round of these tiny runs takes ~0.05 s; with 10 rounds the run could finish between two
#: polls).
ROUNDS = 15  # long enough that a run stopped at round 5 is still running (10 rounds on)
TINY = ["backbone=small_cnn", "backbone.image_size=16", "dataset.max_samples=300",
        "partition.num_clients=4", f"rounds={ROUNDS}", "federation.eval_every=1",
        "federation.checkpoint_every=2", "train.precision=fp32"]  # compared exactly, any device
WALL_CLOCK = ("round_s", "wall_s")


def fedadapt(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "fedadapt.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def metrics(run_dir: Path):
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


def straight_through(args: list[str], run_dir: Path, *, resume: bool = False) -> list[dict]:
    """The metrics of the run ``args`` describe (the command line's overrides), run straight
    through in this process: the same rounds as through Ray, without Ray's start-up (the
    in-process run records Flower's strategy metrics besides: compare with :func:`same`). With
    ``resume``, ``run_dir`` holds a stopped run of ``args``, continued from its checkpoint."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config(args, default_experiment="quickstart")
    run_experiment(to_run_config(composed), run_dir, execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True), resume=resume)
    return metrics(run_dir)


def same(got: list[dict], ref: list[dict]) -> bool:
    """Whether the metrics rows ``got`` (through Ray) are those of ``ref`` (in process), key
    for key of ``got``."""
    return len(got) == len(ref) and got == [{k: r[k] for k in row} for row, r in zip(got, ref)]


@pytest.mark.slow  # fedadapt subprocesses (Ray); the in-process resumes below are fast
@pytest.mark.parametrize("method,extra", [
    # global tensors, the sampling stream and a Flower strategy's own state (FedAdam's moments);
    # personal tensors on the clients are resumed in process below (local_only)
    ("linear_head", ["partition.fraction_fit=0.5", "strategy=fedadam", "strategy.eta=0.01"]),
])
def test_sigkill_then_resume_matches_uninterrupted(method, extra, tmp_path, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    args = [f"method={method}", *TINY, *extra]
    victim = fedadapt(args + [f"output_dir={tmp_path}/killed"], env)
    deadline = time.time() + 300
    run_dir = None
    while time.time() < deadline:
        found = list((tmp_path / "killed").rglob("metrics.jsonl"))
        if found and len(found[0].read_text().splitlines()) >= 5:
            run_dir = found[0].parent
            break
        time.sleep(0.02)
    assert run_dir is not None, "the run never reached round 5"
    os.killpg(victim.pid, signal.SIGKILL)  # the driver, Ray and its workers: a real kill
    victim.wait(timeout=60)
    done = len(read_jsonl(run_dir / "metrics.jsonl"))
    assert not (run_dir / "summary.json").exists(), f"the run finished ({done} rounds)"
    assert 5 <= done < ROUNDS, f"killed after {done} of {ROUNDS} rounds"

    resumed = fedadapt([f"resume={run_dir}"], env)
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read()[-3000:]
    assert same(metrics(run_dir), straight_through([*args, f"cache_dir={cache_dir}"],
                                                   tmp_path / "ref"))
    assert (run_dir / "summary.json").is_file()


def test_tampered_checkpoint_is_refused(tmp_path, cache_dir):
    """In process (no Ray start-up): the run, then its resume from a truncated checkpoint."""
    from omegaconf import OmegaConf

    from fedadapt.config import FedadaptError
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config(["method=linear_head", *TINY[:-3], "rounds=2",
                               f"cache_dir={cache_dir}"], default_experiment="quickstart")
    cfg, yaml = to_run_config(composed), OmegaConf.to_yaml(composed, resolve=True)
    run_dir = tmp_path / "out"
    run_experiment(cfg, run_dir, execute=in_process("workers"), config_yaml=yaml)
    (run_dir / "summary.json").unlink()  # pretend it stopped after its last checkpoint
    arrays = next((run_dir / "checkpoints").glob("round-*/arrays.safetensors"))
    arrays.write_bytes(arrays.read_bytes()[:-8])
    with pytest.raises(FedadaptError) as err:  # what the command prints as its one line
        run_experiment(cfg, run_dir, execute=in_process("workers"), config_yaml=yaml,
                       resume=True)
    assert "arrays.safetensors" in str(err.value) and "checksum" in str(err.value)
    assert "\n" not in str(err.value)


class _Killed(BaseException):
    """Stands for the process dying after a round (its files as a kill leaves them)."""


def _stopping_after(round_: int):
    """An in-process ``execute`` (workers, as in simulation) whose run dies after a round."""
    from fedadapt.federation.simulation.inprocess import in_process

    inner = in_process("workers")

    def execute(plan, client_app):
        saved = plan.on_round

        def on_round(state):
            saved(state)
            if state.server_round == round_:
                raise _Killed

        plan.on_round = on_round
        return inner(plan, client_app)

    execute.nodes = "workers"
    return execute


@pytest.mark.parametrize("extra", [
    ["strategy=fedavgm", "strategy.server_momentum=0.9"],  # the momentum buffer
    ["method=local_only", "partition.fraction_fit=1.0"],  # personal tensors on the clients
    ["dp=server_adaptive", "method.weighting=uniform", "dp.noise_multiplier=0.1",
     "partition.fraction_fit=1.0"],  # the adaptive clipping norm and the noise stream
    ["dp=dpsgd", "dp.noise_multiplier=0.8"],  # each client's DP-SGD steps in its Context
    ["pfl=fedavg_ft"],  # a client rule's state (its fine-tuned copy) on the clients
])
def test_a_strategy_stopped_mid_run_resumes_to_the_same_metrics(extra, tmp_path, cache_dir):
    """The strategy's state from the checkpoint (round 4) and the rounds after it rerun: the
    metrics equal an uninterrupted run's (the process-kill mechanics: the test above). In the
    fast loop (about 2 s each): it pins a checkpoint written without the strategy's arrays
    (FedAvgM's momentum lost) and ``load_client_state`` asked ``<`` instead of ``<=`` (the
    local-only heads of the checkpoint's own round skipped)."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config(["method=linear_head", *TINY, "rounds=8",
                               "partition.fraction_fit=0.5", *extra,
                               f"cache_dir={cache_dir}"])
    yaml = OmegaConf.to_yaml(composed, resolve=True)
    run_experiment(to_run_config(composed), tmp_path / "ref", config_yaml=yaml,
                   execute=in_process("workers"))
    with pytest.raises(_Killed):
        run_experiment(to_run_config(composed), tmp_path / "killed", config_yaml=yaml,
                       execute=_stopping_after(5))
    assert len(read_jsonl(tmp_path / "killed" / "metrics.jsonl")) == 5
    run_experiment(to_run_config(composed), tmp_path / "killed", config_yaml=yaml,
                   execute=in_process("workers"), resume=True)
    assert metrics(tmp_path / "killed") == metrics(tmp_path / "ref")
    if "method=local_only" in extra:
        assert any((tmp_path / "killed" / "clients").rglob("*.safetensors"))
