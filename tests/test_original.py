"""The papers' backbones and the original model (issue 17, item 12): LEAF's FEMNIST CNN,
EfficientNet-B0 through timm, and the server-side phase that trains a backbone with its
classifier on the training clients' pooled data before its features are cached; the same
original model serves ICIIA, DUET and CDC-MMPG."""

import dataclasses

import numpy as np
import pytest
import torch
from conftest import tiny_run

from fedadapt.assets import MissingAssetError
from fedadapt.backbones import build_backbone
from fedadapt.config import (
    BackboneConfig,
    ConfigError,
    OriginalConfig,
    PartitionConfig,
    validate,
)
from fedadapt.experiment import prepare_run
from fedadapt.methods.plugin.iciia import IciiaConfig
from fedadapt.methods.sessions.duet import DuetConfig

LEAF = BackboneConfig(name="leaf_cnn", family="leaf_cnn", image_size=28, crop_pct=1.0,
                      interpolation="bilinear", arch={"hidden": 2048})
B0 = BackboneConfig(name="efficientnet_b0", family="timm", weights="pretrained", image_size=224,
                    crop_pct=1.0, interpolation="bicubic", arch={"model": "efficientnet_b0"})


def test_leaf_cnn_is_leafs_femnist_model_without_its_output_layer():
    """Two 5x5 convolutions (32, 64 channels, 'same' padding, 2x2 max pooling each), a 2,048-unit
    ReLU layer on the 7x7x64 map: 6,476,672 parameters; with LEAF's 62-way output layer the whole
    CNN would be 6,603,710. Grey inputs: the three channels are averaged."""
    b = build_backbone(LEAF)
    assert b.embed_dim == 2048 and b.num_params() == 6_476_672
    assert b.num_params() + 2048 * 62 + 62 == 6_603_710
    convs = [m for m in b.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.padding) for c in convs] == [
        (1, 32, (5, 5), (2, 2)), (32, 64, (5, 5), (2, 2))]
    grey = torch.rand(2, 1, 28, 28)
    feats = b(grey.expand(2, 3, 28, 28))
    assert feats.shape == (2, 2048) and (feats >= 0).all()  # after the ReLU
    torch.testing.assert_close(b(grey.expand(2, 3, 28, 28)), b.features(grey))
    assert b.mean == (0.5,) * 3 and b.std == (1.0,) * 3  # x - 0.5, as the ICIIA authors
    with pytest.raises(ConfigError, match="backbone.image_size=30"):
        build_backbone(dataclasses.replace(LEAF, image_size=30))


def test_efficientnet_b0_through_timm(tmp_path):
    """timm's efficientnet_b0 without its classifier (D = 1,280, 4,007,548 parameters); offline
    its ImageNet weights fail with one line naming the fetch command; a state-dict file (what
    the original-model phase writes) loads back exactly."""
    b = build_backbone(B0, load_weights=False)
    assert b.embed_dim == 1280 and b.num_params() == 4_007_548
    assert (b.crop_pct, b.interpolation, b.mean) == (1.0, "bicubic", (0.485, 0.456, 0.406))
    with pytest.raises(MissingAssetError, match="fedadapt-prefetch backbone=efficientnet_b0"):
        build_backbone(B0)
    from safetensors.torch import save_file

    with torch.no_grad():  # distinct weights, so the round trip proves something
        for p in b.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_file({k: v.contiguous() for k, v in b.weights_state().items()},
              str(tmp_path / "b0.safetensors"))
    again = build_backbone(dataclasses.replace(B0, weights=str(tmp_path / "b0.safetensors")))
    x = torch.randn(1, 3, 64, 64)
    torch.testing.assert_close(again(x), b(x))
    assert again.weights_id.startswith("efficientnet_b0:")


def phase_run(cache_dir, method, **original):
    cfg = tiny_run(cache_dir, method, partition=PartitionConfig(
        kind="dirichlet", num_clients=4, alpha=0.5, min_partition_size=20, val_fraction=0.2,
        test_fraction=0.2, test_clients=0.25))
    cfg.backbone = dataclasses.replace(LEAF, arch={"hidden": 64})
    cfg.original = OriginalConfig(train_backbone=True, **{
        **dict(lr=0.05, momentum=0.9, max_epochs=4, patience=4), **original})
    return validate(cfg)


