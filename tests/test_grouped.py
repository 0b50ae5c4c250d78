"""Grouped local training equals K sequential clients (train_local) to floating-point
tolerance: every client-trained method, K = 1, 3, 8, clients of unequal sizes, anytime exits,
multi-tier, FedProx, gradient clipping, SGD / Adam / AdamW, crops, dropout."""

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_CLIP, tiny_run
from torch import nn

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
from fedadapt.federation.client.grouped import ClientJob, train_group
from fedadapt.federation.client.training import derive_seed, train_local
from fedadapt.grouping import forms

TINY_VIT = BackboneConfig(name="tiny_vit", family="vit", image_size=32, crop_pct=1.0,
                          interpolation="bilinear", arch=dict(
                              patch_size=8, hidden_size=32, num_hidden_layers=3,
                              num_attention_heads=2, intermediate_size=64))
SIZES = [5, 17, 33, 8, 12, 1, 20, 9]  # unequal, batch 8: ragged last batches


def prepared(cache_dir, method, *, backbone=None, setting=None, precision="fp32", device=None,
             **train):
    """A prepared tiny run, in fp32 unless ``precision`` says otherwise, on ``device`` (None:
    the GPU where one is visible, as a run chooses)."""
    cfg = tiny_run(cache_dir, method)
    if device == "cpu":
        cfg.federation = replace(cfg.federation, num_gpus=0)
    if backbone is not None:
        cfg.backbone = backbone
    if setting is not None:
        cfg.setting = setting
    cfg.train = replace(cfg.train, batch_size=8, precision=precision, **train)
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
                                 anchor=j.anchor, linear=j.linear,
                                 crop_seed=j.crop_seed, precision=spec.precision)
        out.append((model.tensors(model.trainable_names()), loss, seen))
    return out


def assert_same(prep, jobs, *, lr=0.05, mu=0.0, atol=2e-5):
    """Grouped equals one client at a time in fp32 (bf16: test_grouped_bf16.py)."""
    spec = prep.spec
    assert spec.precision == "fp32"
    grouped = train_group(prep.model, spec.train_source, jobs, spec.train, lr=lr,
                          proximal_mu=mu, precision=spec.precision)
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


@pytest.mark.parametrize("chunked", [False, True])
def test_a_frozen_backbone_runs_on_the_real_rows_only_and_as_alone(cache_dir, monkeypatch,
                                                                   chunked):
    """A head on a frozen backbone run every step: on the CPU the backbone sees each slot's
    real rows only (a padding row takes its slot's first row's features), in chunks of its
    ``cpu_chunk_pixels`` and channels-last where declared, and the clients train as alone."""
    prep = prepared(cache_dir, LinearHeadConfig(use_cache=False), device="cpu")
    backbone = prep.model.backbone
    if chunked:  # 3 rows of 16 x 16 a call, channels-last, as EfficientNet-Lite0 declares
        monkeypatch.setattr(backbone, "cpu_chunk_pixels", 3 * 16 * 16, raising=False)
        monkeypatch.setattr(backbone, "cpu_channels_last", True, raising=False)
    calls = []  # the grouped steps' calls (not the probe of which tensors a step trains)
    backbone.register_forward_pre_hook(lambda m, args: calls.append(
        (len(args[0]), args[0].is_contiguous(memory_format=torch.channels_last)))
        if forms.active() is not None else None)
    assert_same(prep, jobs_for(prep, 8))  # the clients side by side train as alone
    # every client's examples once an epoch, each run once by the grouped step's backbone
    assert sum(n for n, _ in calls) == sum(SIZES) * prep.spec.train.local_epochs
    if chunked:
        assert max(n for n, _ in calls) == 3 and all(last for _, last in calls)
        from fedadapt.adapters.model import frozen_features

        x = torch.randn(10, 3, 16, 16)
        with torch.no_grad():  # in chunks of 3 rows, channels-last: as one call
            torch.testing.assert_close(frozen_features(backbone, x), backbone(x))


def test_local_only_fedprox_and_adamw(cache_dir):
    local = prepared(cache_dir, LocalOnlyConfig(), optimizer="adamw", weight_decay=0.1)
    assert_same(local, jobs_for(local, 3), lr=0.01)
    prox = prepared(cache_dir, LinearHeadConfig())
    assert_same(prox, jobs_for(prox, 3), mu=0.5)  # FedProx's proximal-mu, as a client gets it


