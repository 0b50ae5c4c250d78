"""DUET and CDC-MMPG as session plug-ins: generated layer shapes, SWA (Eq. 8-9), per-session
generation and padding, the gamma-weighted loss (Eq. 7), ADR's anchor and re-normalisation,
what a device uploads, payload bytes as Flower counts them, AUC, the delay table, config
errors and the counts that fedadapt-inspect prints."""

import itertools
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedadapt.config import ConfigError
from fedadapt.methods.sessions.cdc_mmpg import Adr, CdcMmpg, CdcMmpgConfig, channel_stats, fuse
from fedadapt.methods.sessions.duet import (
    Duet,
    DuetConfig,
    LayerGenerator,
    apply_dynamic,
    build_duet,
    dynamic_arrays,
    dynamic_layers,
    layer_shapes,
    swa_weights,
    weighted_session_ce,
)
from fedadapt.methods.sessions.train import (
    SessionBatch,
    binary_auc,
    kl_weight,
    split_context,
    tensor_bytes,
    train_adr,
    upload_of,
)
from fedadapt.results.tables import RATES_MB_S, delay_table

DIM, HIDDEN, CLASSES, K = 16, [8, 6], 5, 4


def _duet(hidden=HIDDEN, generators=3, temperature=1.0) -> Duet:
    torch.manual_seed(0)
    return Duet(DIM, CLASSES, hidden=list(hidden), generators=generators,
                temperature=temperature, neck=12, embed=7, generator_hidden=9).eval()


def _cdc(adr: bool, query_dim: int = 0) -> CdcMmpg:
    torch.manual_seed(0)
    return CdcMmpg(DIM, CLASSES, hidden=12, adr=adr, latent=4, vae_hidden=10,
                   query_dim=query_dim).eval()


def _entropy(p: torch.Tensor) -> float:
    return float(-(p * p.clamp_min(1e-30).log()).sum())


def _differ(a: dict, b: dict) -> bool:
    return any(not torch.allclose(a[k], b[k]) for k in a)


# -- DUET: shapes -------------------------------------------------------------------------

def test_duet_generates_every_dynamic_layer_per_session():
    """A batch of 3 sessions of K=4: layer n's weight is [3, out_n, in_n] and its bias
    [3, out_n] for every layer of ``layer_shapes``; the layers map [3, K, D] to [3, K, C]."""
    shapes = layer_shapes(DIM, HIDDEN, CLASSES)
    assert shapes == [(8, 16), (6, 8), (5, 6)]
    model = _duet()
    assert model.shapes == shapes
    frames = torch.randn(3, K, DIM)
    with torch.no_grad():
        layers = model(frames)
    assert len(layers) == len(shapes)
    for (w, b), (out, inp) in zip(layers, shapes):
        assert w.shape == (3, out, inp) and b.shape == (3, out)
    assert apply_dynamic(layers, frames).shape == (3, K, CLASSES)
    assert model.session_logits(frames, None, frames).shape == (3, K, CLASSES)


def test_duet_generate_returns_named_layers_that_round_trip():
    """``generate`` answers one session with exactly the device's dynamic layers, named
    ``layer{n}.weight`` / ``layer{n}.bias``; ``dynamic_layers`` inverts ``dynamic_arrays``."""
    model = _duet()
    x = torch.randn(K, DIM)
    with torch.no_grad():
        arrays = model.generate({"embeddings": x})
        batched = model(x.unsqueeze(0))
    assert set(arrays) == {f"layer{n}.{p}" for n in range(3) for p in ("weight", "bias")}
    for n, (out, inp) in enumerate(layer_shapes(DIM, HIDDEN, CLASSES)):
        assert arrays[f"layer{n}.weight"].shape == (out, inp)
        assert arrays[f"layer{n}.bias"].shape == (out,)
        torch.testing.assert_close(arrays[f"layer{n}.weight"], batched[n][0][0])
        torch.testing.assert_close(arrays[f"layer{n}.bias"], batched[n][1][0])
    layers = dynamic_layers(arrays)
    assert len(layers) == 3
    again = dynamic_arrays(layers)
    assert set(again) == set(arrays)
    assert all(torch.equal(again[k], arrays[k]) for k in arrays)
    # the device's prediction from the received arrays equals the server's batched one
    torch.testing.assert_close(apply_dynamic(layers, x),
                               apply_dynamic(batched, x.unsqueeze(0))[0])


# -- SWA ---------------------------------------------------------------------------------

