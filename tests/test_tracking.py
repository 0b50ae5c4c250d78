"""Tracking (fedadapt.tracking): TensorBoard event files and an MLflow run that hold what
metrics.jsonl holds; the acceptance run through the CLI (partition=shard, a log file without
escape codes, partition.png)."""

import json
import os
import subprocess
import sys

import pytest

from fedadapt.config import TrackingConfig
from fedadapt.tracking import flatten_config, open_tracker, scalars

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")

ROWS = [{"round": 1, "lr": 0.1, "train_loss": 2.0, "global_acc": None, "clients_failed": 0,
         "failures": {}, "wall_s": 1.5},
        {"round": 2, "lr": 0.1, "train_loss": 1.5, "global_acc": 0.625, "exit_acc": [0.5, 0.75],
         "tier_acc": {"3": 0.25, "11": 0.875}, "failures": {"nan": 1}, "bytes_up": 123456789}]


def test_scalars_flatten_a_metrics_row():
    assert scalars(ROWS[1]) == {"lr": 0.1, "train_loss": 1.5, "global_acc": 0.625,
                                "exit_acc/0": 0.5, "exit_acc/1": 0.75, "tier_acc/3": 0.25,
                                "tier_acc/11": 0.875, "failures/nan": 1.0,
                                "bytes_up": 123456789.0}
    assert "global_acc" not in scalars(ROWS[0])  # null: not logged
    assert flatten_config({"train": {"lr": 0.01, "betas": [0.9, 0.99]}, "seed": 0,
                           "resume": None}) == {"train.lr": "0.01", "train.betas": "[0.9, 0.99]",
                                                "seed": "0", "resume": "null"}


def read_tensorboard(run_dir):
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def read_mlflow(run_dir):
    from mlflow.tracking import MlflowClient

    info = json.loads((run_dir / "tracking.json").read_text())
    client = MlflowClient(info["mlflow_uri"])
    run = client.get_run(info["mlflow_run_id"])
    metrics = {k: {m.step: m.value for m in client.get_metric_history(run.info.run_id, k)}
               for k in run.data.metrics}
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    return run, metrics, artifacts


@pytest.mark.slow
def test_tracker_writes_both_stores(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = TrackingConfig(tensorboard=True, mlflow=True)
    tracker = open_tracker(cfg, run_dir=run_dir, config_yaml="train:\n  lr: 0.1\nseed: 3\n",
                           name="linear_head seed=3", experiment="unit",
                           output_dir=str(tmp_path / "out"))
    for row in ROWS:
        tracker.log_round(row)
    tracker.close(run_dir)
    tb = read_tensorboard(run_dir)
    assert tb["exit_acc/1"] == {2: 0.75} and tb["train_loss"] == {1: 2.0, 2: 1.5}
    run, metrics, artifacts = read_mlflow(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == "linear_head seed=3"
    assert run.data.params == {"train.lr": "0.1", "seed": "3"}
    assert metrics["bytes_up"] == {2: 123456789.0} and metrics["failures/nan"] == {2: 1.0}
    assert {"metrics.jsonl", "tracking.json"} <= artifacts
    assert (tmp_path / "out" / "mlflow.db").is_file()  # the default local store
    # tracking off: no sink, nothing written
    assert not open_tracker(TrackingConfig(), run_dir=tmp_path, config_yaml="", name="x",
                            experiment="x", output_dir=str(tmp_path / "none"))
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_acceptance_tracking_partition_plot_and_clean_log(tmp_path, cache_dir):
    """`fedadapt method=linear_head rounds=3 tracking.tensorboard=true tracking.mlflow=true`
    (tiny model, partition=shard) with its output redirected to a file: TensorBoard and MLflow
    hold the run's metrics.jsonl, the run directory has partition.png, the log has no escape
    code and at most one line of Flower's deprecation notice."""
    log = tmp_path / "log.txt"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    env.pop("NO_COLOR", None)
    env.pop("RAY_COLOR_PREFIX", None)
    with open(log, "w") as fh:  # `> file 2>&1`
        proc = subprocess.run(
            [sys.executable, "-m", "fedadapt.cli", "method=linear_head", "rounds=3",
             "tracking.tensorboard=true", "tracking.mlflow=true", "partition=shard",
             "partition.num_clients=4", "partition.fraction_fit=0.5", "backbone=small_cnn",
             "backbone.image_size=16", "dataset.max_samples=300", "federation.eval_every=1",
             f"output_dir={tmp_path}/out"],
            stdout=fh, stderr=subprocess.STDOUT, timeout=300, env=env)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\x1b" not in text
    assert text.count("DEPRECATED FEATURE") <= 1 and "This is a deprecated feature" not in text
    assert "[job] method 1/1: linear_head starts" in text
    run_dir = next((tmp_path / "out").glob("quickstart/*/linear_head"))
    assert (run_dir / "partition.png").stat().st_size > 1000
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3]
    tb = read_tensorboard(run_dir)
    assert tb["global_acc"] == {r["round"]: pytest.approx(r["global_acc"]) for r in rows}
    assert tb["client_acc"] == {r["round"]: pytest.approx(r["client_acc"]) for r in rows}
    run, metrics, artifacts = read_mlflow(run_dir)
    expected: dict = {}
    for r in rows:
        for key, value in scalars(r).items():
            expected.setdefault(key, {})[r["round"]] = value
    assert metrics == expected  # every number of metrics.jsonl, exactly, at its round
    assert run.info.status == "FINISHED"
    assert run.data.params["partition.kind"] == "shard" and run.data.params["rounds"] == "3"
    assert {"config.yaml", "metrics.jsonl", "summary.json", "partition.png"} <= artifacts
