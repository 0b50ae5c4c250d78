"""Aggregation maths on hand-built arrays, seeded sampling, FedProx and local-only configs."""

import numpy as np
import pytest
from fedadapt.strategies.fedavg import (
    AdapterFedAvg,
    AdapterFedProx,
    LocalOnly,
    aggregate_client_metrics,
    build_strategy,
)
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)


def reply(arrays: dict, n: int, **metrics) -> Message:
    content = RecordDict({"arrays": ArrayRecord(array_dict={
                              k: Array.from_numpy_ndarray(np.asarray(v, dtype=np.float32))
                              for k, v in arrays.items()}),
                          "metrics": MetricRecord({"num-examples": n, **metrics})})
    return Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)


def strategy(cls=AdapterFedAvg, **kw):
    s = cls(num_clients=4, fraction_train=0.5, fraction_evaluate=1.0, seed=0, **kw)
    s.set_nodes({pid: 1000 + pid for pid in range(4)})
    return s


def test_fedavg_is_example_weighted_mean(flower_task):
    s = strategy()
    replies = [reply({"w": [[1.0, 2.0]], "b": [0.0]}, 1, train_loss=1.0),
               reply({"w": [[3.0, 6.0]], "b": [4.0]}, 3, train_loss=3.0)]
    arrays, metrics = s.aggregate_train(1, replies)
    out = {k: v.numpy() for k, v in arrays.items()}
    np.testing.assert_allclose(out["w"], [[2.5, 5.0]])  # (1*1 + 3*3)/4, (1*2 + 3*6)/4
    np.testing.assert_allclose(out["b"], [3.0])
    assert metrics["train_loss"] == pytest.approx(2.5)
    assert metrics["train_loss_client_mean"] == pytest.approx(2.0)


def test_uniform_weighting_averages_clients_alike(flower_task):
    """FedCLIP's authors average the adapter uniformly over the clients (method.weighting)."""
    from fedadapt.strategies.fedavg import UNIFORM_KEY

    s = strategy(weighting="uniform")
    replies = [reply({"w": [1.0]}, 1, **{UNIFORM_KEY: 1.0}),
               reply({"w": [3.0]}, 3, **{UNIFORM_KEY: 1.0})]
    arrays, _ = s.aggregate_train(1, replies)
    np.testing.assert_allclose(arrays["w"].numpy(), [2.0])
    # evaluation is still reported example-weighted and as the client mean
    ev = s.aggregate_evaluate(1, [reply({}, 10, accuracy=1.0, **{UNIFORM_KEY: 1.0}),
                                  reply({}, 30, accuracy=0.5, **{UNIFORM_KEY: 1.0})])
    assert ev["accuracy"] == pytest.approx(0.625) and ev["accuracy_client_mean"] == 0.75


def test_client_metrics_unweighted_and_weighted():
    rows = [RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 1.0})}),
            RecordDict({"m": MetricRecord({"num-examples": 30, "accuracy": 0.5})})]
    m = aggregate_client_metrics(rows, "num-examples")
    assert m["accuracy_client_mean"] == pytest.approx(0.75)
    assert m["accuracy"] == pytest.approx((10 + 15) / 40)
    assert m["num-clients"] == 2


def test_sampling_is_seeded_and_sized():
    first = [strategy().sample(0.5, 2) for _ in range(3)]
    assert first[0] == first[1] == first[2]
    assert len(first[0]) == 2 and set(first[0]) <= {1000, 1001, 1002, 1003}
    s = strategy()
    draws = [tuple(s.sample(0.5, 2)) for _ in range(20)]
    assert len(set(draws)) > 1  # the stream moves from round to round


def test_configure_train_sends_round_lr_and_prox_mu(flower_task):
    s = strategy(AdapterFedProx, proximal_mu=0.1)
    msgs = list(s.configure_train(3, ArrayRecord(array_dict={
                                      "w": Array.from_numpy_ndarray(np.zeros(2, np.float32))}),
                                  ConfigRecord({"lr": 0.01}), grid=None))
    assert len(msgs) == 2
    cfg = msgs[0].content.config_records["config"]
    assert cfg["server-round"] == 3 and cfg["lr"] == 0.01 and cfg["proximal-mu"] == 0.1


def test_local_only_aggregates_nothing(flower_task):
    s = strategy(LocalOnly)
    arrays, metrics = s.aggregate_train(1, [reply({}, 5, train_loss=1.0)])
    assert arrays is None and metrics["train_loss"] == 1.0
    assert isinstance(build_strategy("fedavg", federated=False, num_clients=2,
                                     fraction_train=1.0, fraction_evaluate=1.0, seed=0), LocalOnly)


def test_min_nodes_match_intended_sample():
    s = AdapterFedAvg(num_clients=10, fraction_train=0.3, fraction_evaluate=1.0, seed=0)
    assert s.min_available_nodes == 10 and s.min_train_nodes == 3 and s.min_evaluate_nodes == 10


def test_client_without_test_data_is_left_out_of_means():
    rows = [RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 0.8})}),
            RecordDict({"m": MetricRecord({"num-examples": 0, "accuracy": float("nan")})})]
    m = aggregate_client_metrics(rows, "num-examples")
    assert m["accuracy_client_mean"] == pytest.approx(0.8) and m["accuracy"] == pytest.approx(0.8)


def test_evaluation_does_not_change_which_clients_train(flower_task):
    arrays = ArrayRecord(array_dict={"w": Array.from_numpy_ndarray(np.zeros(2, np.float32))})
    plain, evaluated = strategy(), strategy()
    for rnd in range(1, 6):
        a = [m.metadata.dst_node_id for m in plain.configure_train(rnd, arrays, ConfigRecord(),
                                                                    None)]
        evaluated.configure_evaluate(rnd, arrays, ConfigRecord(), None)
        b = [m.metadata.dst_node_id for m in evaluated.configure_train(rnd, arrays,
                                                                        ConfigRecord(), None)]
        assert a == b


def test_sampling_state_round_trips():
    s = strategy()
    s.sample(0.5, 2)
    saved = s.state_dict()
    expected = [s.sample(0.5, 2) for _ in range(3)]
    t = strategy()
    t.load_state_dict(saved)
    assert [t.sample(0.5, 2) for _ in range(3)] == expected
