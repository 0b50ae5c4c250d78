"""strategy=fednova (strategies/fednova.py): FedNova's normalised averaging against the paper's
formula, FedAvg where every client takes the same steps, through a run with work cut at a
fleet's deadline, and its refusals in one line."""

import json
import math

import numpy as np
import pytest

from fedadapt.config import ConfigError


def _replies(messages, trained, values):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    out = []
    for msg, n, vals in zip(messages, trained, values):
        arrays = ArrayRecord({k: Array(np.array(v, np.float32)) for k, v in vals.items()})
        content = RecordDict({"arrays": arrays,
                              "metrics": MetricRecord({"num-examples": n, "train_loss": 1.0})})
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