def with_terms(jobs: list[ClientJob], anchors: bool = True) -> list[ClientJob]:
    """Each job its own anchor (its start moved) and linear term (seeded), as Ditto, FedDyn
    and SCAFFOLD give them; the first job has neither (FedProx's anchor, no term)."""
    for i, j in enumerate(jobs[1:], 1):
        gen = torch.Generator().manual_seed(200 + i)
        if anchors:
            j.anchor = {n: t + 0.05 * torch.randn(t.shape, generator=gen)
                        for n, t in j.tensors.items()}
        j.linear = {n: 0.1 * torch.randn(t.shape, generator=gen) for n, t in j.tensors.items()}
    return jobs


def test_each_clients_anchor_and_linear_term_side_by_side_as_alone(cache_dir):
    """The proximal term towards each client's own anchor and its linear term (Ditto, FedDyn,
    SCAFFOLD) give the grouped forms (heads; the Accumulator's laid-out tensors) and vmap
    (full fine-tuning) what one client at a time gets."""
    head = prepared(cache_dir, MlpHeadConfig(hidden_dim=16))
    assert_same(head, with_terms(jobs_for(head, 4)), mu=0.3)
    assert_same(head, with_terms(jobs_for(head, 3), anchors=False))  # SCAFFOLD: no mu
    acc = prepared(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                adapter_bottleneck=4),
                   backbone=TINY_VIT, setting=SettingConfig(name="anytime"))
    assert_same(acc, with_terms(jobs_for(acc, 3, exits=[0, 1, 2])), mu=0.2)
    fine = prepared(cache_dir, FinetuneConfig())
    assert_same(fine, with_terms(jobs_for(fine, 3)), mu=0.1, atol=5e-5)


def test_a_linear_term_adds_itself_to_the_gradient(cache_dir):
    """One plain-SGD step with ``linear`` = c moves each tensor by ``-lr * (grad + c)``: the
    step without it, minus ``lr * c``."""
    prep = prepared(cache_dir, LinearHeadConfig(), local_epochs=1)
    (job,) = jobs_for(prep, 1)
    job.indices = job.indices[:8]  # one batch, one step
    model, spec = prep.model, prep.spec
    c = {n: torch.full_like(t, 0.25) for n, t in job.tensors.items()}
    out = []
    for linear in (None, c):
        model.load_tensors(job.tensors)
        train_local(model, spec.train_source, job.indices, spec.train, lr=0.1, seed=job.seed,
                    linear=linear, precision="fp32")
        out.append(model.tensors(model.trainable_names()))
    for n in c:
        torch.testing.assert_close(out[1][n], out[0][n] - 0.1 * 0.25)


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


def test_dropout_masks_are_each_clients_own_alone_or_grouped(cache_dir):
    """Dropout draws from the client's own step keys (fedadapt.grouping.dropout), so a
    client's masks, and its result, do not depend on its group: K = 8 equals one at a time,
    anytime exits and FedProx included; and the masks are live (dropout 0.5 trains otherwise
    than dropout 0, and two seeds draw different masks)."""
    prep = prepared(cache_dir, LwMlpConfig(hidden_dim=16, dropout=0.5), backbone=TINY_VIT)
    jobs = jobs_for(prep, 8, exits=[0, 1, 2])
    assert_same(prep, jobs, mu=0.01)
    one = train_group(prep.model, prep.spec.train_source, jobs[:1], prep.spec.train, lr=0.05,
                      precision="fp32")
    reseeded = train_group(prep.model, prep.spec.train_source, [replace(jobs[0], seed=99)],
                           prep.spec.train, lr=0.05, precision="fp32")
    assert one[0].loss != pytest.approx(reseeded[0].loss, rel=1e-6)
    plain = prepared(cache_dir, LwMlpConfig(hidden_dim=16, dropout=0.0), backbone=TINY_VIT)
    nodrop = train_group(plain.model, plain.spec.train_source, jobs[:1], plain.spec.train,
                         lr=0.05, precision="fp32")
    assert one[0].loss != pytest.approx(nodrop[0].loss, rel=1e-4)


