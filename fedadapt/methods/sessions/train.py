"""Session plug-ins (DUET, CDC-MMPG): a generator trained once on the server, then a conversation
with every device over Flower's Message API. Nothing trains on the devices.

Every session is split (``method.context``, :func:`split_context`) into the samples the
generator sees (its *context*: the session's first ``context_size`` samples, the client's
previous session, or, transductively, the session itself) and the samples every row scores
(the others; with ``context=session`` the same ones). The split is the same in server training,
in validation (early stopping) and in serving.

Server training, from the training clients' cached features:

1. the original model: ``Linear(D, C)`` on the mixture of all clients' training features;
2. the generator (DUET's PPG + SWA, or CDC-MMPG's FDA with ADR trained first), on sessions of K
   samples cut from each training client's own data (a seeded permutation per epoch): layers
   generated from each session's context, the loss (Eq. 7) on its scored samples; AdamW, early
   stopping on the accuracy of the clients' validation sessions' scored samples, best epoch
   kept.

Serving (:func:`fedadapt.methods.sessions.run.converse`), per client, in two messages:

1. ``session-upload`` (QUERY): the client cuts its test split, in its seeded arrival order, into
   sessions of K and replies with one ArrayRecord per session that has a context and samples to
   score: the context's embeddings (DUET, F-hyper), one anchor embedding chosen at random among
   them (CDC-MMPG), or the context's raw preprocessed images (``method.upload=samples``: the
   server runs the frozen backbone);
2. ``session-predict`` (EVALUATE): the server answers with one ArrayRecord per session holding
   only the generated dynamic layers (plus, once per client, the original classifier for the
   baseline rows); the client scores every session's scored samples with its layers and replies
   with metrics.

The server records each session's upload and download bytes (``ArrayRecord.count_bytes``) and
its generation time; :func:`fedadapt.results.tables.delay_table` turns them into DUET's
Table 3 / CDC-MMPG's Table 6.
Baselines in every run, scored on the same samples: the original model, and fine-tuning (the
original classifier trained on the labels of the context; with ``context=session``, of the
client's previous session, since the session's own labels are what is scored). A session
without a context (a client's first with ``context=previous``; its first with
``context=session`` for fine-tuning) is scored with the original model.
"""

from __future__ import annotations

import copy
import time
from typing import Iterator, NamedTuple, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.config import ConfigError
from fedadapt.federation.client.training import RunSpec, derive_seed
from fedadapt.log import log as log_
from fedadapt.methods.server_trained import (
    ServerData,
    accuracy,
    accuracy_over_clients,
    fit,
    pad,
    pad_labels,
    sequences,
    train_original,
)
from fedadapt.methods.sessions.cdc_mmpg import build_cdc_mmpg, fuse
from fedadapt.methods.sessions.duet import (
    DuetConfig,
    apply_dynamic,
    build_duet,
    dynamic_layers,
    weighted_session_ce,
)
from fedadapt.results.tables import delay_table


def build_generator(spec: RunSpec) -> nn.Module:
    m = spec.method
    if isinstance(m, DuetConfig):
        return build_duet(m, spec.embed_dim, spec.num_classes)
    q = 0 if spec.family.query_feature is None else len(spec.family.query_feature)
    return build_cdc_mmpg(m, spec.embed_dim, spec.num_classes, q)


def fused(spec: RunSpec, frames: torch.Tensor) -> torch.Tensor:
    """The frames with the run's text query concatenated to each (unchanged without one)."""
    return fuse(frames, spec.family.query_feature)


def uses_anchor(generator: nn.Module) -> bool:
    return getattr(generator, "adr", None) is not None


