"""Ditto (Li et al., ICML 2021, arXiv 2012.04221) and APFL (Deng et al., 2020, arXiv
2003.13461) as ``pfl=`` kinds: one round of each on a linear head pinned against plain numpy
(full-batch steps of softmax cross-entropy), Ditto's personal copy and APFL's mixture in the
clients' evaluation and never on the server, resumes equal to straight runs, and the
refusals of bad keys."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import accuracy_of, final_checkpoint, tiny_run
from test_grouped import TINY_VIT
from test_resume import _Killed, _stopping_after  # a run that dies after a round

from fedadapt.adapters.exits import AccumulatorConfig
from fedadapt.adapters.heads import LinearHeadConfig, MlpHeadConfig
from fedadapt.adapters.lora import LoraMethodConfig
from fedadapt.config import ConfigError, SettingConfig, validate
from fedadapt.experiment import prepare_run
from fedadapt.federation.client.grouped import ClientJob
from fedadapt.federation.client.training import derive_seed, train_local
from fedadapt.federation.client.worker import train_groups
from fedadapt.federation.server.checkpoint import load_client_state
from fedadapt.pfl.apfl import ALPHA_KEY, Apfl
from fedadapt.pfl.ditto import Ditto
from fedadapt.pfl.rule import RoundWork
from fedadapt.results.store import read_jsonl

W, B = "head.weight", "head.bias"
LR = 0.1


def prepared(cache_dir, pfl, **train):
    """A tiny run's linear head on cached features, plain SGD (no momentum unless asked)."""
    cfg = tiny_run(cache_dir, LinearHeadConfig(), pfl=pfl)
    cfg.train = replace(cfg.train, **{"momentum": 0.0, **train})
    return prepare_run(validate(cfg), quiet=True)


def jobs_for(prep, sizes=(12,)) -> list[ClientJob]:
    """One job per size, each client starting from its own tensors (the global ones moved)."""
    model, spec = prep.model, prep.spec
    base = model.tensors(model.trainable_names())
    out = []
    for cid, n in enumerate(sizes):
        gen = torch.Generator().manual_seed(10 + cid)
        out.append(ClientJob(cid=cid, indices=spec.clients[cid].train[:n], seed=derive_seed(3, cid),
                             tensors={k: t + 0.05 * torch.randn(t.shape, generator=gen)
                                      for k, t in base.items()}))
    return out


def moved(tensors, seed, scale=0.3):
    gen = torch.Generator().manual_seed(seed)
    return {k: t + scale * torch.randn(t.shape, generator=gen) for k, t in tensors.items()}


def round_of(prep, rule, jobs, state, size=1):
    """``rule``'s round of ``jobs`` (the clients ``size`` side by side) and its RoundWork."""
    spec, model = prep.spec, prep.model
    work = RoundWork(spec=spec, model=model, jobs=jobs, state=state,
                     received={j.cid: {} for j in jobs}, rates={j.cid: (LR, 0.0) for j in jobs},
                     train_config=spec.train, num_classes=spec.num_classes,
                     _train=lambda js, train, r: train_groups(spec, model, js, size, r, train))
    return rule.train_round(work), work


# -- independent numpy -------------------------------------------------------------------------

def data(prep, job):
    x, y = prep.spec.train_source.get(job.indices, "cpu")
    return x.double().numpy(), y.numpy()


def grad(p, x, y):
    """The gradient of the mean softmax cross-entropy of ``x @ W.T + b`` at ``p = (W, b)``."""
    z = x @ p[0].T + p[1]
    e = np.exp(z - z.max(1, keepdims=True))
    g = e / e.sum(1, keepdims=True)
    g[np.arange(len(y)), y] -= 1
    g /= len(y)
    return g.T @ x, g.sum(0)


def np_params(tensors):
    return [tensors[W].double().numpy(), tensors[B].double().numpy()]


def close(got, want, atol=1e-5):
    """``got`` (tensors by name) is ``want`` (numpy ``[W, b]``) to float32's precision."""
    for g, w in zip(np_params(got), want):
        np.testing.assert_allclose(g, w, atol=atol, rtol=1e-5)


def gd(p, x, y, steps, lr, lam=0.0, anchor=None):
    """Full-batch steps of ``lr * (grad + lam * (p - anchor))``."""
    p = [a.copy() for a in p]
    for _ in range(steps):
        g = grad(p, x, y)
        p = [a - lr * (ga + (lam * (a - c) if lam else 0)) for a, ga, c in
             zip(p, g, anchor or p)]
    return p


# -- Ditto -------------------------------------------------------------------------------------

