"""The feature cache: exact keys, reuse, and the same training result as the live backbone."""

import os

import numpy as np
import pytest
import torch
from conftest import tiny_run

from fedadapt.adapters.heads import LinearHeadConfig, MlpHeadConfig
from fedadapt.data.cache import cached_features, feature_key
from fedadapt.experiment import prepare_run
from fedadapt.federation.client.training import derive_seed, train_local


def train_head(cache_dir, use_cache: bool, method_cls=LinearHeadConfig):
    prep = prepare_run(tiny_run(cache_dir, method_cls(use_cache=use_cache)), quiet=True)
    spec, model = prep.spec, prep.model
    assert spec.train_source.kind == ("features" if use_cache else "images")
    for rnd in (1, 2):
        train_local(model, spec.train_source, spec.clients[0].train, spec.train, lr=0.05,
                    seed=derive_seed(spec.seed, rnd, 0), precision=spec.precision)
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

    from dataclasses import replace

    from fedadapt.backbones import build_backbone

    cfg = tiny_run(cache_dir, LinearHeadConfig())
    b = build_backbone(cfg.backbone)
    images = prepare_run(tiny_run(cache_dir, LinearHeadConfig(use_cache=False)),
                         quiet=True).spec.train_source
    t, prepared = images.preprocess, images.prepared
    key = feature_key(b, prepared, "train", t)
    assert key != feature_key(b, prepared, "test", t)
    assert key != feature_key(b, prepared, "train", replace(t, size=24, resize=24))
    assert key != feature_key(b, prepared, "train", replace(t, interpolation="bicubic"))
    assert key != feature_key(b, prepared, "train", t, precision="bf16")
    cfg.backbone.arch = {"width": 8, "init_seed": 1}  # other (random) weights, other key
    assert key != feature_key(build_backbone(cfg.backbone), prepared, "train", t)
    assert cached_features(b, images, cache_dir, precision=prep.spec.precision) == path


def test_feature_file_altered_in_place_is_rebuilt(cache_dir):
    """A cache file changed at the same size (or truncated) fails its digest and is rebuilt
    before anything reads it; its sidecar records what was written."""
    from fedadapt.data import integrity

    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    path = prep.spec.train_source.features_path
    good = np.load(path).copy()
    with open(path, "r+b") as fh:  # same size, other content
        fh.seek(-8, os.SEEK_END)
        fh.write(b"\x00\x00\x80\x7f" * 2)
    integrity._CHECKED.clear()  # a new process
    assert "content differs" in integrity.problem(path)
    again = prepare_run(tiny_run(cache_dir, LinearHeadConfig()), quiet=True)
    assert again.spec.train_source.features_path == path
    np.testing.assert_array_equal(np.load(path), good)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) - 4)
    integrity._CHECKED.clear()
    assert "truncated" in integrity.problem(path)
    with pytest.raises(integrity.CacheIntegrityError, match=os.path.basename(path)):
        integrity.check(path, "feature cache")
