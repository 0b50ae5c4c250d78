"""strategy=fednova (strategies/fednova.py): FedNova's normalised averaging against the paper's
formula, FedAvg where every client takes the same steps, through a run with work cut at a
fleet's deadline, and its refusals in one line."""

import json
import math

import numpy as np
import pytest

from fedadapt.config import ConfigError


def _replies(messages, trained, values, extra=None):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    out = []
    for msg, n, vals in zip(messages, trained, values):
        arrays = ArrayRecord({k: Array(np.array(v, np.float32)) for k, v in vals.items()})
        content = RecordDict({"arrays": arrays,
                              "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0,
                                                       **(extra or {})})})
        msg.metadata.__dict__["_message_id"] = f"m{msg.metadata.dst_node_id}"
        out.append(Message(content, reply_to=msg))
    return out


class _Grid:
    def __init__(self, n):
        from fedadapt.federation.wire.grid import NODE_BASE

        self.ids = [NODE_BASE + c for c in range(n)]

    def get_node_ids(self):
        return self.ids


def test_the_step_weights_are_the_papers():
    from fedadapt.strategies.fednova import local_steps, step_weights

    assert step_weights(5) == 5.0 and step_weights(0, 0.9) == 0.0
    rho, tau = 0.9, 4  # sum_{k=1..tau} (1 - rho^k) / (1 - rho)
    assert step_weights(tau, rho) == pytest.approx(
        sum((1 - rho ** k) / (1 - rho) for k in range(1, tau + 1)))
    assert local_steps(33, 8, 2) == 10 and local_steps(32, 8, 1) == 4


def test_fednova_normalises_each_change_by_its_clients_steps(flower_task):
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from fedadapt.federation.wire.grid import NODE_BASE
    from fedadapt.strategies.fednova import FedNova, step_weights

    held = {0: 40, 1: 10, 2: 30}  # each client's training examples (its data share)
    strategy = FedNova(local_momentum=0.5, local_batch_size=4, local_epochs=1,
                       examples_of=lambda node: held[node - NODE_BASE], fraction_train=1.0,
                       min_available_nodes=3, min_train_nodes=3)
    x = {"w": [1.0, 2.0], "b": [0.5]}
    sent = ArrayRecord({k: Array(np.array(v, np.float32)) for k, v in x.items()})
    msgs = list(strategy.configure_train(1, sent, ConfigRecord({}), _Grid(3)))
    order = [m.metadata.dst_node_id - NODE_BASE for m in msgs]
    trained = {0: 40, 1: 10, 2: 12}  # client 2's work was cut: 12 of its 30 examples
    ys = {0: {"w": [2.0, 0.0], "b": [1.5]}, 1: {"w": [0.0, 4.0]}, 2: {"w": [3.0, 3.0],
                                                                     "b": [0.0]}}
    new, metrics = strategy.aggregate_train(1, _replies(msgs, [trained[c] for c in order],
                                                        [ys[c] for c in order]))
    a = {c: step_weights(math.ceil(trained[c] / 4), 0.5) for c in held}
    for name, holders in (("w", [0, 1, 2]), ("b", [0, 2])):  # client 1 sent no "b"
        p = {c: held[c] / sum(held[h] for h in holders) for c in holders}
        tau_eff = sum(p[c] * a[c] for c in holders)
        x0 = np.array(x[name])
        want = x0 - tau_eff * sum(p[c] * (x0 - np.array(ys[c][name])) / a[c] for c in holders)
        np.testing.assert_allclose(new[name].numpy(), want.astype(np.float32), rtol=1e-6)
    assert metrics["tau_eff"] == pytest.approx(sum(held[c] / 80 * a[c] for c in held))


def test_fednova_with_equal_steps_is_fedavg(flower_task):
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from fedadapt.strategies.fedavg import PerTensorFedAvg
    from fedadapt.strategies.fednova import FedNova

    common = dict(fraction_train=1.0, min_available_nodes=3, min_train_nodes=3)
    rng = np.random.default_rng(0)
    sent = ArrayRecord({"w": Array(rng.standard_normal(6).astype(np.float32))})
    ys = [{"w": rng.standard_normal(6)} for _ in range(3)]
    trained = [30, 29, 25]  # 4 steps of 8 each
    out = []
    for strategy in (FedNova(local_momentum=0.9, local_batch_size=8, **common),
                     PerTensorFedAvg(**common)):
        msgs = list(strategy.configure_train(1, sent, ConfigRecord({}), _Grid(3)))
        new, _ = strategy.aggregate_train(1, _replies(msgs, trained, ys))
        out.append(new["w"].numpy())
    np.testing.assert_allclose(out[0], out[1], rtol=1e-5, atol=1e-6)


