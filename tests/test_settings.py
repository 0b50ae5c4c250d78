"""The Accumulator paper's settings: which exit trains, what is evaluated, personalization."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import tiny_run
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict

from fedadapt.adapters.exits import AccumulatorConfig, LwLinearConfig
from fedadapt.clients.app import make_client_app
from fedadapt.config import BackboneConfig, ConfigError, SettingConfig, validate
from fedadapt.devices import autocast
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.client.training import evaluate_exits, train_local
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.federation.wire import records
from fedadapt.results.store import read_jsonl
from fedadapt.settings import assign_tiers, client_tiers, only_training, part_names

TINY_VIT = BackboneConfig(name="tiny_vit", family="vit", image_size=32, arch=dict(
    patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    intermediate_size=64))


def vit_run(cache_dir, method, setting: SettingConfig, **kw):
    cfg = tiny_run(cache_dir, method, **kw)
    cfg.backbone = TINY_VIT
    cfg.setting = setting
    return validate(cfg)


def lw_multitier(cache_dir):
    """Layer-wise linear heads on the tiny ViT, multi-tier, prepared (no federation)."""
    return prepare_run(vit_run(cache_dir, LwLinearConfig(), SettingConfig(name="multitier")),
                       quiet=True)


def test_tiers_are_balanced_seeded_and_checked():
    tiers = assign_tiers(10, [0, 5, 11], seed=3)
    assert sorted(np.bincount(tiers, minlength=12)[[0, 5, 11]]) == [3, 3, 4]
    assert tiers == assign_tiers(10, [0, 5, 11], seed=3) != assign_tiers(10, [0, 5, 11], seed=4)
    every = client_tiers(SettingConfig(name="multitier"), 24, 12, seed=0)
    assert np.bincount(every).tolist() == [2] * 12
    assert client_tiers(SettingConfig(name="anytime"), 4, 12, seed=0) == []  # no tiers
    with pytest.raises(ConfigError, match="setting.tiers"):
        client_tiers(SettingConfig(name="multitier", tiers=[3, 12]), 4, 12, seed=0)


def _heads_changed(before, model):
    after = model.tensors(model.trainable_names())
    return sorted({n.split(".")[2] for n in after if not torch.equal(before[n], after[n])})


def test_a_tier_trains_only_its_exit_and_anytime_trains_several(cache_dir):
    prep = lw_multitier(cache_dir)
    model, spec = prep.model, prep.spec
    idx = spec.clients[0].train
    start = model.tensors(model.trainable_names())
    train_local(model, spec.train_source, idx, spec.train, lr=0.1, seed=1, exits=[1],
                precision=spec.precision)
    assert _heads_changed(start, model) == ["1"]  # head of exit 1 only (lw heads: head.heads.i)
    model.load_tensors(start)
    train_local(model, spec.train_source, idx, spec.train, lr=0.1, seed=1,
                exits=[0, 1, 2], precision=spec.precision)  # anytime: each step draws an exit
    assert len(_heads_changed(start, model)) >= 2


def test_evaluate_exits_matches_each_exit_alone(cache_dir):
    prep = prepare_run(vit_run(cache_dir, AccumulatorConfig(head_hidden=[16]),
                               SettingConfig(name="anytime")), quiet=True)
    model, src = prep.model, prep.spec.test_source
    idx = np.arange(40)
    _, accs, n = evaluate_exits(model, src, [0, 1, 2], idx, precision=prep.spec.precision)
    assert n == 40 and len(accs) == 3
    dev = next(model.parameters()).device
    x, y = src.get(idx, dev)  # on the model's device (CPU or GPU), in the run's precision
    with torch.no_grad(), autocast(dev.type, prep.spec.precision):
        for e in range(3):
            alone = model.exit_logits(x, last_exit=e, all_exits=False)[-1]
            assert accs[e] == pytest.approx(float((alone.argmax(1) == y).float().mean()))


def test_personalization_parts(cache_dir):
    prep = prepare_run(vit_run(cache_dir, AccumulatorConfig(head_hidden=[16],
                                                            parallel_adapter=True,
                                                            adapter_bottleneck=4),
                               SettingConfig(name="multitier")), quiet=True)
    model = prep.model
    assert part_names(model, "client_token") == ["head.client_token"]
    assert all(".adapter." in n for n in part_names(model, "adapters"))
    acc = part_names(model, "accumulator")
    assert "head.layer_embed" in acc and not any(".adapter." in n for n in acc)
    full = part_names(model, "full")
    assert any(n.startswith("backbone.model.embeddings") for n in full)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with only_training(model, ["head.client_token"]):
        assert [n for n, p in model.named_parameters() if p.requires_grad] == [
            "head.client_token"]
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    lw = lw_multitier(cache_dir).model
    with pytest.raises(ConfigError, match="setting.personalize='client_token'"):
        part_names(lw, "client_token")


def test_accumulator_presets_train_on_all_client_data_and_keep_the_personal_split():
    """Accumulator paper: the global test set evaluates, so FL clients train on all their data;
    personalization holds out 10,000 of CIFAR-100's 50,000 training images (20% of every client),
    half to fine-tune on and half to test."""
    from fedadapt.data.partition import ClientSplit
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.settings import personal_indices

    for name in ("acc_conventional", "acc_anytime", "acc_multitier", "acc_ablation",
                 "acc_communication", "acc_femnist_multitier", "acc_offline"):
        p = to_run_config(compose_config([f"experiment={name}"])).partition
        assert (p.val_fraction, p.test_fraction, p.fraction_evaluate) == (0, 0, 0), name
    run = to_run_config(compose_config(["experiment=acc_personalization"]))
    p, st = run.partition, run.setting
    assert (p.val_fraction, p.test_fraction, st.personal_split) == (0.1, 0.1, "val")
    assert 50_000 * (p.val_fraction + p.test_fraction) == 10_000
    split = ClientSplit(train=np.arange(8), val=np.arange(8, 9), test=np.arange(9, 10))
    fit, test = personal_indices(st, split)
    assert fit.tolist() == [8] and test.tolist() == [9]  # never the FL training data
    fit, _ = personal_indices(SettingConfig(name="personalization"), split)
    assert fit.tolist() == list(range(8))  # FedCLIP's local fine-tuning: its own training data
    with pytest.raises(ConfigError, match="setting.personal_split='val'.*val_fraction"):
        to_run_config(compose_config(["experiment=acc_personalization",
                                      "partition.val_fraction=0"]))


def test_settings_with_exits_need_an_exit_method(cache_dir):
    from fedadapt.adapters.heads import LinearHeadConfig

    with pytest.raises(ConfigError, match="setting=anytime needs a method with early exits"):
        prepare_run(tiny_run(cache_dir, LinearHeadConfig(),
                             setting=SettingConfig(name="anytime")), quiet=True)


def test_personalization_reply_carries_no_tensors(cache_dir, flower_task, tmp_path):
    cfg = vit_run(cache_dir, AccumulatorConfig(head_hidden=[16]),
                  SettingConfig(name="personalization", personalize="client_token", epochs=2))
    prep = prepare_run(cfg, quiet=True)
    spec = prep.spec
    spec.state_dir = str(tmp_path / "clients")
    model = prep.model
    app = make_client_app(lambda ctx: spec)
    sent = model.tensors(model.communicated_names())
    msg = Message(RecordDict({"arrays": ArrayRecord(sent), "config": ConfigRecord(
        {"phase": "personalize", "server-round": 3}),
        records.GRID: ConfigRecord({"clients": [1]})}), dst_node_id=1,
        message_type=MessageType.TRAIN)
    ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 1, "num-partitions": 3},
                  state=RecordDict(), run_config={})
    out = app(msg, ctx).content
    assert len(out.array_records) == 0  # the personalized token never leaves
    m = out.metric_records["c1/metrics"]
    assert m["tier"] == spec.client_exits[1] and m["personalized_params"] == 32
    saved = list((tmp_path / "clients" / "1" / "personalized").glob("*.safetensors"))
    assert len(saved) == 1


def test_corrupted_source_is_deterministic_and_changes_images(cache_dir):
    prep = lw_multitier(cache_dir)
    src = prep.spec.train_source
    idx = np.arange(6)
    clean, _ = src.get(idx)
    noisy = src.corrupted("gaussian_noise", 5, seed=7)
    a, _ = noisy.get(idx)
    b, _ = noisy.get(idx)
    assert torch.equal(a, b) and not torch.equal(a, clean)
    assert torch.equal(src.corrupted("contrast", 0, seed=7).get(idx)[0], clean)


def test_random_resized_crop_is_seeded_and_validated(cache_dir):
    prep = lw_multitier(cache_dir)
    src = prep.spec.train_source
    idx = np.arange(6)
    clean, _ = src.get(idx)

    def cropped(seed):
        return src.get(idx, crop=((0.05, 1.0), np.full(len(idx), seed, np.uint64)))[0]

    a = cropped(1)
    assert a.shape == clean.shape and not torch.equal(a, clean)
    assert torch.equal(a, cropped(1)) and not torch.equal(a, cropped(2))
    cfg = vit_run(cache_dir, LwLinearConfig(), SettingConfig())
    cfg.train.crop_scale = [0.5, 0.2]
    with pytest.raises(ConfigError, match="train.crop_scale"):
        validate(cfg)


@pytest.mark.slow
def test_multitier_and_personalization_runs_end_to_end(cache_dir, tmp_path):
    cfg = vit_run(cache_dir, AccumulatorConfig(head_hidden=[16]),
                  SettingConfig(name="multitier", tiers=[0, 2]))
    cfg.train.crop_scale = [0.05, 1.0]  # the paper's training augmentation, on the clients
    summary = run_experiment(cfg, tmp_path / "mt", config_yaml="mt\n", execute=run_in_process)
    final = summary["final"]
    assert len(final["exit_acc"]) == 3
    assert final["global_acc"] == pytest.approx(sum(final["exit_acc"]) / 3)
    assert sorted(final["tier_acc"]) == ["0", "2"] and summary["tiers"] == {"0": 2, "2": 1}
    assert "exit_acc" in read_jsonl(tmp_path / "mt" / "metrics.jsonl")[-1]
    # personalization from that run's final model: no FL rounds, every client personalizes
    cfg2 = replace(cfg, setting=SettingConfig(name="personalization", tiers=[0, 2],
                                              personalize="accumulator", epochs=1,
                                              init_from=str(tmp_path / "mt")))
    s2 = run_experiment(validate(cfg2), tmp_path / "pers", config_yaml="p\n",
                        execute=run_in_process)
    p = s2["personalization"]
    assert p["clients"] == 3 and p["part"] == "accumulator"
    assert p["gain"] == pytest.approx(p["after"] - p["before"])
    rows = json.loads((tmp_path / "pers" / "personalization.json").read_text())
    assert sorted(r["client"] for r in rows) == [0, 1, 2]
    assert {r["corruption"] for r in rows} <= set(SettingConfig().corruptions)
    # a checkpoint of another model is refused before anything is written
    bad = replace(cfg2, method=AccumulatorConfig(head_hidden=[8]))
    with pytest.raises(Exception, match="another model's tensors"):
        run_experiment(validate(bad), tmp_path / "bad", config_yaml="b\n")
    assert not (tmp_path / "bad").exists()
