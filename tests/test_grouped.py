"""Grouped local training equals K sequential clients (train_local) to floating-point
tolerance: every client-trained method, K = 1, 3, 8, clients of unequal sizes, anytime exits,
multi-tier, FedProx, gradient clipping, SGD / Adam / AdamW, crops; dropout by distribution."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import TINY_CLIP, tiny_run

from fedadapt.adapters.exits import AccumulatorConfig, LwLinearConfig, LwMlpConfig
from fedadapt.adapters.fedclip import FedClipConfig
from fedadapt.adapters.heads import (
    FinetuneConfig,
    LinearHeadConfig,
    LocalOnlyConfig,
    MlpHeadConfig,
)
from fedadapt.config import BackboneConfig, SettingConfig, validate
from fedadapt.experiment import prepare_run
from fedadapt.federation.grouped import ClientJob, train_group
from fedadapt.federation.training import derive_seed, train_local

TINY_VIT = BackboneConfig(name="tiny_vit", family="vit", image_size=32, crop_pct=1.0,
                          interpolation="bilinear", arch=dict(
                              patch_size=8, hidden_size=32, num_hidden_layers=3,
                              num_attention_heads=2, intermediate_size=64))
SIZES = [5, 17, 33, 8, 12, 1, 20, 9]  # unequal, batch 8: ragged last batches


def prepared(cache_dir, method, *, backbone=None, setting=None, **train):
    cfg = tiny_run(cache_dir, method)
    if backbone is not None:
        cfg.backbone = backbone
    if setting is not None:
        cfg.setting = setting
    cfg.train = replace(cfg.train, batch_size=8, **train)
    return prepare_run(validate(cfg), quiet=True)


def jobs_for(prep, k: int, exits=None, crop=False) -> list[ClientJob]:
    spec, model = prep.spec, prep.model
    pool = np.concatenate([c.train for c in spec.clients])
    base = model.tensors(model.trainable_names())
    out, at = [], 0
    for i in range(k):
        idx = pool[at:at + SIZES[i]]
        at += SIZES[i]
        gen = torch.Generator().manual_seed(100 + i)  # clients start from different tensors
        tensors = {n: t + 0.01 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
        out.append(ClientJob(cid=i, indices=idx, tensors=tensors, seed=derive_seed(5, i),
                             crop_seed=derive_seed(5, i, 7) if crop else None, exits=exits))
    return out


def sequential(prep, jobs, *, lr, mu=0.0):
    model, spec = prep.model, prep.spec
    out = []
    for j in jobs:
        model.load_tensors(j.tensors)
        loss, seen = train_local(model, spec.train_source, j.indices, spec.train, lr=lr,
                                 seed=j.seed, proximal_mu=mu, exits=j.exits,
                                 crop_seed=j.crop_seed)
        out.append((model.tensors(model.trainable_names()), loss, seen))
    return out


def assert_same(prep, jobs, *, lr=0.05, mu=0.0, atol=2e-5):
    grouped = train_group(prep.model, prep.spec.train_source, jobs, prep.spec.train, lr=lr,
                          proximal_mu=mu)
    alone = sequential(prep, jobs, lr=lr, mu=mu)
    for g, (tensors, loss, seen) in zip(grouped, alone):
        assert g.seen == seen
        assert g.loss == pytest.approx(loss, rel=1e-4, abs=1e-6)
        for n in tensors:
            torch.testing.assert_close(g.tensors[n], tensors[n], atol=atol, rtol=1e-4, msg=n)


@pytest.mark.parametrize("k", [1, 3, 8])
def test_heads_on_cached_features(cache_dir, k):
    assert_same(prepared(cache_dir, LinearHeadConfig()), jobs_for(prepared(
        cache_dir, LinearHeadConfig()), k))
    mlp = prepared(cache_dir, MlpHeadConfig(hidden_dim=16), optimizer="adam", weight_decay=0.01)
    assert_same(mlp, jobs_for(mlp, k), lr=0.01)


def test_local_only_fedprox_and_adamw(cache_dir):
    local = prepared(cache_dir, LocalOnlyConfig(), optimizer="adamw", weight_decay=0.1)
    assert_same(local, jobs_for(local, 3), lr=0.01)
    prox = prepared(cache_dir, LinearHeadConfig())
    assert_same(prox, jobs_for(prox, 3), mu=0.5)  # FedProx's proximal-mu, as a client gets it


@pytest.mark.parametrize("k", [1, 3, 8])
def test_accumulator_with_token_replace_and_adapters_anytime(cache_dir, k):
    prep = prepared(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                 adapter_bottleneck=4),
                    backbone=TINY_VIT, setting=SettingConfig(name="anytime"),
                    clip_grad_norm=0.5)
    assert_same(prep, jobs_for(prep, k, exits=[0, 1, 2]))


def test_layerwise_heads_anytime_multitier_conventional_and_crops(cache_dir):
    """Anytime: clients of one step draw different exits, so each client's other heads (and
    their momentum) must stay untouched, as torch's SGD leaves tensors without a gradient."""
    prep = prepared(cache_dir, LwLinearConfig(parallel_adapter=True, adapter_bottleneck=4),
                    backbone=TINY_VIT, setting=SettingConfig(name="anytime"),
                    crop_scale=[0.2, 1.0])
    assert_same(prep, jobs_for(prep, 8, exits=[0, 1, 2], crop=True))
    assert_same(prep, jobs_for(prep, 3, exits=[1]))  # a tier: every client at exit 1
    assert_same(prep, jobs_for(prep, 3, exits=None))  # conventional: the last exit