def test_dropout_keeps_one_minus_p_and_rescales():
    from fedadapt.grouping import dropout

    layer = torch.nn.Dropout(0.3).train()
    dropout.install(layer)
    x = torch.ones(200_000)
    with dropout.keyed(torch.tensor(dropout.step_key(3, 0))):
        out = layer(x)
        again = layer(x)  # the forward's second call: another mask
    kept = out > 0
    assert kept.float().mean().item() == pytest.approx(0.7, abs=0.005)
    assert torch.allclose(out[kept], torch.full_like(out[kept], 1 / 0.7))
    assert not torch.equal(kept, again > 0)
    with dropout.keyed(torch.tensor(dropout.step_key(3, 0))):
        assert torch.equal(layer(x), out)  # the same key, the same mask
    assert torch.equal(layer.eval()(x), x)


def test_the_grouped_step_reads_nothing_back_per_step(cache_dir, monkeypatch):
    """Host reads (item, bool, float, int, tolist, numpy, cpu on a tensor) per grouped
    training, outside the data path and the host-side schedule draws: the same small count for
    2 clients x 1 epoch as for 8 clients x 3 epochs, anytime with FedProx, however many steps and
    tensors (the final tensors and the losses, once per group)."""
    prep = prepared(cache_dir, AccumulatorConfig(), backbone=TINY_VIT)
    counts = []
    for k, epochs in ((2, 1), (8, 3)):
        calls = [0]
        train = replace(prep.spec.train, local_epochs=epochs)
        model, source, jobs = prep.model, prep.spec.train_source, jobs_for(prep, k, exits=[0, 2])
        from fedadapt.federation.client import group_forms, group_jobs, group_vmap
        from fedadapt.federation.client.grouped import UsedTensors

        used = UsedTensors(model, source, int(jobs[0].indices[0]), precision="fp32")
        for e in (0, 2):
            used(e)  # found once per run in a worker, before any group trains
        for name in ("item", "__bool__", "__float__", "__int__", "tolist", "numpy", "cpu"):
            orig = getattr(torch.Tensor, name)

            def counted(self, *a, _orig=orig, _calls=calls, **kw):
                _calls[0] += 1
                return _orig(self, *a, **kw)
            monkeypatch.setattr(torch.Tensor, name, counted)
        def schedule(job, train, _orig=group_jobs.schedule, _calls=calls):
            before = _calls[0]  # the client's batches and exits: host-side generator draws
            out = _orig(job, train)
            _calls[0] = before
            return out
        for engine in (group_forms, group_vmap):
            monkeypatch.setattr(engine, "schedule", schedule)
        train_group(model, _ReadsNotCounted(source, calls), jobs, train, lr=0.05,
                    proximal_mu=0.01, used=used, precision="fp32")
        monkeypatch.undo()
        counts.append(calls[0])
    assert counts[0] == counts[1] <= 3, counts


class _ReadsNotCounted:
    """The data source, whose own reads (the data path's, not the step's) are not counted."""

    def __init__(self, source, calls):
        self.source, self.calls = source, calls

    def __getattr__(self, name):
        return getattr(self.source, name)

    def stream(self, *a, **kw):
        it = self.source.stream(*a, **kw)
        while True:
            before = self.calls[0]
            try:
                batch = next(it)
            except StopIteration:
                return
            self.calls[0] = before
            yield batch


def test_personalization_side_by_side_equals_one_after_another(cache_dir, flower_task):
    """Clients with their own corruptions personalize their part side by side (K = 3) as they
    would one after another (K = 1): same accuracies and personalized tensors."""
    from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict

    from fedadapt.federation.server.checkpoint import load_client_state
    from fedadapt.federation.wire import records
    from fedadapt.methods.rounds.clients import personalize_clients

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


