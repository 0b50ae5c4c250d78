"""A researcher's own Flower code, named in the config: a strategy class (docs/federation.md's
worked example, run, stopped and resumed), its state, its returned metrics, an evaluate_fn, the
initial model's evaluation, Flower's Result; mods with Flower's semantics, each client's own
message and a Context per client. Under Flower's contract to the letter: every kind of strategy
state saved (torch tensors, generators, state_dict objects) or refused by name, checked by a
checkpoint's save and load before round 1, a resumed run equal to a straight one; a sweep's
points built before the first runs; the user's errors in one line (their frames only under it);
their files recorded for a resume from any folder."""

import json
import random
import re
import textwrap
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
    return textwrap.dedent(found.group(1))


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
    from fedadapt.federation.simulation.inprocess import in_process

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
    from fedadapt.methods.rounds.strategy import evaluate_fn

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


LRS: list[float] = []


def halving_in_place(msg, context, call_next):
    """The same change made in place, on the message the client was given (each client's own,
    as a Flower ClientApp gets it off the wire)."""
    msg.content["config"]["lr"] *= 0.5
    LRS.append(msg.content["config"]["lr"])
    return call_next(msg, context)


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
    """Four clients side by side in one worker: a mod that hands on another message, and one
    that halves ``msg.content["config"]["lr"]`` in place (which compounded over the clients of
    a round when they shared one ConfigRecord), each equal to ``train.lr`` halved."""
    common = ["rounds=2", "train.lr=0.2", "federation.clients_per_worker=4",
              "partition.fraction_fit=1.0"]
    _run(tmp_path / "mod", [*common, "federation.train_mods=[test_user_code:halving_mod]"],
         cache_dir)
    LRS.clear()
    _run(tmp_path / "in_place", [*common,
                                 "federation.train_mods=[test_user_code:halving_in_place]"],
         cache_dir)
    assert LRS == [0.1] * 8  # 4 clients x 2 rounds, each halved once
    _run(tmp_path / "config", ["rounds=2", "train.lr=0.1", "federation.clients_per_worker=4",
                               "partition.fraction_fit=1.0"], cache_dir)
    _run(tmp_path / "plain", common, cache_dir)
    assert _quality(tmp_path / "mod") == _quality(tmp_path / "config")
    assert _quality(tmp_path / "in_place") == _quality(tmp_path / "config")
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

    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.federation.wire import records

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
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.strategies.build import build_strategy, describe
    from fedadapt.strategies.fedavg import PerTensorFedAvg

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


# -- each client's message its own ---------------------------------------------------------------

def test_each_client_gets_its_own_records_and_shared_arrays_are_still_decoded_once():
    """``records.own``: a client's copy of its message (a ClientApp's, off the wire): its config
    and metrics records and their lists new, its Array objects new over the same bytes, which
    the decoder still decodes once for the worker; an array a mod replaced is decoded apart."""
    from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

    from fedadapt.federation.wire import records
    from fedadapt.methods.rounds.clients import arrays_decoder

    shared = RecordDict({"arrays": ArrayRecord({"w": torch.arange(6.0).reshape(2, 3)}),
                         "config": ConfigRecord({"lr": 0.1, "ids": [1, 2]})})
    a, b = records.own(shared), records.own(shared)
    a["config"]["lr"] *= 0.5
    a["config"]["ids"].append(3)
    a["arrays"]["extra"] = Array(np.zeros(2, dtype=np.float32))
    assert b["config"]["lr"] == 0.1 and b["config"]["ids"] == [1, 2]
    assert shared["config"]["lr"] == 0.1 and list(b["arrays"].keys()) == ["w"]
    assert a["arrays"]["w"] is not shared["arrays"]["w"]
    assert a["arrays"]["w"].data is shared["arrays"]["w"].data  # bytes are immutable: shared
    received = arrays_decoder()
    c = records.own(shared)
    assert received(b) is received(c)  # decoded once for both clients
    c["arrays"]["w"] = Array(np.ones((2, 3), dtype=np.float32))  # what a mod may do
    assert torch.equal(received(c)["w"], torch.ones(2, 3))
    assert torch.equal(received(b)["w"], torch.arange(6.0).reshape(2, 3))