def test_attai_and_finetune(cache_dir):
    clip = prepared(cache_dir, FedClipConfig(), backbone=TINY_CLIP, optimizer="adam",
                    betas=[0.9, 0.98], eps=1e-6, weight_decay=0.2)
    assert_same(clip, jobs_for(clip, 3), lr=1e-3)
    fine = prepared(cache_dir, FinetuneConfig())
    assert_same(fine, jobs_for(fine, 3), atol=5e-5)


def test_dropout_draws_depend_on_the_group_but_not_their_distribution(cache_dir):
    """With dropout the masks come from the global generator under vmap: a client's result
    differs with its group, but over many seeds its mean final loss is the same alone and in a
    group of eight (within three standard errors)."""
    prep = prepared(cache_dir, LwMlpConfig(hidden_dim=16, dropout=0.5), backbone=TINY_VIT)
    jobs = jobs_for(prep, 8, exits=[2])
    alone, grouped = [], []
    for s in range(12):
        first = replace(jobs[0], seed=derive_seed(11, s))
        alone.append(train_group(prep.model, prep.spec.train_source, [first],
                                 prep.spec.train, lr=0.05)[0].loss)
        grouped.append(train_group(prep.model, prep.spec.train_source, [first, *jobs[1:]],
                                   prep.spec.train, lr=0.05)[0].loss)
    a, g = np.array(alone), np.array(grouped)
    assert not np.allclose(a, g)
    sem = np.sqrt(a.var(ddof=1) / len(a) + g.var(ddof=1) / len(g))
    assert abs(a.mean() - g.mean()) < 3 * sem + 1e-6


def test_personalization_side_by_side_equals_one_after_another(cache_dir, flower_task):
    """Clients with their own corruptions personalize their part side by side (K = 3) as they
    would one after another (K = 1): same accuracies and personalized tensors."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

    from fedadapt.federation import records
    from fedadapt.federation.checkpoint import load_client_state
    from fedadapt.federation.worker import personalize_clients

    prep = prepared(cache_dir, AccumulatorConfig(head_hidden=[16]), backbone=TINY_VIT,
                    setting=SettingConfig(name="personalization", personalize="accumulator",
                                          epochs=1, severities=[0, 3, 5]))
    spec, model = prep.spec, prep.model
    arrays = ArrayRecord(model.tensors(model.communicated_names()))
    outs, states = [], []
    for k in (1, 3):
        spec.state_dir = f"{cache_dir}/pers-{k}"
        ctx = Context(run_id=1, node_id=1, node_config={"partition-id": 0}, state=RecordDict(),
                      run_config={})
        content = RecordDict({"arrays": arrays, "config": ConfigRecord(
            {"phase": "personalize", "server-round": 3}), records.GRID: ConfigRecord(
            {"clients": [0, 1, 2], "group-size": k})})
        outs.append(records.unpack(personalize_clients(spec, content, ctx)))
        states.append([load_client_state(f"{spec.state_dir}/{c}/personalized", 3)
                       for c in range(3)])
    assert {c for c in range(3) if spec.client_corruptions[c][1] > 0}  # corrupted data in play
    for c in range(3):
        one, side = (o[c].metric_records["metrics"] for o in outs)
        assert one["acc_before"] == side["acc_before"]
        assert one["acc_after"] == pytest.approx(side["acc_after"], abs=1 / 30)
        assert one["train_loss"] == pytest.approx(side["train_loss"], rel=1e-4)
        for name, t in states[0][c].items():
            torch.testing.assert_close(states[1][c][name], t, atol=2e-5, rtol=1e-4)
