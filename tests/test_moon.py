"""strategy=moon (Li, He, Song, CVPR 2021, arXiv 2103.16257): the model-contrastive term against
numbers worked by hand and by numpy, one step on a two-layer head against the paper's loss
written out here, FedAvg where the term has no effect (mu = 0, a linear head alone), the
previous model as the client's own last one, a resume equal to a straight run, and the
refusals."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_resume import _Killed, _stopping_after  # a run that dies after a round
from torch import nn

from fedadapt.adapters.model import AdaptedModel
from fedadapt.config import ConfigError, TrainConfig
from fedadapt.federation.client.grouped import ClientJob
from fedadapt.pfl.moon import MoonRule, classifier_module, contrastive_loss
from fedadapt.pfl.rule import RoundWork
from fedadapt.results.store import read_jsonl

TINY = ["backbone=small_cnn", "backbone.image_size=16", "dataset.max_samples=300",
        "partition.num_clients=4", "federation.eval_every=1", "train.precision=fp32"]
WALL_CLOCK = ("round_s", "wall_s")


def test_contrastive_loss_by_hand():
    """z = z_glob = [1, 0], z_prev = [0, 1]: sims 1 and 0, tau 0.5: logits [2, 0], so
    l_con = -log(e^2 / (e^2 + 1)) = log(1 + e^-2)."""
    z = torch.tensor([[1.0, 0.0]])
    got = contrastive_loss(z, z.clone(), torch.tensor([[0.0, 1.0]]), 0.5)
    assert got.item() == pytest.approx(math.log(1 + math.exp(-2)), abs=1e-7)
    # the previous model equal to the global one (a client's first round): log 2
    assert contrastive_loss(z, z, z, 0.5).item() == pytest.approx(math.log(2), abs=1e-7)


def test_contrastive_loss_of_one_batch_against_numpy():
    rng = np.random.default_rng(3)
    z, zg, zp = (rng.normal(size=(5, 6)) for _ in range(3))
    tau = 0.5

    def cos(a, b):
        return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)

    pos, neg = np.exp(cos(z, zg) / tau), np.exp(cos(z, zp) / tau)
    want = np.mean(-np.log(pos / (pos + neg)))
    got = contrastive_loss(*(torch.tensor(t, dtype=torch.float32) for t in (z, zg, zp)), tau)
    assert got.item() == pytest.approx(want, rel=1e-6)


class ArraySource:
    """A client's data as arrays: what ``DataSource.stream`` yields, on the CPU."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def stream(self, batches, device, crops=None):
        for b in batches:
            idx = torch.as_tensor(np.asarray(b, dtype=np.int64))
            yield self.x[idx], self.y[idx]


def two_layer_model(seed: int = 0) -> AdaptedModel:
    """Cached features [B, 4] -> Linear(4, 3) -> ReLU -> Linear(3, 2 classes)."""
    torch.manual_seed(seed)
    return AdaptedModel(head=nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)))


def work_of(model, jobs, state, lr, train=None):
    train = train or TrainConfig(lr=lr, momentum=0.0, batch_size=64, local_epochs=1,
                                 precision="fp32")
    return RoundWork(spec=SimpleNamespace(train_source=None, precision="fp32"), model=model,
                     jobs=jobs, state=state, received={j.cid: {} for j in jobs},
                     rates={j.cid: (lr, 0.0) for j in jobs}, train_config=train,
                     num_classes=2, _train=None)


