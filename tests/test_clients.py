"""What a client sends: only communicated trainable tensors, by name; personal ones stay."""

import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import accuracy_of, tiny_run
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedadapt.adapters import AdaptedModel, register_method
from fedadapt.adapters.heads import FinetuneConfig, LinearHeadConfig, LocalOnlyConfig
from fedadapt.clients.app import make_client_app
from fedadapt.config import MethodConfig
from fedadapt.experiment import prepare_run
from fedadapt.federation.wire import records
from fedadapt.methods.rounds.clients import PERSONAL_KEY


def call(app, prep, kind, context, arrays, clients=(0,), group=1, rnd=1):
    """A message to a node naming ``clients``; returns ``{client: its reply records}``."""
    content = RecordDict({"arrays": ArrayRecord(arrays), "config": ConfigRecord(
        {"server-round": rnd, "lr": 0.05}), records.GRID: ConfigRecord(
        {"clients": list(clients), "group-size": group})})
    msg = Message(content=content, dst_node_id=1,
                  message_type=MessageType.TRAIN if kind == "train" else MessageType.EVALUATE)
    return records.unpack(app(msg, context).content)


def context(cid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": cid, "num-partitions": 3},
                   state=RecordDict(), run_config={})


@pytest.mark.parametrize("method", [LinearHeadConfig(), FinetuneConfig()])
def test_reply_holds_exactly_the_communicated_tensors(method, cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, method), quiet=True)
    model = prep.model
    app = make_client_app(lambda ctx: prep.spec)
    ctx = context(0)
    sent = model.tensors(model.communicated_names())
    out = call(app, prep, "train", ctx, sent)[0]
    got = out.array_records["arrays"].to_torch_state_dict()
    assert sorted(got) == sorted(model.communicated_names()) == sorted(model.trainable_names())
    if method.name == "linear_head":
        assert sorted(got) == ["head.bias", "head.weight"]  # the frozen backbone never travels
    else:
        assert any(k.startswith("backbone.") for k in got)
    assert any(not torch.equal(got[k], sent[k]) for k in got)  # it trained
    assert out.metric_records["metrics"]["num-examples"] == len(prep.spec.clients[0].train)
    assert PERSONAL_KEY not in ctx.state.array_records


def test_a_worker_trains_its_clients_side_by_side_and_alone_alike(cache_dir, flower_task,
                                                                 monkeypatch):
    """One message names three clients: each gets its own records; grouping (K = 3) gives
    what one after another (K = 1) gives, to floating-point tolerance, and the grouped call
    trains no client alone (a silent fallback to one at a time would pass the comparison)."""
    from fedadapt.federation.client import worker

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    app = make_client_app(lambda ctx: prep.spec)
    sent = prep.model.tensors(prep.model.communicated_names())
    alone = call(app, prep, "train", context(0), sent, clients=(0, 1, 2), group=1)

    def not_alone(*a, **kw):
        raise AssertionError("a grouped client was trained alone")
    monkeypatch.setattr(worker, "train_local", not_alone)
    grouped = call(app, prep, "train", context(0), sent, clients=(0, 1, 2), group=3)
    assert sorted(alone) == sorted(grouped) == [0, 1, 2]
    for cid in range(3):
        a = alone[cid].array_records["arrays"].to_torch_state_dict()
        g = grouped[cid].array_records["arrays"].to_torch_state_dict()
        for name in a:
            torch.testing.assert_close(g[name], a[name], atol=1e-5, rtol=1e-4)
        assert (grouped[cid].metric_records["metrics"]["num-examples"]
                == len(prep.spec.clients[cid].train))