def _client_app(cache_dir, mods_=()):
    from conftest import tiny_run

    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.clients.app import make_client_app
    from fedadapt.config import FederationConfig
    from fedadapt.experiment import prepare_run

    cfg = tiny_run(cache_dir, LinearHeadConfig(),
                   federation=FederationConfig(eval_every=1, train_mods=list(mods_)))
    prep = prepare_run(cfg, quiet=True)
    return make_client_app(lambda ctx: prep.spec), prep


def _train_message(prep, lr: float):
    """One worker's TRAIN message for clients 0, 1, 2, side by side, as the grid packs it."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict

    from fedadapt.federation.wire import records

    model = prep.model
    content = RecordDict({
        "arrays": ArrayRecord(model.tensors(model.communicated_names())),
        "config": ConfigRecord({"server-round": 1, "lr": lr}),
        records.GRID: ConfigRecord({"clients": [0, 1, 2], "group-size": 3})})
    return Message(content=content, dst_node_id=1, message_type=MessageType.TRAIN)


def _contexts():
    from flwr.app import Context, RecordDict

    return Context(run_id=1, node_id=1, node_config={"partition-id": 0, "num-partitions": 3},
                   state=RecordDict(), run_config={})


def test_a_mod_changing_the_config_in_place_equals_the_change_in_the_config(cache_dir,
                                                                           flower_task):
    """Three clients trained side by side: a mod halving ``msg.content["config"]["lr"]`` in
    place halves each client's once (it compounded over the clients when they shared one
    ConfigRecord: 0.05, 0.025, 0.0125), and each client's reply equals that of lr halved in
    the config."""
    from fedadapt.federation.wire import records

    app, prep = _client_app(cache_dir, ["test_user_code:halving_in_place"])
    LRS.clear()
    with_mod = records.unpack(app(_train_message(prep, 0.1), _contexts()).content)
    assert LRS == [0.05, 0.05, 0.05]
    plain, plain_prep = _client_app(cache_dir)
    halved = records.unpack(plain(_train_message(plain_prep, 0.05), _contexts()).content)
    assert sorted(with_mod) == sorted(halved) == [0, 1, 2]
    for cid in (0, 1, 2):
        for name, array in halved[cid]["arrays"].items():
            np.testing.assert_array_equal(with_mod[cid]["arrays"][name].numpy(), array.numpy())


def none_mod(msg, context, call_next):
    """A mod that forgets to return the reply."""
    call_next(msg, context)


def raising_mod(msg, context, call_next):
    return {}["missing"]


@pytest.mark.parametrize("mod,says", [
    ("test_user_code:none_mod", "mod test_user_code:none_mod returned NoneType, not a Message"),
    ("test_user_code:raising_mod", "mod test_user_code:raising_mod raised KeyError: 'missing' "
                                   "(test_user_code.py, line"),
])
def test_a_mod_that_returns_no_message_or_raises_is_named_in_its_clients_error(
        cache_dir, flower_task, mod, says):
    from fedadapt.federation.wire import records

    app, prep = _client_app(cache_dir, [mod])
    replies = records.unpack(app(_train_message(prep, 0.1), _contexts()).content)
    assert sorted(replies) == [0, 1, 2]
    for content in replies.values():
        reason = records.error_of(content)
        assert reason.startswith(says) and "\n" not in reason, reason


# -- the strategy's state: every kind saved, or refused by name ---------------------------------

def _round_trip(make, change=lambda s: None):
    """A FedAvg with the attributes ``make()`` gives, changed by ``change``, through the run's
    check before round 1 and a checkpoint's bytes into one built anew; the new strategy."""
    import json

    from fedadapt.strategies.state import (
        check_checkpointable,
        load_strategy_state,
        pack_arrays,
        strategy_state,
        unpack_arrays,
    )

    def build():
        s = FedAvg()
        for k, v in make().items():
            setattr(s, k, v)
        return s

    s = build()
    change(s)
    check_checkpointable(s, build)
    state, arrays = strategy_state(s)
    fresh = build()
    load_strategy_state(fresh, json.loads(json.dumps(state)), unpack_arrays(pack_arrays(arrays)))
    return fresh


