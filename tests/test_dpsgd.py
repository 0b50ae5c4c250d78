"""``dp=dpsgd``: sample-level DP-SGD on each client's trained tensors by Opacus. One round's
update pinned against per-sample gradients clipped, summed and noised by hand (the noise from
the same seeded generator); the epsilon in ``metrics.jsonl`` equals Opacus's accountant for the
same steps; the target-epsilon mode reaches its target; each refusal is one line naming the key."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.config import ConfigError
from fedadapt.entry import compose_config, to_run_config
from fedadapt.federation.client import dpsgd
from fedadapt.federation.client.training import derive_seed, train_local
from fedadapt.strategies.privacy import (
    DPSGDAccounting,
    dpsgd_epsilon,
    dpsgd_plan,
    dpsgd_schedule,
)

pytest.importorskip("opacus")

N, D, K, B = 23, 5, 3, 4  # a client's examples, feature width, classes, batch size


class Rows:
    """A client's feature rows, served as :class:`fedadapt.data.sources.DataSource` does."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def stream(self, batches, device, crops=None):
        for b in batches:
            idx = torch.as_tensor(np.asarray(b, dtype=np.int64))
            yield self.x[idx].to(device), self.y[idx].to(device)


class Tiny(nn.Module):
    """A frozen projection (the backbone) before a trained linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(D, D)
        self.head = nn.Linear(D, K)
        self.backbone.requires_grad_(False)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))

    def training_loss(self, x, y):
        return F.cross_entropy(self(x), y)


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, D, generator=g) * 3, torch.randint(K, (N,), generator=g)


def by_hand(model: Tiny, x, y, *, lr, seed, z, clip, epochs, mu=0.0):
    """The round in float64 numpy: Poisson batches and noise from the same seeded streams,
    each example's gradient of (W, b) clipped jointly to ``clip``, summed, noised, divided by
    n q; FedProx's mu (w - w0) added after the noise; plain SGD."""
    q, steps = dpsgd_schedule(N, B, epochs)
    batches = dpsgd.poisson_batches(np.arange(N), B, epochs, derive_seed(seed, dpsgd.BATCH_STREAM))
    assert len(batches) == steps
    noise = torch.Generator().manual_seed(derive_seed(seed, dpsgd.NOISE_STREAM))
    h = np.tanh(x.double().numpy() @ model.backbone.weight.double().detach().numpy().T
                + model.backbone.bias.double().detach().numpy())
    w = model.head.weight.detach().double().numpy().copy()
    b = model.head.bias.detach().double().numpy().copy()
    w0, b0 = w.copy(), b.copy()
    for idx in batches:
        gw, gb = np.zeros_like(w), np.zeros_like(b)
        for i in idx:
            logits = h[i] @ w.T + b
            p = np.exp(logits - logits.max())
            p /= p.sum()
            p[int(y[i])] -= 1.0  # d CE / d logits
            ew, eb = np.outer(p, h[i]), p
            scale = min(1.0, clip / (np.sqrt((ew ** 2).sum() + (eb ** 2).sum()) + 1e-6))
            gw, gb = gw + scale * ew, gb + scale * eb
        gw = gw + torch.normal(0, z * clip, size=w.shape, generator=noise).double().numpy()
        gb = gb + torch.normal(0, z * clip, size=b.shape, generator=noise).double().numpy()
        gw, gb = gw / (N * q) + mu * (w - w0), gb / (N * q) + mu * (b - b0)
        w, b = w - lr * gw, b - lr * gb
    return w, b


@pytest.mark.parametrize("z,clip,mu", [(0.0, 0.05, 0.0), (1.3, 0.5, 0.0), (0.7, 0.2, 0.3)])
def test_one_round_is_per_sample_clipping_and_seeded_noise_on_the_trained_tensors_only(z, clip,
                                                                                        mu):
    from fedadapt.config import TrainConfig

    torch.manual_seed(0)
    model = Tiny()
    frozen = {k: v.clone() for k, v in model.backbone.state_dict().items()}
    x, y = data()
    want_w, want_b = by_hand(model, x, y, lr=0.5, seed=11, z=z, clip=clip, epochs=2, mu=mu)
    train = TrainConfig(lr=0.5, momentum=0.0, batch_size=B, local_epochs=2,
                        precision="fp32")
    loss, seen = train_local(model, Rows(x, y), np.arange(N), train, lr=0.5, seed=11,
                             proximal_mu=mu, precision="fp32",
                             private=dpsgd.PrivateSteps(z, clip))
    np.testing.assert_allclose(model.head.weight.detach().numpy(), want_w, rtol=0, atol=2e-6)
    np.testing.assert_allclose(model.head.bias.detach().numpy(), want_b, rtol=0, atol=2e-6)
    assert all(torch.equal(v, model.backbone.state_dict()[k]) for k, v in frozen.items())
    assert np.isfinite(loss) and seen > 0
    # Opacus's hooks and per-sample gradients are off the model afterwards
    assert not hasattr(model.head.weight, "grad_sample")
    assert not dpsgd._OPEN