@pytest.mark.parametrize("first_round", [True, False])
def test_ditto_one_round_against_numpy(cache_dir, first_round):
    """The sent tensors: 2 plain-SGD steps (12 examples, batch 16, 2 epochs) from the received
    w^t; the personal copy: 3 steps of ``0.2 * (grad + 0.5 (v - w^t))`` from its state (from
    w^t on the client's first round). Nothing else is sent."""
    rule = Ditto(lam=0.5, personal_epochs=3, personal_lr=0.2)
    prep = prepared(cache_dir, rule, local_epochs=2)
    (job,) = jobs_for(prep)
    w0 = np_params(job.tensors)
    state = {} if first_round else moved(job.tensors, 7)
    v0 = w0 if first_round else np_params(state)
    x, y = data(prep, job)
    out, work = round_of(prep, rule, [job], {0: dict(state)})
    close(out[0].tensors, gd(w0, x, y, 2, LR))
    close(work.state[0], gd(v0, x, y, 3, 0.2, lam=0.5, anchor=w0))
    assert work.send == {}
    assert not np.allclose(np_params(out[0].tensors)[0], np_params(work.state[0])[0])


def test_ditto_lam_zero_trains_the_personal_copy_alone(cache_dir):
    """lam = 0: the personal copy is local training from its state, whatever w^t is."""
    rule = Ditto(lam=0.0, personal_epochs=2)
    prep = prepared(cache_dir, rule, local_epochs=1)
    (job,) = jobs_for(prep)
    v0 = moved(job.tensors, 8)
    x, y = data(prep, job)
    want = gd(np_params(v0), x, y, 2, LR)  # personal_lr null: the round's
    _, work = round_of(prep, rule, [job], {0: dict(v0)})
    close(work.state[0], want)
    (other,) = jobs_for(prep)
    other.tensors = moved(other.tensors, 9)  # another global model
    _, work = round_of(prep, rule, [other], {0: dict(v0)})
    close(work.state[0], want)


