"""The worked example of docs/adding-a-method.md: ``method=cosine_head`` is one module, one yaml
and this file, and it runs like any method (composed by Hydra, checked, federated)."""

from __future__ import annotations

import pytest
import torch
from conftest import accuracy_of, final_checkpoint, learning_run

from fedadapt.adapters.cosine_head import CosineClassifier, CosineHeadConfig
from fedadapt.config import ConfigError


def test_logits_are_the_scaled_cosines_whatever_the_feature_norm():
    head = CosineClassifier(dim=8, num_classes=3, scale=10.0, learn_scale=False)
    x = torch.randn(5, 8)
    cos = torch.nn.functional.cosine_similarity(x[:, None], head.weight[None], dim=-1)
    torch.testing.assert_close(head(x), 10.0 * cos)
    torch.testing.assert_close(head(7.0 * x), head(x))


def test_hydra_composes_it_and_its_keys_are_checked():
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config(["method=cosine_head", "method.learn_scale=true"]))
    assert isinstance(run.method, CosineHeadConfig) and run.method.learn_scale
    with pytest.raises(ConfigError, match=r"method.scale=0.0 is invalid"):
        to_run_config(compose_config(["method=cosine_head", "method.scale=0"]))


@pytest.mark.parametrize("learn_scale", [False, True])
def test_it_federates_and_sends_only_what_it_trains(cache_dir, tmp_path, learn_scale):
    from fedadapt.experiment import prepare_run, run_experiment
    from fedadapt.federation.simulation.inprocess import run_in_process

    cfg = learning_run(cache_dir, CosineHeadConfig(learn_scale=learn_scale))
    prep = prepare_run(cfg, quiet=True)
    sent = ["head.scale", "head.weight"] if learn_scale else ["head.weight"]
    assert sorted(prep.model.communicated_names()) == sent
    summary = run_experiment(cfg, tmp_path / "run", config_yaml="cosine_head", prepared=prep,
                             execute=run_in_process)
    assert summary["method"] == "cosine_head" and summary["final"]["round"] == 4
    # the reported accuracy is the final global model's, recomputed here from its logits
    # (float32 in the run); a model that learned (chance is 0.1), so the check can tell
    acc = accuracy_of(prep, final_checkpoint(tmp_path / "run"))
    assert summary["final"]["global_acc"] == pytest.approx(acc, rel=1e-6, abs=0) and acc > 0.3
    assert (tmp_path / "run" / "summary.json").is_file()
