"""The per-round shortcuts give exactly what they replace: encoding and decoding a message's
arrays without formatting or parsing their ``.npy`` headers each time, seeding torch for the
device in use, reading a label column through Arrow, plain SGD without ``torch.optim``, a
client's features read in one gather, the per-tensor average in place, the records read without
Flower's typed views, the in-process transport's copy, numpy's stream held over the rounds."""

import numpy as np
import pytest
import torch
from flwr.app import Array

from fedadapt.codec import as_numpy, to_array
from fedadapt.data.loading import column
from fedadapt.devices import heap_free_bytes, return_freed_memory, seed_torch


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.arange(5, dtype=np.int64),
    np.ones((), dtype=np.float32),
    np.zeros((0, 3), dtype=np.float16),
    np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),  # Array.numpy's path
    np.arange(6, dtype=">f4").reshape(3, 2),
    np.array([True, False]),
], ids=["f32", "i64", "scalar", "empty", "fortran", "big-endian", "bool"])
def test_as_numpy_equals_flowers_decoding(value):
    array = Array(np.asarray(value))
    ours, flowers = as_numpy(array), array.numpy()
    assert ours.dtype == flowers.dtype and ours.shape == flowers.shape
    assert np.array_equal(ours, flowers)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4), lambda: torch.arange(5), lambda: torch.tensor(1.5),
    lambda: torch.randn(4, 3).t(),  # not contiguous: Flower's own path
    lambda: np.ones((2, 2), np.float16), lambda: np.zeros((0, 4), np.float32),
    lambda: np.asfortranarray(np.random.default_rng(0).random((3, 2))),
], ids=["f32", "i64", "scalar", "transposed", "f16", "empty", "fortran"])
def test_to_array_gives_flowers_bytes_the_first_time_and_after(make):
    for _ in range(2):  # the header is made, then reused
        value = make()
        ref = (Array.from_torch_tensor(value) if isinstance(value, torch.Tensor)
               else Array.from_numpy_ndarray(value))
        ours = to_array(value)
        assert (ours.dtype, tuple(ours.shape), ours.stype, ours.data) == \
            (ref.dtype, tuple(ref.shape), ref.stype, ref.data)


def test_as_numpy_is_a_read_only_view_of_the_message():
    array = Array(np.arange(4, dtype=np.float32))
    view = as_numpy(array)
    assert not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(array.data, dtype=np.uint8))


def test_seed_torch_on_the_cpu_draws_what_manual_seed_draws():
    torch.manual_seed(123)
    expected = (torch.randn(5), torch.nn.functional.dropout(torch.ones(64), 0.5),
                torch.randperm(10))
    torch.manual_seed(0)  # another state first
    seed_torch(123, torch.device("cpu"))
    got = (torch.randn(5), torch.nn.functional.dropout(torch.ones(64), 0.5), torch.randperm(10))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_a_label_column_read_through_arrow_equals_the_datasets_column():
    from datasets import Dataset

    ds = Dataset.from_dict({"label": [3, 1, 4, 1, 5, 9, 2, 6]}).select([7, 0, 2, 5])
    assert np.array_equal(column(ds, "label", np.int64),
                          np.asarray(ds["label"], dtype=np.int64))
    assert column(ds, "label", np.int64).tolist() == [6, 3, 4, 9]


def test_freed_memory_is_trimmed_only_when_the_heaps_hold_enough_of_it():
    free = heap_free_bytes()
    if free is None:
        pytest.skip("no glibc mallinfo2 here: every call trims, as before")
    assert return_freed_memory(min_free=free + (1 << 30), check_every_s=0) is False
    blocks = [bytearray(100_000) for _ in range(400)]  # under the mmap threshold: heap blocks
    kept = blocks[1::2]  # every other one freed: holes the heap keeps (no top to shrink)
    del blocks
    assert heap_free_bytes() >= 100_000 * 150
    assert return_freed_memory(min_free=1 << 20, check_every_s=0) is True
    # within check_every_s of that check the heaps are not read again
    assert return_freed_memory(min_free=0, check_every_s=3600) is False
    del kept


# -- local training ---------------------------------------------------------------------------

class _Features:
    """A cached-features source in memory (what :func:`feature_stream` reads)."""

    kind = "features"

    def __init__(self, n: int = 40, dim: int = 6, classes: int = 3, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self._x = rng.standard_normal((n, dim)).astype(np.float32)
        self._y = rng.integers(0, classes, n).astype(np.int64)

    def features(self):
        return self._x

    def labels(self):
        return self._y

    def stream(self, batches, device, crops=None):
        from fedadapt.data.sources import feature_stream

        return feature_stream(self, [np.asarray(b, dtype=np.int64) for b in batches],
                              torch.device(device))


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_plain_sgd_steps_as_torch_sgd_to_the_bit(weight_decay):
    from fedadapt.federation.client.training import PlainSGD

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(5, 4)), torch.nn.Parameter(torch.randn(4)),
           torch.nn.Parameter(torch.randn(3))]  # the last one never gets a gradient
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    opts = [torch.optim.SGD(ref, lr=0.07, momentum=0.0, weight_decay=weight_decay),
            PlainSGD(ours, 0.07, weight_decay)]
    for step in range(4):
        x = torch.randn(6, 5)
        for params, opt in zip((ref, ours), opts):
            opt.zero_grad(set_to_none=True)
            ((x @ params[0] + params[1]).square().mean() * (step + 1)).backward()
            opt.step()
            assert params[2].grad is None
    for a, b in zip(ref, ours):
        assert torch.equal(a, b)


