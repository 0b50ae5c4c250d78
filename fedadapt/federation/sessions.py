"""Session plug-ins (DUET, CDC-MMPG): a generator trained once on the server, then a conversation
with every device over Flower's Message API. Nothing trains on the devices.

Server training, from the training clients' cached features:

1. the original model: ``Linear(D, C)`` on the mixture of all clients' training features;
2. the generator (DUET's PPG + SWA, or CDC-MMPG's FDA with ADR trained first), on sessions of K
   samples cut from each training client's own data (a seeded permutation per epoch); Adam(W),
   early stopping on the accuracy of the clients' validation sessions, best epoch kept.

Serving (:func:`fedadapt.federation.server.converse`), per client, in two messages:

1. ``session-upload`` (QUERY): the client cuts its test split, in its seeded arrival order, into
   sessions of K and replies with one ArrayRecord per session: the K embeddings (DUET, F-hyper),
   one randomly chosen anchor embedding (CDC-MMPG), or the K raw preprocessed images
   (``method.upload=samples``: the server runs the frozen backbone);
2. ``session-predict`` (EVALUATE): the server answers with one ArrayRecord per session holding
   only the generated dynamic layers (plus, once per client, the original classifier for the
   baseline rows); the client predicts every session with its layers and replies with metrics.

The server records each session's upload and download bytes (``ArrayRecord.count_bytes``) and
its generation time; :func:`delay_table` turns them into DUET's Table 3 / CDC-MMPG's Table 6.
Baselines in every run: the original model, and fine-tuning (the original classifier trained on
the labels of the client's previous session, then used for the current one; the first session
has no labels yet and uses the original model).
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.adapters.cdc_mmpg import build_cdc_mmpg, fuse
from fedadapt.adapters.duet import (
    DuetConfig,
    apply_dynamic,
    build_duet,
    dynamic_layers,
    weighted_session_ce,
)
from fedadapt.federation.plugin import (
    ServerData,
    _accuracy,
    accuracy_over_clients,
    fit,
    pad,
    pad_labels,
    sequences,
    train_original,
)
from fedadapt.federation.training import RunSpec, derive_seed

#: Link speeds of DUET's Table 3 and CDC-MMPG's Table 6, in MB/s (1 MB = 10^6 bytes).
RATES_MB_S = (5, 15, 50, 100)


def build_generator(spec: RunSpec) -> nn.Module:
    m = spec.method
    if isinstance(m, DuetConfig):
        return build_duet(m, spec.embed_dim, spec.num_classes)
    q = 0 if spec.query_feature is None else len(spec.query_feature)
    return build_cdc_mmpg(m, spec.embed_dim, spec.num_classes, q)


def fused(spec: RunSpec, frames: torch.Tensor) -> torch.Tensor:
    """The frames with the run's text query concatenated to each (unchanged without one)."""
    return fuse(frames, spec.query_feature)


def uses_anchor(generator: nn.Module) -> bool:
    return getattr(generator, "adr", None) is not None


