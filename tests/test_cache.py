"""The feature cache: exact keys, reuse, and the same training result as the live backbone."""

import os

import numpy as np
import torch
from conftest import tiny_run

from fedadapt.adapters.heads import LinearHeadConfig, MlpHeadConfig
from fedadapt.data.cache import cached_features, feature_key
from fedadapt.experiment import prepare_run
from fedadapt.federation.training import derive_seed, train_local


def train_head(cache_dir, use_cache: bool, method_cls=LinearHeadConfig):
    prep = prepare_run(tiny_run(cache_dir, method_cls(use_cache=use_cache)), quiet=True)
    spec, model = prep.spec, prep.model
    assert spec.train_source.kind == ("features" if use_cache else "images")
    for rnd in (1, 2):
        train_local(model, spec.train_source, spec.clients[0].train, spec.train, lr=0.05,
                    seed=derive_seed(spec.seed, rnd, 0))
    return {k: v.clone() for k, v in model.tensors(model.communicated_names()).items()}


def test_cached_and_live_backbone_train_the_same_weights(cache_dir):
    for method_cls in (LinearHeadConfig, MlpHeadConfig):
        cached = train_head(cache_dir, True, method_cls)
        live = train_head(cache_dir, False, method_cls)
        assert cached.keys() == live.keys()
        for k in cached:
            torch.testing.assert_close(cached[k], live[k], rtol=1e-4, atol=1e-5)


def test_cache_is_reused_and_keyed_exactly(cache_dir):
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    path = prep.spec.train_source.features_path
    mtime = os.stat(path).st_mtime_ns
    again = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    assert again.spec.train_source.features_path == path and os.stat(path).st_mtime_ns == mtime
    feats = np.load(path, mmap_mode="r")
    assert feats.shape == (prep.spec.train_source.prepared.num_train, prep.spec.embed_dim)

    from fedadapt.backbones import build_backbone
    from fedadapt.data.transforms import TransformSpec

    cfg = tiny_run(cache_dir, LinearHeadConfig())
    b = build_backbone(cfg.backbone)
    t = TransformSpec.for_backbone(b)
    prepared = prep.spec.train_source.prepared
    key = feature_key(b, prepared, "train", t)
    assert key != feature_key(b, prepared, "test", t)
    assert key != feature_key(b, prepared, "train", TransformSpec(24, t.mean, t.std))
    cfg.backbone.arch = {"width": 8, "init_seed": 1}  # other (random) weights, other key
    assert key != feature_key(build_backbone(cfg.backbone), prepared, "train", t)
    assert cached_features(b, prepared, "train", t, cache_dir) == path