def split_context(sessions: list[np.ndarray], context: str, size: int
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(context, scored)`` for each of one client's consecutive sessions (``method.context``):
    ``first``: the session's first ``size`` samples and the others; ``previous``: the previous
    session (empty for the first) and the whole session; ``session``: the session as both
    (transductive)."""
    if context == "first":
        return [(s[:size], s[size:]) for s in sessions]
    if context == "previous":
        return [(sessions[i - 1] if i else s[:0], s) for i, s in enumerate(sessions)]
    return [(s, s) for s in sessions]


def context_rows(method) -> int:
    """The most samples a session's context holds: ``method.context_size`` with
    ``context=first``, a whole session (``method.session``) otherwise."""
    return method.context_size if method.context == "first" else method.session


class SessionBatch(NamedTuple):
    """Sessions of one step, each from ONE client, zero-padded (masks: True = padding)."""

    context: torch.Tensor       # [S, Kc, D] what the generator sees
    context_mask: torch.Tensor  # [S, Kc]
    frames: torch.Tensor        # [S, Kt, D] what is scored
    mask: torch.Tensor          # [S, Kt]
    labels: torch.Tensor        # [S, Kt]
    anchor: torch.Tensor        # [S, D] one context sample, chosen at random (ADR's input)
    whole: torch.Tensor         # [S, K, D] the current session (ADR's statistics, Eq. 16-17)
    whole_mask: torch.Tensor    # [S, K]


class SessionBatches:
    """The training clients' sessions for server training: each client's split in a seeded
    permutation cut into sessions of K (:func:`fedadapt.methods.server_trained.sequences`), split by
    ``method.context``; a session without a context or without samples to score is left out.
    ``val`` holds the validation batches (drawn once), :meth:`epoch` draws a training epoch."""

    def __init__(self, spec: RunSpec, data: ServerData, feats: torch.Tensor,
                 rng: np.random.Generator) -> None:
        self.m, self.data, self.feats, self.rng = spec.method, data, feats, rng
        m = self.m
        self.context_len = context_rows(m)
        self.scored_len = m.session - m.context_size if m.context == "first" else m.session
        pairs = self.pairs("val")
        self.val = [self.batch(pairs[i:i + 256]) for i in range(0, len(pairs), 256)]

    def pairs(self, part: str, rng: Optional[np.random.Generator] = None
              ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``(context, scored)`` rows of every client's ``part`` (``train`` or ``val``),
        in sessions drawn from ``rng`` (default: the batches' own stream)."""
        m = self.m
        out = []
        for c in self.data.clients:
            sessions = sequences(getattr(c, part), m.session, rng or self.rng)
            out += [(ctx, scored) for ctx, scored in
                    split_context(sessions, m.context, m.context_size) if len(ctx) and len(scored)]
        if not out:
            raise ConfigError(
                f"method.context={m.context} is invalid here: no {part} session of "
                f"method.session={m.session} has both a context and samples to score"
                + (" (each client needs two sessions)" if m.context == "previous" else ""))
        return out

    def batch(self, group: list[tuple[np.ndarray, np.ndarray]]) -> SessionBatch:
        m, feats, labels = self.m, self.feats, self.data.labels
        x, mask = pad([feats[s] for _, s in group], self.scored_len)
        y = pad_labels([labels[s] for _, s in group], self.scored_len)
        if m.context == "session":
            ctx, ctx_mask, whole, whole_mask = x, mask, x, mask
        else:
            ctx, ctx_mask = pad([feats[c] for c, _ in group], self.context_len)
            whole, whole_mask = (x, mask) if m.context == "previous" else pad(
                [feats[np.concatenate([c, s])] for c, s in group], m.session)
        picks = torch.tensor([int(self.rng.integers(len(c))) for c, _ in group])
        return SessionBatch(ctx, ctx_mask, x, mask, y, ctx[torch.arange(len(group)), picks],
                            whole, whole_mask)

    def steps_per_epoch(self) -> int:
        """How many steps :meth:`epoch` takes (the count does not depend on the draw, which
        comes from a throwaway stream so that the batches' own is untouched)."""
        return -(-len(self.pairs("train", np.random.default_rng(0))) // self.m.sessions_per_step)

    def epoch(self) -> Iterator[SessionBatch]:
        """One epoch of training sessions, ``method.sessions_per_step`` per step."""
        pairs = self.pairs("train")
        order = self.rng.permutation(len(pairs))
        step = self.m.sessions_per_step
        for i in range(0, len(order), step):
            yield self.batch([pairs[j] for j in order[i:i + step]])


def train_generator(spec: RunSpec) -> dict:
    """The original model and the generator, on the training clients' cached features: the
    layers generated from each session's context, the loss (Eq. 7) and the validation accuracy
    on its scored samples."""
    m = spec.method
    largest = max(len(c.train) for c in spec.clients)
    if m.session > largest:
        raise ConfigError(f"method.session={m.session} is invalid: sessions are cut from one "
                          f"client's data and the largest training client holds {largest} "
                          f"samples")
    data = ServerData.of(spec)
    feats = fused(spec, data.feats)  # the original model: image only

    def stage_rng(stage: int) -> np.random.Generator:
        torch.manual_seed(derive_seed(spec.seed, 0x5E55, stage))
        return np.random.default_rng([spec.seed, 0x5E55, stage])

    original, original_log = train_original(spec, data, stage_rng(1), lr=m.classifier_lr)

    rng = stage_rng(2)
    generator = build_generator(spec)
    batches = SessionBatches(spec, data, feats, rng)
    logs = {"original": original_log}
    if uses_anchor(generator):  # CDC-MMPG stage 1: ADR alone, then frozen
        logs["adr"] = train_adr(generator.adr, feats[data.train_idx], batches, m, spec.seed)

    gamma = getattr(m, "gamma", 1.0)

    def losses():
        for b in batches.epoch():
            logits = generator.session_logits(b.context, b.context_mask, b.frames, b.anchor,
                                              sample=True)
            yield weighted_session_ce(logits, b.labels, b.mask, gamma)

    @torch.no_grad()
    def val() -> float:
        correct = total = 0
        for b in batches.val:
            pred = generator.session_logits(b.context, b.context_mask, b.frames,
                                            b.anchor).argmax(-1)
            correct += int(((pred == b.labels) & ~b.mask).sum())
            total += int((~b.mask).sum())
        return correct / max(total, 1)

    opt = torch.optim.AdamW([p for p in generator.parameters() if p.requires_grad], lr=m.lr,
                            weight_decay=m.weight_decay)
    generator.train()
    logs["generator"] = fit(generator, losses, val, epochs=m.max_epochs, patience=m.patience,
                            lr=m.lr, optimizer=opt, label=f"{m.name} (generator)")
    return {"original": original, "generator": generator.eval(), "log": logs}


def kl_weight(epoch: int, warmup: int, epochs: int) -> float:
    """ADR's KL weight beta in ``epoch`` (from 1): a linear ramp from 0 over the first
    ``min(warmup, epochs - 1)`` epochs, then 1 (the last epoch trains the full objective)."""
    span = min(warmup, epochs - 1)
    return min(1.0, (epoch - 1) / span) if span > 0 else 1.0


def train_adr(adr, train_feats: torch.Tensor, batches, m, seed: int) -> dict:
    """CDC-MMPG's first stage: ADR alone with AdamW (``method.adr_lr``,
    ``method.weight_decay``; ``method.adr_schedule``: the paper's polynomial decay to 0 over
    the ``method.adr_epochs`` epochs' steps, or constant), the KL's weight beta warmed up
    linearly over ``method.kl_warmup`` epochs (:func:`kl_weight`); the kept epoch is the best
    on the validation sessions' full loss (beta = 1, the same VAE noise every epoch). Frozen
    afterwards; the log holds :meth:`Adr.diagnostics` on the validation anchors. ``batches``
    gives ``val``, ``epoch()`` and ``steps_per_epoch()`` (:class:`SessionBatches`)."""
    adr.pop_mean.copy_(train_feats.mean(0))
    adr.pop_std.copy_(train_feats.std(0) + 1e-6)
    epoch = 0

    def losses():
        nonlocal epoch
        epoch += 1
        beta = kl_weight(epoch, m.kl_warmup, m.adr_epochs)
        for b in batches.epoch():
            yield adr.loss(b.anchor, b.whole, b.whole_mask, m.lam, beta)

    @torch.no_grad()
    def val() -> float:  # higher is better: the negative validation loss
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, 0xADE))
            return -float(np.mean([float(adr.loss(b.anchor, b.whole, b.whole_mask, m.lam))
                                   for b in batches.val]))

    steps = m.adr_epochs * batches.steps_per_epoch()

    def polynomial(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.PolynomialLR(opt, total_iters=steps, power=1.0)

    log = fit(adr, losses, val, epochs=m.adr_epochs, patience=m.adr_epochs, lr=m.adr_lr,
              optimizer=torch.optim.AdamW(adr.parameters(), lr=m.adr_lr,
                                          weight_decay=m.weight_decay),
              label=f"{m.name} (ADR)", score="-val loss",
              schedule=polynomial if m.adr_schedule == "polynomial" else None)
    adr.requires_grad_(False)
    adr.eval()
    d = log["diagnostics"] = adr.diagnostics(torch.cat([b.anchor for b in batches.val]))
    log_(f"[{m.name} (ADR)] validation anchors: reconstruction MSE {d['recon_mse']:.3f} "
         f"(the mean: {d['mean_predictor_mse']:.3f}), KL {d['kl']:.2f} nats, "
         f"{d['active_dims']}/{d['latent_dims']} latent dimensions active, mu's std across "
         f"anchors {d['mu_std']:.4f}")
    return log


# -- the device's side --------------------------------------------------------------------

def client_sessions(spec: RunSpec, cid: int) -> list[np.ndarray]:
    """The client's test split in its seeded arrival order, cut into consecutive sessions of K
    (the last may be shorter)."""
    order = np.random.default_rng([spec.seed, 0xA77, cid]).permutation(spec.clients[cid].test)
    k = spec.method.session
    return [order[i:i + k] for i in range(0, len(order), k)]


def upload_key(method) -> str:
    """The name of what the device uploads per session: ``anchor`` (CDC-MMPG with ADR: one
    embedding) or ``embeddings`` (DUET, F-hyper: the context's), or their raw-image forms with
    ``method.upload=samples`` (``anchor_sample``, ``samples``)."""
    anchor = bool(getattr(method, "adr", False))
    if method.upload == "samples":
        return "anchor_sample" if anchor else "samples"
    return "anchor" if anchor else "embeddings"


def upload_of(spec: RunSpec, frames: torch.Tensor, images: Optional[torch.Tensor],
              gen: torch.Generator) -> dict[str, torch.Tensor]:
    """What the device sends for one session (:func:`upload_key`), from its context ``frames``
    ``[Kc, D]`` (and ``images`` ``[Kc, 3, H, W]``): one anchor chosen at random among them, or
    all of them; embeddings, or with ``method.upload=samples`` preprocessed images."""
    key = upload_key(spec.method)
    rows = images if spec.method.upload == "samples" else frames
    if key.startswith("anchor"):
        k = int(torch.randint(len(frames), (1,), generator=gen))
        rows = rows[k:k + 1]
    return {key: rows.contiguous()}


def device_sessions(spec: RunSpec, cid: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(context, scored)`` of each of the client's test sessions (:func:`client_sessions`
    split by ``method.context``, :func:`split_context`); the i-th is ``session.i``."""
    m = spec.method
    return split_context(client_sessions(spec, cid), m.context, m.context_size)


def finetuning_labels(method, sessions: list[tuple[np.ndarray, np.ndarray]], i: int
                      ) -> np.ndarray:
    """The samples whose labels the fine-tuning baseline gets for session ``i``: its context
    (what the generator sees); with ``context=session`` the previous session's samples (its
    own labels are what is scored). Empty: none, the original model scores the session."""
    context, _ = sessions[i]
    if method.context == "session":
        return sessions[i - 1][1] if i else context[:0]
    return context


def session_upload(spec: RunSpec, cid: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The client's first message: ``{"session.i": upload}`` of the context of every session
    that has one and has samples to score, and its metrics."""
    gen = torch.Generator().manual_seed(derive_seed(spec.seed, 0xA7C, cid))
    out = {}
    for i, (context, scored) in enumerate(device_sessions(spec, cid)):
        if not (len(context) and len(scored)):
            continue  # nothing to generate from (a first session), or nothing to score
        frames, _ = spec.train_source.get(context)
        images = (spec.family.image_source.get(context)[0] if spec.method.upload == "samples"
                  else None)
        out[f"session.{i}"] = upload_of(spec, fused(spec, frames), images, gen)
    return out, {"sessions": len(out)}


