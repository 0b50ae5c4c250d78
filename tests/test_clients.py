"""What a client sends: only communicated trainable tensors, by name; personal ones stay."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import tiny_run
from fedadapt.clients.app import PERSONAL_KEY, make_client_app
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedadapt.adapters import AdaptedModel, register_method
from fedadapt.adapters.heads import FinetuneConfig, LinearHeadConfig, LocalOnlyConfig
from fedadapt.config import MethodConfig
from fedadapt.experiment import prepare_run


def call(app, prep, kind, context, arrays):
    content = RecordDict({"arrays": ArrayRecord(arrays),
                          "config": ConfigRecord({"server-round": 1, "lr": 0.05})})
    msg = Message(content=content, dst_node_id=1,
                  message_type=MessageType.TRAIN if kind == "train" else MessageType.EVALUATE)
    return app(msg, context)


def context(pid: int) -> Context:
    return Context(run_id=1, node_id=1, node_config={"partition-id": pid, "num-partitions": 3},
                   state=RecordDict(), run_config={})


@pytest.mark.parametrize("method", [LinearHeadConfig(), FinetuneConfig()])
def test_reply_holds_exactly_the_communicated_tensors(method, cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, method), quiet=True)
    model = prep.model
    app = make_client_app(lambda ctx: prep.spec)
    ctx = context(0)
    sent = model.tensors(model.communicated_names())
    out = call(app, prep, "train", ctx, sent)
    got = out.content.array_records["arrays"].to_torch_state_dict()
    assert sorted(got) == sorted(model.communicated_names()) == sorted(model.trainable_names())
    if method.name == "linear_head":
        assert sorted(got) == ["head.bias", "head.weight"]  # the frozen backbone never travels
    else:
        assert any(k.startswith("backbone.") for k in got)
    assert any(not torch.equal(got[k], sent[k]) for k in got)  # it trained
    assert out.content.metric_records["metrics"]["num-examples"] == len(prep.spec.clients[0].train)
    assert PERSONAL_KEY not in ctx.state.array_records


def test_personal_tensors_stay_in_context_state(cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, LocalOnlyConfig()), quiet=True)
    assert prep.model.communicated_names() == []
    app = make_client_app(lambda ctx: prep.spec)
    ctx = context(1)
    out = call(app, prep, "train", ctx, {})
    assert len(out.content.array_records["arrays"]) == 0  # nothing leaves the client
    personal = ctx.state.array_records[PERSONAL_KEY].to_torch_state_dict()
    assert sorted(personal) == ["head.bias", "head.weight"]
    # the next visit starts from the personal state, and evaluation uses it
    out2 = call(app, prep, "train", ctx, {})
    again = ctx.state.array_records[PERSONAL_KEY].to_torch_state_dict()
    assert not torch.equal(again["head.weight"], personal["head.weight"])
    assert len(out2.content.array_records["arrays"]) == 0
    ev = call(app, prep, "evaluate", ctx, {})
    assert 0.0 <= ev.content.metric_records["metrics"]["accuracy"] <= 1.0


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
    for _ in range(2):
        out = call(app, prep, "train", ctx, prep.model.tensors(["head.weight"]))
        assert list(out.content.array_records["arrays"].keys()) == ["head.weight"]
        assert list(ctx.state.array_records[PERSONAL_KEY].keys()) == ["head.bias"]


def test_wrong_tensors_from_server_are_refused(cache_dir, flower_task):
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    app = make_client_app(lambda ctx: prep.spec)
    with pytest.raises(ValueError, match="expected"):
        call(app, prep, "train", context(0), {"other": torch.zeros(2)})


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

    from fedadapt.federation import training

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
