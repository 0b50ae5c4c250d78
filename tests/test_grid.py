"""The grid a strategy sees: one node per client; underneath, one message per worker (shared
records once), one reply per client (its content, or its own error), bytes per client."""

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

from fedadapt.federation.wire import records
from fedadapt.federation.wire.grid import NODE_BASE, ClientGrid, Nodes, node_id


class Workers:
    """An inner grid whose nodes answer with ``answer(message) -> Message``; keeps what it
    was sent."""

    def __init__(self, answer):
        self.answer, self.sent = answer, []

    def send_and_receive(self, messages, *, timeout=None):
        out = []
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"w{len(self.sent)}-{i}"
            self.sent.append(msg)
            out.append(self.answer(msg))
        return out


def trained_everything(msg: Message) -> Message:
    """Each client of the worker message replies with its arrays plus one."""
    replies = {}
    for cid in records.clients_of(msg.content):
        mine = records.view(msg.content, cid)
        arrays = {k: v.numpy() + 1 for k, v in mine.array_records["arrays"].items()}
        replies[cid] = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in
                                                          arrays.items()}),
                                   "metrics": MetricRecord({"num-examples": 1})})
    return Message(records.pack(replies), reply_to=msg)


def strategy_messages(cids, content=None):
    """What FedAvg's configure_train makes: one RecordDict, the same object in every message."""
    content = content or RecordDict({
        "arrays": ArrayRecord({"w": Array(np.zeros((2, 3), np.float32)),
                               "b": Array(np.zeros(3, np.float32))}),
        "config": ConfigRecord({"server-round": 1, "lr": 0.1})})
    return [Message(content, dst_node_id=node_id(p), message_type=MessageType.TRAIN)
            for p in cids]


def test_a_strategy_sees_one_node_per_client_in_partition_order():
    grid = ClientGrid(None, Nodes("workers", {0: 11, 1: 12}), 5)
    assert list(grid.get_node_ids()) == [NODE_BASE + p for p in range(5)]
    assert grid.partition_of(NODE_BASE + 3) == 3
    with pytest.raises(ValueError, match="no client has node id 12"):
        grid.partition_of(12)


def test_clients_spread_over_workers_by_their_work_when_it_is_known():
    """Worked by hand: sizes 25, 52, 41, 16, 85, 18 over two workers. In order: 118 and 119.
    Largest first to the less loaded worker: 85 -> w0, 52 -> w1, 41 -> w1 (93), 25 -> w0
    (110), 18 -> w1 (111), 16 -> w0 (126)... each worker's clients then in the round's order."""
    sizes = {0: 25, 1: 52, 2: 41, 3: 16, 4: 85, 5: 18}
    even = Nodes("workers", {0: 11, 1: 12})
    assert even.assign(list(sizes)) == [(11, [0, 1, 2]), (12, [3, 4, 5])]
    balanced = Nodes("workers", {0: 11, 1: 12}, work=sizes.__getitem__)
    assert balanced.assign(list(sizes)) == [(11, [0, 3, 4]), (12, [1, 2, 5])]
    assert balanced.assign([4]) == [(11, [4])]  # a worker without clients gets no message
    assert balanced.assign(list(sizes), per_message=2) == even.assign(list(sizes), 2)
    alone = Nodes("workers", {0: 11}, work=sizes.__getitem__)
    assert alone.assign([2, 4]) == [(11, [2, 4])]
    clients = Nodes("clients", {0: 11, 1: 12}, work=sizes.__getitem__)
    assert clients.assign([1, 0]) == [(12, [1]), (11, [0])]


def test_one_message_per_worker_carries_the_shared_records_once(flower_task):
    inner = Workers(trained_everything)
    grid = ClientGrid(inner, Nodes("workers", {0: 11, 1: 12}), 6, group_size=3)
    msgs = strategy_messages([5, 0, 3, 1])
    replies = grid.send_and_receive(msgs)
    assert len(inner.sent) == 2 and [m.metadata.dst_node_id for m in inner.sent] == [11, 12]
    first = inner.sent[0].content
    assert records.clients_of(first) == [0, 1]  # split in partition order
    assert records.packing(first)["group-size"] == 3
    assert first["arrays"] is msgs[0].content["arrays"]  # once, not per client
    assert not any("/" in name for name in first.keys())
    # one reply per client, in the order of the strategy's messages, from the client's node
    assert [r.metadata.src_node_id for r in replies] == [node_id(p) for p in (5, 0, 3, 1)]
    assert [r.metadata.reply_to_message_id for r in replies] == \
        [m.metadata.message_id for m in msgs]
    np.testing.assert_array_equal(replies[0].content["arrays"]["w"].numpy(), np.ones((2, 3)))


