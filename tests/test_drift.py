"""strategy=scaffold and strategy=feddyn (strategies/scaffold.py, strategies/feddyn.py, their
client side fedadapt/pfl/drift.py): one round's client update and server update against
independent numpy on a linear head (SCAFFOLD options I and II; FedDyn over two rounds so that h
and g_k are non-zero), a SCAFFOLD client at c = c_i = 0 trains as FedAvg's, clients side by side
equal one at a time, a resume equal to a straight run, the bytes of a round, and the
refusals in one line naming the key."""

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import tiny_run
from test_resume import _Killed, _stopping_after  # a run that dies after a round

from fedadapt.adapters.heads import LinearHeadConfig
from fedadapt.config import ConfigError, validate
from fedadapt.experiment import prepare_run
from fedadapt.federation.client.grouped import ClientJob
from fedadapt.federation.client.training import derive_seed, local_schedule
from fedadapt.federation.client.worker import train_groups
from fedadapt.pfl.drift import FedDynRule, ScaffoldRule
from fedadapt.pfl.rule import RoundWork

LR, SIZES = 0.1, [13, 8, 21]  # batch 8: a ragged last batch, one client of one batch


@pytest.fixture(scope="module")
def prep(cache_dir):
    cfg = tiny_run(cache_dir, LinearHeadConfig())
    cfg.train = replace(cfg.train, batch_size=8, local_epochs=2, momentum=0.0,
                        weight_decay=0.0)
    return prepare_run(validate(cfg), quiet=True)


def make_jobs(prep, seed=0):
    spec, model = prep.spec, prep.model
    pool = np.concatenate([c.train for c in spec.clients])
    base = model.tensors(model.trainable_names())
    out, at = [], 0
    for i, n in enumerate(SIZES):
        gen = torch.Generator().manual_seed(seed * 10 + i)
        tensors = {k: t + 0.1 * torch.randn(t.shape, generator=gen) for k, t in base.items()}
        out.append(ClientJob(cid=i, indices=pool[at:at + n], tensors=tensors,
                             seed=derive_seed(7, seed, i)))
        at += n
    return out


def work_for(prep, jobs, *, state=None, received=None, side_by_side=3):
    spec = prep.spec
    return RoundWork(
        spec=spec, model=prep.model, jobs=jobs, rates={j.cid: (LR, 0.0) for j in jobs},
        state=state if state is not None else {j.cid: {} for j in jobs},
        received=received if received is not None else {j.cid: {} for j in jobs},
        train_config=spec.train, num_classes=spec.num_classes,
        _train=lambda js, train, r: train_groups(spec, prep.model, js, side_by_side, r, train))


def data_of(prep, indices):
    """``(features [n, D], labels [n])`` in float64, the head's inputs."""
    (x, y), = list(prep.spec.train_source.stream([np.asarray(indices)], torch.device("cpu")))
    return x.double().numpy(), y.numpy()


def grad(w, b, f, y):
    """The gradient of the mean cross-entropy of ``softmax(f w^T + b)`` (numpy)."""
    z = f @ w.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    return p.T @ f / len(y), p.mean(0)


def numpy_sgd(prep, job, start, *, linear=None, mu=0.0, anchor=None, momentum=0.0):
    """``train.local_epochs`` of SGD on the head from ``start`` ({name: float64}), each
    step's gradient plus ``linear`` and ``mu (w - anchor)`` (with ``momentum``, torch's: the
    buffer ``m <- rho m + g``, first ``g``): the reference."""
    (wn, w0), (bn, b0) = sorted(start.items(), key=lambda kv: kv[1].ndim, reverse=True)
    w, b = w0.copy(), b0.copy()
    mw = mb = None
    feats, labels = data_of(prep, job.indices)
    where = {int(i): k for k, i in enumerate(job.indices)}
    batches, _ = local_schedule(job.indices, prep.spec.train, job.seed, None)
    for batch in batches:
        rows = [where[int(i)] for i in batch]
        gw, gb = grad(w, b, feats[rows], labels[rows])
        if linear is not None:
            gw, gb = gw + linear[wn], gb + linear[bn]
        if mu:
            gw, gb = gw + mu * (w - anchor[wn]), gb + mu * (b - anchor[bn])
        if momentum:
            mw, mb = (gw, gb) if mw is None else (momentum * mw + gw, momentum * mb + gb)
            gw, gb = mw, mb
        w, b = w - LR * gw, b - LR * gb
    return {wn: w, bn: b}, len(batches)