def test_one_step_on_a_two_layer_head_against_the_paper_formula():
    """One SGD step (the whole batch) of cross-entropy + mu * l_con, written here from Eq. 3-4
    with its own autograd: the hidden layer moves by both terms, the classifier by the
    cross-entropy only; the state becomes the hidden layer it trained."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 4, generator=gen), torch.tensor([0, 1, 1, 0, 1, 0])
    model = two_layer_model()
    start = model.tensors(model.trainable_names())  # the global model received
    prev = {"head.0.weight": torch.randn(3, 4, generator=gen),
            "head.0.bias": torch.randn(3, generator=gen)}  # its own last model's hidden layer
    lr, mu, tau = 0.3, 5.0, 0.5
    job = ClientJob(cid=7, indices=np.arange(6), tensors=dict(start), seed=11,
                    source=ArraySource(x, y))
    state = {7: dict(prev)}
    res = MoonRule(mu, tau).train_round(work_of(model, [job], state, lr))[7]

    w = {n: t.clone().requires_grad_(True) for n, t in start.items()}
    w1, b1, w2, b2 = w["head.0.weight"], w["head.0.bias"], w["head.2.weight"], w["head.2.bias"]
    z = torch.relu(x @ w1.T + b1)
    z_glob = torch.relu(x @ start["head.0.weight"].T + start["head.0.bias"])
    z_prev = torch.relu(x @ prev["head.0.weight"].T + prev["head.0.bias"])
    logits = z @ w2.T + b2
    ce = -(logits.log_softmax(1)[torch.arange(6), y]).mean()

    def sim(a, b):
        # a row all zeros after the ReLU has no direction: 0, as nn.CosineSimilarity's eps
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1)).clamp_min(1e-8)

    pos, neg = torch.exp(sim(z, z_glob) / tau), torch.exp(sim(z, z_prev) / tau)
    l_con = (-torch.log(pos / (pos + neg))).mean()
    ce_only = torch.autograd.grad(ce, [w1, w2], retain_graph=True)
    (ce + mu * l_con).backward()
    for n in start:
        assert torch.allclose(res.tensors[n], start[n] - lr * w[n].grad, atol=1e-6), n
    assert not torch.allclose(w1.grad, ce_only[0], atol=1e-3)  # l_con moves the hidden layer
    assert torch.allclose(w2.grad, ce_only[1])  # and not the classifier
    assert res.loss == pytest.approx((ce + mu * l_con).item(), rel=1e-6)
    assert sorted(state[7]) == ["head.0.bias", "head.0.weight"]
    for n in state[7]:
        assert torch.equal(state[7][n], res.tensors[n])


def test_each_client_keeps_its_own_previous_model():
    """Two clients from one global model: each one's state is the hidden layer it trained
    itself; a client on its first round (empty state) contrasts against the global model
    (l_con = log 2, no gradient: its step is the cross-entropy's alone)."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen)
    model = two_layer_model(1)
    start = model.tensors(model.trainable_names())
    jobs = [ClientJob(cid=c, indices=np.arange(4 * c, 4 * c + 4), tensors=dict(start),
                      seed=c, source=ArraySource(x, y)) for c in (0, 1)]
    state = {0: {}, 1: {}}
    out = MoonRule(1.0, 0.5).train_round(work_of(model, jobs, state, 0.2))
    for c in (0, 1):
        w = {n: t.clone().requires_grad_(True) for n, t in start.items()}
        xb, yb = x[4 * c:4 * c + 4], y[4 * c:4 * c + 4]
        logits = torch.relu(xb @ w["head.0.weight"].T + w["head.0.bias"]) @ w["head.2.weight"].T \
            + w["head.2.bias"]
        nn.functional.cross_entropy(logits, yb).backward()
        for n in start:
            assert torch.allclose(out[c].tensors[n], start[n] - 0.2 * w[n].grad, atol=1e-6)
        assert out[c].loss == pytest.approx(
            nn.functional.cross_entropy(logits, yb).item() + math.log(2), rel=1e-6)
        for n in ("head.0.weight", "head.0.bias"):
            assert torch.equal(state[c][n], out[c].tensors[n])
    assert not torch.equal(state[0]["head.0.weight"], state[1]["head.0.weight"])


def test_a_model_without_one_classifier_is_refused():
    with pytest.raises(ConfigError, match="no trainable classifier"):
        classifier_module(AdaptedModel(head=nn.Linear(4, 3)), 10)
    two = AdaptedModel(head=nn.ModuleList([nn.Linear(4, 10), nn.Linear(4, 10)]))
    with pytest.raises(ConfigError, match="has 2"):
        classifier_module(two, 10)


def run(args: list[str], run_dir, cache_dir, execute=None, resume=False) -> list[dict]:
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*TINY, *args, f"cache_dir={cache_dir}"])
    run_experiment(to_run_config(composed), run_dir, execute=execute or in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True), resume=resume)
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_mu_zero_is_fedavg_exactly(tmp_path, cache_dir):
    # MOON trains a worker's clients one at a time: FedAvg's too, to compare them to the bit
    common = ["method=mlp_head", "rounds=3", "partition.fraction_fit=0.5",
              "federation.clients_per_worker=1"]
    fedavg = run([*common, "strategy=fedavg"], tmp_path / "fedavg", cache_dir)
    moon = run([*common, "strategy=moon", "strategy.mu=0"], tmp_path / "moon", cache_dir)
    assert moon == fedavg


