"""``strategy=`` and ``dp=``: every Flower strategy and DP wrapper by its Flower name, with its
own constructor parameters as keys; one-line refusals; the docs' table current; a strategy's
state (moments, momentum, clipping norm, the accountant's ledger) round-trips exactly."""

import dataclasses
import inspect
import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MetricRecord,
    RecordDict,
)

from fedadapt.argv import config_problem
from fedadapt.config import ConfigError
from fedadapt.entry import compose_config, to_run_config
from fedadapt.federation.wire.grid import ClientGrid, Nodes
from fedadapt.strategies.build import build_strategy, describe
from fedadapt.strategies.docs import markdown_table
from fedadapt.strategies.fedavg import PerTensorFedAvg
from fedadapt.strategies.privacy import privacy_spent
from fedadapt.strategies.registry import CAPABILITIES, DP_WRAPPERS, STRATEGIES
from fedadapt.strategies.schema import DERIVED
from fedadapt.strategies.state import SeededStreams, load_strategy_state, strategy_state

ROOT = Path(__file__).resolve().parents[1]


def run_config(*overrides):
    return to_run_config(compose_config(["method=linear_head", *overrides]))


def needs(name: str) -> list[str]:
    """What the rest of a config needs for ``strategy=name`` (its capabilities): a LoRA method,
    a fleet's clock."""
    caps = CAPABILITIES[name]
    return ((["method=lora"] if caps.rank_aware else [])
            + (["fleet=tiers"] if caps.asynchronous else []))


def build(cfg, num_clients=10):
    return build_strategy(cfg.strategy, cfg.dp, num_clients=num_clients,
                          fraction_train=cfg.partition.fraction_fit,
                          fraction_evaluate=cfg.partition.fraction_evaluate,
                          weighting=cfg.method.weighting, lr=cfg.train.lr,
                          rank_of=lambda node: 8)  # the LoRA-rank strategies' (method.ranks)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_flower_strategy_is_an_option_with_its_own_keys(name):
    cfg = run_config(f"strategy={name}", "partition.fraction_fit=1.0", *needs(name))
    flower = STRATEGIES[name]
    own = [p.name for p in list(inspect.signature(flower.__init__).parameters.values())[1:]
           if p.name not in DERIVED and p.kind is not p.VAR_KEYWORD]
    assert [f.name for f in dataclasses.fields(cfg.strategy)] == ["name", *own]
    strategy = build(cfg)
    assert isinstance(strategy, flower)  # Flower's class, at most composed with per-tensor
    assert describe(strategy) == flower.__name__
    assert strategy.fraction_train == 1.0 and strategy.min_train_nodes == 10


def test_keys_reach_the_flower_constructor():
    cfg = run_config("strategy=fedadam", "strategy.eta=0.01", "strategy.tau=1e-4",
                     "train.lr=0.02")
    s = build(cfg)
    assert (s.eta, s.tau, s.beta_1, s.eta_l) == (0.01, 1e-4, 0.9, 0.02)  # eta_l = train.lr
    q = build(run_config("strategy=qfedavg", "strategy.q=0.5", "train.lr=0.03"))
    assert (q.q, q.client_learning_rate, q.train_loss_key) == (0.5, 0.03, "train_loss")


@pytest.mark.parametrize("name", sorted(DP_WRAPPERS))
def test_every_dp_wrapper_wraps_any_strategy(name):
    cfg = run_config(f"dp={name}", "method.weighting=uniform", "dp.noise_multiplier=0.5",
                     "partition.num_clients=40", "partition.fraction_fit=1.0")
    s = build(cfg, num_clients=40)
    assert isinstance(s, DP_WRAPPERS[name]) and s.num_sampled_clients == 40
    assert describe(s) == f"{DP_WRAPPERS[name].__name__}(FedAvg)"
    accounted = name.endswith("fixed")
    assert (s.accountant is not None) if accounted else not hasattr(s, "accountant")
    if accounted:
        assert privacy_spent(s)["epsilon"] == 0.0 and s.accountant.config.target_delta == 1e-5


