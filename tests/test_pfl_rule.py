"""The extension point of personalized FL (fedadapt/pfl/rule.py), through its smallest real
kind, FedAvg-FT (pfl=fedavg_ft, the pattern docs/personalization.md shows): what is sent is
FedAvg's to the bit, what a client is evaluated with is its own state, the state is kept per
client in the run directory, and its keys are refused in one line."""

import pytest
from omegaconf import OmegaConf

from fedadapt.config import ConfigError
from fedadapt.results.store import read_jsonl

TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=300", "partition.num_clients=4", "partition.fraction_fit=0.5",
        "federation.eval_every=1", "rounds=3", "train.lr=0.05"]
WALL_CLOCK = ("round_s", "wall_s")


def _run(run_dir, overrides, cache_dir):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*TINY, *overrides, f"cache_dir={cache_dir}"])
    run_experiment(to_run_config(composed), run_dir,
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                   execute=in_process("workers"))
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_fedavg_ft_sends_fedavgs_model_and_evaluates_each_clients_fine_tuned_copy(
        tmp_path, cache_dir):
    plain = _run(tmp_path / "fedavg", [], cache_dir)
    tuned = _run(tmp_path / "ft", ["pfl=fedavg_ft", "pfl.ft_epochs=2"], cache_dir)
    for a, b in zip(plain, tuned):  # the server's model and the training: FedAvg's, exactly
        assert a["train_loss"] == b["train_loss"]
        assert a["global_acc"] == b["global_acc"]
    # a client that has trained is evaluated with its fine-tuned copy, not the global model
    assert tuned[-1]["client_acc"] != plain[-1]["client_acc"]
    kept = sorted((tmp_path / "ft").rglob("rule/round-*.safetensors"))
    assert kept, "each trained client keeps its copy as its rule state"
    assert not list((tmp_path / "fedavg").rglob("rule/round-*.safetensors"))


@pytest.mark.parametrize("overrides, says", [
    (["pfl=fedavg_ft", "pfl.ft_epochs=0"], "pfl.ft_epochs=0 is invalid: must be >= 1"),
    (["pfl=lg_fedavg"], "trains its head only"),
    (["pfl.norms=true"], "method.use_cache=false"),
])
def test_a_kinds_bad_value_is_one_line_naming_it(overrides, says, tmp_path, cache_dir):
    with pytest.raises(ConfigError) as err:
        _run(tmp_path / "bad", overrides, cache_dir)
    assert says in str(err.value) and "\n" not in str(err.value)