def test_a_linear_head_alone_is_fedavg(tmp_path, cache_dir):
    """The representation is the frozen feature: l_con is a constant (its train loss is
    higher by mu * l_con), the tensors, and so every accuracy, are FedAvg's."""
    common = ["method=linear_head", "rounds=3", "federation.clients_per_worker=1"]  # as MOON
    fedavg = run([*common, "strategy=fedavg"], tmp_path / "fedavg", cache_dir)
    moon = run([*common, "strategy=moon", "strategy.mu=5"], tmp_path / "moon", cache_dir)
    loss = [k for k in fedavg[0] if "train_loss" in k]
    assert loss and all(m[k] > f[k] for m, f in zip(moon, fedavg) for k in loss)
    assert [{k: v for k, v in r.items() if k not in loss} for r in moon] == \
        [{k: v for k, v in r.items() if k not in loss} for r in fedavg]
    assert not list((tmp_path / "moon").rglob("rule"))  # nothing in front of the head


def test_moon_changes_an_mlp_head_and_keeps_each_clients_last_model(tmp_path, cache_dir):
    common = ["method=mlp_head", "rounds=2", "partition.fraction_fit=1.0"]
    fedavg = run([*common, "strategy=fedavg"], tmp_path / "fedavg", cache_dir)
    moon = run([*common, "strategy=moon", "strategy.mu=5"], tmp_path / "moon", cache_dir)
    assert moon[0]["global_loss"] == fedavg[0]["global_loss"]  # round 1: previous = global
    assert moon[1]["global_loss"] != fedavg[1]["global_loss"]
    kept = sorted((tmp_path / "moon").rglob("rule/round-*.safetensors"))
    assert len(kept) == 4 * 2  # each client, each round (every client trains every round)


def test_a_resume_is_exact(tmp_path, cache_dir):
    """Stopped after round 2 (the checkpoint's), resumed: the metrics of a straight run; half
    the clients a round, so a client's previous model is often from rounds before."""
    args = ["method=mlp_head", "rounds=5", "partition.fraction_fit=0.5", "strategy=moon",
            "federation.checkpoint_every=2", "federation.clients_per_worker=2"]
    ref = run(args, tmp_path / "ref", cache_dir)
    layout = json.loads((tmp_path / "ref" / "summary.json").read_text())["layout"]
    assert (layout["side_by_side"], layout["side_by_side_why"]) == \
        ("one_at_a_time", "strategy=moon")  # the run's layout line says so
    with pytest.raises(_Killed):
        run(args, tmp_path / "killed", cache_dir, execute=_stopping_after(3))
    got = run(args, tmp_path / "killed", cache_dir, resume=True)
    assert got == ref


@pytest.mark.parametrize("args,key", [
    (["strategy.mu=-1"], "strategy.mu"),
    (["strategy.temperature=0"], "strategy.temperature"),
    (["dp=dpsgd"], "dp"),
    (["pfl=fedper"], "pfl"),
    (["secagg=secaggplus"], "strategy"),
])
def test_refused_in_one_line_before_any_data(args, key, cache_dir):
    from fedadapt.config import validate
    from fedadapt.entry import compose_config, to_run_config

    composed = compose_config([*TINY, "method=mlp_head", "strategy=moon", *args,
                               f"cache_dir={cache_dir}"])
    with pytest.raises(ConfigError) as err:
        validate(to_run_config(composed))
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)