def test_swa_weights_are_a_distribution_flatter_with_temperature():
    """p sums to one and is non-negative; a larger tau gives flatter weights (higher entropy,
    lower maximum) and a tiny tau concentrates on the largest row sum of S = W W^T."""
    torch.manual_seed(0)
    w = torch.randn(5, 4, 3)
    row_sums = (w.flatten(1) @ w.flatten(1).T).sum(1)
    ps = {tau: swa_weights(w, tau) for tau in (1e-4, 0.1, 1.0, 10.0)}
    for p in ps.values():
        assert p.shape == (5,)
        assert (p >= 0).all()
        assert float(p.sum()) == pytest.approx(1.0, abs=1e-6)
    entropies = [_entropy(ps[t]) for t in (0.1, 1.0, 10.0)]
    assert entropies[0] < entropies[1] < entropies[2]
    assert ps[0.1].max() > ps[1.0].max() > ps[10.0].max()
    assert int(ps[1e-4].argmax()) == int(row_sums.argmax())
    assert float(ps[1e-4].max()) > 0.99


def test_swa_weights_equal_eq_8_by_hand():
    """For W = [[1, 0], [1, 1], [0, 2]]: S = W W^T, p' = S.sum(1) = [2, 5, 6] and
    p = softmax((p' / tau) / sum p')."""
    w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])
    tau = 0.5
    p_prime = [2.0, 5.0, 6.0]
    logits = [(v / tau) / sum(p_prime) for v in p_prime]
    z = sum(math.exp(v) for v in logits)
    expected = torch.tensor([math.exp(v) / z for v in logits])
    torch.testing.assert_close(swa_weights(w.unsqueeze(1), tau), expected)  # [N_p, 1, 2]
    torch.testing.assert_close(swa_weights(w, tau), expected)


def test_swa_is_a_plain_average_at_tau_one_and_not_at_a_small_tau():
    """Eq. 8's softmax inputs p'_i / sum_j p'_j sum to one, so at tau = 1 they differ by less
    than one and p stays near uniform for generators of similar norms; a small tau separates
    non-identical generators. ``Duet.swa_weights`` logs the p every session uses."""
    torch.manual_seed(0)
    gen = LayerGenerator((5, 16), embed=7, hidden=9, generators=5)
    with torch.no_grad():
        gen.w1.mul_(torch.tensor([1.0, 1.1, 1.2, 1.3, 1.4]).view(5, 1, 1))  # not identical
    with torch.no_grad():
        at_one, small = gen.weights(1.0), gen.weights(0.01)
    assert float(at_one.max() - at_one.min()) < 0.05
    assert float(small.max() - small.min()) > 0.5
    assert int(small.argmax()) == 4  # the largest row sum of S
    model = _duet(temperature=0.01)
    logged = model.swa_weights()
    assert len(logged) == len(model.shapes)
    for p, g in zip(logged, model.generators):
        assert p == pytest.approx(g.weights(0.01).tolist())
        assert sum(p) == pytest.approx(1.0, abs=1e-6)


def test_a_single_generator_has_weight_one():
    """N_p = 1 is DUET without SWA: the one generator's weight is exactly 1."""
    gen = LayerGenerator((5, 16), embed=7, hidden=9, generators=1)
    p = gen.weights(0.3)
    assert p.shape == (1,) and p.tolist() == [1.0]


def test_combined_generator_is_the_p_weighted_sum_of_the_generators():
    """Eq. 9: the final generator's W1, b1, W2, b2 are the p-weighted sums of the N_p
    generators'; its output (Eq. 6, weights scaled by 1/sqrt(fan-in)) matches a hand-built
    one and a single generator loaded with the combined parameters."""
    torch.manual_seed(0)
    out, inp, tau = 3, 4, 0.7
    gen = LayerGenerator((out, inp), embed=5, hidden=6, generators=4)
    e = torch.randn(2, 5)
    p = gen.weights(tau)
    combined = {name: sum(p[j] * getattr(gen, name)[j] for j in range(4))
                for name in ("w1", "b1", "w2", "b2")}
    flat = (e @ combined["w1"].T + combined["b1"]) @ combined["w2"].T + combined["b2"]
    weight, bias = gen(e, tau)
    assert weight.shape == (2, out, inp) and bias.shape == (2, out)
    torch.testing.assert_close(weight, flat[:, :out * inp].reshape(2, out, inp) / math.sqrt(inp))
    torch.testing.assert_close(bias, flat[:, out * inp:])
    single = LayerGenerator((out, inp), embed=5, hidden=6, generators=1)
    with torch.no_grad():
        for name, value in combined.items():
            getattr(single, name).copy_(value.unsqueeze(0))
    w1, b1 = single(e, tau)
    torch.testing.assert_close(w1, weight)
    torch.testing.assert_close(b1, bias)
    # and p is not uniform: the plain mean of the generators gives different layers
    mean = {name: getattr(gen, name).mean(0) for name in ("w1", "b1", "w2", "b2")}
    flat_mean = (e @ mean["w1"].T + mean["b1"]) @ mean["w2"].T + mean["b2"]
    assert not torch.allclose(flat_mean[:, out * inp:], bias)


