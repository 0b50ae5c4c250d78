"""Aggregation maths on hand-built replies (per tensor over the clients that sent it), Flower's
server optimisers composed with it, local-only, the client metrics, and the seeded streams the
strategies sample and draw noise with."""

import random

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAdam, FedAvg, FedAvgM

from fedadapt.codec import UNIFORM_KEY
from fedadapt.federation.wire.grid import ClientGrid, Nodes, node_id
from fedadapt.strategies.fedavg import (
    LocalOnly,
    PerTensorFedAvg,
    aggregate_client_metrics,
    per_tensor,
)
from fedadapt.strategies.state import SeededStreams


def arrays(**tensors) -> ArrayRecord:
    return ArrayRecord({k: Array.from_numpy_ndarray(np.asarray(v, dtype=np.float32))
                        for k, v in tensors.items()})


def reply(tensors: dict, n: int, **metrics) -> Message:
    """A client's reply, as fedadapt's grid hands it to a strategy."""
    sent = Message(RecordDict(), dst_node_id=node_id(0), message_type=MessageType.TRAIN)
    sent.metadata.__dict__["_message_id"] = "m"
    return Message(RecordDict({"arrays": arrays(**tensors), "metrics": MetricRecord(
        {"num-examples": n, UNIFORM_KEY: 1.0, "train_loss": 1.0, **metrics})}), reply_to=sent)


class _NoGrid:
    """Enough of a grid for configure_train: four clients."""

    def get_node_ids(self):
        return [node_id(p) for p in range(4)]


def aggregate(strategy, current: ArrayRecord, replies: list[Message]):
    strategy.configure_train(1, current, ConfigRecord({}), _NoGrid())
    return strategy.aggregate_train(1, replies)


def kwargs(**kw):
    return dict(fraction_train=1.0, min_train_nodes=1, min_available_nodes=1,
                train_metrics_aggr_fn=aggregate_client_metrics, **kw)


def test_per_tensor_fedavg_is_example_weighted_mean(flower_task):
    new, metrics = aggregate(PerTensorFedAvg(**kwargs()), arrays(w=[[0.0, 0.0]], b=[0.0]), [
        reply({"w": [[1.0, 2.0]], "b": [0.0]}, 1, train_loss=1.0),
        reply({"w": [[3.0, 6.0]], "b": [4.0]}, 3, train_loss=3.0)])
    np.testing.assert_allclose(new["w"].numpy(), [[2.5, 5.0]])  # (1*1 + 3*3)/4, (1*2 + 3*6)/4
    np.testing.assert_allclose(new["b"].numpy(), [3.0])
    assert metrics["train_loss"] == pytest.approx(2.5)
    assert metrics["train_loss_client_mean"] == pytest.approx(2.0)


def test_each_tensor_is_averaged_over_the_clients_that_trained_it(flower_task):
    """Multi-tier: a tier-0 client sends exit 0's head only; exit 1's head is the mean of the
    deeper clients alone (no dilution by untouched copies), and a tensor nobody trained keeps
    its value."""
    new, _ = aggregate(PerTensorFedAvg(**kwargs()), arrays(head0=[0.0], head1=[0.0], head2=[7.0]), [
        reply({"head0": [2.0]}, 1),                  # tier 0
        reply({"head0": [4.0], "head1": [10.0]}, 1),  # tier 1
        reply({"head1": [20.0]}, 3)])                # tier 1, three times the data
    out = {k: float(v.numpy()[0]) for k, v in new.items()}
    assert out == {"head0": 3.0, "head1": pytest.approx(17.5), "head2": 7.0}


def test_error_replies_are_left_out(flower_task):
    sent = Message(RecordDict(), dst_node_id=node_id(1), message_type=MessageType.TRAIN)
    sent.metadata.__dict__["_message_id"] = "e"
    failed = Message(Error(code=0, reason="boom"), reply_to=sent)
    new, _ = aggregate(PerTensorFedAvg(**kwargs()), arrays(w=[0.0]),
                       [reply({"w": [2.0]}, 1), failed])
    assert float(new["w"].numpy()[0]) == 2.0


