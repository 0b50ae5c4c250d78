"""The job line's time left counts each method still to run at its own cost: measured (a resumed
run's rounds) or estimated (a method that runs the backbone every round), not at the mean time
per round of the cheap methods before it."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import SMALL_CNN, tiny_run

from fedadapt.progress import Job


def _after_one_method(**costs) -> Job:
    """``cached`` done at 1 s per round after a 2 s start-up; ``heavy`` (10 rounds) to come."""
    job = Job("j", {"cached": 10, "heavy": 10}, **costs)
    job.finished, job._per_unit, job._startups = ["cached"], [1.0], [2.0]
    return job


def test_a_method_to_come_is_counted_at_its_own_cost():
    assert _after_one_method().eta == 2 + 9 * 1.0  # no cost known: the mean so far
    assert _after_one_method(extra={"heavy": 5.0}).eta == 2 + 9 * (1.0 + 5.0)
    assert _after_one_method(measured={"heavy": 3.0}, extra={"heavy": 5.0}).eta == 2 + 9 * 3.0


def test_method_costs_measured_from_a_resumed_run_or_estimated_from_the_backbone(tmp_path,
                                                                                monkeypatch):
    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.backbones import build_backbone
    from fedadapt.config import BackboneConfig
    from fedadapt.estimate import method_costs

    jobs = [(name, tiny_run(str(tmp_path), LinearHeadConfig(use_cache=cached)), "")
            for name, cached in (("cached", True), ("through_backbone", False),
                                 ("resumed", False))]
    for _, run, _ in jobs:  # runs on the CPU (a GPU's time is not estimated from the CPU's)
        run.federation.num_gpus = 0
    backbone = build_backbone(BackboneConfig(**SMALL_CNN))
    prep = SimpleNamespace(model=SimpleNamespace(backbone=backbone), layout={"workers": 1},
                           partition=SimpleNamespace(clients=[SimpleNamespace(
                               train=np.arange(100), test=np.arange(20))] * 3),
                           spec=SimpleNamespace(test_source=SimpleNamespace(
                               labels=lambda: np.zeros(50))))
    dirs = {name: tmp_path / name for name, _, _ in jobs}
    dirs["resumed"].mkdir()
    (dirs["resumed"] / "metrics.jsonl").write_text(
        "".join(json.dumps({"round": r, "round_s": s}) + "\n" for r, s in enumerate([4, 6, 5])))
    state = {k: v.clone() for k, v in backbone.state_dict().items()}
    measured, extra = method_costs(jobs, {name: prep for name, _, _ in jobs}, dirs)
    assert measured == {"resumed": 5}
    assert set(extra) == {"through_backbone"} and extra["through_backbone"] > 0
    after = backbone.state_dict()  # the timed forward changed nothing of the run's model
    assert all((after[k] == v).all() for k, v in state.items())
    import torch  # runs on a GPU: the driver's CPU does not estimate their time

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for _, run, _ in jobs:
        run.federation.num_gpus = None
    assert method_costs(jobs, {name: prep for name, _, _ in jobs}, dirs) == ({"resumed": 5}, {})


def test_a_round_through_the_backbone_counts_training_and_its_share_of_evaluation():
    """Fine-tuning's estimate once missed its evaluation rounds and took a training step as 3
    forwards (the main job said 2 min 51 s left where 4 min 02 s remained): a round costs a
    timed training step per training image over the workers, and each ``eval_every`` rounds
    the forwards of the global test split and the evaluated clients' test splits."""
    from fedadapt.estimate import backbone_seconds_per_round

    run = SimpleNamespace(partition=SimpleNamespace(fraction_fit=0.3, fraction_evaluate=1.0),
                          train=SimpleNamespace(local_epochs=2),
                          federation=SimpleNamespace(eval_every=4))
    prep = SimpleNamespace(layout={"workers": 2},
                           partition=SimpleNamespace(clients=[SimpleNamespace(
                               train=np.arange(100), test=np.arange(20))] * 10),
                           spec=SimpleNamespace(test_source=SimpleNamespace(
                               labels=lambda: np.zeros(360))))
    train = 0.03 * (10 * 100 * 0.3 * 2) / 2  # 300 images' steps on each of the 2 workers
    evaluated = 0.01 * (360 + 10 * 20 / 2) / 4  # every 4th round: the server's 360, the
    assert backbone_seconds_per_round(run, prep, 0.03, 0.01) == pytest.approx(  # clients' 200
        train + evaluated)