@torch.no_grad()
def session_predict(spec: RunSpec, cid: int, arrays: dict[str, dict[str, torch.Tensor]]
                    ) -> tuple[dict, Optional[dict[str, torch.Tensor]]]:
    """The client's second message: every session's scored samples (never its context, unless
    ``context=session``) predicted with its generated layers, and by the baselines on the same
    samples. Returns metrics and, for a binary task, the score histograms for the pooled AUC."""
    m = spec.method
    original = nn.Linear(spec.embed_dim, spec.num_classes)
    original.load_state_dict(arrays["original"])
    sessions = device_sessions(spec, cid)
    logits = {"generated": [], "original": [], "finetune": []}
    ys, fallback, scored_sessions = [], 0, 0
    for i, (_, scored) in enumerate(sessions):
        if not len(scored):
            continue
        x, y = spec.train_source.get(scored)
        answer = arrays.get(f"session.{i}")
        if answer is None:  # no context to generate from: the original model
            fallback += len(y)
        base = original(x)
        logits["generated"].append(base if answer is None else
                                   apply_dynamic(dynamic_layers(answer), fused(spec, x)))
        logits["original"].append(base)
        if m.finetune_steps:
            labeled = finetuning_labels(m, sessions, i)  # the device labels what it has seen
            tuned = _finetune(original, *spec.train_source.get(labeled), m) if len(labeled) \
                else original
            logits["finetune"].append(tuned(x))
        ys.append(y)
        scored_sessions += 1
    y = torch.cat(ys) if ys else torch.empty(0, dtype=torch.long)
    cat = {k: torch.cat(v) if v else torch.empty(0, spec.num_classes) for k, v in logits.items()}
    # the same keys from every client (NaN: fine-tuning skipped, or no test data)
    metrics = {"num-examples": len(y), "sessions": scored_sessions, "original-fallback": fallback,
               **{f"acc_{k}": accuracy(v, y) if len(v) == len(y) else float("nan")
                  for k, v in cat.items()}}
    scores = None
    if spec.num_classes == 2:  # labels stay here: the client's own AUC (and score histograms)
        scored = {k: v for k, v in cat.items() if len(v) == len(y)}
        metrics.update({f"auc_{k}": binary_auc(margin(v), y) for k, v in scored.items()})
        if m.auc_bins:
            scores = {}
            for k, v in scored.items():
                scores.update(score_histograms(k, margin(v), y, m.auc_bins))
    return metrics, scores


