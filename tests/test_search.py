"""search=lr: Hydra's Optuna sweeper tunes train.lr on the clients' validation splits; the task
function returns that objective (never a test accuracy)."""

import json
import os
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from fedadapt.cli import objective_value
from fedadapt.config import ConfigError
from fedadapt.entry import compose_config, to_run_config


def test_objective_is_the_reported_rounds_validation_accuracy():
    cfg = OmegaConf.create({"objective": "val_acc"})
    summary = {"selected": {"round": 3, "val_acc": 0.75, "global_acc": 0.9, "client_acc": 0.8}}
    assert objective_value(cfg, [summary]) == 0.75  # not the test accuracies beside it
    assert objective_value(OmegaConf.create({"objective": None}), [summary]) is None
    with pytest.raises(ConfigError, match="one method per job"):
        objective_value(cfg, [summary, summary])
    with pytest.raises(ConfigError, match="no validation accuracy"):
        objective_value(cfg, [{"selected": {"round": 3, "val_acc": None}}])


def test_objective_needs_validation_data():
    with pytest.raises(ConfigError, match="partition.val_fraction > 0"):
        to_run_config(compose_config(["objective=val_acc", "partition.val_fraction=0"]))
    with pytest.raises(ConfigError, match="objective='test_acc' is invalid"):
        to_run_config(compose_config(["objective=test_acc"]))


def test_search_preset_composes_an_optuna_lr_search():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    from hydra import compose, initialize_config_module

    from fedadapt.entry import register_configs

    register_configs()
    with initialize_config_module(config_module="fedadapt.conf", version_base=None):
        cfg = compose("config", overrides=["search=lr", "method=linear_head"],
                      return_hydra_config=True)
    assert cfg.objective == "val_acc"
    assert cfg.hydra.mode.name == "MULTIRUN"
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("OptunaSweeper") and sweeper.direction == "maximize"
    assert sweeper.params["train.lr"] == "tag(log, interval(1e-4, 1.0))"


@pytest.mark.slow
def test_optuna_search_runs_trials_and_records_the_best(tmp_path, cache_dir):
    """Two trials (tiny model, 1 round, partition=pathological) in one process, each a run
    without Ray (``federation.backend=inprocess``): each returns its validation accuracy;
    Optuna's result names the best train.lr; Flower's deprecation notice appears at most
    once."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    out = subprocess.run(
        [sys.executable, "-m", "fedadapt.cli", "search=lr", "method=linear_head",
         "hydra.sweeper.n_trials=2", "rounds=1", "partition=pathological",
         "partition.num_clients=3", "partition.classes_per_client=4", "backbone=small_cnn",
         "backbone.image_size=16", "dataset.max_samples=300", "federation.backend=inprocess",
         f"output_dir={tmp_path}/out"],
        capture_output=True, text=True, timeout=600, env=env)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-3000:]
    assert log.count("DEPRECATED FEATURE") <= 1
    sweep = next((tmp_path / "out" / "quickstart").glob("multirun_*"))
    trials = sorted(sweep.glob("trial_*"))
    assert len(trials) == 2
    vals, lrs = [], []
    for trial in trials:
        summary = json.loads((trial / "linear_head" / "summary.json").read_text())
        vals.append(summary["selected"]["val_acc"])
        lrs.append(yaml.safe_load((trial / "linear_head" / "config.yaml").read_text())
                   ["train"]["lr"])
        assert summary["partition"]["kind"] == "pathological"
    assert lrs[0] != lrs[1] and all(1e-4 <= lr <= 1.0 for lr in lrs)
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == max(vals)
    assert result["best_params"]["train.lr"] == lrs[vals.index(max(vals))]