# -- a session's layers depend on its samples ----------------------------------------------

def test_duet_layers_depend_on_the_session_and_are_deterministic():
    """Two different sessions get different layers; the same session twice identical ones."""
    model = _duet()
    a, b = torch.randn(K, DIM), torch.randn(K, DIM)
    with torch.no_grad():
        ga, ga2, gb = (model.generate({"embeddings": x}) for x in (a, a.clone(), b))
    assert all(torch.equal(ga[k], ga2[k]) for k in ga)
    assert _differ(ga, gb)


@pytest.mark.parametrize("adr", [True, False])
def test_cdc_mmpg_layers_depend_on_the_session_and_are_deterministic(adr):
    """CDC-MMPG with ADR (one anchor) and without (F-hyper, the K frames): different sessions,
    different layers; the same session twice, identical layers."""
    model = _cdc(adr)
    a, b = torch.randn(K, DIM), torch.randn(K, DIM)
    key = "anchor" if adr else "embeddings"

    def upload(x):
        return {key: x[:1] if adr else x}

    with torch.no_grad():
        ga, ga2, gb = (model.generate(upload(x)) for x in (a, a.clone(), b))
    assert all(torch.equal(ga[k], ga2[k]) for k in ga)
    assert _differ(ga, gb)


def test_duet_padding_is_ignored():
    """A session padded to K=6 with a mask (and garbage in the padding) gets the same layers as
    the unpadded session, also next to a full session in the batch."""
    model = _duet()
    x = torch.randn(1, K, DIM)
    padded = torch.cat([x, 1e3 * torch.randn(1, 2, DIM)], dim=1)
    mask = torch.tensor([[False] * K + [True] * 2])
    full = torch.randn(1, 6, DIM)
    with torch.no_grad():
        plain = model(x)
        masked = model(padded, mask)
        batch = model(torch.cat([full, padded]),
                      torch.cat([torch.zeros(1, 6, dtype=torch.bool), mask]))
        alone = model(full)
        unmasked = model(padded)
    for (w, b), (wm, bm), (wb, bb), (wf, bf) in zip(plain, masked, batch, alone):
        torch.testing.assert_close(wm, w)
        torch.testing.assert_close(bm, b)
        torch.testing.assert_close(wb[1:], w)
        torch.testing.assert_close(bb[1:], b)
        torch.testing.assert_close(wb[:1], wf)
        torch.testing.assert_close(bb[:1], bf)
    # without the mask the padding would change the layers
    assert not torch.allclose(unmasked[-1][1], plain[-1][1])


# -- what the generator sees (method.context) ---------------------------------------------

def test_split_context_first_previous_session():
    """``first``: the session's first k samples, the rest scored (a short last session keeps
    what it has); ``previous``: the previous session, the whole session scored, nothing before
    the first; ``session``: the session as both."""
    sessions = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 10)]
    first = split_context(sessions, "first", 3)
    assert [(c.tolist(), s.tolist()) for c, s in first] == [
        ([0, 1, 2], [3]), ([4, 5, 6], [7]), ([8, 9], [])]
    previous = split_context(sessions, "previous", 3)
    assert [(c.tolist(), s.tolist()) for c, s in previous] == [
        ([], [0, 1, 2, 3]), ([0, 1, 2, 3], [4, 5, 6, 7]), ([4, 5, 6, 7], [8, 9])]
    same = split_context(sessions, "session", 3)
    assert all(c is s for c, s in same) and [s.tolist() for _, s in same] == \
        [x.tolist() for x in sessions]


@pytest.mark.parametrize("kind", ["duet", "cdc_mmpg", "f_hyper"])
def test_layers_come_from_the_context_and_score_the_frames(kind):
    """``session_logits(context, mask, frames, anchor)`` generates each session's layers from
    its context (or the anchor chosen among it) only and applies them to ``frames``: the
    logits equal the served layers applied to the frames, other frames leave the layers alone,
    another context changes them."""
    model = _duet() if kind == "duet" else _cdc(adr=kind == "cdc_mmpg")
    context, frames, other = (torch.randn(1, n, DIM) for n in (2, 3, 5))
    anchor = context[:, 1]
    upload = {"anchor": anchor} if kind == "cdc_mmpg" else {"embeddings": context[0]}
    with torch.no_grad():
        served = dynamic_layers(model.generate(upload))
        logits = model.session_logits(context, None, frames, anchor)
        on_other = model.session_logits(context, None, other, anchor)
        elsewhere = model.session_logits(torch.randn(1, 2, DIM), None, frames,
                                         torch.randn(1, DIM))
    assert logits.shape == (1, 3, CLASSES) and on_other.shape == (1, 5, CLASSES)
    torch.testing.assert_close(logits[0], apply_dynamic(served, frames[0]))
    torch.testing.assert_close(on_other[0], apply_dynamic(served, other[0]))
    assert not torch.allclose(elsewhere, logits)