def train_generator(spec: RunSpec) -> dict:
    """The original model and the generator, on the training clients' cached features."""
    m = spec.method
    largest = max(len(c.train) for c in spec.clients)
    if m.session > largest:
        from fedadapt.config import ConfigError

        raise ConfigError(f"method.session={m.session} is invalid: sessions are cut from one "
                          f"client's data and the largest training client holds {largest} "
                          f"samples")
    data = ServerData.of(spec)
    feats, labels = fused(spec, data.feats), data.labels  # the original model: image only

    def stage_rng(stage: int) -> np.random.Generator:
        torch.manual_seed(derive_seed(spec.seed, 0x5E55, stage))
        return np.random.default_rng([spec.seed, 0x5E55, stage])

    original, original_log = train_original(spec, data, stage_rng(1), lr=m.classifier_lr)

    rng = stage_rng(2)
    generator = build_generator(spec)
    k = m.session
    val_sessions = [s for c in data.clients for s in sequences(c.val, k, rng)]
    val_anchors = [int(rng.integers(len(s))) for s in val_sessions]
    gamma = getattr(m, "gamma", 1.0)

    def batch(group: list[np.ndarray], anchors: list[int]):
        x, mask = pad([feats[s] for s in group], k)
        y = pad_labels([labels[s] for s in group], k)
        return x, mask, y, x[torch.arange(len(group)), torch.tensor(anchors)]

    def steps():
        """One epoch of training sessions (each from ONE client), ``sessions_per_step``
        sessions per step; yields ``(frames, mask, labels, anchor)``."""
        sessions = [s for c in data.clients for s in sequences(c.train, k, rng)]
        order = rng.permutation(len(sessions))
        for i in range(0, len(order), m.sessions_per_step):
            group = [sessions[j] for j in order[i:i + m.sessions_per_step]]
            yield batch(group, [int(rng.integers(len(s))) for s in group])

    val_batches = [batch(val_sessions[i:i + 256], val_anchors[i:i + 256])
                   for i in range(0, len(val_sessions), 256)]

    logs = {"original": original_log}
    if uses_anchor(generator):  # CDC-MMPG stage 1: ADR alone (AdamW), then frozen
        logs["adr"] = _train_adr(spec, generator.adr, feats[data.train_idx], steps, val_batches)

    params = [p for p in generator.parameters() if p.requires_grad]
    opt = (torch.optim.AdamW(params, lr=m.lr, weight_decay=m.weight_decay) if m.weight_decay
           else torch.optim.Adam(params, lr=m.lr))

    def losses():
        for x, mask, y, a in steps():
            yield weighted_session_ce(generator.session_logits(x, mask, a, sample=True), y,
                                      mask, gamma)

    @torch.no_grad()
    def val() -> float:
        correct = total = 0
        for x, mask, y, a in val_batches:
            pred = generator.session_logits(x, mask, a, sample=False).argmax(-1)
            correct += int(((pred == y) & ~mask).sum())
            total += int((~mask).sum())
        return correct / max(total, 1)

    generator.train()
    logs["generator"] = fit(generator, losses, val, epochs=m.max_epochs, patience=m.patience,
                            lr=m.lr, optimizer=opt, label=f"{m.name} (generator)")
    return {"original": original, "generator": generator.eval(), "log": logs}


def _train_adr(spec: RunSpec, adr, train_feats: torch.Tensor, steps, val_batches) -> dict:
    """CDC-MMPG's first stage: ADR alone with AdamW, early-stopped on the validation sessions'
    loss; frozen afterwards."""
    m = spec.method
    adr.pop_mean.copy_(train_feats.mean(0))
    adr.pop_std.copy_(train_feats.std(0) + 1e-6)

    @torch.no_grad()
    def adr_val() -> float:  # higher is better: the negative validation loss
        with torch.random.fork_rng(devices=[]):  # the same VAE noise every epoch
            torch.manual_seed(derive_seed(spec.seed, 0xADE))
            return -float(np.mean([float(adr.loss(a, x, mask, m.lam))
                                   for x, mask, _, a in val_batches]))

    log = fit(adr, lambda: (adr.loss(a, x, mask, m.lam) for x, mask, _, a in steps()),
              adr_val, epochs=m.adr_epochs, patience=m.adr_epochs, lr=m.adr_lr,
              optimizer=torch.optim.AdamW(adr.parameters(), lr=m.adr_lr),
              label=f"{m.name} (ADR)", score="-val loss")
    adr.requires_grad_(False)
    adr.eval()
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
    embedding) or ``embeddings`` (DUET, F-hyper: K), or their raw-image forms with
    ``method.upload=samples`` (``anchor_sample``, ``samples``)."""
    anchor = bool(getattr(method, "adr", False))
    if method.upload == "samples":
        return "anchor_sample" if anchor else "samples"
    return "anchor" if anchor else "embeddings"


def upload_of(spec: RunSpec, frames: torch.Tensor, images: Optional[torch.Tensor],
              gen: torch.Generator) -> dict[str, torch.Tensor]:
    """What the device sends for one session (:func:`upload_key`): one randomly chosen anchor,
    or the whole session; embeddings, or with ``method.upload=samples`` preprocessed images."""
    key = upload_key(spec.method)
    rows = images if spec.method.upload == "samples" else frames
    if key.startswith("anchor"):
        k = int(torch.randint(len(frames), (1,), generator=gen))
        rows = rows[k:k + 1]
    return {key: rows.contiguous()}


def session_upload(spec: RunSpec, cid: int) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """The client's first message: ``{"session.i": upload}`` and its metrics."""
    gen = torch.Generator().manual_seed(derive_seed(spec.seed, 0xA7C, cid))
    out = {}
    for i, s in enumerate(client_sessions(spec, cid)):
        frames, _ = spec.train_source.get(s)
        images = spec.image_source.get(s)[0] if spec.method.upload == "samples" else None
        out[f"session.{i}"] = upload_of(spec, fused(spec, frames), images, gen)
    return out, {"sessions": len(out)}