def test_ditto_side_by_side_equals_one_at_a_time(cache_dir):
    rule = Ditto(lam=0.3, personal_epochs=2, personal_lr=0.05)
    prep = prepared(cache_dir, rule, batch_size=8)
    runs = []
    for size in (3, 1):
        jobs = jobs_for(prep, (12, 20, 7))
        state = {0: {}, 1: moved(jobs[1].tensors, 5), 2: moved(jobs[2].tensors, 6)}
        runs.append(round_of(prep, rule, jobs, state, size=size))
    (together, w3), (alone, w1) = runs
    for cid in range(3):
        for n in (W, B):
            torch.testing.assert_close(together[cid].tensors[n], alone[cid].tensors[n],
                                       atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(w3.state[cid][n], w1.state[cid][n], atol=2e-5,
                                       rtol=1e-4)


# -- APFL --------------------------------------------------------------------------------------

def apfl_numpy(w, v, a, x, y, steps, lr, alpha_lr, adaptive=True):
    """APFL's local steps (Algorithm 1), each from the values before it."""
    w, v = [t.copy() for t in w], [t.copy() for t in v]
    for _ in range(steps):
        gw = grad(w, x, y)
        gm = grad([a * pv + (1 - a) * pw for pv, pw in zip(v, w)], x, y)
        ga = sum(float(((pv - pw) * g).sum()) for pv, pw, g in zip(v, w, gm))
        w = [p - lr * g for p, g in zip(w, gw)]
        v = [p - lr * a * g for p, g in zip(v, gm)]
        if adaptive:
            a = min(1.0, max(0.0, a - alpha_lr * ga))
    return w, v, a


@pytest.mark.parametrize("first_round", [True, False])
def test_apfl_one_round_against_numpy(cache_dir, first_round):
    """3 steps (12 examples, batch 16, 3 epochs): w by its own loss, v by the mixture's,
    alpha by ``<v - w, grad F(mixture)>``; from the state's v and alpha, or from w^t and
    ``pfl.alpha`` on the client's first round. The client is evaluated with
    ``alpha v + (1 - alpha) w``."""
    rule = Apfl(alpha=0.3, alpha_lr=0.5)
    prep = prepared(cache_dir, rule, local_epochs=3)
    (job,) = jobs_for(prep)
    w0 = np_params(job.tensors)
    state = {} if first_round else {**moved(job.tensors, 4), ALPHA_KEY: torch.tensor([0.6])}
    v0, a0 = (w0, 0.3) if first_round else (np_params(state), 0.6)
    x, y = data(prep, job)
    w, v, a = apfl_numpy(w0, v0, a0, x, y, 3, LR, 0.5)
    out, work = round_of(prep, rule, [job], {0: dict(state)})
    close(out[0].tensors, w)
    close(work.state[0], v)
    assert float(work.state[0][ALPHA_KEY]) == pytest.approx(a, abs=1e-5)
    if not first_round:
        assert a != pytest.approx(0.6, abs=1e-4)  # it learned
    assert work.send == {}
    evaluated = rule.evaluated(prep.model, out[0].tensors, work.state[0])
    close(evaluated, [a * pv + (1 - a) * pw for pv, pw in zip(v, w)], atol=2e-5)


def test_apfl_alpha_stays_in_zero_one(cache_dir):
    """A large alpha_lr drives alpha to a bound, where the projection keeps it."""
    for seed in (4, 5, 6):
        rule = Apfl(alpha=0.5, alpha_lr=1e3)
        prep = prepared(cache_dir, rule, local_epochs=3)
        (job,) = jobs_for(prep)
        state = moved(job.tensors, seed, scale=1.0)
        x, y = data(prep, job)
        _, _, want = apfl_numpy(np_params(job.tensors), np_params(state), 0.5, x, y, 3, LR, 1e3)
        _, work = round_of(prep, rule, [job], {0: dict(state)})
        got = float(work.state[0][ALPHA_KEY])
        assert 0.0 <= got <= 1.0 and got in (0.0, 1.0) and got == want


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_apfl_fixed_alpha_zero_trains_fedavgs_w(cache_dir, momentum):
    """adaptive_alpha=false, alpha=0: w is what FedAvg's local training makes of w^t (with the
    run's optimiser, momentum too), alpha stays 0 and v does not move."""
    rule = Apfl(alpha=0.0, adaptive_alpha=False)
    prep = prepared(cache_dir, rule, local_epochs=2, batch_size=8, momentum=momentum)
    (job,) = jobs_for(prep, (20,))
    v0 = moved(job.tensors, 3)
    out, work = round_of(prep, rule, [job], {0: dict(v0)})
    model, spec = prep.model, prep.spec
    model.load_tensors(job.tensors)
    loss, seen = train_local(model, spec.train_source, job.indices, spec.train, lr=LR,
                             seed=job.seed, precision="fp32")
    assert (out[0].loss, out[0].seen) == (pytest.approx(loss, rel=1e-6), seen)
    fedavg = model.tensors([W, B])
    for n in (W, B):
        torch.testing.assert_close(out[0].tensors[n], fedavg[n], atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(work.state[0][n], v0[n])
    assert float(work.state[0][ALPHA_KEY]) == 0.0


@pytest.mark.parametrize("family", ["exits", "lora", "dropout"])
def test_apfls_own_step_runs_each_family_as_train_local_does(cache_dir, family):
    """APFL's step (two ``functional_call`` forwards) on an early-exit model at the exits a
    client draws (adapters in a tiny ViT), on LoRA in it, and with dropout (the client's own
    masks): with alpha fixed at 0 its w is exactly train_local's, and alpha learns."""
    method, backbone, setting, exits = {
        "exits": (AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                    adapter_bottleneck=4), TINY_VIT,
                  SettingConfig(name="anytime"), [0, 1, 2]),
        "lora": (LoraMethodConfig(), TINY_VIT, None, None),
        "dropout": (MlpHeadConfig(hidden_dim=16, dropout=0.5), None, None, None)}[family]
    rule = Apfl(alpha=0.0, adaptive_alpha=False)
    cfg = tiny_run(cache_dir, method, pfl=rule)
    cfg.backbone = backbone or cfg.backbone
    cfg.setting = setting or cfg.setting
    cfg.train = replace(cfg.train, momentum=0.0, batch_size=8)
    prep = prepare_run(validate(cfg), quiet=True)
    model, spec = prep.model, prep.spec
    (job,) = jobs_for(prep, (20,))
    job.exits = exits
    out, _ = round_of(prep, rule, [job], {0: {}})
    model.load_tensors(job.tensors)
    train_local(model, spec.train_source, job.indices, spec.train, lr=LR, seed=job.seed,
                exits=exits, precision="fp32")
    for n, t in model.tensors(model.trainable_names()).items():
        torch.testing.assert_close(out[0].tensors[n], t, atol=1e-6, rtol=1e-5, msg=n)
    (job,) = jobs_for(prep, (20,))
    job.exits = exits
    _, work = round_of(prep, Apfl(alpha=0.5, alpha_lr=0.1), [job], {0: {}})
    assert 0 < float(work.state[0][ALPHA_KEY]) < 1
    assert float(work.state[0][ALPHA_KEY]) != pytest.approx(0.5, abs=1e-4)


# -- whole runs --------------------------------------------------------------------------------

TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=300", "partition.num_clients=4", "federation.eval_every=1",
        "federation.checkpoint_every=2", "train.precision=fp32", "train.momentum=0"]


def composed(cache_dir, args):
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config

    c = compose_config([*TINY, *args, f"cache_dir={cache_dir}"])
    return to_run_config(c), OmegaConf.to_yaml(c, resolve=True)