def test_torch_tensors_of_any_dtype_and_shape_are_saved_exactly():
    grad = torch.nn.Parameter(torch.randn(2, 3, dtype=torch.float64))
    tensors = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).to(torch.bfloat16),
               "f16": torch.randn(2, 2).half(), "i64": torch.arange(7),
               "bool": torch.tensor([True, False]), "scalar": torch.tensor(3.5),
               "empty": torch.zeros(0, 4), "view": torch.arange(12.0).reshape(3, 4).t(),
               "c64": torch.randn(3, dtype=torch.complex64)}
    back = _round_trip(lambda: {"value": None, "momentum": None},
                       lambda s: s.__dict__.update(value=tensors, momentum=grad))
    for name, t in tensors.items():
        got = back.value[name]
        assert (got.dtype, tuple(got.shape), got.device) == (t.dtype, tuple(t.shape), t.device)
        assert torch.equal(got, t), name
    assert isinstance(back.momentum, torch.nn.Parameter) and back.momentum.requires_grad
    assert back.momentum.dtype == torch.float64 and torch.equal(back.momentum, grad)


@pytest.mark.cuda
def test_a_cuda_tensor_comes_back_on_its_device():
    t = torch.randn(4, 4, device="cuda").to(torch.bfloat16)
    back = _round_trip(lambda: {"value": None}, lambda s: setattr(s, "value", t)).value
    assert back.device == t.device and back.dtype == torch.bfloat16 and torch.equal(back, t)


class Schedule:
    """A step-size schedule with a counter (the issue's): saved through its state_dict()."""

    def __init__(self):
        self.calls = 0

    def __call__(self, server_round=0):
        self.calls += 1
        return 1.0 / self.calls

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


class Counter:
    """The same without state_dict(): its counter would be lost on resume."""

    def __init__(self):
        self.calls = 0

    def __call__(self, server_round):
        self.calls += 1
        return 1.0 / self.calls


def test_generators_modules_optimizers_and_objects_with_state_dict_are_saved():
    def make():
        layer = torch.nn.Linear(3, 2)
        return {"torch_rng": torch.Generator().manual_seed(3),
                "np_rng": np.random.default_rng(3), "sched": Schedule(), "layer": layer,
                "opt": torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)}

    def change(s):
        torch.rand(2, generator=s.torch_rng), s.np_rng.random(2), s.sched(1), s.sched(2)
        s.layer(torch.ones(1, 3)).sum().backward()
        s.opt.step()  # its state: a momentum buffer per parameter, keyed by int

    original = FedAvg()
    for k, v in make().items():
        setattr(original, k, v)
    change(original)
    back = _round_trip(make, lambda s: s.__dict__.update(vars(original)))
    assert torch.equal(torch.rand(3, generator=back.torch_rng),
                       torch.rand(3, generator=original.torch_rng))
    assert back.np_rng.random() == original.np_rng.random()
    assert back.sched.calls == 2 and back.sched() == original.sched()
    for a, b in zip(back.layer.state_dict().values(), original.layer.state_dict().values()):
        assert torch.equal(a, b)
    saved, loaded = original.opt.state_dict()["state"], back.opt.state_dict()["state"]
    assert sorted(loaded) == [0, 1] and all(
        torch.equal(loaded[i]["momentum_buffer"], saved[i]["momentum_buffer"]) for i in (0, 1))


def _stateful_closure():
    n = 0

    def step(server_round):
        nonlocal n
        n += 1
        return n
    return step


class _Stateless:
    def __call__(self, x):
        return x


@pytest.mark.parametrize("value,says", [
    (Counter(), "cannot checkpoint strategy attribute strategy.value (Counter): a callable "
                "object that holds state (calls) and has no state_dict()"),
    (_stateful_closure(), "cannot checkpoint strategy attribute strategy.value (function): "
                          "_stateful_closure.<locals>.step keeps state in its closure "
                          "(nonlocal n)"),
    (Schedule().__call__, "cannot checkpoint strategy attribute strategy.value (method)"),
    ([len, print], "cannot checkpoint strategy attribute strategy.value/0 "
                   "(builtin_function_or_method): a function or method inside a container"),
    (object(), "cannot checkpoint strategy attribute strategy.value (object): keep it as"),
    (np.array([object()]), "cannot checkpoint strategy attribute strategy.value (ndarray): a "
                           "numpy array of Python objects"),
    (torch.eye(3).to_sparse(), "cannot checkpoint strategy attribute strategy.value (Tensor): "
                               "a torch.sparse_coo tensor"),
])
def test_state_no_checkpoint_holds_is_refused_in_one_line_naming_the_attribute(value, says):
    from fedadapt.strategies.state import StrategyStateError, strategy_state

    s = FedAvg()
    s.value = value
    with pytest.raises(StrategyStateError) as err:
        strategy_state(s)
    text = str(err.value)
    assert "\n" not in text and text.startswith(says), text


