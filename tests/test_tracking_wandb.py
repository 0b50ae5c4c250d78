"""Tracking with Weights & Biases (``tracking.wandb``), offline: what the W&B run holds is read
back from its offline log with W&B's own reader (``wandb leet inspect --json``): the config,
every number of every ``metrics.jsonl`` row at its round (the keys TensorBoard and MLflow get),
the run's table and curves, the run directory's files; ``resume=`` continues the same run.
Nothing here reaches the network: the mode is offline and W&B's folders are temporary."""

import json
import subprocess
import sys

import pytest

from fedadapt.config import ConfigError, TrackingConfig
from fedadapt.tracking import check_available, open_tracker, scalars

ROWS = [{"round": 1, "lr": 0.1, "train_loss": 2.0, "global_acc": None, "clients_failed": 0,
         "failures": {}, "wall_s": 1.5},
        {"round": 2, "lr": 0.1, "train_loss": 1.5, "global_acc": 0.625, "exit_acc": [0.5, 0.75],
         "tier_acc": {"3": 0.25, "11": 0.875}, "failures": {"nan": 1}, "bytes_up": 123456789}]
TABLE = ("## unit: linear_head on digits\n\n| method | global acc (final) | wall s |\n"
         "|---|---|---|\n| linear_head | 62.50 | 1.5 |\n")