# -- gamma weighting (Eq. 7) --------------------------------------------------------------

def _ce_case():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, CLASSES)
    labels = torch.randint(0, CLASSES, (2, 4))
    mask = torch.tensor([[False] * 4, [False, False, True, True]])
    return logits, labels, mask


def test_weighted_ce_with_gamma_one_is_the_mean_over_real_samples():
    logits, labels, mask = _ce_case()
    expected = F.cross_entropy(logits[~mask], labels[~mask])
    torch.testing.assert_close(weighted_session_ce(logits, labels, mask, 1.0), expected)
    torch.testing.assert_close(weighted_session_ce(logits, labels, mask), expected)


def test_weighted_ce_weights_the_t_th_sample_by_gamma_to_the_t():
    """gamma < 1: sum_t gamma^t CE_t / sum_t gamma^t over the non-padded samples."""
    logits, labels, mask = _ce_case()
    gamma = 0.5
    num = den = 0.0
    for s in range(2):
        for t in range(4):
            if mask[s, t]:
                continue
            ce = float(F.cross_entropy(logits[s, t:t + 1], labels[s, t:t + 1]))
            num += gamma ** t * ce
            den += gamma ** t
    got = float(weighted_session_ce(logits, labels, mask, gamma))
    assert got == pytest.approx(num / den, rel=1e-5)
    assert got != pytest.approx(float(weighted_session_ce(logits, labels, mask, 1.0)), rel=1e-3)


def test_weighted_ce_padding_contributes_nothing():
    """Changing logits and labels at padded positions leaves the loss and its gradient there
    at zero."""
    logits, labels, mask = _ce_case()
    other_logits, other_labels = logits.clone(), labels.clone()
    other_logits[mask] = 1e3 * torch.randn(int(mask.sum()), CLASSES)
    other_labels[mask] = (labels[mask] + 1) % CLASSES
    for gamma in (1.0, 0.7):
        torch.testing.assert_close(weighted_session_ce(other_logits, other_labels, mask, gamma),
                                   weighted_session_ce(logits, labels, mask, gamma))
    leaf = logits.clone().requires_grad_(True)
    weighted_session_ce(leaf, labels, mask, 0.7).backward()
    assert torch.equal(leaf.grad[mask], torch.zeros_like(leaf.grad[mask]))
    assert leaf.grad[~mask].abs().sum() > 0


# -- CDC-MMPG -----------------------------------------------------------------------------

@pytest.mark.parametrize("adr", [True, False])
def test_cdc_mmpg_generates_one_linear_layer(adr):
    """The answer is one linear layer D -> C: ``layer0.weight`` [C, D] and ``layer0.bias`` [C]
    and nothing else."""
    model = _cdc(adr)
    x = torch.randn(K, DIM)
    with torch.no_grad():
        arrays = model.generate({"anchor": x[:1]} if adr else {"embeddings": x})
    assert set(arrays) == {"layer0.weight", "layer0.bias"}
    assert arrays["layer0.weight"].shape == (CLASSES, DIM)
    assert arrays["layer0.bias"].shape == (CLASSES,)
    assert model.shapes == [(CLASSES, DIM)]
    assert model.session_logits(x.unsqueeze(0), None, x.unsqueeze(0), x[:1]).shape == \
        (1, K, CLASSES)


def test_cdc_mmpg_with_adr_uses_only_the_anchor():
    """With ADR the generated layer depends on the anchor alone: the same anchor with other
    frames gives the same layer; another anchor a different one."""
    model = _cdc(adr=True)
    anchor = torch.randn(1, DIM)
    frames_a = torch.cat([anchor, torch.randn(K - 1, DIM)]).unsqueeze(0)
    frames_b = torch.cat([anchor, torch.randn(K - 1, DIM)]).unsqueeze(0)
    with torch.no_grad():
        la = model.generate_layer(model.summary(frames_a, None, anchor))
        lb = model.generate_layer(model.summary(frames_b, None, anchor))
        other = model.generate_layer(model.summary(frames_a, None, torch.randn(1, DIM)))
        served = model.generate({"anchor": anchor})
    for t, u in zip(la, lb):
        assert torch.equal(t, u)
    torch.testing.assert_close(served["layer0.weight"], la[0][0])
    torch.testing.assert_close(served["layer0.bias"], la[1][0])
    assert not torch.allclose(other[1], la[1])
    # without ADR (F-hyper) the frames do matter
    fhyper = _cdc(adr=False)
    with torch.no_grad():
        fa = fhyper.generate_layer(fhyper.summary(frames_a, None, anchor))
        fb = fhyper.generate_layer(fhyper.summary(frames_b, None, anchor))
    assert not torch.allclose(fa[1], fb[1])