def test_functions_and_stateless_callables_are_configuration_not_state():
    from fedadapt.strategies.state import strategy_state

    s = FedAvg()
    s.fn, s.lam, s.obj, s.builtin = _draws, (lambda x: x), _Stateless(), len
    state, _ = strategy_state(s)
    assert not {"fn", "lam", "obj", "builtin"} & set(state)
    assert "train_metrics_aggr_fn" not in state  # Flower's own: rebuilt from the config


class _Forgetful:
    """state_dict() that load_state_dict() does not restore: a resume would differ."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        pass


def test_state_that_does_not_come_back_from_a_checkpoint_is_refused_before_round_1():
    from fedadapt.strategies.state import StrategyStateError, check_checkpointable

    def build():
        s = FedAvg()
        s.keeper = _Forgetful()
        return s

    s = build()
    s.keeper.n = 4
    with pytest.raises(StrategyStateError) as err:
        check_checkpointable(s, build)
    assert str(err.value).startswith("strategy attribute strategy.keeper does not come back the "
                                     "same from a checkpoint")


# -- the user's code checked before anything runs, errors in one line -------------------------

CODE = {
    "kinds.py": '''
import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.serverapp.strategy import FedAvg


class Schedule:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return 1.0 / self.calls

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


class Kinds(FedAvg):
    """Every kind of state a checkpoint saves, each moving the model or a metric."""

    def __init__(self, beta: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.beta = beta
        self.momentum = None  # torch tensors, made in round 1
        self.torch_rng = torch.Generator().manual_seed(1)
        self.np_rng = np.random.default_rng(1)
        self.eta = Schedule()

    def configure_train(self, server_round, arrays, config, grid):
        self.current = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        averaged, metrics = super().aggregate_train(server_round, replies)
        eta = self.eta()
        new, moved = ArrayRecord(), {}
        for name, old in self.current.items():
            delta = torch.from_numpy(averaged[name].numpy() - old.numpy()).to(torch.float64)
            moved[name] = delta if self.momentum is None else \\
                self.beta * self.momentum[name] + delta
            new[name] = Array((old.numpy() + eta * moved[name].numpy()).astype(np.float32))
        self.momentum = moved
        return new, MetricRecord({
            "tensor": float(sum(float(m.norm()) for m in moved.values())),
            "torch_gen": float(torch.rand(1, generator=self.torch_rng)),
            "np_gen": float(self.np_rng.random()), "schedule": eta})
''',
    "lazy.py": '''
from flwr.serverapp.strategy import FedAvg


class Lazy(FedAvg):
    def aggregate_train(self, server_round, replies):
        self.cache = object()  # made by a hook: no checkpoint holds it
        return super().aggregate_train(server_round, replies)
''',
    "boom.py": '''
from flwr.serverapp.strategy import FedAvg


def divide(r):
    return 1 / (r - r)


class Boom(FedAvg):
    def aggregate_train(self, server_round, replies):
        if server_round == 2:
            divide(server_round)
        return super().aggregate_train(server_round, replies)


class Raises(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        raise RuntimeError("no such dataset on this machine")
''',
    "only_a.py": '''
from flwr.serverapp.strategy import FedAvg


class A(FedAvg):
    def __init__(self, only_a: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        self.only_a = only_a


class B(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)


class Counting(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.schedule = Step()


class Step:
    def __init__(self):
        self.n = 0

    def __call__(self):
        self.n += 1
        return self.n
''',
    "evals.py": '''
def good(server_round, arrays):
    return None


def three(server_round, arrays, extra):
    return None
''',
    "mods2.py": '''
def two(msg, context):
    return msg
''',
}


@pytest.fixture
def code_dir(user_dir):
    for name, text in CODE.items():
        (user_dir / name).write_text(text)
    return user_dir


def _check(overrides):
    from fedadapt.entry import compose_config, job_configs

    return job_configs(compose_config(overrides), overrides)


@pytest.mark.parametrize("overrides,says", [
    # the docs' own strategy passes **kwargs on to FedAvg: the misspelt key, by name
    (["strategy=custom", "strategy.target=halfstep.HalfStepFedAvg", "strategy.stepp=0.5"],
     "strategy.stepp is not a parameter of halfstep.HalfStepFedAvg: FedAvg.__init__() got an "
     "unexpected keyword argument 'stepp' (its parameters: step, keep)"),
    (["federation.evaluate_fn=evals.py:three"],
     "federation.evaluate_fn='evals.py:three' takes (server_round, arrays, extra), not "
     "Flower's (server_round, arrays)"),
    (["federation.train_mods=[mods2.py:two]"],
     "federation.train_mods: mods2.py:two takes (msg, context), not a mod's (msg, context, "
     "call_next)"),
    (["strategy=custom", "strategy.target=only_a.py:Counting"],
     "cannot checkpoint strategy attribute strategy.schedule (Step): a callable object that "
     "holds state (n)"),
    (["strategy=custom", "strategy.target=halfstep.HalfStepFedAvg", "dp=server_fixed",
      "method.weighting=uniform"],
     "strategy.target='halfstep.HalfStepFedAvg' is invalid: dp=server_fixed with accounting "
     "needs FedAvg's own aggregation"),
])
def test_user_code_errors_are_one_line_naming_the_object_and_key(code_dir, overrides, says):
    with pytest.raises(FedadaptError) as err:
        _check(overrides)
    assert str(err.value).startswith(says) and "\n" not in str(err.value), str(err.value)
    if "dp=server_fixed" in overrides:  # the explained refusal, as a built-in strategy gets it
        assert "(HalfStepFedAvg overrides aggregate_train)" in str(err.value)
        assert str(err.value).endswith("or dp.accounting=false")
        _check([*overrides, "dp.accounting=false"])  # runs without the accountant


def test_an_exception_in_the_users_constructor_shows_their_frames_under_one_line(code_dir):
    from fedadapt.userimport import UserCodeError

    with pytest.raises(UserCodeError) as err:
        _check(["strategy=custom", "strategy.target=boom.py:Raises"])
    header, *frames = str(err.value).splitlines()
    assert header == ("Raises.__init__ (strategy.target=boom.py:Raises) raised when it was built "
                      "(before round 1): RuntimeError: no such dataset on this machine")
    files = [ln for ln in frames if ln.strip().startswith("File ")]
    assert files and all(str(code_dir / "boom.py") in ln for ln in files), frames


def test_an_exception_in_the_users_evaluate_fn_names_the_key_and_keeps_their_frames(
        code_dir, monkeypatch):
    """What the server makes of an exception that passed through fedadapt's frames from the
    user's evaluate_fn: their function and the key, the round, their frames only."""
    from fedadapt import userimport
    from fedadapt.userimport import load, user_error

    monkeypatch.setattr(userimport, "_NAMED", {})  # this test file named no object here

    (code_dir / "evals_raise.py").write_text(
        "def evaluate(server_round, arrays):\n    return {'acc': 1 / 0}\n")
    fn = load("evals_raise.py:evaluate", "federation.evaluate_fn")

    def fedadapt_frame():  # stands for the server's own call
        return fn(3, None)

    try:
        fedadapt_frame()
    except ZeroDivisionError as err:
        raised = user_error(err, "in round 3")
    header, *frames = str(raised).splitlines()
    assert header == ("evaluate (federation.evaluate_fn=evals_raise.py:evaluate) raised in "
                      "round 3: ZeroDivisionError: division by zero")
    files = [ln.strip() for ln in frames if ln.strip().startswith("File ")]
    assert len(files) == 1 and str(code_dir / "evals_raise.py") in files[0]
    assert user_error(ValueError("not theirs"), "in round 1") is None