def f64(tensors):
    return {n: t.double().numpy() for n, t in tensors.items()}


def close(got, want, atol=2e-5):
    for n in want:
        np.testing.assert_allclose(np.asarray(got[n], np.float64), want[n], atol=atol,
                                   rtol=1e-4, err_msg=n)


def variates(jobs, scale):
    """A server c and each client's c_i, non-zero."""
    gen = torch.Generator().manual_seed(3)
    c = {n: scale * torch.randn(t.shape, generator=gen) for n, t in jobs[0].tensors.items()}
    c_i = {j.cid: {n: scale * torch.randn(t.shape, generator=gen)
                   for n, t in j.tensors.items()} for j in jobs}
    return c, c_i


@pytest.mark.parametrize("option", ["I", "II"])
def test_a_scaffold_client_round_is_the_papers(prep, option):
    """Algorithm 1: K steps with the gradient corrected by c - c_i, then c_i+ by option I (the
    gradient at x over all the client's data) or II (c_i - c + (x - y_i) / (K lr)); dc_i sent,
    c_i+ kept."""
    jobs = make_jobs(prep)
    c, c_i = variates(jobs, 0.05)
    state = {cid: dict(v) for cid, v in c_i.items()}
    work = work_for(prep, jobs, state=state,
                    received={j.cid: {f"c/{n}": t for n, t in c.items()} for j in jobs})
    out = ScaffoldRule(option).train_round(work)
    for job in jobs:
        x, ci, cc = f64(job.tensors), f64(c_i[job.cid]), f64(c)
        y, steps = numpy_sgd(prep, job, x, linear={n: cc[n] - ci[n] for n in x})
        close(f64(out[job.cid].tensors), y)
        if option == "II":
            want = {n: ci[n] - cc[n] + (x[n] - y[n]) / (steps * LR) for n in x}
        else:
            feats, labels = data_of(prep, job.indices)
            names = sorted(x, key=lambda n: x[n].ndim, reverse=True)
            want = dict(zip(names, grad(x[names[0]], x[names[1]], feats, labels)))
        close(f64(work.state[job.cid]), want, atol=1e-4)
        close(f64({n[3:]: t for n, t in work.send[job.cid].items()}),
              {n: want[n] - ci[n] for n in x}, atol=1e-4)
        assert set(work.send[job.cid]) == {f"dc/{n}" for n in x}


def test_option_ii_with_momentum_divides_by_the_weight_of_its_steps(prep):
    """With SGD momentum rho, y_i = x - lr sum_t w_t g_t, the weights adding up to FedNova's
    sum_k (1 - rho^k) / (1 - rho): c_i+ = c_i - c + (x - y_i) / (lr sum_k ...)."""
    rho, jobs = 0.5, make_jobs(prep)
    c, c_i = variates(jobs, 0.05)
    work = work_for(prep, jobs, state={cid: dict(v) for cid, v in c_i.items()},
                    received={j.cid: {f"c/{n}": t for n, t in c.items()} for j in jobs})
    work.train_config = replace(work.train_config, momentum=rho)
    out = ScaffoldRule("II").train_round(work)
    for job in jobs:
        x, ci, cc = f64(job.tensors), f64(c_i[job.cid]), f64(c)
        y, steps = numpy_sgd(prep, job, x, linear={n: cc[n] - ci[n] for n in x}, momentum=rho)
        close(f64(out[job.cid].tensors), y)
        weight = sum((1 - rho ** k) / (1 - rho) for k in range(1, steps + 1))
        close(f64(work.state[job.cid]),
              {n: ci[n] - cc[n] + (x[n] - y[n]) / (weight * LR) for n in x}, atol=1e-4)