#: The score axis of the AUC histograms: the logit margin ``l_1 - l_0`` (the log-odds of the
#: positive class, a monotone function of the softmax score) clipped to +-AUC_RANGE.
AUC_RANGE = 16.0


def margin(logits: torch.Tensor) -> torch.Tensor:
    """``[N, 2]`` logits -> ``[N]`` log-odds of class 1 (ranks samples as the softmax does)."""
    return (logits[:, 1] - logits[:, 0]).float()


def score_histograms(key: str, scores: torch.Tensor, labels: torch.Tensor, bins: int
                     ) -> dict[str, torch.Tensor]:
    """What a client shares for the pooled AUC of model ``key``: per class, how many of its
    test samples' scores fall into each of ``bins`` equal bins of ``[-AUC_RANGE, AUC_RANGE]``
    (outside: the end bins). No per-sample value leaves the device."""
    idx = ((scores.clamp(-AUC_RANGE, AUC_RANGE) + AUC_RANGE) * (bins / (2 * AUC_RANGE))).long()
    idx = idx.clamp(0, bins - 1)  # [N]
    return {f"{key}.{name}": torch.bincount(idx[labels == c], minlength=bins).float()
            for c, name in ((0, "negative"), (1, "positive"))}


def _finetune(original: nn.Linear, x: torch.Tensor, y: torch.Tensor, m) -> nn.Linear:
    """The fine-tuning baseline: a copy of the original classifier, ``finetune_steps`` full-batch
    SGD steps (deterministic) on one labeled session."""
    layer = copy.deepcopy(original)
    opt = torch.optim.SGD(layer.parameters(), lr=m.finetune_lr, momentum=0.9)
    with torch.enable_grad():
        for _ in range(m.finetune_steps):
            loss = F.cross_entropy(layer(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return layer


# -- the server's side --------------------------------------------------------------------

class SessionServer:
    """Answers each client's uploads with generated parameters and keeps one record per session
    (bytes up and down, generation seconds)."""

    def __init__(self, spec: RunSpec, trained: dict) -> None:
        self.spec = spec
        self.generator = trained["generator"]
        self.original = {k: v.detach().cpu().clone()
                         for k, v in trained["original"].state_dict().items()}
        #: One list of session records per client that was answered.
        self.by_client: dict[int, list[dict]] = {}
        self.backbone = None
        if spec.method.upload == "samples":  # loaded before any session is timed
            from fedadapt.backbones import build_backbone

            self.backbone = build_backbone(spec.backbone).eval().to(spec.device)

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """``method.upload=samples``: the server runs the frozen backbone (static layers) on the
        run's device and in its precision, as the clients' cached features were computed."""
        from fedadapt.devices import autocast

        dev = torch.device(self.spec.device)
        with torch.no_grad(), autocast(dev.type, self.spec.precision):
            return self.backbone(images.to(dev)).float().cpu()

    @torch.no_grad()
    def answer(self, cid: int, uploads: dict[str, dict[str, torch.Tensor]],
               upload_bytes: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
        """``{"original": ..., "session.i": generated layers}`` for one client."""
        out = {"original": self.original}
        records = self.by_client.setdefault(cid, [])
        for name in sorted(uploads, key=lambda n: int(n.split(".")[1])):
            upload = uploads[name]
            t0 = time.perf_counter()
            if "samples" in upload:
                upload = {"embeddings": fused(self.spec, self.embed(upload["samples"]))}
            elif "anchor_sample" in upload:
                upload = {"anchor": fused(self.spec, self.embed(upload["anchor_sample"]))}
            out[name] = self.generator.generate(upload)
            seconds = time.perf_counter() - t0
            records.append({"client": cid, "session": int(name.split(".")[1]),
                                 "up_bytes": upload_bytes[name],
                                 "up_tensor_bytes": tensor_bytes(uploads[name]),
                                 "down_tensor_bytes": tensor_bytes(out[name]), "gen_s": seconds})
        return out

    def check_uploads(self, uploads: dict[str, dict[str, torch.Tensor]]) -> Optional[str]:
        """Why a client's uploads cannot be answered (None when they can)."""
        m = self.spec.method
        key = upload_key(m)
        anchor = key.startswith("anchor")
        width = self.spec.embed_dim + (0 if self.spec.family.query_feature is None
                                       else len(self.spec.family.query_feature))
        for name, upload in uploads.items():
            if not name.split(".")[-1].isdigit():
                return f"{name}: not a session"
            if set(upload) != {key}:
                return f"{name}: arrays {sorted(upload)}, expected ['{key}']"
            t = upload[key]
            if key in ("embeddings", "anchor") and (t.dim() != 2 or t.shape[1] != width):
                return f"{name}: {key} of shape {tuple(t.shape)}, expected [K, {width}]"
            if key in ("samples", "anchor_sample") and t.dim() != 4:
                return f"{name}: {key} of shape {tuple(t.shape)}, expected [K, 3, H, W]"
            rows = context_rows(m)
            if len(t) == 0 or len(t) > rows or (anchor and len(t) != 1):
                return f"{name}: {len(t)} rows for a context of {rows}"
            if not torch.isfinite(t).all():
                return f"{name}: non-finite values"
        return None

    @property
    def records(self) -> list[dict]:
        """Every answered session, by client."""
        return [r for cid in sorted(self.by_client) for r in self.by_client[cid]]

    def keep_clients(self, clients: set[int]) -> None:
        """Drop the records of clients that did not complete the conversation."""
        self.by_client = {cid: rs for cid, rs in self.by_client.items() if cid in clients}

    def note_download(self, cid: int, download_bytes: dict[str, int]) -> None:
        """The serialized size of each session's answer, as Flower counts it."""
        for r in self.by_client[cid]:
            r["down_bytes"] = download_bytes[f"session.{r['session']}"]


def tensor_bytes(arrays: dict[str, torch.Tensor]) -> int:
    """The tensors' own bytes (numel x element size), without serialization headers."""
    return sum(t.numel() * t.element_size() for t in arrays.values())


def binary_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC (scikit-learn's ``roc_auc_score``: the Mann-Whitney statistic, ties count one
    half); NaN unless both classes occur."""
    from sklearn.metrics import roc_auc_score

    labels = np.asarray(labels)
    if len(np.unique(labels)) < 2:
        return float("nan")
    return float(roc_auc_score(labels, np.asarray(scores, dtype=np.float64)))


def histogram_auc(negative: np.ndarray, positive: np.ndarray) -> dict:
    """The pooled AUC from the clients' summed score histograms (``roc_auc_score`` with the bin
    as the score and the counts as sample weights), and how exact it is: scores that share a
    bin count as ties (one half), so the exact AUC of the underlying scores lies within
    ``tie_bound`` = 0.5 x (positive-negative pairs in one bin) / (all pairs) of it."""
    from sklearn.metrics import roc_auc_score

    neg, pos = np.asarray(negative, np.float64), np.asarray(positive, np.float64)
    pairs = neg.sum() * pos.sum()
    if pairs == 0:
        return {"auc": float("nan"), "tie_bound": float("nan")}
    bins = np.arange(len(neg), dtype=np.float64)
    keep = np.concatenate([neg, pos]) > 0
    auc = roc_auc_score(np.r_[np.zeros(len(neg)), np.ones(len(pos))][keep],
                        np.r_[bins, bins][keep], sample_weight=np.r_[neg, pos][keep])
    return {"auc": float(auc), "tie_bound": float(0.5 * (neg * pos).sum() / pairs)}


RESULT_KEYS = ("acc_original", "acc_finetune", "acc_generated")


def summarize_sessions(rows: list[dict], records: list[dict],
                       scores: list[dict[str, torch.Tensor]]) -> dict:
    """Accuracy over all clients' test images (example-weighted) and the client mean; for a
    binary task the mean of the clients' own AUCs (``auc``) and, from the score histograms in
    ``scores`` (``method.auc_bins``), the AUC pooled over every client's samples
    (``auc_pooled``, within ``auc_tie_bound``); per-session payloads and generation time; the
    delay table. Nothing here sees a label: the clients computed what needs them."""
    out: dict = {key: acc for key in RESULT_KEYS
                 if (acc := accuracy_over_clients(rows, key)) is not None}
    out["scored_images"] = int(sum(r["num-examples"] for r in rows))
    out["original_fallback_images"] = int(sum(r.get("original-fallback", 0) for r in rows))
    aucs = {k: [r[f"auc_{k}"] for r in rows if f"auc_{k}" in r and np.isfinite(r[f"auc_{k}"])]
            for k in ("generated", "original", "finetune")}
    if any(aucs.values()):  # binary task: the mean of the clients' own AUCs
        out["auc"] = {k: float(np.mean(v)) for k, v in aucs.items() if v}
        out["auc_clients"] = {k: len(v) for k, v in aucs.items() if v}
    if scores:  # pooled over every client's test samples, from their summed histograms
        pooled = {k: histogram_auc(sum(s[f"{k}.negative"] for s in scores),
                                   sum(s[f"{k}.positive"] for s in scores))
                  for k in ("generated", "original", "finetune")
                  if all(f"{k}.negative" in s for s in scores)}
        out["auc_pooled"] = {k: v["auc"] for k, v in pooled.items()}
        out["auc_tie_bound"] = {k: v["tie_bound"] for k, v in pooled.items()}
    if records:
        up = [r["up_bytes"] for r in records]
        down = [r["down_bytes"] for r in records if "down_bytes" in r]
        gen = [r["gen_s"] for r in records]
        out["payload"] = {"sessions": len(records),
                          "up_bytes_median": float(np.median(up)),
                          "up_bytes_max": int(max(up)),
                          "up_tensor_bytes_median": float(np.median(
                              [r["up_tensor_bytes"] for r in records])),
                          "down_bytes_median": float(np.median(down)) if down else None,
                          "down_bytes_max": int(max(down)) if down else None,
                          "down_tensor_bytes_median": float(np.median(
                              [r["down_tensor_bytes"] for r in records])),
                          "generate_ms_median": 1000 * float(np.median(gen)),
                          "generate_ms_p90": 1000 * float(np.percentile(gen, 90))}
        out["delay"] = delay_table(out["payload"])
    return out


def generator_summary(method, generator: nn.Module) -> dict:
    """What served every session: ``method.context`` and, for DUET, SWA's p of each dynamic
    layer (Eq. 8). p depends only on the generators' weights, not on the session, so it is
    logged once per run."""
    out: dict = {"context": method.context}
    if method.context == "first":
        out["context_size"] = method.context_size
    if hasattr(generator, "swa_weights"):
        out["swa"] = {"temperature": method.temperature, "generators": method.generators,
                      "depends_on_session": False, "p": generator.swa_weights()}
    return out