def test_wrong_return_types_of_the_users_hooks_are_one_line_naming_hook_and_round():
    from types import SimpleNamespace

    from flwr.app import ArrayRecord

    from fedadapt.federation.server import loop as server
    from fedadapt.userimport import UserCodeError

    class Mine(FedAvg):
        def aggregate_train(self, server_round, replies):
            return None

    def check(call, says):
        with pytest.raises(UserCodeError) as err:
            call()
        assert str(err.value) == says

    check(lambda: server._aggregated(Mine(), None, 3),
          "Mine.aggregate_train returned NoneType in round 3, not (ArrayRecord | None, "
          "MetricRecord | None) (Flower's aggregate_train(server_round, replies))")
    check(lambda: server._aggregated(Mine(), (ArrayRecord(), [1]), 2),
          "Mine.aggregate_train returned list in round 2 where a MetricRecord or None is due")
    check(lambda: server._messages(Mine(), "configure_train", None, 1),
          "FedAvg.configure_train returned NoneType in round 1, not an iterable of Messages "
          "(Flower's configure_train(server_round, arrays, config, grid) -> Iterable[Message])")

    def evaluate(server_round, arrays):
        return [0.5]

    plan = SimpleNamespace(global_eval=None, evaluate_fn=evaluate)
    check(lambda: server._server_eval(plan, 4, ArrayRecord()),
          "test_wrong_return_types_of_the_users_hooks_are_one_line_naming_hook_and_round."
          "<locals>.evaluate (federation.evaluate_fn) returned list in round 4, not a "
          "MetricRecord (Flower's evaluate_fn(server_round, arrays) -> MetricRecord | None)")


