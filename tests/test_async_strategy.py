"""Asynchronous strategies as the server sees them: the AsynchronousStrategy protocol, which
FedBuff implements and a researcher's own strategy (written here, run as strategy=custom on a
simulated fleet) can too: told when its clients arrive, it sets the server's clock and the
round's loss."""

from pathlib import Path

import pytest
from flwr.serverapp.strategy import FedAvg
from omegaconf import OmegaConf

from fedadapt.results.store import read_jsonl

TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=120", "partition.num_clients=4", "partition.fraction_fit=0.5",
        "rounds=3", "fleet=tiers", "fleet.compute=[1e6,1e7]"]

#: A user's asynchronous strategy: each round only the client that arrives first is applied,
#: and the clock moves to its arrival.
FIRST_ARRIVAL = '''
from flwr.app import MetricRecord
from flwr.serverapp.strategy import FedAvg


class FirstArrival(FedAvg):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.now = 0.0
        self.first = -1  # the node that arrives first this round
        self.told = 0

    def arrive(self, arrivals):
        self.told = len(arrivals)
        if arrivals:
            self.first, (start, seconds) = min(arrivals.items(), key=lambda kv: sum(kv[1]))
            self.now = max(self.now, start + seconds)

    def aggregate_train(self, server_round, replies):
        first = [m for m in replies if m.metadata.src_node_id == self.first]
        arrays, metrics = super().aggregate_train(server_round, first)
        return arrays, MetricRecord({**dict(metrics or {}), "arrived_at": self.now,
                                     "told": self.told})
'''


def test_fedbuff_is_an_asynchronous_strategy_and_fedavg_is_not():
    from fedadapt.strategies.asynchronous import AsynchronousStrategy
    from fedadapt.strategies.fedbuff import FedBuff

    assert isinstance(FedBuff(buffer_size=1), AsynchronousStrategy)
    assert not isinstance(FedAvg(), AsynchronousStrategy)


@pytest.fixture
def user_strategy(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "first.py").write_text(FIRST_ARRIVAL)
    monkeypatch.chdir(folder)
    return folder


@pytest.mark.slow  # a whole run, in process (about 8 s)
def test_a_users_asynchronous_strategy_is_told_the_arrivals_and_sets_the_clock(
        user_strategy, tmp_path, cache_dir):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.strategies.asynchronous import AsynchronousStrategy
    from fedadapt.strategies.custom import target_class

    assert isinstance(target_class("first.py:FirstArrival")(), AsynchronousStrategy)
    composed = compose_config([*TINY, "strategy=custom", "strategy.target=first.py:FirstArrival",
                               f"cache_dir={cache_dir}"])
    run_experiment(to_run_config(composed), tmp_path / "run", execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True))
    rows = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["round"] > 0]
    assert len(rows) == 3
    for row in rows:
        # told every client that arrives, by node; the clock is the strategy's
        assert row["strategy/train/told"] == row["clients_trained"] == row["clients_sampled"] == 2
        assert row["sim_time_s"] == row["strategy/train/arrived_at"] > 0
        # the round's loss is the one of the update the strategy applied
        assert row["train_loss"] == row["strategy/train/train_loss"]
    assert [r["sim_time_s"] for r in rows] == sorted(r["sim_time_s"] for r in rows)