def test_a_scaffold_client_at_zero_variates_trains_as_fedavgs(prep):
    jobs = make_jobs(prep)
    zero = {n: torch.zeros_like(t) for n, t in jobs[0].tensors.items()}
    got = ScaffoldRule("II").train_round(work_for(
        prep, jobs, received={j.cid: {f"c/{n}": t for n, t in zero.items()} for j in jobs}))
    plain = work_for(prep, jobs).train()
    for job in jobs:
        for n, t in plain[job.cid].tensors.items():
            torch.testing.assert_close(got[job.cid].tensors[n], t, rtol=0, atol=0)


def test_feddyn_clients_over_two_rounds_are_the_papers(prep):
    """Round 1 from g_k = 0; round 2 from the g_k it kept: each the minimiser's steps of
    L_k - <g_k, theta> + alpha/2 ||theta - theta^{t-1}||^2, then g_k -= alpha (theta_k -
    theta^{t-1})."""
    alpha, state = 0.3, {}
    rule = FedDynRule(alpha)
    g = {}
    for rnd in range(2):
        jobs = make_jobs(prep, seed=rnd)
        state = {j.cid: state.get(j.cid, {}) for j in jobs}
        work = work_for(prep, jobs, state=state)
        out = rule.train_round(work)
        for job in jobs:
            x = f64(job.tensors)
            gk = g.get(job.cid, {n: np.zeros_like(v) for n, v in x.items()})
            theta, _ = numpy_sgd(prep, job, x, linear={n: -gk[n] for n in x}, mu=alpha,
                                 anchor=x)
            close(f64(out[job.cid].tensors), theta)
            g[job.cid] = {n: gk[n] - alpha * (theta[n] - x[n]) for n in x}
            close(f64(work.state[job.cid]), g[job.cid], atol=1e-4)
        assert rnd == 0 or any(np.abs(v).max() > 0 for v in g[0].values())


@pytest.mark.parametrize("rule", [ScaffoldRule("II"), ScaffoldRule("I"), FedDynRule(0.2)])
def test_side_by_side_equals_one_at_a_time(prep, rule):
    jobs = make_jobs(prep)
    c, c_i = variates(jobs, 0.05)
    received = {j.cid: {f"c/{n}": t for n, t in c.items()} for j in jobs}
    outs = []
    for size in (3, 1):
        state = {cid: dict(v) for cid, v in c_i.items()}
        work = work_for(prep, jobs, state=state, received=received, side_by_side=size)
        outs.append((rule.train_round(work), work.state, work.send))
    (a, sa, da), (b, sb, db) = outs
    for job in jobs:
        close(f64(a[job.cid].tensors), f64(b[job.cid].tensors))
        close(f64(sa[job.cid]), f64(sb[job.cid]), atol=1e-4)
        close(f64(da.get(job.cid, {})), f64(db.get(job.cid, {})), atol=1e-4)


# -- the servers -------------------------------------------------------------------------------

def _replies(messages, values):
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

    out = []
    for msg, vals in zip(messages, values):
        arrays = ArrayRecord({k: Array(np.array(v, np.float32)) for k, v in vals.items()})
        content = RecordDict({"arrays": arrays, "metrics": MetricRecord(
            {"num-examples": 10, "train_loss": 1.0})})
        msg.metadata.__dict__["_message_id"] = f"m{msg.metadata.dst_node_id}"
        out.append(Message(content, reply_to=msg))
    return out


class _Grid:
    def __init__(self, n):
        from fedadapt.federation.wire.grid import NODE_BASE

        self.ids = [NODE_BASE + c for c in range(n)]

    def get_node_ids(self):
        return self.ids


def _sent(values):
    from flwr.app import Array, ArrayRecord

    return ArrayRecord({k: Array(np.array(v, np.float32)) for k, v in values.items()})