def test_a_sweep_builds_every_points_strategy_before_its_first(code_dir):
    """``strategy.target=A,B`` with a key only A takes: point 1 refused before point 0 runs;
    so is a point whose class holds state no checkpoint can hold, and a point's evaluate_fn
    that takes other arguments."""
    from fedadapt.argv import sweep_problem

    tiny = ["-m", "method=linear_head", "rounds=1"]
    said = sweep_problem([*tiny, "strategy=custom", "strategy.target=only_a.py:A,only_a.py:B",
                          "strategy.only_a=2.0"])
    # (the point's label is Hydra's override, its ':' escaped)
    assert said.startswith("sweep point 1 (strategy.target=only_a.py\\:B): strategy.only_a is "
                           "not a parameter of only_a.py:B"), said
    said = sweep_problem([*tiny, "strategy=custom",
                          "strategy.target=only_a.py:A,only_a.py:Counting"])
    assert said.startswith("sweep point 1 (strategy.target=only_a.py\\:Counting): cannot "
                           "checkpoint strategy attribute strategy.schedule (Step)"), said
    said = sweep_problem([*tiny, "federation.evaluate_fn=evals.py:good,evals.py:three"])
    assert said.startswith("sweep point 1 (federation.evaluate_fn=evals.py\\:three): "
                           "federation.evaluate_fn='evals.py:three' takes"), said
    assert sweep_problem([*tiny, "strategy=custom",
                          "strategy.target=only_a.py:A,halfstep.HalfStepFedAvg"]) is None


@pytest.mark.slow  # a run of two rounds, in process
def test_an_exception_in_the_users_hook_names_it_and_its_round_with_their_frames_only(
        code_dir, tmp_path, cache_dir):
    from fedadapt.userimport import UserCodeError

    with pytest.raises(UserCodeError) as err:
        _run(tmp_path / "run", ["strategy=custom", "strategy.target=boom.py:Boom", "rounds=3"],
             cache_dir)
    header, *frames = str(err.value).splitlines()
    assert header == ("Boom.aggregate_train (strategy.target=boom.py:Boom) raised in round 2: "
                      "ZeroDivisionError: division by zero")
    files = [ln.strip() for ln in frames if ln.strip().startswith("File ")]
    assert [f.split(", in ")[-1] for f in files] == ["aggregate_train", "divide"]
    assert all(str(code_dir / "boom.py") in f for f in files)
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1