def test_own_records_travel_under_the_clients_prefix(flower_task):
    inner = Workers(trained_everything)
    grid = ClientGrid(inner, Nodes("workers", {0: 11}), 3)
    config = ConfigRecord({"phase": "plugin"})
    msgs = [Message(RecordDict({"config": config, "arrays": ArrayRecord(
        {"w": Array(np.full(2, p, np.float32))})}), dst_node_id=node_id(p),
        message_type=MessageType.EVALUATE) for p in range(3)]
    replies = grid.send_and_receive(msgs)
    content = inner.sent[0].content
    assert sorted(content.keys()) == sorted(["config", records.GRID, "c0/arrays", "c1/arrays",
                                             "c2/arrays"])
    assert [float(r.content["arrays"]["w"].numpy()[0]) for r in replies] == [1.0, 2.0, 3.0]
    assert "phase" in records.view(content, 2)["config"]
    assert records.GRID not in records.view(content, 2)  # the worker's record, no client's


def test_each_client_gets_its_own_error_and_a_late_one_none(flower_task):
    def answer(msg):
        return Message(records.pack({0: RecordDict({"metrics": MetricRecord({"num-examples": 1})}),
                                     1: records.error("ValueError: client 1 broke")}),
                       reply_to=msg)  # client 2: no record, it was late

    grid = ClientGrid(Workers(answer), Nodes("workers", {0: 11}), 3)
    replies = grid.send_and_receive(strategy_messages([0, 1, 2]))
    assert [grid.partition_of(r.metadata.src_node_id) for r in replies] == [0, 1]
    assert not replies[0].has_error() and replies[1].has_error()
    assert replies[1].error.reason == "ValueError: client 1 broke"


def test_a_worker_message_that_failed_fails_each_of_its_clients(flower_task):
    grid = ClientGrid(Workers(lambda m: Message(Error(code=3, reason="actor died"),
                                                reply_to=m)),
                      Nodes("workers", {0: 11}), 2)
    replies = grid.send_and_receive(strategy_messages([0, 1]))
    assert [(r.metadata.src_node_id, r.error.reason) for r in replies] == [
        (node_id(0), "actor died"), (node_id(1), "actor died")]


def test_bytes_are_what_each_client_would_exchange(flower_task):
    inner = Workers(trained_everything)
    grid = ClientGrid(inner, Nodes("workers", {0: 11}), 2)
    grid.trained = lambda cid: ["w"] if cid == 0 else ["w", "b"]
    msgs = strategy_messages([0, 1])
    sent = msgs[0].content["arrays"]
    grid.send_and_receive(msgs)
    down, up = grid.take_bytes()
    only_w = ArrayRecord({"w": sent["w"]}).count_bytes()
    assert down == {0: only_w, 1: sent.count_bytes()}  # client 0 trains w only
    assert up == {0: sent.count_bytes(), 1: sent.count_bytes()}  # what each sent back
    assert grid.take_bytes() == ({}, {})


def test_a_deployment_client_is_sent_only_what_it_trains(flower_task):
    inner = Workers(trained_everything)
    grid = ClientGrid(inner, Nodes("clients", {0: 21, 1: 22}), 2)
    grid.trained = lambda cid: ["w"] if cid == 0 else ["w", "b"]
    grid.send_and_receive(strategy_messages([0, 1]))
    assert [m.metadata.dst_node_id for m in inner.sent] == [21, 22]
    assert sorted(inner.sent[0].content["arrays"].keys()) == ["w"]
    assert sorted(inner.sent[1].content["arrays"].keys()) == ["b", "w"]


def test_malformed_exchanges_are_refused(flower_task):
    grid = ClientGrid(Workers(trained_everything), Nodes("workers", {0: 11}), 2)
    with pytest.raises(ValueError, match="two messages for client 0"):
        grid.send_and_receive(strategy_messages([0, 0]))
    with pytest.raises(ValueError, match="no client has node id"):
        grid.send_and_receive([Message(RecordDict(), dst_node_id=5,
                                       message_type=MessageType.TRAIN)])
    bad = RecordDict({"a/b": ConfigRecord({})})
    with pytest.raises(ValueError, match="reserved"):
        grid.send_and_receive(strategy_messages([1], bad))


def test_push_then_pull_as_on_flowers_grids(flower_task):
    grid = ClientGrid(Workers(trained_everything), Nodes("workers", {0: 11}), 2)
    ids = grid.push_messages(strategy_messages([0, 1]))
    replies = list(grid.pull_messages(ids))
    assert [r.metadata.reply_to_message_id for r in replies] == ids