def test_train_local_equals_torch_sgd_and_a_running_float64_total():
    """The client's loop with torch's SGD and the loss summed step by step in a float64
    tensor, as it was written before: the same weights and the same mean loss, bit for bit."""
    from fedadapt.adapters import AdaptedModel
    from fedadapt.config import TrainConfig
    from fedadapt.devices import seed_torch
    from fedadapt.federation.client.training import local_optimizer, local_schedule, train_local

    source, indices = _Features(), np.arange(3, 37)
    train = TrainConfig(lr=0.1, momentum=0.0, batch_size=8, local_epochs=2)
    torch.manual_seed(1)
    model = AdaptedModel(head=torch.nn.Linear(6, 3))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss, seen = train_local(model, source, indices, train, lr=train.lr, seed=11,
                             precision="fp32")

    ref = AdaptedModel(head=torch.nn.Linear(6, 3))
    ref.load_tensors(start)
    opt = torch.optim.SGD(list(ref.parameters()), lr=train.lr, momentum=0.0)
    batches, _ = local_schedule(indices, train, 11, None)
    seed_torch(11, torch.device("cpu"))
    total, n = torch.zeros((), dtype=torch.float64), 0
    for x, y in source.stream(batches, "cpu"):
        step_loss = torch.nn.functional.cross_entropy(ref(x), y)
        opt.zero_grad(set_to_none=True)
        step_loss.backward()
        opt.step()
        total += step_loss.detach().double() * len(y)
        n += len(y)
    assert (loss, seen) == (float(total) / n, n) and seen == 2 * len(indices)
    for name, p in ref.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[name])
    assert type(local_optimizer(list(model.parameters()), train, 0.1)).__name__ == "PlainSGD"
    with_momentum = TrainConfig(momentum=0.9)
    assert isinstance(local_optimizer(list(model.parameters()), with_momentum, 0.1),
                      torch.optim.SGD)


@pytest.mark.parametrize("chunk_bytes", [1 << 20, 6 * 4 * 10, 1])
def test_features_read_in_chunks_equal_a_gather_per_batch(monkeypatch, chunk_bytes):
    """One gather for consecutive batches (up to ``FEATURE_CHUNK_BYTES``; a batch larger than
    a chunk is read alone) gives each batch's rows as a gather of its own would."""
    import fedadapt.data.sources as sources

    monkeypatch.setattr(sources, "FEATURE_CHUNK_BYTES", chunk_bytes)
    source = _Features()
    rng = np.random.default_rng(3)
    batches = [rng.permutation(40)[:k] for k in (8, 8, 5, 13, 1, 8)]
    got = list(source.stream(batches, "cpu"))
    assert len(got) == len(batches)
    for (x, y), idx in zip(got, batches):
        assert torch.equal(x, torch.from_numpy(source.features()[idx]))
        assert torch.equal(y, torch.from_numpy(source.labels()[idx]))


# -- the server's side ------------------------------------------------------------------------

def _reply(tensors: dict, examples: int, loss: float):
    from flwr.app import ArrayRecord, MetricRecord, RecordDict

    arrays = ArrayRecord()
    for name, value in tensors.items():
        arrays[name] = to_array(value)
    return RecordDict({"arrays": arrays, "metrics": MetricRecord(
        {"num-examples": examples, "train_loss": loss})})


def test_the_per_tensor_average_equals_the_float64_torch_formula():
    """Accumulated in place in numpy: the same float64 products and sums, in the same order,
    as ``sum(float64(x) * w) / sum(w)`` in torch; a 0-d tensor, and a tensor one client did
    not send, included."""
    from flwr.app import ArrayRecord

    from fedadapt.strategies.fedavg import average_by_tensor

    torch.manual_seed(2)
    current = {"w": torch.randn(4, 3), "s": torch.tensor(0.5), "b": torch.randn(3)}
    sent = [{n: torch.randn_like(t) for n, t in current.items()} for _ in range(3)]
    del sent[1]["b"]
    examples = [7, 12, 5]
    out = average_by_tensor(ArrayRecord({n: to_array(t) for n, t in current.items()}),
                            [_reply(s, e, 0.0) for s, e in zip(sent, examples)],
                            "num-examples")
    for name in current:
        acc, total = None, 0.0
        for s, e in zip(sent, examples):
            if name in s:
                term = s[name].double() * float(e)
                acc, total = (term if acc is None else acc + term), total + float(e)
        expected = (acc / total).float()
        assert torch.equal(torch.from_numpy(as_numpy(out[name]).copy()), expected), name