@pytest.mark.slow  # runs of three rounds, in process
def test_every_kind_of_state_resumes_to_the_straight_run(code_dir, tmp_path, cache_dir):
    """Torch tensors made by a hook, torch and numpy generators and a schedule object with
    state_dict(): a run stopped after round 2 and resumed gives every row of the run never
    stopped, each kind's own metric included."""
    args = ["strategy=custom", "strategy.target=kinds.py:Kinds", "rounds=3",
            "partition.fraction_fit=1.0"]
    _run(tmp_path / "ref", args, cache_dir)
    rows = _rows(tmp_path / "ref")
    for kind in ("tensor", "torch_gen", "np_gen", "schedule"):
        values = [r[f"strategy/train/{kind}"] for r in rows]
        assert len(set(values)) == 3, (kind, values)  # it moves every round
    with pytest.raises(_Killed):
        _run(tmp_path / "stopped", args, cache_dir, execute=_stopping_after(2))
    _run(tmp_path / "stopped", args, cache_dir, resume=True)
    assert _rows(tmp_path / "stopped") == rows


@pytest.mark.slow  # a run of one round, in process
def test_state_a_hook_makes_is_refused_after_round_1_not_at_the_first_checkpoint(
        code_dir, tmp_path, cache_dir):
    from fedadapt.strategies.state import StrategyStateError

    with pytest.raises(StrategyStateError) as err:
        _run(tmp_path / "run", ["strategy=custom", "strategy.target=lazy.py:Lazy", "rounds=4",
                                "federation.checkpoint_every=5"], cache_dir)
    assert str(err.value).startswith("cannot checkpoint strategy attribute strategy.cache "
                                     "(object)")
    assert str(err.value).endswith("(found after round 1; the first checkpoint would have "
                                   "refused it)")
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 1


# -- the user's files recorded, a resume from any folder ----------------------------------------