def test_an_empty_poisson_batch_is_a_step_of_noise_alone():
    from fedadapt.config import TrainConfig

    torch.manual_seed(0)
    model = Tiny()
    x, y = data()
    seed = next(s for s in range(500) if any(  # a seed that draws an empty batch
        len(b) == 0 for b in dpsgd.poisson_batches(np.arange(N), B, 1,
                                                   derive_seed(s, dpsgd.BATCH_STREAM))))
    want_w, want_b = by_hand(model, x, y, lr=0.3, seed=seed, z=0.9, clip=0.4, epochs=1)
    train_local(model, Rows(x, y), np.arange(N),
                TrainConfig(lr=0.3, momentum=0.0, batch_size=B, local_epochs=1,
                            precision="fp32"), lr=0.3,
                seed=seed, precision="fp32", private=dpsgd.PrivateSteps(0.9, 0.4))
    np.testing.assert_allclose(model.head.weight.detach().numpy(), want_w, rtol=0, atol=2e-6)
    np.testing.assert_allclose(model.head.bias.detach().numpy(), want_b, rtol=0, atol=2e-6)


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
def test_the_mod_accounts_each_clients_rounds_in_its_context_with_opacus(accountant):
    from flwr.app import Context, MetricRecord, RecordDict

    class Reply:  # what the mod reads of a client's reply Message
        def __init__(self, content):
            self.content = content

        def has_error(self):
            return False

    mod, ctx = DPSGDAccounting(accountant), Context(1, 7, {}, RecordDict(), {})
    rounds = [(1.1, 0.25, 8), (1.1, 0.25, 8), (0.9, 0.2, 10)]
    got = []
    for z, q, steps in rounds:
        def client(msg, context, z=z, q=q, steps=steps):
            return Reply(RecordDict({"metrics": MetricRecord({
                "num-examples": 10, "dpsgd_noise": z, "dpsgd_sample_rate": q,
                "dpsgd_steps": steps, "dpsgd_delta": 1e-5})}))

        metrics = mod(None, ctx, client).content["metrics"]
        assert "dpsgd_noise" not in metrics and metrics["num-examples"] == 10
        got.append(metrics["dpsgd_epsilon"])
    from opacus.accountants import create_accountant

    acc = create_accountant(accountant)
    for z, q, steps in rounds:
        for _ in range(steps):
            acc.step(noise_multiplier=z, sample_rate=q)
    assert got[-1] == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    assert got[0] < got[1] < got[2]


def test_the_target_epsilon_sets_each_clients_noise_and_is_reached():
    cfg = to_run_config(compose_config(["dp=dpsgd", "dp.target_epsilon=2.5"]))
    sizes = [40, 200, 7]
    plan = dpsgd_plan(cfg.dp, sizes, batch_size=16, local_epochs=2, rounds=5)
    for n, z, delta in zip(sizes, plan.noise, plan.delta):
        q, steps = dpsgd_schedule(n, 16, 2)
        assert delta == min(1e-5, n ** -1.1)
        spent = dpsgd_epsilon([(z, q, steps * 5)], delta, "rdp")
        assert 2.5 * 0.97 < spent <= 2.5  # Opacus's tolerance: within 0.01 below the target
    fixed = to_run_config(compose_config(["dp=dpsgd", "dp.noise_multiplier=0.8",
                                          "dp.delta=1e-4"]))
    plan = dpsgd_plan(fixed.dp, sizes, batch_size=16, local_epochs=2, rounds=5)
    assert plan.noise == (0.8,) * 3 and plan.delta == (1e-4,) * 3


def test_a_target_no_noise_reaches_is_refused_in_one_line():
    cfg = to_run_config(compose_config(["dp=dpsgd", "dp.target_epsilon=1e-9"]))
    with pytest.raises(ConfigError) as err:
        dpsgd_plan(cfg.dp, [50], batch_size=50, local_epochs=1, rounds=100)
    assert str(err.value).startswith("dp.target_epsilon=1e-09 is invalid: no noise reaches it")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("override,says", [
    ("dp.max_grad_norm=0", "dp.max_grad_norm=0.0 is invalid"),
    ("dp.noise_multiplier=-1", "dp.noise_multiplier=-1.0 is invalid"),
    ("dp.delta=1.5", "dp.delta=1.5 is invalid"),
    ("dp.target_epsilon=0", "dp.target_epsilon=0.0 is invalid"),
    ("dp.accountant=gdp", "dp.accountant='gdp' is invalid"),
    ("train.clip_grad_norm=1.0", "train.clip_grad_norm=1.0 is invalid"),
])
def test_bad_keys_are_refused_in_one_line_naming_the_key(override, says):
    with pytest.raises(ConfigError) as err:
        to_run_config(compose_config(["dp=dpsgd", override]))
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