def test_wandb_missing_names_the_package(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as err:
        check_available(TrackingConfig(wandb=True))
    assert str(err.value) == ("tracking.wandb=true needs the package 'wandb': "
                              "pip install 'fedadapt[wandb]'")
    check_available(TrackingConfig(wandb=False))  # off: nothing asked of the package
    monkeypatch.setitem(sys.modules, "wandb", None)  # an import that fails at the sink too
    with pytest.raises(ConfigError, match=r"^tracking.wandb=true needs the package 'wandb'"):
        open_tracker(TrackingConfig(wandb=True), run_dir=tmp_path, config_yaml="", name="x",
                     experiment="x", output_dir=str(tmp_path))


def test_wandb_mode_is_checked():
    from fedadapt.entry import compose_config, to_run_config

    with pytest.raises(ConfigError) as err:
        to_run_config(compose_config(["method=linear_head", "tracking.wandb=true",
                                      "tracking.wandb_mode=cloud"]))
    assert str(err.value) == ("tracking.wandb_mode='cloud' is invalid: one of "
                              "('offline', 'online')")


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    """W&B offline, its settings, cache and artifact staging under ``tmp_path``, no error
    reports."""
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    return tmp_path


def read_wandb(output_dir, run_id):
    """The records of W&B run ``run_id``'s offline logs under ``<output_dir>/wandb`` (a
    resumed run has one per process), in order: (run records, history {key: {step: value}},
    config, tables {key: table json}, files saved, exit codes)."""
    runs, history, config, tables, files, exits = [], {}, {}, {}, set(), []
    # W&B names a second folder of the same second ...-<id>-1
    folders = sorted((output_dir / "wandb").glob(f"offline-run-*-{run_id}*"))
    assert folders, f"no offline run {run_id} under {output_dir / 'wandb'}"
    for folder in folders:
        out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json",
                              str(folder)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        for line in out.stdout.splitlines():
            record = json.loads(line)
            kind = record["type"]
            if kind == "run":
                runs.append(record["run"])
                config.update(record["run"]["config"]["update"])
            elif kind == "config":
                config.update(record["config"].get("update", {}))
            elif kind == "history":
                item = record["history"]["item"]
                for key, value in item.items():
                    if key.startswith("_"):
                        continue
                    if key.endswith("._type") and value == "table-file":
                        name = key.removesuffix("._type")
                        tables[name] = json.loads(
                            (folder / "files" / item[f"{name}.path"]).read_text())
                    history.setdefault(key, {})[item["_step"]] = value
            elif kind == "files":
                files |= {f["path"] for f in record["files"]["files"]}
            elif kind == "exit":
                exits.append(record["exit"].get("exit_code", 0))
    config.pop("_wandb", None)
    return runs, history, config, tables, files, exits


@pytest.mark.slow
def test_wandb_run_holds_the_rounds_config_table_and_curves(wandb_offline):
    from PIL import Image

    tmp_path = wandb_offline
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = TrackingConfig(wandb=True)
    tags = {"fedadapt.method": "linear_head", "fedadapt.seed": "3"}
    tracker = open_tracker(cfg, run_dir=run_dir, config_yaml="train:\n  lr: 0.1\nseed: 3\n",
                           name="linear_head seed=3", experiment="unit", output_dir=str(out),
                           tags=tags)
    for row in ROWS:
        tracker.log_round(row)
    # what a run writes after its last round, before the tracker closes
    (run_dir / "table.md").write_text(TABLE)
    Image.new("RGB", (40, 30), (200, 30, 30)).save(run_dir / "curves.png")
    tracker.close(run_dir)

    saved = json.loads((run_dir / "tracking.json").read_text())
    assert saved["wandb_project"] == "unit" and saved["wandb_mode"] == "offline"
    assert saved["wandb_last_round"] == 2
    runs, history, config, tables, files, exits = read_wandb(out, saved["wandb_run_id"])
    [run] = runs
    assert run["display_name"] == "linear_head seed=3" and run["project"] == "unit"
    assert sorted(run["tags"]) == ["method=linear_head", "seed=3"]
    assert str(run_dir) in run["notes"]
    assert config == {"train": {"lr": 0.1}, "seed": 3}
    expected: dict = {}
    for r in ROWS:  # every number of every row, at its round: what MLflow and TensorBoard get
        for key, value in scalars(r).items():
            expected.setdefault(key, {})[r["round"]] = value
    numbers = {k: v for k, v in history.items() if not k.startswith(("table.", "curves."))}
    assert numbers == expected
    assert tables["table"] == {"columns": ["method", "global acc (final)", "wall s"],
                               "data": [["linear_head", "62.50", "1.5"]]}
    assert history["curves._type"] == {2: "image-file"}  # at the last round's step
    assert (history["curves.width"], history["curves.height"]) == ({2: 40}, {2: 30})
    assert {"metrics.jsonl", "table.md", "curves.png", "tracking.json"} <= files
    assert exits == [0]
    assert not list(run_dir.glob("wandb")) and not list(run_dir.glob("*/*.wandb"))


@pytest.mark.slow
def test_wandb_resume_continues_the_same_run(wandb_offline):
    """An interrupted run logged rounds 1-3 with its checkpoint at round 2; the resumed process
    repeats round 3 (W&B keeps a step's first values: not sent again) and logs round 4 into
    the same W&B run; a failed close marks the run's exit code."""
    tmp_path = wandb_offline
    run_dir, out = tmp_path / "run", tmp_path / "out"
    run_dir.mkdir()
    cfg = TrackingConfig(wandb=True, wandb_project="elsewhere")
    common = dict(run_dir=run_dir, config_yaml="seed: 0\n", name="lh", experiment="unit",
                  output_dir=str(out))
    first = open_tracker(cfg, **common)
    for r in (1, 2, 3):
        first.log_round({"round": r, "train_loss": 1.0 / r})
    first.close(run_dir, failed=True)
    run_id = json.loads((run_dir / "tracking.json").read_text())["wandb_run_id"]
    second = open_tracker(cfg, **common, resume_round=2)
    for r in (3, 4):
        second.log_round({"round": r, "train_loss": 10.0 + r})
    second.close(run_dir)
    saved = json.loads((run_dir / "tracking.json").read_text())
    assert saved["wandb_run_id"] == run_id and saved["wandb_last_round"] == 4
    runs, history, _, _, _, exits = read_wandb(out, run_id)
    assert [r["run_id"] for r in runs] == [run_id, run_id]
    assert {r["project"] for r in runs} == {"elsewhere"}
    assert history["train_loss"] == {1: 1.0, 2: 0.5, 3: pytest.approx(1 / 3), 4: 14.0}
    assert exits == [1, 0]


@pytest.mark.slow
def test_wandb_beside_tensorboard_on_a_real_run(wandb_offline, cache_dir):
    """`tracking.wandb=true tracking.tensorboard=true` on a 3-round run (fedadapt.api.run,
    tiny model): W&B holds every number of metrics.jsonl at its round, the keys TensorBoard
    holds, the resolved config, the run's table row; fedadapt-report still finds one run."""
    pytest.importorskip("tensorboard")
    from fedadapt.api import run
    from fedadapt.results.report import find_runs
    from fedadapt.results.store import read_jsonl

    tmp_path = wandb_offline
    out = tmp_path / "out"
    outcome = run(["method=linear_head", "rounds=3", "tracking.wandb=true",
                   "tracking.tensorboard=true", "partition=shard", "partition.num_clients=4",
                   "partition.fraction_fit=0.5", "backbone=small_cnn", "backbone.image_size=16",
                   "dataset.max_samples=300", "federation.eval_every=1",
                   f"output_dir={out}"], tmp_path / "out" / "lh")
    rows = read_jsonl(outcome.run_dir / "metrics.jsonl")
    saved = json.loads((outcome.run_dir / "tracking.json").read_text())
    runs, history, config, tables, files, exits = read_wandb(out, saved["wandb_run_id"])
    expected: dict = {}
    for r in rows:
        for key, value in scalars(r).items():
            expected.setdefault(key, {})[r["round"]] = value
    numbers = {k: v for k, v in history.items() if not k.startswith(("table.", "curves."))}
    assert numbers == expected
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(str(outcome.run_dir / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(numbers)
    assert config["rounds"] == 3 and config["partition"]["kind"] == "shard"
    [run_record] = runs
    assert run_record["project"] == "quickstart"
    assert "method=linear_head" in run_record["tags"] and "seed=0" in run_record["tags"]
    assert tables["table"]["data"][0][0] == "linear_head"
    assert "curves._type" in history and exits == [0]
    assert {"config.yaml", "summary.json", "metrics.jsonl"} <= files
    assert [r["dir"] for r in find_runs([str(out)])] == [str(outcome.run_dir)]