def test_records_read_without_the_typed_views_equal_them():
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    from fedadapt.codec import record

    content = RecordDict({"config": ConfigRecord({"a": 1}), "m2": MetricRecord({"x": 1.0}),
                          "arrays": ArrayRecord(), "metrics": MetricRecord({"y": 2.0})})
    assert record(content, MetricRecord) is next(iter(content.metric_records.values()))
    assert record(content, ArrayRecord) is content.array_records["arrays"]
    assert record(content, ConfigRecord, "config") is content.config_records["config"]
    assert record(content, MetricRecord, "metrics") is content.metric_records["metrics"]
    assert record(content, MetricRecord, "config") is None  # a record of another kind
    assert record(content, ConfigRecord, "missing") is None
    assert record(RecordDict(), ArrayRecord) is None


def test_the_in_process_transport_copies_every_record_and_shares_the_arrays(flower_task):
    from flwr.app import Message

    from fedadapt.federation.simulation.inprocess import transport_copy

    msg = Message(_reply({"w": torch.randn(2, 3)}, 4, 0.25), dst_node_id=3,
                  message_type="train")
    copy = transport_copy(msg)
    assert copy is not msg and copy.content is not msg.content
    for name in ("arrays", "metrics"):
        assert copy.content[name] is not msg.content[name]
    assert copy.content["arrays"]["w"] is msg.content["arrays"]["w"]  # strings, shape, bytes
    copy.content["metrics"]["num-examples"] = 99
    del copy.content["arrays"]["w"]
    assert msg.content["metrics"]["num-examples"] == 4 and "w" in msg.content["arrays"]
    assert copy.metadata.dst_node_id == msg.metadata.dst_node_id


def test_numpys_stream_held_over_the_rounds_draws_what_it_draws_unheld():
    """Inside ``held()`` the hooks draw the same numbers as without it, whatever is drawn from
    numpy's global generator between them; the process's state is back after it."""
    from fedadapt.strategies.state import SeededStreams

    def hooks(streams, between):
        out = []
        for _ in range(3):
            with streams.use("train"):
                out.append(np.random.normal(size=2))
            between()
        return np.concatenate(out)

    np.random.seed(5)
    unheld = hooks(SeededStreams(9), lambda: None)
    held_streams = SeededStreams(9)
    np.random.seed(5)
    outer = np.random.get_state()
    with held_streams.held():
        held = hooks(held_streams, lambda: np.random.random(7))  # moves the global state
    assert np.array_equal(unheld, held)
    after = np.random.get_state()
    assert np.array_equal(after[1], outer[1]) and after[2] == outer[2]
    reference = SeededStreams(9)
    hooks(reference, lambda: None)
    assert held_streams.state_dict() == reference.state_dict()


def test_a_worker_replies_without_sleeping_when_no_reply_is_due(monkeypatch):
    from flwr.app import ConfigRecord, RecordDict

    import fedadapt.federation.client.worker as worker
    from fedadapt.federation.wire import records

    slept = []
    monkeypatch.setattr(worker.time, "sleep", slept.append)
    deadline = worker.Deadline(RecordDict({records.GRID: ConfigRecord({records.TIMEOUT: 0.0})}))
    assert deadline.in_time(None)
    deadline.wait()
    assert slept == []  # time.sleep(0) still gives up the CPU
    deadline.due = 60.0
    deadline.wait()
    assert len(slept) == 1 and 0 < slept[0] <= 60.0


@pytest.mark.parametrize("fails", [False, True])
def test_the_rounds_leave_the_collector_as_they_found_it(monkeypatch, fails):
    """What the process holds is frozen while the rounds run (the collector's full scans skip
    it) and collectable again after them, a failed round included."""
    import gc
    from types import SimpleNamespace

    import fedadapt.federation.server.loop as server
    from fedadapt.strategies.state import SeededStreams

    frozen = []

    def round_(grid, state, plan, rnd, config):
        frozen.append(gc.get_freeze_count())
        if fails:
            raise RuntimeError("round failed")
        return {"round": rnd}, 0, 0

    monkeypatch.setattr(server, "_train_round", round_)
    monkeypatch.setattr(server, "_evaluate_round", lambda *a, **k: 0)
    monkeypatch.setattr(server, "_close_round", lambda *a, **k: None)
    state = SimpleNamespace(server_round=0, num_rounds=2, history=[None], checkpoint_round=0,
                            streams=SeededStreams(0))
    plan = SimpleNamespace(eval_round0=False, eval_every=10, lr_at=lambda rnd: 0.1)
    before = gc.get_freeze_count()
    if fails:
        with pytest.raises(RuntimeError, match="round failed"):
            server.run_round_loop(None, state, plan)
    else:
        server.run_round_loop(None, state, plan)
    assert frozen and all(n > before for n in frozen)
    assert gc.get_freeze_count() == 0