def run(cache_dir, run_dir, args, execute=None, resume=False):
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    cfg, yaml = composed(cache_dir, args)
    run_experiment(cfg, run_dir, config_yaml=yaml, execute=execute or in_process("workers"),
                   resume=resume)
    return [{k: v for k, v in r.items() if k not in ("round_s", "wall_s")}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


def test_ditto_run_keeps_the_personal_copy_and_evaluates_with_it(cache_dir, tmp_path):
    """The server's model of a Ditto run is FedAvg's to the bit (the personal copy never
    reaches it), its global accuracy too; the client-mean accuracy is each client's personal
    copy's on its own test split (computed here from the saved copies), not the global
    model's."""
    args = ["rounds=3", "partition.fraction_fit=1.0", "train.lr=0.2"]
    ditto = run(cache_dir, tmp_path / "ditto",
                [*args, "pfl=ditto", "pfl.lam=0.0", "pfl.personal_epochs=5"])
    fedavg = run(cache_dir, tmp_path / "fedavg", args)
    assert [r["global_acc"] for r in ditto] == [r["global_acc"] for r in fedavg]
    assert [r["train_loss"] for r in ditto] == [r["train_loss"] for r in fedavg]
    ours, theirs = final_checkpoint(tmp_path / "ditto"), final_checkpoint(tmp_path / "fedavg")
    assert set(ours) == set(theirs)
    for n in ours:
        np.testing.assert_array_equal(np.asarray(ours[n]), np.asarray(theirs[n]))
    cfg, _ = composed(cache_dir, [*args, "pfl=ditto"])
    prep = prepare_run(validate(cfg), quiet=True)
    spec, accs, global_accs = prep.spec, [], []
    for cid, client in enumerate(spec.clients):
        v = load_client_state(tmp_path / "ditto" / "clients" / str(cid) / "rule", 3)
        accs.append(accuracy_of(prep, {**ours, **v}, client.test, spec.train_source))
        global_accs.append(accuracy_of(prep, ours, client.test, spec.train_source))
    assert ditto[-1]["client_acc"] == pytest.approx(np.mean(accs), abs=1e-6)
    assert fedavg[-1]["client_acc"] == pytest.approx(np.mean(global_accs), abs=1e-6)
    assert ditto[-1]["client_acc"] != pytest.approx(fedavg[-1]["client_acc"], abs=1e-3)


@pytest.mark.parametrize("kind", [["pfl=ditto", "pfl.lam=0.3", "pfl.personal_epochs=2"],
                                  ["pfl=apfl", "pfl.alpha=0.4", "pfl.alpha_lr=0.5"]])
def test_stopped_and_resumed_equals_straight(cache_dir, tmp_path, kind):
    """Stopped after round 3 (checkpoint at 2: round 3 reruns from the rule's saved state),
    resumed: the metrics of a straight run, client-mean accuracy (the personal models) too.
    Two clients a worker: Ditto's side by side, APFL's one at a time (the layout says so)."""
    args = ["rounds=5", "partition.fraction_fit=0.5", "federation.clients_per_worker=2", *kind]
    ref = run(cache_dir, tmp_path / "ref", args)
    with pytest.raises(_Killed):
        run(cache_dir, tmp_path / "killed", args, execute=_stopping_after(3))
    assert run(cache_dir, tmp_path / "killed", args, resume=True) == ref
    assert all(r["client_acc"] is not None for r in ref)
    layout = json.loads((tmp_path / "ref" / "summary.json").read_text())["layout"]
    assert layout["clients_per_worker"] == 2
    if "pfl=apfl" in kind:
        assert (layout["side_by_side"], layout["side_by_side_why"]) == ("one_at_a_time",
                                                                        "pfl=apfl")
    else:
        assert layout["side_by_side"] != "one_at_a_time"


# -- bad input ---------------------------------------------------------------------------------

@pytest.mark.parametrize("args,key", [
    (["pfl=ditto", "pfl.lam=-0.5"], "pfl.lam"),
    (["pfl=ditto", "pfl.personal_epochs=0"], "pfl.personal_epochs"),
    (["pfl=ditto", "pfl.personal_lr=0"], "pfl.personal_lr"),
    (["pfl=apfl", "pfl.alpha=1.5"], "pfl.alpha"),
    (["pfl=apfl", "pfl.alpha=-0.1"], "pfl.alpha"),
    (["pfl=apfl", "pfl.alpha_lr=0"], "pfl.alpha_lr"),
    (["pfl=apfl", "dp=dpsgd"], "dp"),  # its own steps are not DP-SGD's
])
def test_bad_values_are_refused_in_one_line_naming_the_key(cache_dir, args, key):
    with pytest.raises(ConfigError) as err:
        composed(cache_dir, args)
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)