@pytest.mark.slow
def test_a_run_with_dropout_anytime_fedprox_and_crops_is_the_same_for_k_1_4_8(cache_dir,
                                                                            tmp_path):
    """The issue's run: L.W. MLP + PA (dropout 0.1), anytime, Dirichlet 0.3, FedProx, the
    paper's crops; clients_per_worker 1, 4 and 8 give the same global arrays (1e-6) and train
    losses (rel 1e-6) after 2 rounds: a client's draws never depend on its group."""
    import json

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
    from fedadapt.federation.simulation.inprocess import in_process

    base = ["experiment=custom", "dataset=digits", "dataset.max_samples=300",
            "train.precision=fp32",  # compared to 1e-6: fp32 on any device
            "backbone=tiny_vit", "backbone.image_size=32", "method=lw_mlp_pa",
            "method.hidden_dim=16", "setting=anytime", "partition=dirichlet",
            "partition.alpha=0.3", "partition.num_clients=8", "partition.fraction_fit=1.0",
            "partition.fraction_evaluate=0.0", "rounds=2", "train.batch_size=8",
            "train.lr=0.05", "train.crop_scale=[0.3,1.0]", "strategy=fedprox",
            "strategy.proximal_mu=0.1", "federation.workers=1", "federation.num_cpus=1",
            f"cache_dir={cache_dir}"]
    arrays, losses = {}, {}
    for k in (1, 4, 8):
        out = tmp_path / f"k{k}"
        cfg = to_run_config(compose_config(base + [f"federation.clients_per_worker={k}"]))
        assert cfg.method.dropout == 0.1
        run_experiment(cfg, out, config_yaml="k\n", execute=in_process("workers"))
        arrays[k] = {n: v.numpy() for n, v in load_checkpoint(latest_checkpoint(out))[0].items()}
        losses[k] = [json.loads(line)["train_loss"] for line in
                     (out / "metrics.jsonl").read_text().splitlines()]
    for k in (4, 8):
        assert losses[k] == pytest.approx(losses[1], rel=1e-6)
        for n, v in arrays[1].items():
            np.testing.assert_allclose(arrays[k][n], v, rtol=0, atol=1e-6, err_msg=f"K={k} {n}")


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_plain_sgd_updates_in_one_call_and_leaves_unreached_slices_as_they_were(weight_decay):
    """Plain SGD takes the fused update: a client's slice its step did not reach has a zero
    gradient and stays as it was, as under the mask; with weight decay the mask still decides
    (torch decays only tensors with a gradient)."""
    from fedadapt.config import TrainConfig
    from fedadapt.federation.client.group_optim import StackedOptimizer

    torch.manual_seed(0)
    p = torch.randn(3, 4, 5, requires_grad=True)
    used = torch.tensor([[True, False, True]])  # client 1's step did not reach it
    grad = torch.randn(3, 4, 5) * used.view(3, 1, 1)
    p.grad = grad.clone()
    before = p.detach().clone()
    train = replace(TrainConfig(), optimizer="sgd", momentum=0.0, weight_decay=weight_decay)
    StackedOptimizer({"w": p}, train, lr=0.1).step(used, [True])
    d = grad + weight_decay * before
    expected = torch.where(used.view(3, 1, 1), before - 0.1 * d, before)
    torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)
    assert torch.equal(p.detach()[1], before[1])


# -- the grouped forms (fedadapt.grouping.forms) ----------------------------------------------


@pytest.mark.parametrize("bias", ["slot", "shared", None])
@pytest.mark.parametrize("out,d_in", [(1, 64), (10, 96), (10, 24), (forms.NARROW_COLUMNS, 64),
                                      (40, 24)])