@pytest.mark.parametrize("strategy", ["fedavg", "fedadam", "krum", "fednova"])
def test_it_wraps_no_strategy_and_composes_with_any(strategy):
    from fedadapt.strategies.build import build_strategy

    cfg = to_run_config(compose_config(["dp=dpsgd", f"strategy={strategy}"]))
    built = build_strategy(cfg.strategy, cfg.dp, num_clients=5, fraction_train=1.0,
                           fraction_evaluate=0.0, weighting="examples", lr=0.1,
                           train=cfg.train)
    assert "DifferentialPrivacy" not in type(built).__name__


def test_batchnorm_in_a_trained_module_is_refused_in_one_line():
    model = Tiny()
    model.head = nn.Sequential(nn.BatchNorm1d(D), nn.Linear(D, K))
    with pytest.raises(ConfigError) as err:
        dpsgd.refuse_untrainable(model, "mine")
    assert str(err.value).startswith("dp=dpsgd is invalid for method=mine: its trained module "
                                     "head.0 (BatchNorm1d): BatchNorm cannot support")
    assert "\n" not in str(err.value)
    model.head[0].requires_grad_(False)  # a frozen BatchNorm is not trained
    dpsgd.refuse_untrainable(model, "mine")


# -- a whole run ------------------------------------------------------------------------------

TINY = ["backbone=tiny_vit", "dataset.max_samples=300", "partition.num_clients=4",
        "partition.fraction_fit=1.0", "rounds=2", "federation.eval_every=1", "train.lr=0.1",
        "train.precision=fp32", "dp=dpsgd", "dp.noise_multiplier=0.9", "dp.max_grad_norm=0.5"]


def run(run_dir, overrides, cache_dir):
    from omegaconf import OmegaConf

    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl

    composed = compose_config([*TINY, *overrides, f"cache_dir={cache_dir}"])
    summary = run_experiment(to_run_config(composed), run_dir,
                             config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                             execute=in_process("workers"))
    return summary, read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow  # whole runs, in process
def test_a_run_reports_each_rounds_epsilon_as_opacus_accounts_it(tmp_path, cache_dir):
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.partition import cached_partition

    summary, rows = run(tmp_path / "k4", ["federation.clients_per_worker=4"], cache_dir)
    assert summary["layout"]["side_by_side"] == "one_at_a_time"
    assert summary["privacy"]["epsilon"] == rows[-1]["strategy/train/dpsgd_epsilon_max"]
    _, alone = run(tmp_path / "k1", ["federation.clients_per_worker=1"], cache_dir)
    cfg = to_run_config(compose_config([*TINY, f"cache_dir={cache_dir}"]))
    prepared = prepare_dataset(cfg.dataset, cfg.cache_dir, cfg.seed)
    sizes = [len(c.train) for c in cached_partition(prepared, cfg.partition,
                                                    load_card(cfg.dataset.name), cfg.seed,
                                                    cfg.cache_dir).clients]
    for rnd, row in enumerate(rows, 1):
        assert row["clients_failed"] == 0
        spent = []
        for n in sizes:
            q, steps = dpsgd_schedule(n, cfg.train.batch_size, cfg.train.local_epochs)
            spent.append(dpsgd_epsilon([(0.9, q, steps)] * rnd, min(1e-5, n ** -1.1), "rdp"))
        assert row["strategy/train/dpsgd_epsilon_max"] == pytest.approx(max(spent), rel=1e-9)
        assert row["strategy/train/dpsgd_epsilon_client_mean"] == pytest.approx(
            np.mean(spent), rel=1e-9)
    # one at a time whatever the workers' group size: the same numbers
    assert [r["global_loss"] for r in rows] == [r["global_loss"] for r in alone]
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in alone]


def test_a_trained_tensor_opacus_gives_no_per_sample_gradient_is_refused_before_the_rounds():
    class Scaled(Tiny):  # a trained tensor held by a module whose forward never runs
        def __init__(self):
            super().__init__()
            self.extra = nn.Module()
            self.extra.w = nn.Parameter(torch.ones(K))

        def forward(self, x):
            return super().forward(x) * self.extra.w

    x, y = data()
    with pytest.raises(ConfigError) as err:
        dpsgd.probe(Scaled(), Rows(x, y), np.arange(N), "mine")
    assert str(err.value) == ("dp=dpsgd is invalid for method=mine: Opacus computes no "
                              "per-sample gradient of its trained tensors (none for extra.w)")
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dpsgd.probe(model, Rows(x, y), np.arange(N), "mine")  # no step taken, nothing left behind
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert model.head.weight.grad is None and not hasattr(model.head.weight, "grad_sample")


def test_a_method_whose_clients_do_not_train_is_refused_before_any_data():
    from fedadapt.experiment import prepare_run

    with pytest.raises(ConfigError) as err:
        prepare_run(to_run_config(compose_config(["dp=dpsgd", "method=duet"])), quiet=True)
    assert str(err.value) == ("dp=dpsgd is invalid for method=duet: DP-SGD runs in the clients' "
                              "local training of the rounds, and this method's clients train "
                              "none")