def test_uniform_weighting_averages_clients_alike(flower_task):
    """FedCLIP's authors average the adapter uniformly over the clients (method.weighting)."""
    new, _ = aggregate(PerTensorFedAvg(**kwargs(weighted_by_key=UNIFORM_KEY)), arrays(w=[0.0]),
                       [reply({"w": [1.0]}, 1), reply({"w": [3.0]}, 3)])
    np.testing.assert_allclose(new["w"].numpy(), [2.0])


def test_per_tensor_equals_flowers_fedavg_when_every_client_sends_everything(flower_task):
    current = arrays(w=np.zeros((3, 4)), b=np.zeros(4))
    rng = np.random.default_rng(0)
    replies = [reply({"w": rng.normal(size=(3, 4)), "b": rng.normal(size=4)}, int(n))
               for n in (3, 5, 9)]
    ours, _ = aggregate(PerTensorFedAvg(**kwargs()), current, replies)
    flowers, _ = aggregate(FedAvg(**kwargs()), current, replies)
    for name in ("w", "b"):
        np.testing.assert_allclose(ours[name].numpy(), flowers[name].numpy(), atol=1e-6)


@pytest.mark.parametrize("cls", [FedAdam, FedAvgM])
def test_server_optimisers_compose_with_the_per_tensor_mean(cls, flower_task):
    """FedAdam over the per-tensor mean: the tensor only tier 1 trains moves by FedAdam's rule
    from the tier-1 mean alone; a tensor nobody sent has a zero pseudo-gradient."""
    composed = per_tensor(cls)
    assert [c.__name__ for c in composed.__mro__[:3]][1] == cls.__name__
    assert issubclass(composed, PerTensorFedAvg) and issubclass(composed, cls)
    extra = dict(eta=1.0, tau=1e-9, beta_1=0.0, beta_2=0.0) if cls is FedAdam else dict(
        server_learning_rate=1.0, server_momentum=0.0)
    strategy = composed(**kwargs(), **extra)
    current = arrays(head0=[0.0], head1=[0.0], head2=[5.0])
    new, _ = aggregate(strategy, current, [reply({"head0": [2.0]}, 1),
                                           reply({"head0": [4.0], "head1": [10.0]}, 1)])
    out = {k: float(v.numpy()[0]) for k, v in new.items()}
    if cls is FedAdam:  # eta * m / (sqrt(v) + tau) = sign(delta) with beta 0: +1 per tensor
        assert out["head0"] == pytest.approx(1.0) and out["head1"] == pytest.approx(1.0)
        assert out["head2"] == pytest.approx(5.0)
    else:
        assert out == {"head0": 3.0, "head1": 10.0, "head2": 5.0}


def test_fedadam_moves_by_its_own_rule_not_by_the_mean(flower_task):
    """The server optimiser runs: client updates 1 and 3 with eta = 1 are not averaged to 2."""
    strategy = per_tensor(FedAdam)(**kwargs(), eta=1.0, beta_1=0.9, beta_2=0.99, tau=1e-3)
    new, _ = aggregate(strategy, arrays(w=[0.0]), [reply({"w": [1.0]}, 1),
                                                   reply({"w": [3.0]}, 1)])
    delta, m, v = 2.0, 0.1 * 2.0, 0.01 * 4.0
    eta_norm = np.sqrt(1 - 0.99 ** 2) / (1 - 0.9 ** 2)  # Flower's bias correction, round 1
    assert float(new["w"].numpy()[0]) == pytest.approx(eta_norm * m / (np.sqrt(v) + 1e-3))
    assert float(new["w"].numpy()[0]) != pytest.approx(delta)


def test_local_only_aggregates_nothing(flower_task):
    new, metrics = aggregate(LocalOnly(**kwargs()), arrays(), [reply({}, 5, train_loss=1.0)])
    assert new is None and metrics["train_loss"] == 1.0


def test_client_metrics_unweighted_and_weighted():
    rows = [RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 1.0})}),
            RecordDict({"m": MetricRecord({"num-examples": 30, "accuracy": 0.5})})]
    m = aggregate_client_metrics(rows, "num-examples")
    assert m["accuracy_client_mean"] == pytest.approx(0.75)
    assert m["accuracy"] == pytest.approx((10 + 15) / 40)
    assert m["num-clients"] == 2