def test_a_per_slot_product_narrow_or_wide_computes_the_plain_one(out, d_in, bias):
    """``slot_matmul`` (transposed on the CPU where the weight is narrow) gives the plain
    batched product, its bias broadcast, and the same gradients."""
    torch.manual_seed(0)
    x3 = torch.randn(3, 7, d_in)
    w = torch.randn(3, out, d_in, requires_grad=True)
    b = {"slot": torch.randn(3, 1, out), "shared": torch.randn(1, 1, out), None: None}[bias]
    b = None if b is None else b.requires_grad_()
    y = forms.slot_matmul(x3, w, b)
    if out > 1:  # the narrow form is the transpose of a product with the outputs as its rows
        assert y.mT.is_contiguous() == forms.narrow(out, d_in)
    plain = torch.bmm(x3, w.mT) + (0 if b is None else b)
    torch.testing.assert_close(y, plain, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(plain)
    grads = torch.autograd.grad((y * g).sum(), [t for t in (w, b) if t is not None])
    expected = torch.autograd.grad((plain * g).sum(), [t for t in (w, b) if t is not None])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("d_in,d_out", [(96, 10), (24, 10), (8, 40), (12, 12), (80, 80)])
def test_a_linear_layers_stored_layout_round_trips_and_computes_each_slot(d_in, d_out):
    """A linear weight stored in its layout (as it is where narrow, else transposed; few inputs
    with many outputs are not mistaken for narrow) comes back as it was, and its grouped form
    gives each slot what the layer alone gives."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_out))
    forms.install(model)
    weights = torch.randn(3, d_out, d_in)
    biases = torch.randn(3, d_out)
    stored = {"0.weight": forms.to_layout(model, "0.weight", weights),
              "0.bias": forms.to_layout(model, "0.bias", biases)}
    assert torch.equal(forms.from_layout(model, "0.weight", stored["0.weight"],
                                         model[0].weight.shape), weights)
    x = torch.randn(3 * 5, d_in)
    with forms.slots_active(forms.Slots(5, stored)):
        y = model(x)
    for s in range(3):
        torch.testing.assert_close(y[5 * s:5 * s + 5],
                                   F.linear(x[5 * s:5 * s + 5], weights[s], biases[s]),
                                   rtol=1e-5, atol=1e-5)


def _built(method, backbone=None, class_text=None):
    from fedadapt.adapters.registry import build_model
    from fedadapt.backbones import build_backbone

    return build_model(method, build_backbone(backbone or TINY_VIT), 5, with_backbone=True,
                       class_text=class_text)


def test_every_client_trained_method_of_the_presets_has_grouped_forms():
    """The methods the presets train on clients run side by side as one batch through their
    grouped forms; full fine-tuning, a module without a form (the docs' cosine head) and
    FedCLIP's text adapter (per client on the prompts) take vmap, and say why."""
    from fedadapt.adapters.bitfit import BitfitConfig
    from fedadapt.adapters.ia3 import Ia3MethodConfig
    from fedadapt.adapters.lora import DoraMethodConfig, LoraMethodConfig
    from fedadapt.federation.client.grouped import engine_of

    forms_methods = [LinearHeadConfig(), MlpHeadConfig(), LocalOnlyConfig(), LwLinearConfig(),
                     LwMlpConfig(), AccumulatorConfig(), AccumulatorConfig(parallel_adapter=True),
                     LwLinearConfig(parallel_adapter=True), LoraMethodConfig(),
                     LoraMethodConfig(ffa=True), LoraMethodConfig(ranks=[2, 4]),
                     LoraMethodConfig(exits=True, lora_dropout=0.1), DoraMethodConfig(),
                     Ia3MethodConfig(), BitfitConfig()]
    for method in forms_methods:
        assert engine_of(_built(method)) == ("forms", None), method
    assert engine_of(_built(LoraMethodConfig(), TINY_CLIP)) == ("forms", None)
    engine, why = engine_of(_built(FinetuneConfig()))
    assert engine == "vmap" and "ViTEmbeddings" in why
    own = _built(LinearHeadConfig())
    own.head = _Scaled(own.head)  # a user's module without a grouped form
    engine, why = engine_of(own)
    assert engine == "vmap" and "test_grouped._Scaled (head.gain)" in why


class _Scaled(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.gain = inner, torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.gain * self.inner(x)


@pytest.mark.parametrize("learn_scale", [False, True])
def test_the_cosine_heads_own_grouped_form_equals_one_client_at_a_time(cache_dir, learn_scale):
    """docs/adding-a-method.md's worked example registers a grouped form for its head."""
    from fedadapt.adapters.cosine_head import CosineHeadConfig
    from fedadapt.federation.client.grouped import engine_of

    prep = prepared(cache_dir, CosineHeadConfig(learn_scale=learn_scale))
    assert engine_of(prep.model) == ("forms", None)
    assert_same(prep, jobs_for(prep, 3))


def test_fedclip_has_grouped_forms_but_its_text_adapter_takes_vmap(cache_dir):
    from fedadapt.federation.client.grouped import engine_of

    prep = prepared(cache_dir, FedClipConfig(), backbone=TINY_CLIP)
    assert engine_of(prep.model) == ("forms", None)
    text = prepared(cache_dir, FedClipConfig(text_adapter=True), backbone=TINY_CLIP)
    engine, why = engine_of(text.model)
    assert engine == "vmap" and "text adapter" in why
    assert_same(text, jobs_for(text, 3), lr=1e-3)  # through vmap, as one at a time


def test_clients_at_different_exits_share_one_forward_per_step(cache_dir, monkeypatch):
    """Anytime clients of a step run as one batch: the embedding once per step for every
    client (not once per exit drawn), each deeper block on the clients that go deeper."""
    prep = prepared(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                 adapter_bottleneck=4),
                    backbone=TINY_VIT, setting=SettingConfig(name="anytime"))
    backbone = prep.model.backbone
    rows_per_block, embeds = [], [0]
    embed = type(backbone).embed

    def counted_embed(self, images):
        embeds[0] += 1
        return embed(self, images)

    from fedadapt.federation.client.grouped import UsedTensors

    jobs = [replace(j, indices=j.indices[:8]) for j in jobs_for(prep, 8, exits=[0, 1, 2])
            if len(j.indices) >= 8]
    used = UsedTensors(prep.model, prep.spec.train_source, int(jobs[0].indices[0]),
                       precision="fp32")
    for e in (0, 1, 2):
        used(e)  # found once per run in a worker, before any group trains
    monkeypatch.setattr(type(backbone), "embed", counted_embed)
    hooks = [block.register_forward_pre_hook(
        lambda m, args, i=i: rows_per_block.append((i, len(args[0]))))
        for i, block in enumerate(backbone.blocks)]
    train = replace(prep.spec.train, batch_size=8)
    train_group(prep.model, prep.spec.train_source, jobs, train, lr=0.05, precision="fp32",
                used=used)
    for hook in hooks:
        hook.remove()
    assert embeds[0] == 1  # one step: one batch of every client's 8 rows
    by_block = dict(rows_per_block)
    assert by_block[0] == 8 * len(jobs) >= by_block[1] >= by_block[2]
    assert by_block[2] < by_block[0]  # some client left before the last block


@pytest.mark.parametrize("k", [1, 3])
def test_a_captured_step_equals_the_eager_one(cache_dir, k):
    """``federation.compile``: the grouped step through torch.compile (inductor on the CPU;
    fixed shapes, the clients' last batches padded) trains what the eager step trains."""
    prep = prepared(cache_dir, MlpHeadConfig(hidden_dim=16), optimizer="adam")
    jobs = jobs_for(prep, k)
    if k > 1:  # and a client without data, whose slot is all padding
        jobs.append(replace(jobs[0], cid=k, indices=jobs[0].indices[:0]))
    spec = prep.spec
    eager = train_group(prep.model, spec.train_source, jobs, spec.train, lr=0.01,
                        precision="fp32")
    captured = train_group(prep.model, spec.train_source, jobs, spec.train, lr=0.01,
                           precision="fp32", compile=True)
    for e, c in zip(eager, captured):
        assert (c.seen, c.loss) == (e.seen, pytest.approx(e.loss, rel=1e-5))
        for n in e.tensors:
            torch.testing.assert_close(c.tensors[n], e.tensors[n], atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_a_captured_accumulator_step_equals_one_client_at_a_time(cache_dir):
    """The Accumulator + PA on the small ViT, clients of unequal sizes, clipping and FedProx:
    captured (inductor), equal to one client at a time; a second group reuses the graph."""
    import torch._dynamo.utils as dynamo_utils

    prep = prepared(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                 adapter_bottleneck=4),
                    backbone=TINY_VIT, clip_grad_norm=0.5)
    jobs = jobs_for(prep, 3)
    spec = prep.spec
    alone = sequential(prep, jobs, lr=0.05, mu=0.1)
    for _ in range(2):
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        grouped = train_group(prep.model, spec.train_source, jobs, spec.train, lr=0.05,
                              precision="fp32", proximal_mu=0.1, compile=True)
        for g, (tensors, loss, seen) in zip(grouped, alone):
            assert g.seen == seen and g.loss == pytest.approx(loss, rel=1e-4)
            for n in tensors:
                torch.testing.assert_close(g.tensors[n], tensors[n], atol=2e-5, rtol=1e-4)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == before  # no recompile


@pytest.mark.parametrize("opt", [dict(optimizer="sgd", momentum=0.9, weight_decay=0.1),
                                 dict(optimizer="sgd", momentum=0.0, weight_decay=0.1),
                                 dict(optimizer="adam", weight_decay=0.01),
                                 dict(optimizer="adamw", weight_decay=0.1)])
def test_the_flat_optimizer_steps_as_the_per_tensor_one(opt):
    """The grouped forms' optimiser updates every client's every tensor in a few operations
    over one flat buffer; it computes what the per-tensor one (and torch's, per client) does,
    leaving each client's unreached tensors and their state as they were."""
    from fedadapt.config import TrainConfig
    from fedadapt.federation.client.group_optim import FlatOptimizer, StackedOptimizer

    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 4, 5), (3, 1, 5), (3, 7)]
    flat = torch.randn(sum(torch.Size(s).numel() for s in shapes), generator=gen)
    views, at = [], 0
    for s in shapes:
        views.append(flat[at:at + torch.Size(s).numel()].view(s))
        at += torch.Size(s).numel()
    flat_leaves = {f"t{i}": v.detach().requires_grad_(True) for i, v in enumerate(views)}
    plain = {f"t{i}": v.detach().clone().requires_grad_(True) for i, v in enumerate(views)}
    train = replace(TrainConfig(), **opt)
    fo, so = FlatOptimizer(flat, flat_leaves, train, 0.1), StackedOptimizer(plain, train, 0.1)
    for step in range(4):
        used = torch.rand(len(shapes), 3, generator=gen) > 0.3
        fo.zero_grad()
        so.zero_grad()
        for i, s in enumerate(shapes):
            g = torch.randn(s, generator=gen) * used[i].view(-1, *([1] * (len(s) - 1)))
            flat_leaves[f"t{i}"].grad.add_(g)
            plain[f"t{i}"].grad = g.clone()
        fo.step(used)
        so.step(used, used.any(dim=1).tolist())
        for n in plain:
            torch.testing.assert_close(flat_leaves[n].detach(), plain[n].detach(), rtol=1e-6,
                                       atol=1e-7, msg=f"{opt} step {step} {n}")