@pytest.mark.parametrize("argv,says", [
    (["strategy=fedfoo"], "strategy=fedfoo is not an option of strategy"),
    (["strategy=fedadam", "strategy.bogus=1"],
     "strategy.bogus is not a key of strategy=fedadam (its keys: name, eta"),
    (["strategy=fedadam", "strategy.eta=abc"], "strategy.eta: Value 'abc'"),
    (["dp=client_fixed", "dp.clip=1"], "dp.clip is not a key of dp=client_fixed"),
])
def test_what_does_not_compose_is_one_line_naming_the_key(argv, says):
    problem = config_problem(argv)
    assert problem.startswith(says) and "\n" not in problem


@pytest.mark.parametrize("overrides,key,says", [
    (["strategy=fedadam", "+strategy.bogus=1"], "strategy.bogus", "not a key of strategy="),
    (["dp=server_fixed", "method.weighting=uniform", "dp.noise_multiplier=0"],
     "dp.noise_multiplier", "accounting"),
    (["dp=server_fixed"], "method.weighting", "uniform"),
    (["dp=server_fixed", "method.weighting=uniform", "strategy=fedadam"], "strategy",
     "FedAvg's own aggregation"),
    (["setting=multitier", "strategy=fedmedian"], "strategy=fedmedian", "tier"),
    (["setting=multitier", "dp=server_adaptive", "method.weighting=uniform"],
     "dp=server_adaptive", "tier"),
    (["method.strategy=fedprox"], "method.strategy", "strategy=fedprox strategy.proximal_mu"),
    (["method.proximal_mu=0.1"], "method.proximal_mu", "strategy.proximal_mu"),
    (["strategy=fedtrimmedavg", "strategy.beta=0.7"], "strategy=fedtrimmedavg", "beta"),
])
def test_bad_strategy_settings_are_refused_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        cfg = run_config(*overrides)
        build(cfg)  # Flower's own checks of a value (fedtrimmedavg's beta) come at build
    assert key in str(err.value) and says in str(err.value) and "\n" not in str(err.value)


def test_krum_needs_enough_clients_per_round():
    from fedadapt.strategies.checks import check_counts

    cfg = run_config("strategy=krum", "strategy.num_malicious_nodes=2")
    check_counts(cfg.strategy, cfg.dp, num_clients=10, sampled=7)
    with pytest.raises(ConfigError, match=r"strategy.num_malicious_nodes=2 .*2f\+3 = 7.* 6"):
        check_counts(cfg.strategy, cfg.dp, num_clients=10, sampled=6)
    bulyan = run_config("strategy=bulyan", "strategy.num_malicious_nodes=1")
    with pytest.raises(ConfigError, match=r"4f\+3 = 7"):
        check_counts(bulyan.strategy, bulyan.dp, num_clients=10, sampled=5)


def test_the_docs_strategy_table_is_current():
    assert (ROOT / "docs" / "strategies.md").read_text() == markdown_table(), \
        "regenerate: python -m fedadapt.strategies.docs > docs/strategies.md"


# -- state round trip -------------------------------------------------------------------------

def _round(strategy, arrays: ArrayRecord, rnd: int, streams: SeededStreams, seed: int):
    """One round on a grid of four clients whose replies are the arrays plus seeded noise."""
    grid = ClientGrid(None, Nodes("workers", {0: 1}), 4)
    with streams.use("train"):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({}), grid))
    rng = np.random.default_rng(seed)
    replies = []
    for m in msgs:
        m.metadata.__dict__["_message_id"] = f"m{grid.partition_of(m.metadata.dst_node_id)}"
        sent = {k: v.numpy() + rng.normal(scale=0.5, size=v.numpy().shape).astype(np.float32)
                for k, v in arrays.items()}
        replies.append(Message(RecordDict({
            "arrays": ArrayRecord({k: Array(v) for k, v in sent.items()}),
            "metrics": MetricRecord({"num-examples": 5, "unit-weight": 1.0,
                                     "train_loss": 1.0, "norm_bit": 1})}), reply_to=m))
    with streams.use("train"):
        new, _ = strategy.aggregate_train(rnd, replies)
    return new if new is not None else arrays