def test_a_group_that_fails_side_by_side_retries_alone_with_its_cause(cache_dir, flower_task,
                                                                      monkeypatch):
    """A fault inside the grouped step of one group (clients 0 and 1 of groups {0, 1}, {2}):
    only that group's clients are retried one at a time, with one log line naming the cause;
    every client's result is what the unbroken worker gives."""
    from fedadapt.federation.client import worker

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    app = make_client_app(lambda ctx: prep.spec)
    sent = prep.model.tensors(prep.model.communicated_names())
    clean = call(app, prep, "train", context(0), sent, clients=(0, 1, 2), group=2)
    lines, alone = [], []
    real_group, real_local = worker.train_group, worker.train_local

    def broken_group(model, source, jobs, *a, **kw):
        if any(j.cid == 0 for j in jobs):
            raise RuntimeError("vmap: no batching rule for this op")
        return real_group(model, source, jobs, *a, **kw)

    def local(model, source, indices, *a, **kw):
        alone.append(next(c for c in range(3) if np.array_equal(
            prep.spec.clients[c].train, indices)))
        return real_local(model, source, indices, *a, **kw)
    monkeypatch.setattr(worker, "train_group", broken_group)
    monkeypatch.setattr(worker, "train_local", local)
    monkeypatch.setattr(worker, "log", lines.append)
    monkeypatch.setattr(worker, "_FALLBACK_CAUSES", set())
    out = call(app, prep, "train", context(0), sent, clients=(0, 1, 2), group=2)
    out_again = call(app, prep, "train", context(0), sent, clients=(0, 1, 2), group=2)
    assert sorted(alone) == [0, 0, 1, 1, 2, 2]  # group {0, 1} retried alone; {2} is one client
    assert lines == ["[worker] a group of 2 clients failed side by side (RuntimeError: vmap: no "
                     "batching rule for this op): training its clients one at a time (only this "
                     "group)"]  # once per cause
    for cid in range(3):
        want = clean[cid].array_records["arrays"].to_torch_state_dict()
        for got in (out, out_again):
            got = got[cid].array_records["arrays"].to_torch_state_dict()
            for name in want:
                torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)


def test_a_failing_client_fails_alone(cache_dir, flower_task):
    """An injected exception in one client of a group: it replies an error record, the others
    train."""
    from fedadapt.config import FaultConfig
    from fedadapt.federation.server.faults import injected_fault

    faults = FaultConfig(fraction=0.5, kinds=["raise"])
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig(), faults=faults), quiet=True)
    app = make_client_app(lambda ctx: prep.spec)
    sent = prep.model.tensors(prep.model.communicated_names())
    rnd = next(r for r in range(1, 50) if sorted(
        injected_fault(0, r, c, 0.5, ["raise"]) is None for c in range(3)) == [False, True, True])
    out = call(app, prep, "train", context(0), sent, clients=(0, 1, 2), group=3, rnd=rnd)
    failed = [c for c in range(3) if injected_fault(0, rnd, c, 0.5, ["raise"])]
    for cid in range(3):
        if cid in failed:
            assert "injected fault" in records.error_of(out[cid])
        else:
            assert "arrays" in out[cid].array_records


def test_personal_tensors_stay_in_context_state(cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, LocalOnlyConfig()), quiet=True)
    assert prep.model.communicated_names() == []
    app = make_client_app(lambda ctx: prep.spec)
    ctx = context(1)
    out = call(app, prep, "train", ctx, {}, clients=(1,))[1]
    assert len(out.array_records["arrays"]) == 0  # nothing leaves the client
    personal = ctx.state.array_records[PERSONAL_KEY].to_torch_state_dict()
    assert sorted(personal) == ["head.bias", "head.weight"]
    # the next visit starts from the personal state, and evaluation uses it
    out2 = call(app, prep, "train", ctx, {}, clients=(1,), rnd=2)[1]
    again = ctx.state.array_records[PERSONAL_KEY].to_torch_state_dict()
    assert not torch.equal(again["head.weight"], personal["head.weight"])
    assert len(out2.array_records["arrays"]) == 0
    ev = call(app, prep, "evaluate", ctx, {}, clients=(1,), rnd=2)[1]
    # the client's own head after its two visits, on its own test rows, recomputed here
    want = accuracy_of(prep, again, prep.spec.clients[1].test, prep.spec.train_source)
    assert ev.metric_records["metrics"]["accuracy"] == pytest.approx(want, rel=1e-6, abs=0)


def test_any_worker_continues_a_client_from_its_saved_state(cache_dir, flower_task, tmp_path):
    """In simulation a client's personal tensors live in its state folder: a client trained by
    one worker in round 1 continues in round 2 on another worker from exactly those."""
    from fedadapt.federation.server.checkpoint import load_client_state

    prep = prepare_run(tiny_run(cache_dir, LocalOnlyConfig()), quiet=True)
    prep.spec.state_dir = str(tmp_path / "clients")
    app = make_client_app(lambda ctx: prep.spec)
    call(app, prep, "train", context(0), {}, clients=(2,), rnd=1)
    after1 = load_client_state(tmp_path / "clients" / "2", 1)
    call(app, prep, "train", context(1), {}, clients=(2,), rnd=2)  # another worker
    from fedadapt.methods.rounds import clients

    clients._PERSONAL.clear()  # no per-process cache: read from the folder
    model = prep.model
    model.load_tensors(after1)
    from fedadapt.federation.client.training import derive_seed, train_local

    train_local(model, prep.spec.train_source, prep.spec.clients[2].train, prep.spec.train,
                lr=0.05, seed=derive_seed(0, 2, 2), crop_seed=derive_seed(0, 2, 2, 7),
                precision=prep.spec.precision)
    after2 = load_client_state(tmp_path / "clients" / "2", 2)
    for name, t in model.tensors(model.personal_names()).items():
        torch.testing.assert_close(after2[name], t)