def test_a_resume_reads_the_users_files_where_the_run_recorded_them(code_dir, tmp_path,
                                                                    monkeypatch, capsys):
    from fedadapt.userimport import USER_FILES, file_record, load, read_records, recorded_files

    rec = file_record("only_a.py:A")
    assert rec["file"] == str(code_dir / "only_a.py") and len(rec["sha256"]) == 64
    (code_dir / "resumed_module.py").write_text("def fn(server_round, arrays):\n    pass\n")
    # a module by its dotted name: the folder it is imported from
    assert file_record("resumed_module.fn")["root"] == str(code_dir)
    assert file_record("flwr.clientapp.mod:fixedclipping_mod") is None  # a package's
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / USER_FILES).write_text(json.dumps({"files": [
        rec, file_record("resumed_module.fn")]}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "only_a.py").write_text("A = 'another file of the same name'\n")
    monkeypatch.chdir(elsewhere)
    with recorded_files(read_records([tmp_path / "run"])):
        assert load("only_a.py:A", "strategy.target").__name__ == "A"
    assert capsys.readouterr().err == ""
    assert load("only_a.py:A", "strategy.target") == "another file of the same name"
    (code_dir / "only_a.py").write_text(CODE["only_a.py"] + "\n# edited\n")
    with recorded_files(read_records([tmp_path / "run"])):
        pass
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(said) == 1 and said[0].startswith(f"[job] {code_dir / 'only_a.py'} changed since "
                                                 f"the run started (sha256 ")


@pytest.mark.slow  # the command, twice, in process backend
def test_fedadapt_resume_from_another_folder_runs_the_recorded_strategy_file(code_dir,
                                                                             tmp_path,
                                                                             cache_dir):
    import os
    import subprocess
    import sys

    (code_dir / "flaky.py").write_text(
        "import os\nfrom flwr.serverapp.strategy import FedAvg\n\n\n"
        "class Flaky(FedAvg):\n"
        "    def aggregate_train(self, server_round, replies):\n"
        "        if server_round == 2 and os.path.exists('stop-at-round-2'):\n"
        "            raise RuntimeError('stopped on purpose')\n"
        "        return super().aggregate_train(server_round, replies)\n")
    (code_dir / "stop-at-round-2").write_text("")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    args = [*TINY, "rounds=3", "strategy=custom", "strategy.target=flaky.py:Flaky",
            "federation.backend=inprocess", f"output_dir={tmp_path / 'out'}"]
    first = subprocess.run([sys.executable, "-m", "fedadapt.cli", *args], cwd=code_dir,
                           env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 2, first.stderr[-3000:]
    assert ("fedadapt: error: Flaky.aggregate_train (strategy.target=flaky.py:Flaky) raised in "
            "round 2: RuntimeError: stopped on purpose") in first.stderr
    [job] = [p.parent for p in (tmp_path / "out").rglob("job.json")]
    recorded = json.loads((job / "linear_head" / "user_files.json").read_text())["files"]
    assert [(r["key"], r["file"]) for r in recorded] == [
        ("strategy.target", str(code_dir / "flaky.py"))]
    (code_dir / "flaky.py").write_text((code_dir / "flaky.py").read_text() + "# edited\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    second = subprocess.run([sys.executable, "-m", "fedadapt.cli", f"resume={job}"],
                            cwd=elsewhere, env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"[job] {code_dir / 'flaky.py'} changed since the run started" in second.stderr
    assert [r["round"] for r in read_jsonl(job / "linear_head" / "metrics.jsonl")] == [1, 2, 3]


# -- smaller items --------------------------------------------------------------------------------

def test_the_api_composes_as_the_command_does(user_dir):
    from fedadapt import api
    from fedadapt.entry import compose_config, job_configs

    with pytest.raises(ConfigError) as err:
        api.run(["rounds=1"], user_dir / "run")
    assert str(err.value).startswith("experiment=quickstart compares ['linear_head', "
                                     "'mlp_head', 'finetune', 'local_only']: fedadapt.api.run "
                                     "runs one method, name it with method=NAME")
    seen = {}

    def fake_run(cfg, run_dir, *, config_yaml, label, execute):
        seen.update(cfg=cfg, yaml=config_yaml, label=label)
        raise _Killed

    import fedadapt.experiment

    original = fedadapt.experiment.run_experiment
    fedadapt.experiment.run_experiment = fake_run
    try:
        with pytest.raises(_Killed):
            api.run(["method=mlp_head"], user_dir / "run")
    finally:
        fedadapt.experiment.run_experiment = original
    [(label, cfg, yaml)] = job_configs(compose_config(["method=mlp_head"],
                                                      default_experiment="quickstart"),
                                       ["method=mlp_head"])
    assert (seen["label"], seen["yaml"], seen["cfg"].experiment) == (label, yaml, "quickstart")


def test_the_peft_snippet_of_the_docs_imports_no_fedadapt():
    text = (ROOT / "docs" / "peft.md").read_text()
    snippet = text.split("With transformers and peft alone (no fedadapt), for a ViT:")[1]
    code = snippet.split("```python\n")[1].split("```")[0]
    assert "fedadapt" not in code and "from peft import PeftModel" in code


@pytest.mark.slow  # a two-round multi-tier run, in process
def test_a_strategy_that_declares_its_capabilities_runs_where_they_allow(tmp_path, cache_dir,
                                                                         monkeypatch):
    """docs/federation.md's SenderMedian declares that it averages each tensor over its
    senders: it runs in setting=multitier; a FedMedian subclass that declares nothing combines
    whole updates (FedMedian's registered capabilities) and is refused there."""
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "sendermedian.py").write_text(docs_example("sendermedian.py"))
    (folder / "wholemedian.py").write_text("from flwr.serverapp.strategy import FedMedian\n\n\n"
                                           "class WholeMedian(FedMedian):\n    pass\n")
    monkeypatch.chdir(folder)
    tiers = ["method=lw_linear", "backbone=tiny_vit", "dataset.max_samples=300",
             "partition.num_clients=4", "setting=multitier", "rounds=2",
             f"cache_dir={cache_dir}", "strategy=custom"]
    with pytest.raises(ConfigError, match=r"^strategy.target=wholemedian.WholeMedian is invalid "
                                          r"here: it combines whole updates"):
        to_run_config(compose_config([*tiers, "strategy.target=wholemedian.WholeMedian"]))
    with pytest.raises(ConfigError, match=r"^strategy.target='sendermedian.SenderMedian' is "
                                          r"invalid: dp=server_fixed with accounting"):
        to_run_config(compose_config([*TINY, "strategy=custom", "dp=server_fixed",
                                      "strategy.target=sendermedian.SenderMedian",
                                      "method.weighting=uniform"]))
    run = to_run_config(compose_config([*tiers, "strategy.target=sendermedian.SenderMedian"]))
    summary = run_experiment(run, tmp_path / "run", config_yaml="sendermedian",
                             execute=in_process("workers"))
    assert summary["strategy"]["class"] == "SenderMedian"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["round"] for r in rows] == [1, 2] and rows[-1]["global_acc"] is not None