@pytest.mark.parametrize("overrides", [
    ["strategy=fedadam"], ["strategy=fedavgm", "strategy.server_momentum=0.9"],
    ["strategy=fedyogi"],
    # Flower's QFedAvg runs gc.collect() per array: seconds in a test process that holds much
    pytest.param(["strategy=qfedavg"], marks=pytest.mark.slow),
    ["dp=server_adaptive", "method.weighting=uniform", "dp.noise_multiplier=0.1"],
    ["dp=server_fixed", "method.weighting=uniform"],
    ["dp=client_adaptive", "method.weighting=uniform", "dp.noise_multiplier=0.1"],
])
def test_a_saved_strategy_continues_exactly(overrides, flower_task):
    cfg = run_config(*overrides, "partition.num_clients=4", "partition.fraction_fit=0.5")
    arrays = ArrayRecord({"w": Array(np.zeros((3, 2), np.float32)),
                          "b": Array(np.ones(2, np.float32))})
    strategy, streams = build(cfg, 4), SeededStreams(0)
    for rnd in (1, 2):
        arrays = _round(strategy, arrays, rnd, streams, rnd)
    state, tensors = strategy_state(strategy, arrays)
    state = json.loads(json.dumps(state))  # JSON, no pickle
    saved_streams = json.loads(json.dumps(streams.state_dict()))
    expected = _round(strategy, arrays, 3, streams, 3)

    again, again_streams = build(cfg, 4), SeededStreams(123)
    load_strategy_state(again, state, {k: v.copy() for k, v in tensors.items()}, arrays)
    again_streams.load_state_dict(saved_streams)
    got = _round(again, arrays, 3, again_streams, 3)
    for name in ("w", "b"):
        np.testing.assert_array_equal(got[name].numpy(), expected[name].numpy())
    if hasattr(strategy, "clipping_norm"):
        assert again.clipping_norm == strategy.clipping_norm
    if privacy_spent(strategy) is not None:
        assert privacy_spent(again) == privacy_spent(strategy)
        assert privacy_spent(strategy)["releases"] == 3


def test_transient_and_callable_attributes_are_not_saved(flower_task):
    cfg = run_config("partition.num_clients=4")
    strategy = build(cfg, 4)
    assert isinstance(strategy, PerTensorFedAvg)
    arrays = _round(strategy, ArrayRecord({"w": Array(np.zeros(2, np.float32))}), 1,
                    SeededStreams(0), 1)
    state, tensors = strategy_state(strategy, arrays)
    assert "_sent_arrays" not in state and "train_metrics_aggr_fn" not in state
    assert tensors == {} and state["weighted_by_key"] == {"value": "num-examples"}


def test_an_attribute_it_cannot_write_fails_loudly(flower_task):
    strategy = build(run_config(), 4)
    strategy.odd = object()
    with pytest.raises(TypeError, match="cannot checkpoint strategy attribute strategy.odd"):
        strategy_state(strategy)


@pytest.mark.slow
def test_the_global_model_keeps_its_dtype_under_flowers_fedopt(tmp_path, cache_dir):
    """Flower's FedAdam returns float64 arrays (numpy 2 promotes by its float64 eta_norm); the
    global model stays float32, so FedAdam's rounds move the bytes FedAvg's do."""
    from omegaconf import OmegaConf

    from fedadapt.experiment import run_experiment
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl

    rows = {}
    for name in ("fedavg", "fedadam"):
        composed = compose_config(["experiment=custom", "dataset=digits", "method=linear_head",
                                   "dataset.max_samples=200", "backbone=small_cnn",
                                   "backbone.image_size=16", "partition.num_clients=4",
                                   "rounds=2", f"strategy={name}", f"cache_dir={cache_dir}"])
        run_experiment(to_run_config(composed), tmp_path / name,
                       config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                       execute=in_process("workers"))
        arrays, _ = load_checkpoint(latest_checkpoint(tmp_path / name))
        assert {str(t.dtype) for t in arrays.values()} == {"torch.float32"}
        rows[name] = [(r["bytes_up"], r["bytes_down"]) for r in
                      read_jsonl(tmp_path / name / "metrics.jsonl")]
    assert rows["fedadam"] == rows["fedavg"]


def test_a_config_with_its_strategy_pickles():
    """A spawned process (fedadapt-bench's isolated runs, a joblib sweep) gets the config
    pickled: the generated schemas are found by name in fedadapt.strategies.registry."""
    import pickle

    cfg = run_config("strategy=fedadam", "strategy.eta=0.02", "dp=client_adaptive",
                     "method.weighting=uniform")
    again = pickle.loads(pickle.dumps(cfg))
    assert again.strategy == cfg.strategy and again.dp == cfg.dp and again.strategy.eta == 0.02