@dataclass
class PersonalBiasConfig(MethodConfig):
    name: str = "test_personal_bias"


@register_method("test_personal_bias", PersonalBiasConfig)
def build_personal_bias(cfg, backbone, num_classes, with_backbone):
    """A linear head whose bias is personal: the pattern of a client token."""
    return AdaptedModel(head=torch.nn.Linear(backbone.embed_dim, num_classes),
                        personal=("head.bias",))


def test_personal_prefix_is_never_sent(cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, PersonalBiasConfig()), quiet=True)
    assert prep.model.communicated_names() == ["head.weight"]
    assert prep.model.personal_names() == ["head.bias"]
    app = make_client_app(lambda ctx: prep.spec)
    ctx = context(2)
    for rnd in (1, 2):
        out = call(app, prep, "train", ctx, prep.model.tensors(["head.weight"]), clients=(2,),
                   rnd=rnd)[2]
        assert list(out.array_records["arrays"].keys()) == ["head.weight"]
        assert list(ctx.state.array_records[PERSONAL_KEY].keys()) == ["head.bias"]


def test_wrong_tensors_from_server_are_refused(cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    app = make_client_app(lambda ctx: prep.spec)
    out = call(app, prep, "train", context(0), {"other": torch.zeros(2)})[0]
    assert "ValueError" in records.error_of(out) and "expected" in records.error_of(out)


def test_data_never_crosses_between_clients(cache_dir):
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    train_sets = [set(c.train) for c in prep.spec.clients]
    assert not any(a & b for i, a in enumerate(train_sets) for b in train_sets[i + 1:])
    assert np.all(np.concatenate([c.train for c in prep.spec.clients]) < prep.spec.train_source
                  .prepared.num_train)


def test_client_process_pins_its_torch_threads(cache_dir):
    """A client's process runs torch with ``federation.num_cpus`` threads, whatever
    OMP_NUM_THREADS says: CPU results depend on the thread count."""
    from dataclasses import replace

    from fedadapt.federation.client import training

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        training._MODELS.clear()
        training.cached_model(replace(prep.spec, run_id="pinned", client_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        training._MODELS.clear()
        torch.set_num_threads(before)


def test_a_message_s_shared_arrays_are_decoded_once_for_all_its_clients():
    """Clients of one worker message start from the same decoded global tensors (a whole CLIP
    is not decoded once per client); a client's own arrays (``c<id>/arrays``) are its own."""
    from fedadapt.methods.rounds.clients import arrays_decoder

    shared = {"w": torch.arange(6.0).reshape(2, 3)}
    content = RecordDict({"arrays": ArrayRecord(shared),
                          records.key(2, "arrays"): ArrayRecord({"w": torch.zeros(2, 3)})})
    received = arrays_decoder()
    first, second, own = (received(records.view(content, c)) for c in (0, 1, 2))
    assert first is second and torch.equal(first["w"], shared["w"])
    assert torch.equal(own["w"], torch.zeros(2, 3))


@pytest.mark.slow  # a fresh Python process: torch._dynamo must not be imported already
@pytest.mark.parametrize("momentum,imported", [(0.0, False), (0.9, True)])
def test_the_warm_up_imports_torch_dynamo_only_for_an_optimizer_that_needs_it(
        cache_dir, momentum, imported):
    """The handshake's warm-up steps the client's own optimizer: plain SGD (PlainSGD) never
    touches ``torch.optim``, whose first use imports ``torch._dynamo`` (about 2 s of start-up);
    SGD with momentum is torch's and is warmed up, import included."""
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    code = f"""
import sys
sys.path.insert(0, {tests!r})
from conftest import tiny_run
from fedadapt.adapters.heads import LinearHeadConfig
from fedadapt.clients.app import warm_up
from fedadapt.experiment import prepare_run
cfg = tiny_run({cache_dir!r}, LinearHeadConfig())
cfg.train.momentum = {momentum}
warm_up(prepare_run(cfg, quiet=True).spec)
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(imported)
