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
ROUNDS = 30
TINY = ["backbone=small_cnn", "backbone.image_size=16", "dataset.max_samples=300",
        "partition.num_clients=4", f"rounds={ROUNDS}", "federation.eval_every=1",
        "federation.checkpoint_every=2"]
WALL_CLOCK = ("round_s", "wall_s")


def fedadapt(args, env, **kw):
    return subprocess.Popen([sys.executable, "-m", "fedadapt.cli", *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kw)


def metrics(run_dir: Path):
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("method,extra", [
    ("linear_head", ["partition.fraction_fit=0.5"]),  # global tensors + sampling RNG
    ("local_only", ["partition.fraction_fit=1.0"]),   # personal tensors on the clients
    # a Flower strategy's own state: FedAdam's moments, FedAvgM's momentum, the adaptive
    # clipping norm and the DP noise stream (the accountant's ledger: test_strategy_zoo)
    ("linear_head", ["partition.fraction_fit=0.5", "strategy=fedadam", "strategy.eta=0.01"]),
    ("linear_head", ["partition.fraction_fit=0.5", "strategy=fedavgm",
                     "strategy.server_momentum=0.9"]),
    ("linear_head", ["partition.fraction_fit=1.0", "dp=server_adaptive",
                     "method.weighting=uniform", "dp.noise_multiplier=0.1"]),
])
def test_sigkill_then_resume_matches_uninterrupted(method, extra, tmp_path, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    args = [f"method={method}", *TINY, *extra]
    ref = fedadapt(args + [f"output_dir={tmp_path}/ref"], env)
    assert ref.wait(timeout=300) == 0, ref.stderr.read()[-3000:]

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
    ref_dir = next((tmp_path / "ref").rglob("summary.json")).parent
    assert metrics(run_dir) == metrics(ref_dir)
    assert (run_dir / "summary.json").is_file()
    if method == "local_only":
        assert any((run_dir / "clients").rglob("*.safetensors"))


def test_tampered_checkpoint_is_refused(tmp_path, cache_dir):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    run = fedadapt(["method=linear_head", *TINY[:-3], "rounds=2",
                    f"output_dir={tmp_path}/out"], env)
    assert run.wait(timeout=300) == 0, run.stderr.read()[-3000:]
    run_dir = next((tmp_path / "out").rglob("summary.json")).parent
    (run_dir / "summary.json").unlink()  # pretend it stopped after its last checkpoint
    arrays = next((run_dir / "checkpoints").glob("round-*/arrays.safetensors"))
    arrays.write_bytes(arrays.read_bytes()[:-8])
    out = fedadapt([f"resume={run_dir}"], env)
    assert out.wait(timeout=120) != 0
    err = out.stderr.read()
    assert "arrays.safetensors" in err and "checksum" in err
    assert "Traceback" not in err  # one clear line, not a stack