def test_client_without_test_data_is_left_out_of_means():
    rows = [RecordDict({"m": MetricRecord({"num-examples": 10, "accuracy": 0.8})}),
            RecordDict({"m": MetricRecord({"num-examples": 0, "accuracy": float("nan")})})]
    m = aggregate_client_metrics(rows, "num-examples")
    assert m["accuracy_client_mean"] == pytest.approx(0.8) and m["accuracy"] == pytest.approx(0.8)


# -- the strategies' randomness ---------------------------------------------------------------

def _sampled(streams: SeededStreams, stream: str, n: int, fraction: float, rounds: int
             ) -> list[list[int]]:
    """The clients Flower's FedAvg samples on fedadapt's grid, round after round."""
    strategy = FedAvg(fraction_train=fraction, fraction_evaluate=fraction, min_train_nodes=1,
                      min_evaluate_nodes=1, min_available_nodes=n)
    grid = ClientGrid(None, Nodes("workers", {0: 1}), n)
    out = []
    for rnd in range(1, rounds + 1):
        with streams.use(stream):
            hook = strategy.configure_train if stream == "train" else strategy.configure_evaluate
            msgs = hook(rnd, ArrayRecord(), ConfigRecord({}), grid)
        out.append(sorted(grid.partition_of(m.metadata.dst_node_id) for m in msgs))
    return out


def test_the_same_seed_samples_the_same_clients_whatever_else_uses_random(flower_task):
    first = _sampled(SeededStreams(3), "train", 20, 0.25, 5)
    random.seed(12345)  # other code moving the global generators changes nothing
    np.random.seed(7)
    second = _sampled(SeededStreams(3), "train", 20, 0.25, 5)
    assert first == second and len(set(map(tuple, first))) > 1  # it moves round to round
    assert all(len(r) == 5 for r in first)
    assert _sampled(SeededStreams(4), "train", 20, 0.25, 5) != first
    state = random.getstate()
    _sampled(SeededStreams(3), "train", 20, 0.25, 1)
    assert random.getstate() == state  # the process's own state is left as it was


def test_evaluation_does_not_change_which_clients_train(flower_task):
    plain, evaluated = SeededStreams(0), SeededStreams(0)
    for _ in range(5):
        a = _sampled(plain, "train", 10, 0.3, 1)
        _sampled(evaluated, "evaluate", 10, 0.5, 1)
        assert a == _sampled(evaluated, "train", 10, 0.3, 1)


def test_flowers_draw_equals_the_plain_loops(flower_task):
    """fedadapt-bench's plain loop trains the clients Flower's FedAvg samples."""
    streams = SeededStreams(5)
    assert [streams.sample("train", 50, 10) for _ in range(3)] == \
        _sampled(SeededStreams(5), "train", 50, 0.2, 3)


def test_streams_round_trip_through_json(flower_task):
    import json

    streams = SeededStreams(1)
    _sampled(streams, "train", 10, 0.5, 2)
    with streams.use("train"):
        np.random.normal()
    saved = json.loads(json.dumps(streams.state_dict()))
    expected = _sampled(streams, "train", 10, 0.5, 3)
    with streams.use("train"):
        noise = np.random.normal(size=3)
    again = SeededStreams(99)
    again.load_state_dict(saved)
    assert _sampled(again, "train", 10, 0.5, 3) == expected
    with again.use("train"):
        np.testing.assert_array_equal(np.random.normal(size=3), noise)


def test_the_node_list_is_built_once(flower_task):
    """A strategy's draw copies the node list (Flower: ``list(grid.get_node_ids())``), then
    samples k of it; the grid builds no list per call."""
    grid = ClientGrid(None, Nodes("workers", {0: 1}), 10_000)
    assert grid.get_node_ids() is grid.get_node_ids()
    assert grid.get_node_ids()[:2] == [node_id(0), node_id(1)]
    strategy = FedAvg(fraction_train=0.001, min_train_nodes=1, min_available_nodes=10_000)
    with SeededStreams(0).use("train"):
        msgs = strategy.configure_train(1, ArrayRecord(), ConfigRecord({}), grid)
    assert len(msgs) == 10