def test_the_scaffold_server_moves_x_and_c_as_the_paper(flower_task):
    """x += eta_g mean(y_i - x), c += |S|/N mean(dc_i), each tensor over its senders; c goes
    down beside x as rule/c/<tensor>."""
    from flwr.app import ConfigRecord

    from fedadapt.federation.wire.grid import NODE_BASE
    from fedadapt.strategies.scaffold import Scaffold

    s = Scaffold(option="II", server_lr=0.5, num_clients=5, fraction_train=1.0,
                 min_available_nodes=3, min_train_nodes=3)
    x = {"w": np.array([1.0, 2.0]), "b": np.array([0.5])}
    c = {n: np.zeros_like(v) for n, v in x.items()}
    for rnd, ys in enumerate([{0: [2.0, 0.0], 1: [0.0, 4.0], 2: [3.0, 3.0]},
                              {0: [1.0, 1.0], 1: [2.0, 2.0], 2: [0.5, 0.0]}], start=1):
        msgs = list(s.configure_train(rnd, _sent(x), ConfigRecord({}), _Grid(3)))
        sent = next(iter(msgs[0].content.array_records.values()))
        assert sorted(sent.keys()) == ["b", "rule/c/b", "rule/c/w", "w"]
        for n in x:
            np.testing.assert_allclose(sent[f"rule/c/{n}"].numpy(), c[n], atol=1e-7)
        replies = {cid: {"w": y, "rule/dc/w": [0.1 * cid + rnd, -0.2]} for cid, y in ys.items()}
        for cid in (0, 2):  # client 1 did not send b
            replies[cid].update(b=[rnd + cid], **{"rule/dc/b": [cid - 0.5]})
        order = [m.metadata.dst_node_id - NODE_BASE for m in msgs]
        new, _ = s.aggregate_train(rnd, _replies(msgs, [replies[k] for k in order]))
        for n, holders in (("w", [0, 1, 2]), ("b", [0, 2])):
            step = np.mean([np.array(replies[k][n]) - x[n] for k in holders], axis=0)
            c[n] = c[n] + sum(np.array(replies[k][f"rule/dc/{n}"]) for k in holders) / 5
            x[n] = (x[n] + 0.5 * step).astype(np.float32).astype(np.float64)
            np.testing.assert_allclose(new[n].numpy(), x[n], rtol=1e-6)
            np.testing.assert_allclose(s.c[n], c[n], rtol=1e-6)


def test_the_feddyn_server_keeps_h_over_two_rounds(flower_task):
    """h -= alpha/N sum(theta_k - theta^{t-1}); theta^t = mean(theta_k) - h / alpha."""
    from flwr.app import ConfigRecord

    from fedadapt.strategies.feddyn import FedDyn

    alpha, n_all = 0.1, 4
    s = FedDyn(alpha=alpha, num_clients=n_all, fraction_train=1.0, min_available_nodes=3,
               min_train_nodes=3)
    theta = {"w": np.array([1.0, -1.0])}
    h = {"w": np.zeros(2)}
    for rnd, thetas in enumerate([[[1.5, -1.0], [0.5, 0.0], [2.0, -2.0]],
                                  [[1.0, 1.0], [0.0, -0.5], [3.0, 0.0]]], start=1):
        msgs = list(s.configure_train(rnd, _sent(theta), ConfigRecord({}), _Grid(3)))
        new, _ = s.aggregate_train(rnd, _replies(msgs, [{"w": t} for t in thetas]))
        ts = np.array(thetas)
        h["w"] = h["w"] - alpha / n_all * (ts - theta["w"]).sum(0)
        theta["w"] = (ts.mean(0) - h["w"] / alpha).astype(np.float32).astype(np.float64)
        np.testing.assert_allclose(s.h["w"], h["w"], rtol=1e-6)
        np.testing.assert_allclose(new["w"].numpy(), theta["w"], rtol=1e-6)
    assert np.abs(h["w"]).max() > 0


# -- through runs --------------------------------------------------------------------------------

TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=300", "partition.num_clients=4", "federation.eval_every=1",
        "federation.checkpoint_every=2", "train.precision=fp32", "partition.fraction_fit=0.5",
        "train.momentum=0"]