def test_clients_of_different_tiers_train_in_one_group_as_alone(cache_dir):
    """Multi-tier (and ``tiers_from=fleet``): a worker no longer splits its clients by tier;
    a group of clients at exits 0, 1 and 2 (each its own tier: its exit every step, or anytime
    below its device's cap) equals each client alone."""
    prep = prepared(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                 adapter_bottleneck=4),
                    backbone=TINY_VIT, setting=SettingConfig(name="multitier"))
    tiers = [replace(j, exits=[i % 3]) for i, j in enumerate(jobs_for(prep, 6))]
    assert_same(prep, tiers)
    capped = [replace(j, exits=list(range(i % 3 + 1))) for i, j in enumerate(jobs_for(prep, 6))]
    assert_same(prep, capped)


def test_a_worker_groups_clients_across_tiers():
    from fedadapt.federation.client.worker import _groups

    jobs = [ClientJob(cid=i, indices=np.arange(3), tensors={}, seed=i, exits=[i % 3])
            for i in range(7)]
    groups = _groups(jobs, 4, {i: (0.1, 0.01 * (i % 2)) for i in range(7)})
    assert [(rates, [j.cid for j in g]) for rates, g in groups] == [
        ((0.1, 0.0), [0, 2, 4, 6]), ((0.1, 0.01), [1, 3, 5])]  # by (lr, mu), not by tier


def test_work_beside_the_rounds_is_done_again_in_the_caller_when_it_failed():
    from fedadapt.methods.run import Background

    calls = []

    def flaky():
        calls.append(len(calls))
        if len(calls) == 1:
            raise ImportError("deadlock detected by _ModuleLock")

    Background(flaky).join()
    assert calls == [0, 1]
    failing = Background(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.join()


def test_work_beside_the_rounds_is_waited_for_when_the_rounds_raise():
    """Pins the abort at exit (``terminate called without an active exception``, exit code 134
    where the user's error gives 2): the partition plot's thread still drawing while the
    process exits on an error raised in round 2."""
    import time

    from fedadapt.methods.run import Background

    done, calls = [], []

    def slow():
        calls.append(1)
        time.sleep(0.3)
        done.append(1)

    with pytest.raises(RuntimeError, match="round 2"):
        with Background(slow):
            raise RuntimeError("round 2")
    assert done == [1] and calls == [1]  # waited for, and not run again
    with pytest.raises(RuntimeError, match="round 2"):  # the rounds' error, not the plot's
        with Background(lambda: 1 / 0):
            raise RuntimeError("round 2")
    with pytest.raises(ZeroDivisionError):
        with Background(lambda: 1 / 0):
            pass
