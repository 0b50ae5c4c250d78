"""Aggregation maths on hand-built client contents (per tensor over the clients that sent it),
seeded sampling by client, FedProx and local-only configs."""

import numpy as np
import pytest
from fedadapt.strategies.fedavg import (
    UNIFORM_KEY,
    AdapterFedAvg,
    AdapterFedProx,
    LocalOnly,
    aggregate_client_metrics,
    build_strategy,
)
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict


def arrays(**tensors) -> ArrayRecord:
    return ArrayRecord(array_dict={k: Array.from_numpy_ndarray(np.asarray(v, dtype=np.float32))
                                   for k, v in tensors.items()})


def content(tensors: dict, n: int, **metrics) -> RecordDict:
    return RecordDict({"arrays": arrays(**tensors),
                       "metrics": MetricRecord({"num-examples": n, **metrics})})


def strategy(cls=AdapterFedAvg, **kw):
    return cls(num_clients=4, fraction_train=0.5, fraction_evaluate=1.0, seed=0, **kw)


def test_fedavg_is_example_weighted_mean():
    s = strategy()
    current = arrays(w=[[0.0, 0.0]], b=[0.0])
    new, metrics = s.aggregate_clients(current, [
        content({"w": [[1.0, 2.0]], "b": [0.0]}, 1, train_loss=1.0),
        content({"w": [[3.0, 6.0]], "b": [4.0]}, 3, train_loss=3.0)])
    out = {k: v.numpy() for k, v in new.items()}
    np.testing.assert_allclose(out["w"], [[2.5, 5.0]])  # (1*1 + 3*3)/4, (1*2 + 3*6)/4
    np.testing.assert_allclose(out["b"], [3.0])
    assert metrics["train_loss"] == pytest.approx(2.5)
    assert metrics["train_loss_client_mean"] == pytest.approx(2.0)


def test_each_tensor_is_averaged_over_the_clients_that_trained_it():
    """Multi-tier: a tier-0 client sends exit 0's head only; exit 1's head is the mean of the
    deeper clients alone (no dilution by untouched copies), and a tensor nobody trained keeps
    its value."""
    s = strategy()
    current = arrays(head0=[0.0], head1=[0.0], head2=[7.0])
    new, _ = s.aggregate_clients(current, [
        content({"head0": [2.0]}, 1),                  # tier 0
        content({"head0": [4.0], "head1": [10.0]}, 1),  # tier 1
        content({"head1": [20.0]}, 3)])                # tier 1, three times the data
    out = {k: float(v.numpy()[0]) for k, v in new.items()}
    assert out == {"head0": 3.0, "head1": pytest.approx(17.5), "head2": 7.0}


def test_uniform_weighting_averages_clients_alike():
    """FedCLIP's authors average the adapter uniformly over the clients (method.weighting)."""
    s = strategy(weighting="uniform")
    new, _ = s.aggregate_clients(arrays(w=[0.0]), [
        content({"w": [1.0]}, 1, **{UNIFORM_KEY: 1.0}),
        content({"w": [3.0]}, 3, **{UNIFORM_KEY: 1.0})])
    np.testing.assert_allclose(new["w"].numpy(), [2.0])
    # evaluation is still reported example-weighted and as the client mean
    ev = s.aggregate_evaluate_clients([content({}, 10, accuracy=1.0, **{UNIFORM_KEY: 1.0}),
                                       content({}, 30, accuracy=0.5, **{UNIFORM_KEY: 1.0})])
    assert ev["accuracy"] == pytest.approx(0.625) and ev["accuracy_client_mean"] == 0.75


def test_client_metrics_unweighted_and_weighted():
    rows = [RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 1.0})}),
            RecordDict({"m": MetricRecord({"num-examples": 30, "accuracy": 0.5})})]
    m = aggregate_client_metrics(rows, "num-examples")
    assert m["accuracy_client_mean"] == pytest.approx(0.75)
    assert m["accuracy"] == pytest.approx((10 + 15) / 40)
    assert m["num-clients"] == 2


def test_sampling_is_seeded_sized_and_linear_in_the_sampled():
    first = [strategy().sample_train() for _ in range(3)]
    assert first[0] == first[1] == first[2]
    assert len(first[0]) == 2 and set(first[0]) <= {0, 1, 2, 3}
    s = strategy()
    draws = [tuple(s.sample_train()) for _ in range(20)]
    assert len(set(draws)) > 1  # the stream moves from round to round
    big = AdapterFedAvg(num_clients=10_000_000, fraction_train=1e-6, fraction_evaluate=0.0,
                        seed=0)  # drawing 10 of ten million must not touch every client
    assert len(big.sample_train()) == 10 and big.sample_evaluate() == []


def test_round_config_carries_round_and_prox_mu():
    s = strategy(AdapterFedProx, proximal_mu=0.1)
    cfg = s.round_config(3, ConfigRecord({"lr": 0.01}))
    assert cfg["server-round"] == 3 and cfg["lr"] == 0.01 and cfg["proximal-mu"] == 0.1


def test_local_only_aggregates_nothing():
    s = strategy(LocalOnly)
    new, metrics = s.aggregate_clients(arrays(), [content({}, 5, train_loss=1.0)])
    assert new is None and metrics["train_loss"] == 1.0
    assert isinstance(build_strategy("fedavg", federated=False, num_clients=2,
                                     fraction_train=1.0, fraction_evaluate=1.0, seed=0), LocalOnly)


def test_min_counts_match_intended_sample():
    s = AdapterFedAvg(num_clients=10, fraction_train=0.3, fraction_evaluate=1.0, seed=0)
    assert s.min_train_nodes == 3 and s.min_evaluate_nodes == 10
    assert len(s.sample_train()) == 3 and len(s.sample_evaluate()) == 10


def test_client_without_test_data_is_left_out_of_means():
    rows = [RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 0.8})}),
            RecordDict({"m": MetricRecord({"num-examples": 0, "accuracy": float("nan")})})]
    m = aggregate_client_metrics(rows, "num-examples")
    assert m["accuracy_client_mean"] == pytest.approx(0.8) and m["accuracy"] == pytest.approx(0.8)


def test_evaluation_does_not_change_which_clients_train():
    plain, evaluated = strategy(), strategy()
    for _ in range(5):
        a = plain.sample_train()
        evaluated.sample_evaluate()
        assert a == evaluated.sample_train()


def test_sampling_state_round_trips():
    s = strategy()
    s.sample_train()
    saved = s.state_dict()
    expected = [s.sample_train() for _ in range(3)]
    t = strategy()
    t.load_state_dict(saved)
    assert [t.sample_train() for _ in range(3)] == expected