@torch.no_grad()
def session_predict(spec: RunSpec, cid: int, arrays: dict[str, dict[str, torch.Tensor]]
                    ) -> tuple[dict, Optional[dict[str, torch.Tensor]]]:
    """The client's second message: every session predicted with its generated layers, and the
    baselines. Returns metrics and, for a binary task, the scores the server needs for AUC."""
    m = spec.method
    original = nn.Linear(spec.embed_dim, spec.num_classes)
    original.load_state_dict(arrays["original"])
    sessions = client_sessions(spec, cid)
    logits = {"generated": [], "original": [], "finetune": []}
    ys = []
    previous = None
    for i, s in enumerate(sessions):
        x, y = spec.train_source.get(s)
        logits["generated"].append(apply_dynamic(dynamic_layers(arrays[f"session.{i}"]),
                                                 fused(spec, x)))
        logits["original"].append(original(x))
        if m.finetune_steps:
            tuned = original if previous is None else _finetune(original, *previous, m)
            logits["finetune"].append(tuned(x))
        previous = (x, y)  # the device labels the session it has just seen
        ys.append(y)
    y = torch.cat(ys) if ys else torch.empty(0, dtype=torch.long)
    cat = {k: torch.cat(v) if v else torch.empty(0, spec.num_classes) for k, v in logits.items()}
    # the same keys from every client (NaN: fine-tuning skipped, or no test data)
    metrics = {"num-examples": len(y), "sessions": len(sessions),
               **{f"acc_{k}": _accuracy(v, y) if len(v) == len(y) else float("nan")
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

            self.backbone = build_backbone(spec.backbone).eval()

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """``method.upload=samples``: the server runs the frozen backbone (static layers)."""
        return self.backbone(images)

    @torch.no_grad()
    def answer(self, pid: int, uploads: dict[str, dict[str, torch.Tensor]],
               upload_bytes: dict[str, int]) -> dict[str, dict[str, torch.Tensor]]:
        """``{"original": ..., "session.i": generated layers}`` for one client."""
        out = {"original": self.original}
        records = self.by_client.setdefault(pid, [])
        for name in sorted(uploads, key=lambda n: int(n.split(".")[1])):
            upload = uploads[name]
            t0 = time.perf_counter()
            if "samples" in upload:
                upload = {"embeddings": fused(self.spec, self.embed(upload["samples"]))}
            elif "anchor_sample" in upload:
                upload = {"anchor": fused(self.spec, self.embed(upload["anchor_sample"]))}
            out[name] = self.generator.generate(upload)
            seconds = time.perf_counter() - t0
            records.append({"client": pid, "session": int(name.split(".")[1]),
                                 "up_bytes": upload_bytes[name],
                                 "up_tensor_bytes": tensor_bytes(uploads[name]),
                                 "down_tensor_bytes": tensor_bytes(out[name]), "gen_s": seconds})
        return out

    def check_uploads(self, uploads: dict[str, dict[str, torch.Tensor]]) -> Optional[str]:
        """Why a client's uploads cannot be answered (None when they can)."""
        m = self.spec.method
        key = upload_key(m)
        anchor = key.startswith("anchor")
        width = self.spec.embed_dim + (0 if self.spec.query_feature is None
                                       else len(self.spec.query_feature))
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
            if len(t) == 0 or len(t) > m.session or (anchor and len(t) != 1):
                return f"{name}: {len(t)} rows for sessions of {m.session}"
            if not torch.isfinite(t).all():
                return f"{name}: non-finite values"
        return None

    @property
    def records(self) -> list[dict]:
        """Every answered session, by client."""
        return [r for pid in sorted(self.by_client) for r in self.by_client[pid]]

    def keep_clients(self, clients: set[int]) -> None:
        """Drop the records of clients that did not complete the conversation."""
        self.by_client = {pid: rs for pid, rs in self.by_client.items() if pid in clients}

    def note_download(self, pid: int, download_bytes: dict[str, int]) -> None:
        """The serialized size of each session's answer, as Flower counts it."""
        for r in self.by_client[pid]:
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


def delay_table(payload: dict) -> list[dict]:
    """Per link speed: upload and download time of the median session's measured payload (the
    serialized ArrayRecord, as Flower counts it), and the total with the server's median
    generation time (ms)."""
    rows = []
    for rate in RATES_MB_S:
        up_ms = 1000 * payload["up_bytes_median"] / (rate * 1e6)
        down_ms = 1000 * (payload["down_bytes_median"] or 0) / (rate * 1e6)
        rows.append({"rate_MB_s": rate, "up_ms": up_ms, "down_ms": down_ms,
                     "total_ms": up_ms + payload["generate_ms_median"] + down_ms})
    return rows