ICIIA = IciiaConfig(images=4, min_history=1, max_epochs=1, patience=1, finetune_epochs=1,
                    prompt_tuning=False, layers=1)


def test_original_model_phase_trains_the_backbone_on_the_training_clients(cache_dir,
                                                                          monkeypatch):
    """LEAF's CNN from scratch on the training clients' pooled digits: the phase learns (a later
    epoch beats the random start on validation), uses only the training rows (the unseen test
    client adds nothing), saves the backbone that the run then builds and caches features of,
    and hands its classifier to the methods as the original model; a second run reuses it."""
    from fedadapt.federation.server import original as phase
    from fedadapt.methods.plugin.train import train_on_server

    prep = prepare_run(phase_run(cache_dir, ICIIA), quiet=True)
    spec = prep.spec
    weights = spec.backbone.weights
    assert weights.endswith("backbone.safetensors") and "/original/leaf_cnn-digits-" in weights
    import json
    from pathlib import Path

    info = json.loads((Path(weights).parent / phase.INFO).read_text())
    assert info["train_images"] == sum(len(c.train) for c in spec.clients)
    assert info["val_images"] == sum(len(c.val) for c in spec.clients)
    assert sum(len(c.train) == 0 for c in spec.clients) == 1  # the unseen test client
    assert info["best_epoch"] > 0 and info["best_val_acc"] > info["curve"][0]["val_acc"]

    trained, untrained = build_backbone(spec.backbone), build_backbone(
        dataclasses.replace(LEAF, arch={"hidden": 64}))
    assert not torch.allclose(trained.features[0].weight, untrained.features[0].weight)

    original = train_on_server(spec)["original"]
    for k, v in original.state_dict().items():
        torch.testing.assert_close(v, spec.family.original_classifier[k])
    assert train_on_server(spec)["log"]["original"]["trained_with_backbone"]

    def no_training(*args, **kwargs):
        raise AssertionError("the phase ran again")

    monkeypatch.setattr(phase, "train", no_training)
    again = prepare_run(phase_run(cache_dir, dataclasses.replace(ICIIA, groups=4)), quiet=True)
    assert again.spec.backbone.weights == weights  # every method of a job shares it


def test_the_same_original_model_serves_the_session_plugins(cache_dir):
    """DUET gets the phase's backbone (its cached features, and the server's forward on uploaded
    samples) and classifier, the very ones ICIIA gets."""
    from fedadapt.methods.sessions.train import SessionServer, train_generator

    duet = DuetConfig(session=4, generators=2, max_epochs=1, patience=1, finetune_steps=1,
                      upload="samples")
    prep = prepare_run(phase_run(cache_dir, duet), quiet=True)
    iciia = prepare_run(phase_run(cache_dir, ICIIA), quiet=True)
    spec = prep.spec
    assert spec.backbone.weights == iciia.spec.backbone.weights
    trained = train_generator(spec)
    for k, v in trained["original"].state_dict().items():
        torch.testing.assert_close(v, spec.family.original_classifier[k])
    rows = np.arange(8)
    cached, _ = spec.train_source.get(rows)
    images, _ = spec.family.image_source.get(rows)
    server = SessionServer(spec, trained)
    with torch.no_grad():
        torch.testing.assert_close(server.embed(images), cached, atol=1e-4, rtol=1e-4)


def test_the_phase_refuses_what_it_cannot_do(cache_dir):
    from fedadapt.adapters.heads import LinearHeadConfig

    cfg = phase_run(cache_dir, LinearHeadConfig())
    cfg.partition.test_clients = 0.0
    with pytest.raises(ConfigError, match="original.train_backbone=true is invalid for method"):
        prepare_run(cfg, quiet=True)
    cfg = phase_run(cache_dir, ICIIA)
    cfg.backbone = BackboneConfig(name="tiny_vit", family="vit", image_size=32, arch=dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        patch_size=8, image_size=32))
    with pytest.raises(ConfigError, match="backbone=tiny_vit"):
        prepare_run(cfg, quiet=True)
    with pytest.raises(ConfigError, match="original.lr"):
        validate(phase_run(cache_dir, ICIIA, lr=0.0))
