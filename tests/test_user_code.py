"""A researcher's own Flower code, named in the config: a strategy class (docs/federation.md's
worked example, run, stopped and resumed), its state, its returned metrics, an evaluate_fn, the
initial model's evaluation, Flower's Result; mods with Flower's semantics and a Context per
client."""

import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAvg
from omegaconf import OmegaConf
from test_resume import _Killed, _stopping_after  # a run that dies after a round, in process

from fedadapt.config import ConfigError, FedadaptError
from fedadapt.results.store import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=300", "partition.num_clients=4", "federation.eval_every=1",
        "federation.checkpoint_every=1"]
WALL_CLOCK = ("round_s", "wall_s")


def docs_example(name: str) -> str:
    """The code block after ``<!-- example: NAME ... -->`` in docs/federation.md."""
    text = (ROOT / "docs" / "federation.md").read_text()
    found = re.search(rf"<!-- example: {re.escape(name)}[^>]*-->\s*```python\n(.*?)```", text,
                      re.S)
    assert found, f"docs/federation.md has no example {name}"
    return found.group(1)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The working directory of a user with docs/federation.md's halfstep.py in it."""
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "halfstep.py").write_text(docs_example("halfstep.py"))
    (folder / "myeval.py").write_text(
        "from flwr.app import MetricRecord\n"
        "def evaluate(server_round, arrays):\n"
        "    norm = sum(float((a.numpy() ** 2).sum()) for a in arrays.values())\n"
        "    return MetricRecord({'norm': norm ** 0.5, 'accuracy': 0.25})\n")
    monkeypatch.chdir(folder)
    return folder


def _run(run_dir, overrides, cache_dir, execute=None, resume=False):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.inprocess import in_process

    composed = compose_config([*TINY, *overrides, f"cache_dir={cache_dir}"])
    yaml = OmegaConf.to_yaml(composed, resolve=True)
    summary = run_experiment(to_run_config(composed), run_dir, config_yaml=yaml,
                             execute=execute or in_process("workers"), resume=resume)
    return summary, yaml


def _rows(run_dir):
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.slow  # whole multi-round runs, in process
def test_the_docs_strategy_runs_is_recorded_stops_and_resumes_to_the_same_arrays(
        user_dir, tmp_path, cache_dir):
    from fedadapt.api import load_result

    args = ["strategy=custom", "strategy.target=halfstep.HalfStepFedAvg", "strategy.step=0.5",
            "strategy.keep=0.67", "partition.fraction_fit=0.75", "rounds=4"]
    summary, yaml = _run(tmp_path / "ref", args, cache_dir)
    assert summary["strategy"]["class"] == "HalfStepFedAvg"
    assert summary["strategy"]["strategy"] == {"name": "custom",
                                               "target": "halfstep.HalfStepFedAvg",
                                               "step": 0.5, "keep": 0.67}
    saved = OmegaConf.load(tmp_path / "ref" / "config.yaml").strategy
    assert (saved.name, saved.target, saved.step) == ("custom", "halfstep.HalfStepFedAvg", 0.5)
    rows = _rows(tmp_path / "ref")
    # its own metric, and FedAvg's aggregated client metrics it passed on
    assert all(r["strategy/train/update_norm"] > 0 and "strategy/train/train_loss" in r
               for r in rows)
    assert all("strategy/evaluate/accuracy" in r for r in rows)
    from fedadapt.results import report

    report.main([str(tmp_path / "ref"), "--out", str(tmp_path / "report")])
    assert "| linear_head | custom | halfstep.HalfStepFedAvg |" in (
        tmp_path / "report" / "report.md").read_text()

    with pytest.raises(_Killed):
        _run(tmp_path / "stopped", args, cache_dir, execute=_stopping_after(2))
    _run(tmp_path / "stopped", args, cache_dir, resume=True)
    assert _rows(tmp_path / "stopped") == rows  # the generator's draws continued exactly
    ref, resumed = load_result(tmp_path / "ref"), load_result(tmp_path / "stopped")
    assert sorted(ref.arrays.keys()) == sorted(resumed.arrays.keys())
    for name in ref.arrays.keys():
        np.testing.assert_array_equal(ref.arrays[name].numpy(), resumed.arrays[name].numpy())
    assert sorted(ref.train_metrics_clientapp) == [1, 2, 3, 4]
    assert ref.train_metrics_clientapp[4]["update_norm"] == rows[-1]["strategy/train/update_norm"]