def test_fednova_is_refused_with_dp():
    from fedadapt.entry import compose_config, to_run_config

    with pytest.raises(ConfigError) as err:
        to_run_config(compose_config(["method=linear_head", "strategy=fednova",
                                      "dp=server_fixed", "method.weighting=uniform"]))
    assert str(err.value).startswith("dp=server_fixed is invalid with strategy=fednova")
    assert "\n" not in str(err.value)


def test_fednova_on_work_cut_at_the_deadline_runs(tmp_path, cache_dir):
    """Through a run: the slow tier's work cut at the deadline, FedNova's normalised update
    (its tau_eff in the row); train.optimizer=adam refused before anything is written."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl

    base = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
            "dataset.max_samples=300", "partition.num_clients=6", "rounds=1",
            "partition.fraction_fit=1.0", "strategy=fednova", f"cache_dir={cache_dir}"]

    def run(name, extra):
        composed = compose_config([*base, *extra])
        return run_experiment(to_run_config(composed), tmp_path / name,
                              execute=in_process("workers"),
                              config_yaml=OmegaConf.to_yaml(composed, resolve=True))

    with pytest.raises(ConfigError) as err:
        run("adam", ["train.optimizer=adam"])
    assert str(err.value).startswith("train.optimizer=adam is invalid with strategy=fednova")
    assert not (tmp_path / "adam").exists()
    fleet = ["fleet=tiers", "fleet.compute=[1e3,1e6]"]
    run("plain", fleet)
    described = json.loads((tmp_path / "plain" / "fleet.json").read_text())["clients"]
    fast_s = max(c["train_flops"] / c["compute"] for c in described if c["tier"] == 1)
    slow_s = min(c["train_flops"] / c["compute"] for c in described if c["tier"] == 0)
    run("cut", [*fleet, f"federation.round_timeout={math.sqrt(fast_s * slow_s)}",
                "fleet.partial_work=true"])
    (plain,) = read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    (cut,) = read_jsonl(tmp_path / "cut" / "metrics.jsonl")
    assert cut["sim_partial"] == 3 and cut["clients_trained"] == 6
    # the slow tier's fewer steps: a smaller tau_eff than when every client finished
    assert 0 < cut["strategy/train/tau_eff"] < plain["strategy/train/tau_eff"]
    assert cut["global_acc"] is not None


def _one_round(strategy, n, trained, ys, sent=None, extra=None):
    from flwr.app import Array, ArrayRecord, ConfigRecord

    sent = sent or ArrayRecord({"w": Array(np.array([1.0, 2.0], np.float32))})
    msgs = list(strategy.configure_train(1, sent, ConfigRecord({}), _Grid(n)))
    return strategy.aggregate_train(1, _replies(msgs, trained, ys, extra))


def test_one_step_is_one_step_weight_and_the_momentum_bounds_are_said_whole():
    """Mutants of ``steps <= 0`` (as ``<= 1``: one step weighed 0) and of the momentum check
    survived: one step is ``a = 1`` with or without momentum; momentum 0 is plain SGD, 1 is
    refused in one line naming train.momentum."""
    from fedadapt.strategies.fednova import FedNova, step_weights

    assert step_weights(1) == 1.0 and step_weights(1, 0.9) == pytest.approx(1.0)
    assert step_weights(-3) == 0.0
    assert FedNova(local_momentum=0).local_momentum == 0.0
    with pytest.raises(ConfigError) as err:
        FedNova(local_momentum=1.0)
    assert str(err.value) == ("train.momentum=1.0 is invalid with strategy=fednova: its step "
                              "weights need 0 <= momentum < 1")
    with pytest.raises(ConfigError, match="train.momentum=-0.1"):
        FedNova(local_momentum=-0.1)


def test_the_defaults_are_the_configs():
    """``strategy=fednova`` has no keys of its own: the constructor's defaults are plain SGD,
    batch 32, one epoch, the data share from what a client reports."""
    from pathlib import Path

    import yaml

    from fedadapt.strategies.fednova import FedNova

    text = (Path(__file__).parents[1] / "conf" / "strategy" / "fednova.yaml").read_text()
    assert "# Keys: none." in text and set(yaml.safe_load(text)) == {"defaults", "name"}
    plain = FedNova()
    assert (plain.local_momentum, plain.local_batch_size, plain.local_epochs,
            plain.examples_of) == (0.0, 32, 1, None)


def test_one_client_of_weight_one_and_a_client_of_one_step_count(flower_task):
    """Mutants of ``total <= 0`` (as ``<= 1``), ``a > 0`` (as ``> 1``) and the metrics'
    ``total > 0`` (as ``> 1``) survived: one client of uniform weight 1 that took one step moves
    the model to its own, and its tau_eff (1) is reported."""
    from fedadapt.codec import UNIFORM_KEY
    from fedadapt.strategies.fednova import FedNova

    strategy = FedNova(local_batch_size=32, fraction_train=1.0, min_available_nodes=1,
                       min_train_nodes=1, weighted_by_key=UNIFORM_KEY)
    new, metrics = _one_round(strategy, 1, [20], [{"w": [4.0, -1.0]}],  # 20 examples: 1 step
                              extra={UNIFORM_KEY: 1.0})
    np.testing.assert_array_equal(new["w"].numpy(), np.array([4.0, -1.0], np.float32))
    assert metrics["tau_eff"] == 1.0


def test_a_client_that_took_no_step_or_weighs_nothing_changes_nothing(flower_task):
    """Mutants of ``a > 0`` (as ``>= 0``: a zero-step client divided by 0) and of the totals'
    ``> 0`` (as ``>= 0``: a division by a zero total) survived: a client that trained no
    example is left out; clients whose data shares are all 0 leave the model as sent, without
    tau_eff."""
    from fedadapt.strategies.fednova import FedNova

    common = dict(local_batch_size=10, fraction_train=1.0, min_available_nodes=2,
                  min_train_nodes=2)
    new, _ = _one_round(FedNova(**common), 2, [0, 10], [{"w": [9.0, 9.0]}, {"w": [3.0, 5.0]}])
    np.testing.assert_array_equal(new["w"].numpy(), np.array([3.0, 5.0], np.float32))
    new, metrics = _one_round(FedNova(examples_of=lambda node: 0, **common), 2, [10, 10],
                              [{"w": [9.0, 9.0]}, {"w": [3.0, 5.0]}])
    np.testing.assert_array_equal(new["w"].numpy(), np.array([1.0, 2.0], np.float32))
    assert "tau_eff" not in metrics


def test_a_tensor_nobody_sent_keeps_its_value_and_every_tensor_its_dtype(flower_task):
    """Mutants of the unsent tensor (``out[name] = None``; ``continue`` as ``break``, which
    skipped the tensors after it) and of the dtype (``astype(None)``: float64) survived."""
    from flwr.app import Array, ArrayRecord

    from fedadapt.strategies.fednova import FedNova

    sent = ArrayRecord({"frozen": Array(np.array([7.0], np.float32)),
                        "w": Array(np.array([1.0, 2.0], np.float32)),
                        "h": Array(np.array([0.5], np.float16))})
    strategy = FedNova(local_batch_size=10, fraction_train=1.0, min_available_nodes=2,
                       min_train_nodes=2)
    new, _ = _one_round(strategy, 2, [10, 10], [{"w": [3.0, 4.0], "h": [1.5]},
                                                 {"w": [5.0, 6.0], "h": [2.5]}], sent=sent)
    assert list(new) == ["frozen", "w", "h"]
    np.testing.assert_array_equal(new["frozen"].numpy(), np.array([7.0], np.float32))
    np.testing.assert_array_equal(new["w"].numpy(), np.array([4.0, 5.0], np.float32))
    assert new["w"].numpy().dtype == np.float32 and new["h"].numpy().dtype == np.float16
    np.testing.assert_array_equal(new["h"].numpy(), np.array([2.0], np.float16))