def _rows(run_dir):
    from fedadapt.results.store import read_jsonl

    return [{k: v for k, v in r.items() if k not in ("round_s", "wall_s")}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("extra", [["strategy=scaffold"], ["strategy=scaffold",
                                                            "strategy.option=I"],
                                   ["strategy=feddyn", "strategy.alpha=0.1"]])
def test_a_run_stopped_after_round_3_resumes_to_the_straight_runs_metrics(extra, tmp_path,
                                                                          cache_dir):
    """The server's c / h (strategy state, checkpointed at round 2) and the clients' c_i / g_k
    (their rule state) come back: rounds 3 and 4 rerun as the straight run's."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*TINY, "rounds=5", *extra, f"cache_dir={cache_dir}"])
    yaml = OmegaConf.to_yaml(composed, resolve=True)
    run_experiment(to_run_config(composed), tmp_path / "ref", config_yaml=yaml,
                   execute=in_process("workers"))
    with pytest.raises(_Killed):
        run_experiment(to_run_config(composed), tmp_path / "killed", config_yaml=yaml,
                       execute=_stopping_after(3))
    run_experiment(to_run_config(composed), tmp_path / "killed", config_yaml=yaml,
                   execute=in_process("workers"), resume=True)
    ref = _rows(tmp_path / "ref")
    assert _rows(tmp_path / "killed") == ref and len(ref) == 5
    assert any((tmp_path / "killed" / "clients").rglob("*rule*"))


def test_a_scaffold_round_moves_twice_fedavgs_bytes(tmp_path, cache_dir):
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    rows = {}
    for name in ("fedavg", "scaffold", "feddyn"):
        composed = compose_config([*TINY, "rounds=2", "federation.eval_every=2",
                                   f"strategy={name}", f"cache_dir={cache_dir}"])
        run_experiment(to_run_config(composed), tmp_path / name, execute=in_process("workers"),
                       config_yaml=OmegaConf.to_yaml(composed, resolve=True))
        rows[name] = _rows(tmp_path / name)[0]
    for way in ("bytes_up", "bytes_down"):
        assert rows["feddyn"][way] == rows["fedavg"][way]
        assert abs(rows["scaffold"][way] - 2 * rows["fedavg"][way]) <= 64, way


@pytest.mark.parametrize("args,starts", [
    (["strategy=scaffold", "dp=server_fixed", "method.weighting=uniform"],
     "dp=server_fixed is invalid with strategy=scaffold"),
    (["strategy=feddyn", "dp=client_adaptive", "method.weighting=uniform"],
     "dp=client_adaptive is invalid with strategy=feddyn"),
    (["strategy=feddyn", "strategy.alpha=0"], "strategy.alpha=0"),
    (["strategy=scaffold", "strategy.option=III"], "strategy.option='III' is invalid"),
    (["strategy=scaffold", "strategy.server_lr=0"], "strategy.server_lr=0"),
    (["strategy=scaffold", "train.optimizer=adam"], "train.optimizer='adam' is invalid"),
    (["strategy=scaffold", "strategy.option=I", "dp=dpsgd"], "strategy.option='I' is invalid"),
    (["strategy=scaffold", "secagg=secaggplus"], "strategy='scaffold' is invalid"),
    (["strategy=feddyn", "pfl=fedper"], "pfl='fedper' is invalid"),
    (["strategy=scaffold", "fleet=tiers", "fleet.partial_work=true"],
     "fleet.partial_work=True is invalid"),
])
def test_refused_in_one_line_naming_the_key(args, starts):
    from fedadapt.entry import compose_config, to_run_config

    with pytest.raises(ConfigError) as err:
        to_run_config(compose_config(["method=linear_head", *args]))
    assert str(err.value).startswith(starts), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["scaffold", "feddyn"])
def test_multitier_clients_correct_the_tensors_they_send(name, tmp_path, cache_dir):
    """Multi-tier: each tier's clients send their tier's tensors; c / h and each client's state
    move per tensor over the clients that sent it, and the rounds run to the end."""
    from fedadapt.adapters.exits import LwLinearConfig
    from fedadapt.config import BackboneConfig, SettingConfig
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl
    from fedadapt.strategies.registry import strategy_schemas

    cfg = tiny_run(cache_dir, LwLinearConfig())
    cfg.backbone = BackboneConfig(name="tiny_vit", family="vit", image_size=32, arch=dict(
        patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        intermediate_size=64))
    cfg.setting = SettingConfig(name="multitier")
    cfg.strategy = strategy_schemas()[name]()
    cfg.train = replace(cfg.train, momentum=0.0)
    run_experiment(validate(cfg), tmp_path, execute=in_process("workers"), config_yaml="x\n")
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(rows) == 2 and all(np.isfinite(r["train_loss"]) for r in rows)
    states = list((tmp_path / "clients").rglob("*rule*"))
    assert states