@pytest.mark.slow  # whole multi-round runs, in process
def test_evaluate_fn_round0_and_the_flower_result(user_dir, tmp_path, cache_dir):
    from fedadapt.api import load_result

    _run(tmp_path / "both", ["rounds=2", "federation.evaluate_fn=myeval.py:evaluate",
                             "federation.eval_round0=true"], cache_dir)
    rows = read_jsonl(tmp_path / "both" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[0]["train_loss"] is None and rows[0]["global_acc"] is not None
    assert all(r["evaluate_fn/accuracy"] == 0.25 and r["evaluate_fn/norm"] > 0 for r in rows)
    assert rows[0]["evaluate_fn/norm"] != rows[2]["evaluate_fn/norm"]  # the arrays it was given
    result = load_result(tmp_path / "both")
    assert sorted(result.evaluate_metrics_serverapp) == [0, 1, 2]
    assert result.evaluate_metrics_serverapp[0]["global_acc"] == rows[0]["global_acc"]
    assert result.evaluate_metrics_serverapp[2]["norm"] == rows[2]["evaluate_fn/norm"]
    assert sorted(result.evaluate_metrics_clientapp) == [1, 2]

    # replacing fedadapt's own global evaluation: its accuracy fills the global column
    summary, _ = _run(tmp_path / "only", ["rounds=1", "federation.evaluate_fn=myeval.evaluate",
                                          "federation.global_eval=false"], cache_dir)
    assert summary["final"]["global_acc"] == 0.25


@pytest.mark.parametrize("overrides,says", [
    (["strategy=custom"], "strategy=custom needs strategy.target"),
    (["strategy=custom", "strategy.target=halfstep.Nope"], "strategy.target='halfstep.Nope' "
                                                            "cannot be loaded"),
    (["strategy=custom", "strategy.target=numpy.random.default_rng"],
     "strategy.target='numpy.random.default_rng' is invalid: it is not a subclass"),
    (["strategy=custom", "strategy.target=halfstep.HalfStepFedAvg", "strategy.step=abc"],
     "strategy.step is invalid"),
    (["strategy=custom", "strategy.target=flwr.serverapp.strategy.FedAdam",
      "strategy.etaa=0.1"], "strategy.etaa is not a parameter of"),
    (["strategy=custom", "strategy.target=halfstep.HalfStepFedAvg",
      "strategy.fraction_train=0.5"], "strategy.fraction_train is set by fedadapt"),
    (["federation.evaluate_fn=myeval.nope"], "federation.evaluate_fn='myeval.nope' cannot"),
])
def test_bad_user_code_is_one_line_naming_the_key(user_dir, overrides, says):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.methods.rounds.run import evaluate_fn

    with pytest.raises(ConfigError) as err:
        evaluate_fn(to_run_config(compose_config(overrides)))
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


class _Keeper(FedAvg):
    """A strategy holding every kind of state the checkpoint writes."""

    def __init__(self, seed: int = 0, **kwargs):
        super().__init__(**kwargs)
        self.rng = np.random.default_rng(seed)
        self.legacy = np.random.RandomState(seed)
        self.torch_rng = torch.Generator().manual_seed(seed)
        self.py_rng = random.Random(seed)
        self.mixed = {"counts": [1, 2], "buffer": np.arange(3.0), "nested": [np.ones(2), "x"]}


def _draws(s):
    return (s.rng.random(), s.legacy.rand(), torch.rand(1, generator=s.torch_rng).item(),
            s.py_rng.random())


def test_strategy_state_holds_generators_and_mixed_containers():
    from fedadapt.strategies.state import load_strategy_state, strategy_state

    a = _Keeper(seed=3)
    _draws(a)
    a.mixed["buffer"] += 1
    state, arrays = strategy_state(a)
    b = _Keeper(seed=99)
    load_strategy_state(b, state, arrays)
    assert _draws(a) == _draws(b)
    assert b.mixed["counts"] == [1, 2] and b.mixed["nested"][1] == "x"
    np.testing.assert_array_equal(b.mixed["buffer"], np.arange(3.0) + 1)


class _OwnState(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0
        self.cache = object()  # not checkpointable itself: the class saves what matters

    def state_dict(self):
        return {"seen": self.seen, "weights": np.full(2, float(self.seen))}

    def load_state_dict(self, state):
        self.seen = state["seen"] + int(state["weights"][0] - state["seen"])


def test_a_class_with_state_dict_is_saved_through_it_and_others_are_refused_by_name():
    from fedadapt.strategies.state import (
        StrategyStateError,
        load_strategy_state,
        strategy_state,
    )

    a = _OwnState()
    a.seen = 5
    state, arrays = strategy_state(a)
    b = _OwnState()
    load_strategy_state(b, state, arrays)
    assert b.seen == 5
    plain = FedAvg()
    plain.cache = object()
    with pytest.raises(StrategyStateError) as err:
        strategy_state(plain)
    assert isinstance(err.value, FedadaptError)
    assert str(err.value).startswith("cannot checkpoint strategy attribute strategy.cache "
                                     "(object)") and "\n" not in str(err.value)


# -- mods with Flower's semantics --------------------------------------------------------------

COUNTS: list[tuple[int, int, int]] = []


def halving_mod(msg, context, call_next):
    """A user's mod that hands the client another message: its config's learning rate halved."""
    from flwr.app import ConfigRecord, Message, RecordDict

    content = RecordDict(dict(msg.content.items()))
    config = dict(msg.content["config"])
    content["config"] = ConfigRecord({**config, "lr": config["lr"] * 0.5})
    return call_next(Message(content=content, metadata=msg.metadata), context)


def counting_mod(msg, context, call_next):
    """A counter in the client's own context.state, across rounds (and a resume)."""
    from flwr.app import MetricRecord

    seen = context.state.metric_records.get("counter", MetricRecord({"n": 0}))["n"] + 1
    context.state["counter"] = MetricRecord({"n": seen})
    COUNTS.append((int(context.node_config["partition-id"]), int(seen),
                   int(msg.content["config"]["server-round"])))
    return call_next(msg, context)


def _quality(run_dir):
    return [{k: r[k] for k in ("round", "train_loss", "global_acc", "global_loss", "client_acc")}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.slow  # whole multi-round runs, in process
def test_a_mod_that_halves_the_learning_rate_equals_halving_it_in_the_config(tmp_path,
                                                                             cache_dir):
    common = ["rounds=2", "train.lr=0.2", "federation.clients_per_worker=4"]
    _run(tmp_path / "mod", [*common, "federation.train_mods=[test_user_code:halving_mod]"],
         cache_dir)
    _run(tmp_path / "config", ["rounds=2", "train.lr=0.1", "federation.clients_per_worker=4"],
         cache_dir)
    _run(tmp_path / "plain", common, cache_dir)
    assert _quality(tmp_path / "mod") == _quality(tmp_path / "config")
    assert _quality(tmp_path / "mod") != _quality(tmp_path / "plain")


@pytest.mark.slow  # whole multi-round runs, in process
def test_each_client_has_its_own_context_state_across_rounds_and_a_resume(tmp_path,
                                                                           cache_dir):
    args = ["rounds=3", "partition.fraction_fit=1.0", "federation.clients_per_worker=4",
            "federation.train_mods=[test_user_code:counting_mod]"]
    COUNTS.clear()
    with pytest.raises(_Killed):
        _run(tmp_path / "run", args, cache_dir, execute=_stopping_after(2))
    _run(tmp_path / "run", args, cache_dir, resume=True)
    by_client: dict[int, list[tuple[int, int]]] = {}
    for cid, n, rnd in COUNTS:
        by_client.setdefault(cid, []).append((rnd, n))
    assert sorted(by_client) == [0, 1, 2, 3]  # each client its own partition-id
    assert all(seq == [(1, 1), (2, 2), (3, 3)] for seq in by_client.values()), by_client


@pytest.mark.slow  # whole multi-round runs, in process
def test_flowers_local_dp_mod_adds_its_noise_to_each_reply(tmp_path, cache_dir):
    from flwr.app import MessageType

    from fedadapt.federation import records
    from fedadapt.federation.inprocess import in_process

    replies: dict[str, dict] = {"plain": {}, "dp": {}}

    def keeper(which):
        def keep(sent, reply, context):
            if sent.metadata.message_type == MessageType.TRAIN:
                for cid, content in records.unpack(reply.content).items():
                    replies[which][cid] = {n: a.numpy() for n, a in content["arrays"].items()}
        return keep

    sensitivity, epsilon, delta = 0.01, 1.0, 1e-5
    dp = ("federation.train_mods=[{_target_: flwr.client.mod.LocalDpMod, clipping_norm: 100.0, "
          f"sensitivity: {sensitivity}, epsilon: {epsilon}, delta: {delta}}}]")
    for which, extra in (("plain", []), ("dp", [dp])):
        _run(tmp_path / which, ["rounds=1", "partition.fraction_fit=1.0", *extra], cache_dir,
             execute=in_process("workers", on_reply=keeper(which)))
    assert sorted(replies["dp"]) == sorted(replies["plain"]) == [0, 1, 2, 3]
    sigma = sensitivity * np.sqrt(2 * np.log(1.25 / delta)) / epsilon  # Flower's formula
    noise = np.concatenate([(replies["dp"][c][n] - replies["plain"][c][n]).ravel()
                            for c in replies["dp"] for n in replies["dp"][c]])
    assert noise.std() == pytest.approx(sigma, rel=0.1) and abs(noise.mean()) < sigma / 10


def test_a_custom_fedavg_subclass_composes_with_per_tensor_averaging_and_dp(user_dir):
    from fedadapt.strategies.fedavg import PerTensorFedAvg
    from fedadapt.strategies.zoo import build_strategy, describe
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from fedadapt.entry import compose_config, to_run_config

    def build(*extra):
        cfg = to_run_config(compose_config(["strategy=custom", "strategy.step=0.25",
                                            "strategy.target=halfstep.HalfStepFedAvg", *extra]))
        return build_strategy(cfg.strategy, cfg.dp, num_clients=10, fraction_train=0.5,
                              fraction_evaluate=0.0, weighting=cfg.method.weighting, lr=0.1)

    plain = build()
    assert isinstance(plain, PerTensorFedAvg) and plain.step == 0.25
    # FedAvg's parameters reach it through its **kwargs, as fedadapt derives them
    assert (plain.fraction_train, plain.min_train_nodes) == (0.5, 5)
    assert type(plain).__mro__[1].__name__ == "HalfStepFedAvg"  # its aggregation over FedAvg's
    wrapped = build("dp=server_fixed", "method.weighting=uniform", "dp.accounting=false")
    assert isinstance(wrapped, DifferentialPrivacyServerSideFixedClipping)
    assert describe(wrapped) == "DifferentialPrivacyServerSideFixedClipping(HalfStepFedAvg)"