def test_adr_renormalises_the_anchor_to_the_given_statistics():
    """AdaIN (Eq. 16): with the population buffers set, renormalise(a, mean, std) =
    (a - pop_mean) / pop_std * std + mean; the population mean maps onto ``mean``."""
    torch.manual_seed(0)
    adr = Adr(DIM, latent=4, hidden=10)
    pop_mean, pop_std = torch.randn(DIM), torch.rand(DIM) + 0.5
    adr.pop_mean.copy_(pop_mean)
    adr.pop_std.copy_(pop_std)
    a = torch.randn(3, DIM)
    mean, std = torch.randn(3, DIM), torch.rand(3, DIM) + 0.1
    torch.testing.assert_close(adr.renormalise(a, mean, std),
                               (a - pop_mean) / pop_std * std + mean)
    torch.testing.assert_close(adr.renormalise(pop_mean.expand(3, DIM), mean, std), mean)
    g, parts = adr(a, sample=False)
    assert g.shape == (3, DIM) and parts["recon"].shape == (3, DIM)
    assert parts["mu"].shape == (3, 4) and parts["logvar"].shape == (3, 4)


def test_adr_loss_is_finite_and_trains_encoder_and_decoder():
    torch.manual_seed(0)
    adr = Adr(DIM, latent=4, hidden=10)
    frames = torch.randn(3, K, DIM)
    mask = torch.zeros(3, K, dtype=torch.bool)
    mask[2, 3] = True
    loss = adr.loss(frames[:, 0], frames, mask, lam=0.1)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    for part in (adr.encoder, adr.decoder):
        grads = [p.grad for p in part.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0


def _clusters(seed: int, n: int, dim: int = 128, centres: int = 4, spread: float = 3.0):
    """``n`` sessions of 4 features, each session from one of ``centres`` Gaussian clusters:
    ``[n, 4, dim]`` features and ``[n]`` cluster ids."""
    gen = torch.Generator().manual_seed(seed)
    means = spread * torch.randn(centres, dim, generator=torch.Generator().manual_seed(99))
    ids = torch.randint(0, centres, (n,), generator=gen)
    return means[ids].unsqueeze(1) + 0.3 * torch.randn(n, 4, dim, generator=gen), ids


def _batch(x: torch.Tensor) -> SessionBatch:
    mask = torch.zeros(x.shape[:2], dtype=torch.bool)
    labels = torch.zeros(x.shape[:2], dtype=torch.long)
    return SessionBatch(x, mask, x, mask, labels, x[:, 0], x, mask)


class _ClusterSessions:
    """Fresh sessions every epoch, fixed validation sessions (SessionBatches' interface)."""

    def __init__(self) -> None:
        self.epochs = 0
        self.val = [_batch(_clusters(1000, 256)[0])]

    def steps_per_epoch(self) -> int:
        return 8

    def epoch(self):
        self.epochs += 1
        for step in range(self.steps_per_epoch()):
            yield _batch(_clusters(10 * self.epochs + step, 32)[0])


def test_a_trained_adr_uses_its_latent_and_beats_the_mean():
    """On features from 4 Gaussian clusters ADR, trained with the per-anchor sums and the KL
    warm-up, reconstructs far better than predicting the training features' mean, keeps KL > 0
    with active latent dimensions, and its mu separates anchors of different clusters by far
    more than 1e-4 (the collapse it had: KL 0, mu constant, worse than the mean)."""
    torch.manual_seed(0)
    adr = Adr(128, latent=4, hidden=32)
    sessions = _ClusterSessions()
    train = torch.cat([_clusters(s, 64)[0].flatten(0, 1) for s in range(4)])
    m = CdcMmpgConfig(adr_epochs=20, adr_lr=3e-3, kl_warmup=5, lam=0.1, weight_decay=0.01)
    log = train_adr(adr, train, sessions, m, seed=0)
    d = log["diagnostics"]
    assert sessions.epochs == 20 and log["epochs_run"] == 20
    assert d["recon_mse"] < 0.05 * d["mean_predictor_mse"]  # KL summed, MSE averaged: 0.34
    assert d["kl"] > 1.0 and d["active_dims"] >= 1
    assert not adr.encoder[0].weight.requires_grad  # frozen for stage 2
    x, ids = _clusters(2000, 200)
    with torch.no_grad():
        mu = adr.encoder(x[:, 0]).chunk(2, dim=-1)[0]
    centres = torch.stack([mu[ids == c].mean(0) for c in range(4)])
    gaps = torch.cdist(centres, centres)[~torch.eye(4, dtype=torch.bool)]
    assert float(gaps.min()) > 0.1
    assert float(mu.std(0).mean()) > 0.1


@pytest.mark.parametrize("schedule", ["polynomial", "constant"])
def test_adr_learning_rate_decays_polynomially_to_zero(schedule, monkeypatch):
    """The paper's "adamw optimizer with a polynomial decay scheduler" for ADR: the rate falls
    linearly from method.adr_lr at the first step to 0 after the last (8 steps x 3 epochs);
    method.adr_schedule=constant keeps it."""
    rates = []
    step = torch.optim.AdamW.step

    def recorded(opt, *a, **kw):
        rates.append(opt.param_groups[0]["lr"])
        return step(opt, *a, **kw)

    monkeypatch.setattr(torch.optim.AdamW, "step", recorded)
    torch.manual_seed(0)
    m = CdcMmpgConfig(adr_epochs=3, adr_lr=1e-3, kl_warmup=0, adr_schedule=schedule)
    log = train_adr(Adr(128, latent=4, hidden=8), torch.randn(64, 128), _ClusterSessions(), m,
                    seed=0)
    assert len(rates) == 24
    if schedule == "polynomial":
        assert rates == pytest.approx([1e-3 * (1 - i / 24) for i in range(24)])
        assert log["last_lr"] == 0.0
    else:
        assert rates == [1e-3] * 24 and log["last_lr"] == 1e-3


def test_adr_schedule_is_checked():
    with pytest.raises(ConfigError, match="method.adr_schedule"):
        CdcMmpgConfig(adr_schedule="cosine").check()


def test_kl_warmup_ramps_linearly_and_ends_at_one():
    """beta: 0, 0.2, ..., 0.8 over the first 5 epochs, then 1; never past the last epoch."""
    assert [kl_weight(e, 5, 10) for e in range(1, 11)] == pytest.approx(
        [0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert [kl_weight(e, 5, 3) for e in (1, 2, 3)] == pytest.approx([0.0, 0.5, 1.0])
    assert kl_weight(1, 0, 10) == 1.0 and kl_weight(1, 5, 1) == 1.0


def test_adr_terms_are_per_anchor_sums_and_beta_weighs_the_kl():
    """``loss = beta * KL + recon + lam * extra``, each term summed over its dimensions per
    anchor and averaged over anchors; beta = 0 drops the KL."""
    torch.manual_seed(0)
    adr = Adr(DIM, latent=4, hidden=10)
    frames = torch.randn(3, K, DIM)
    anchor = frames[:, 0]
    with torch.random.fork_rng():
        torch.manual_seed(1)
        t = adr.terms(anchor, frames, None)
    with torch.random.fork_rng():
        torch.manual_seed(1)
        g, vae = adr(anchor, sample=True)
    torch.testing.assert_close(t["recon"], ((vae["recon"] - anchor) ** 2).sum(-1).mean())
    kl = -0.5 * (1 + vae["logvar"] - vae["mu"] ** 2 - vae["logvar"].exp())
    torch.testing.assert_close(t["kl"], kl.sum(-1).mean())
    for beta in (0.0, 0.4, 1.0):
        with torch.random.fork_rng():
            torch.manual_seed(1)
            loss = adr.loss(anchor, frames, None, 0.1, beta)
        torch.testing.assert_close(loss, beta * t["kl"] + t["recon"] + 0.1 * t["extra"])


def test_channel_stats_skip_padding():
    """Channel-wise mean and population std (plus 1e-6 in the variance) over the real frames."""
    torch.manual_seed(0)
    frames = torch.randn(2, 5, 6)
    frames[1, 3:] = 1e3  # padding
    mask = torch.tensor([[False] * 5, [False, False, False, True, True]])
    mean, std = channel_stats(frames, mask)
    assert mean.shape == std.shape == (2, 6)
    for s, n in ((0, 5), (1, 3)):
        real = frames[s, :n]
        torch.testing.assert_close(mean[s], real.mean(0))
        torch.testing.assert_close(std[s], (real.var(0, unbiased=False) + 1e-6).sqrt())
        torch.testing.assert_close(std[s], real.std(0, unbiased=False), atol=1e-5, rtol=1e-4)
    m0, s0 = channel_stats(frames[:1], None)
    torch.testing.assert_close(m0, mean[:1])
    torch.testing.assert_close(s0, std[:1])


def test_fuse_concatenates_the_query_to_every_frame():
    frames, query = torch.randn(2, 3, 4), torch.randn(2, 5)
    fused = fuse(frames, query)
    assert fused.shape == (2, 3, 9)
    assert torch.equal(fused[..., :4], frames)
    assert torch.equal(fused[..., 4:], query.unsqueeze(1).expand(2, 3, 5))
    assert fuse(frames, None) is frames
    assert fuse(frames[0], query[0]).shape == (3, 9)


@pytest.mark.parametrize("adr", [True, False])
def test_a_text_query_changes_the_generated_layer(adr):
    """With ``query_dim`` > 0 the layer is D + Dq -> C and differs between queries."""
    model = _cdc(adr, query_dim=3)
    frames = torch.randn(K, DIM)
    q1, q2 = torch.randn(3), torch.randn(3)

    def upload(q):
        x = fuse(frames, q)
        return {"anchor": x[:1]} if adr else {"embeddings": x}

    with torch.no_grad():
        g1, g2 = model.generate(upload(q1)), model.generate(upload(q2))
    assert g1["layer0.weight"].shape == (CLASSES, DIM + 3)
    assert _differ(g1, g2)


# -- what travels -------------------------------------------------------------------------

def test_upload_is_the_session_or_one_anchor():
    """DUET and F-hyper upload the K embeddings; CDC-MMPG with ADR exactly one of the frames,
    chosen by the device's seeded generator."""
    frames = torch.randn(K, DIM)
    for method in (DuetConfig(session=K), CdcMmpgConfig(adr=False)):
        up = upload_of(SimpleNamespace(method=method), frames, None,
                       torch.Generator().manual_seed(0))
        assert set(up) == {"embeddings"} and torch.equal(up["embeddings"], frames)
    spec = SimpleNamespace(method=CdcMmpgConfig(adr=True))
    chosen = set()
    for seed in range(20):
        up = upload_of(spec, frames, None, torch.Generator().manual_seed(seed))
        assert set(up) == {"anchor"} and up["anchor"].shape == (1, DIM)
        rows = [i for i in range(K) if torch.equal(up["anchor"][0], frames[i])]
        assert len(rows) == 1
        chosen.add(rows[0])
        again = upload_of(spec, frames, None, torch.Generator().manual_seed(seed))
        assert torch.equal(again["anchor"], up["anchor"])
    assert len(chosen) > 1


def test_tensor_bytes_and_flowers_measured_size():
    """``tensor_bytes`` is numel x 4 for float32; the generated layers' bytes are
    4 * sum(out*in + out); Flower's ``count_bytes`` adds, per array, its serialization header
    and the key, under 200 bytes each."""
    from flwr.app import ArrayRecord

    assert tensor_bytes({"a": torch.randn(3, 4), "b": torch.randn(7)}) == 19 * 4
    assert tensor_bytes({}) == 0
    model = _duet()
    with torch.no_grad():
        arrays = model.generate({"embeddings": torch.randn(K, DIM)})
    dynamic = sum(o * i + o for o, i in layer_shapes(DIM, HIDDEN, CLASSES))
    assert tensor_bytes(arrays) == 4 * dynamic
    record = ArrayRecord(arrays)
    overhead = {k: len(v.data) - arrays[k].numel() * arrays[k].element_size() + len(k)
                for k, v in record.items()}
    assert set(overhead) == set(arrays)
    assert record.count_bytes() - tensor_bytes(arrays) == sum(overhead.values())
    assert all(0 < v < 200 for v in overhead.values())


def test_binary_auc_is_the_mann_whitney_statistic():
    scores = torch.tensor([0.1, 0.4, 0.35, 0.8, 0.4, 0.1, 0.6])
    labels = torch.tensor([0, 1, 0, 1, 0, 1, 0])
    pos = [float(s) for s, y in zip(scores, labels) if y == 1]
    neg = [float(s) for s, y in zip(scores, labels) if y == 0]
    brute = sum(1.0 if p > n else 0.5 if p == n else 0.0
                for p, n in itertools.product(pos, neg)) / (len(pos) * len(neg))
    assert binary_auc(scores, labels) == pytest.approx(brute)
    assert brute == pytest.approx(7 / 12)  # 2.5 + 4 + 0.5 of 3 x 4 pairs
    assert binary_auc(torch.tensor([0.1, 0.2, 0.8, 0.9]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert binary_auc(torch.tensor([0.9, 0.8, 0.2, 0.1]), torch.tensor([0, 0, 1, 1])) == 0.0
    assert binary_auc(torch.full((5,), 0.3), torch.tensor([0, 1, 1, 0, 1])) == 0.5
    assert math.isnan(binary_auc(torch.rand(3), torch.ones(3, dtype=torch.long)))


def test_delay_table_adds_up():
    """5 MB up at 5 MB/s is 1000 ms; each total is upload + generation + download."""
    rows = delay_table({"up_bytes_median": 5e6, "down_bytes_median": 1e6,
                        "generate_ms_median": 2.0})
    assert [r["rate_MB_s"] for r in rows] == list(RATES_MB_S)
    first = rows[0]
    assert first["rate_MB_s"] == 5
    assert first["up_ms"] == pytest.approx(1000.0)
    assert first["down_ms"] == pytest.approx(200.0)
    assert first["total_ms"] == pytest.approx(1202.0)
    for r in rows:
        assert r["up_ms"] == pytest.approx(5e6 / (r["rate_MB_s"] * 1e6) * 1000)
        assert r["down_ms"] == pytest.approx(1e6 / (r["rate_MB_s"] * 1e6) * 1000)
        assert r["total_ms"] == pytest.approx(r["up_ms"] + 2.0 + r["down_ms"])
    no_down = delay_table({"up_bytes_median": 5e6, "down_bytes_median": None,
                           "generate_ms_median": 2.0})
    assert no_down[0]["down_ms"] == 0 and no_down[0]["total_ms"] == pytest.approx(1002.0)


# -- configuration and counts --------------------------------------------------------------

@pytest.mark.parametrize("cfg,key", [
    (DuetConfig(generators=0), "method.generators"),
    (DuetConfig(temperature=0.0), "method.temperature"),
    (DuetConfig(gamma=1.5), "method.gamma"),
    (DuetConfig(gamma=0.0), "method.gamma"),
    (DuetConfig(session=0), "method.session"),
    (DuetConfig(upload="pixels"), "method.upload"),
    (DuetConfig(dynamic_hidden=[8, 0]), "method.dynamic_hidden"),
    (CdcMmpgConfig(lam=-0.1), "method.lam"),
    (CdcMmpgConfig(session=0), "method.session"),
    (CdcMmpgConfig(upload="pixels"), "method.upload"),
    (CdcMmpgConfig(query="  "), "method.query"),
    (DuetConfig(context="all"), "method.context"),
    (DuetConfig(context_size=0), "method.context_size"),
    (DuetConfig(session=4, context="first", context_size=4), "method.context_size"),
    (CdcMmpgConfig(session=3, context_size=5), "method.context_size"),
    (CdcMmpgConfig(kl_warmup=-1), "method.kl_warmup"),
])
def test_bad_values_name_the_setting(cfg, key):
    from fedadapt.adapters import build_model
    from fedadapt.federation.client.training import BackboneInfo

    with pytest.raises(ConfigError, match=re.escape(key)):
        build_model(cfg, BackboneInfo(embed_dim=16), 5, with_backbone=False)


@pytest.mark.parametrize("cfg", [DuetConfig(generators=2, dynamic_hidden=[8]), CdcMmpgConfig(),
                                 CdcMmpgConfig(adr=False)])
def test_valid_configs_build_and_communicate_only_the_dynamic_layers(cfg):
    from fedadapt.adapters import build_model
    from fedadapt.federation.client.training import BackboneInfo

    model = build_model(cfg, BackboneInfo(embed_dim=16), 5, with_backbone=False)
    shapes = layer_shapes(16, list(cfg.dynamic_hidden), 5) if isinstance(cfg, DuetConfig) \
        else [(5, 16)]
    assert model.count(model.communicated_names()) == sum(o * i + o for o, i in shapes)


@pytest.mark.parametrize("overrides,hidden", [([], []), (["method.dynamic_hidden=[8]"], [8])])
def test_inspect_counts_duet(overrides, hidden):
    """``fedadapt-inspect method=duet``: what travels is one set of dynamic layers (D*C + C for
    hidden []); the generator is what trains. (small_cnn: a random backbone, no download; the
    digits card is read, not the data.)"""
    from fedadapt.counts import inspect_run
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config(["method=duet", "backbone=small_cnn", "dataset=digits",
                                        *overrides]))
    assert list(run.method.dynamic_hidden) == hidden
    counts = inspect_run(run, flops=False)
    d, c = counts["embed_dim"], counts["num_classes"]
    assert c == 10
    dynamic = sum(o * i + o for o, i in layer_shapes(d, hidden, c))
    if not hidden:
        assert dynamic == d * c + c
    assert counts["communicated_params"] == dynamic
    duet = counts["duet"]
    assert duet["dynamic_params"] == dynamic
    assert duet["download_bytes_per_session"] == 4 * dynamic
    assert duet["generator_params"] == counts["trainable_params"]
    generator = build_duet(run.method, d, c)
    assert duet["generator_params"] == sum(p.numel() for p in generator.parameters())
    assert duet["generators"] == 5 and counts["personal_params"] == 0


@pytest.mark.parametrize("preset", ["cdc_mmpg", "f_hyper"])
def test_inspect_counts_cdc_mmpg(preset):
    """CDC-MMPG and F-hyper send one linear layer D -> C; ADR's parameters count only with
    ADR and belong to the trained generator."""
    from fedadapt.counts import inspect_run
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config([f"method={preset}", "backbone=small_cnn",
                                        "dataset=digits"]))
    counts = inspect_run(run, flops=False)
    d, c = counts["embed_dim"], counts["num_classes"]
    entry = counts["cdc_mmpg"]
    assert counts["communicated_params"] == entry["dynamic_params"] == d * c + c
    assert entry["generator_params"] == counts["trainable_params"]
    assert entry["adr"] == (preset == "cdc_mmpg")
    assert (entry["adr_params"] > 0) == entry["adr"]
