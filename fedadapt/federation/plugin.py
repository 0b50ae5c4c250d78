"""Server-trained plug-ins (ICIIA): trained once on the server ("cloud") from the training clients'
cached features, then delivered to every client as named arrays in one Flower round; the clients
only recognise with it.

ICIIA's Algorithm 1 on the server:

1. the *original model*: the backbone's classifier ``Linear(D, C)`` trained on the mixture of all
   clients' training features (early stopping on their validation features);
2. the module, its classifier initialised from the original one, trained on sequences of B
   images that each come from ONE client (SGD, gradient-norm clipping, early stopping on the
   clients' validation sequences; the best validation epoch is kept);
3. the prompt-tuning baseline: the classifier over ``[feature; client token]`` with one learned
   token of D/2 per client, trained jointly on the clients' labeled training features.

Each client then recognises its test split (in arrival order) with the original classifier, with
the module in batch mode (sequences of B of its images), one by one with its cache of the B - 1
most recent features (the original classifier answers while the cache holds fewer than
``method.min_history``: cold start), with its prompt token, and with the last layer fine-tuned on
its own labeled training split (the fine-tuning baseline, trained on the client).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.adapters.iciia import Iciia, recognize_stream
from fedadapt.data.partition import ClientSplit
from fedadapt.federation.training import RunSpec, derive_seed
from fedadapt.log import log


def sequences(indices: np.ndarray, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A seeded permutation of ``indices`` cut into pieces of ``size``: one client's sequences,
    or the classifiers' batches."""
    perm = rng.permutation(np.asarray(indices))
    return [perm[i:i + size] for i in range(0, len(perm), size)]


def build_module(spec: RunSpec) -> Iciia:
    m = spec.method
    return Iciia(spec.embed_dim, spec.num_classes, layers=m.layers, groups=m.groups,
                 heads=m.heads, dropout=m.dropout, mixing=m.mixing, shuffle=m.shuffle,
                 classifier_relu=m.classifier_relu)


class PromptClassifier(nn.Module):
    """Prompt tuning for a frozen feature extractor: ``Linear(D + D/2, C)`` over the feature and
    the client's learned token (one token of D/2 per client)."""

    def __init__(self, dim: int, num_classes: int, num_clients: int) -> None:
        super().__init__()
        self.tokens = nn.Parameter(torch.zeros(num_clients, dim // 2))
        self.linear = nn.Linear(dim + dim // 2, num_classes)

    def forward(self, feats: torch.Tensor, client: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([feats, self.tokens[client]], dim=-1))


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean()) if len(y) else float("nan")


def fit(model: nn.Module, loss_of: Callable[[], list[torch.Tensor]],
        val_acc: Callable[[], float], *, epochs: int, patience: int, lr: float,
        momentum: float = 0.9, clip: Optional[float] = None, label: str = "",
        optimizer: Optional[torch.optim.Optimizer] = None, score: str = "val",
        schedule: Optional[Callable[[torch.optim.Optimizer], object]] = None) -> dict:
    """SGD (or ``optimizer``) on each loss ``loss_of()`` yields in an epoch (one batch each),
    early stopping on ``val_acc`` (higher is better; ``score`` names it in the log); ``model``
    ends with its best epoch's weights. ``schedule(opt)`` builds a learning-rate scheduler
    stepped after every optimiser step."""
    opt = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                       lr=lr, momentum=momentum)
    scheduler = schedule(opt) if schedule else None
    best, best_state, best_epoch, waited = float("-inf"), copy.deepcopy(model.state_dict()), 0, 0
    t0 = time.time()
    for epoch in range(1, epochs + 1):
        model.train()
        losses = []
        for loss in loss_of():
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            if scheduler is not None:
                scheduler.step()
            losses.append(float(loss.detach()))
        model.eval()
        acc = val_acc()
        if acc > best:
            best, best_state, best_epoch, waited = acc, copy.deepcopy(model.state_dict()), epoch, 0
        else:
            waited += 1
        shown = (lambda v: f"{100 * v:.2f}%") if score == "val" else (lambda v: f"{v:.4f}")
        rate = f" | lr {opt.param_groups[0]['lr']:.2e}" if scheduler is not None else ""
        log(f"[{label}] epoch {epoch}/{epochs} | loss {np.mean(losses):.3f} | {score} "
            f"{shown(acc)} | best {shown(best)} (epoch {best_epoch}){rate} | "
            f"{time.time() - t0:.0f} s")
        if waited >= patience:
            break
    model.load_state_dict(best_state)
    return {"best_val_acc": best, "best_epoch": best_epoch, "epochs_run": epoch,
            "train_s": time.time() - t0, "last_lr": opt.param_groups[0]["lr"]}


#: The classifiers' batch size (the original model, prompt tuning).
CLASSIFIER_BATCH = 64


@dataclass
class ServerData:
    """What the server holds: the training clients' training and validation features and labels
    (the uploads the protocol provides for server training), never a test sample. Rows are the
    server's own: ``clients[c]`` indexes client ``c``'s rows, ``owner`` gives each row's
    client."""

    feats: torch.Tensor
    labels: torch.Tensor
    train_idx: np.ndarray
    val_idx: np.ndarray
    owner: np.ndarray
    #: Each client's rows (``test`` empty: the server has none).
    clients: list[ClientSplit]

    @classmethod
    def of(cls, spec: RunSpec) -> "ServerData":
        """Read only the clients' ``train`` and ``val`` rows of the cached features (unseen
        test clients hold neither)."""
        if sum(len(c.val) for c in spec.clients) == 0:
            from fedadapt.config import ConfigError

            raise ConfigError(f"method={spec.method.name} trains with early stopping on the "
                              f"clients' validation splits: partition.val_fraction must be > 0")
        held = np.concatenate([np.concatenate([c.train, c.val]) for c in spec.clients])
        feats, labels = spec.train_source.get(held.astype(np.int64))  # [R, D], [R]
        clients, owner, start = [], [], 0
        for cid, c in enumerate(spec.clients):
            n_train, n_val = len(c.train), len(c.val)
            clients.append(ClientSplit(train=np.arange(start, start + n_train),
                                       val=np.arange(start + n_train, start + n_train + n_val),
                                       test=np.empty(0, dtype=np.int64)))
            owner += [cid] * (n_train + n_val)
            start += n_train + n_val
        return cls(feats, labels, np.concatenate([c.train for c in clients]),
                   np.concatenate([c.val for c in clients]), np.asarray(owner, dtype=np.int64),
                   clients)


def train_original(spec: RunSpec, data: ServerData, rng: np.random.Generator, *, lr: float
                   ) -> tuple[nn.Linear, dict]:
    """The original model: the classifier ``Linear(D, C)`` trained on the mixture of the
    clients' training features (SGD, early stopping on their validation features), or, with
    ``original.train_backbone``, the classifier trained with the backbone."""
    m = spec.method
    original = nn.Linear(spec.embed_dim, spec.num_classes)
    feats, labels = data.feats, data.labels
    if spec.original_classifier is not None:  # trained with the backbone (original.*)
        original.load_state_dict(spec.original_classifier)
        with torch.no_grad():
            val = _accuracy(original(feats[data.val_idx]), labels[data.val_idx])
        log(f"[original classifier] trained with the backbone: {100 * val:.2f}% on the "
            f"clients' validation features")
        return original.eval(), {"trained_with_backbone": True, "best_val_acc": val}

    def batches():
        for b in sequences(data.train_idx, CLASSIFIER_BATCH, rng):
            yield F.cross_entropy(original(feats[b]), labels[b])

    @torch.no_grad()
    def val() -> float:
        return _accuracy(original(feats[data.val_idx]), labels[data.val_idx])

    log_ = fit(original, batches, val, epochs=m.classifier_epochs, patience=m.patience, lr=lr,
               label="original classifier")
    return original.eval(), log_


def train_on_server(spec: RunSpec) -> dict:
    """Algorithm 1 and the baselines' server parts; returns the trained modules and a log."""
    m = spec.method

    def stage_rng(stage: int) -> np.random.Generator:
        """Each stage draws from its own seeded streams, so the baselines are the same in every
        run of a seed, whichever module is trained between them."""
        torch.manual_seed(derive_seed(spec.seed, 0x1C11A, stage))
        return np.random.default_rng([spec.seed, 0x1C11A, stage])

    data = ServerData.of(spec)
    feats, labels, clients = data.feats, data.labels, data.clients
    train_idx, val_idx, owner = data.train_idx, data.val_idx, data.owner

    # 1. the original model: the classifier on the mixture of the clients' training features
    original, original_log = train_original(spec, data, stage_rng(1), lr=m.lr)

    # 2. ICIIA: sequences of B images of one client, the classifier starts from the original
    rng = stage_rng(2)
    module = build_module(spec)
    module.classifier.load_state_dict(original.state_dict())
    val_seqs = [s for c in clients for s in sequences(c.val, m.images, rng)]

    def iciia_batches():
        seqs = [s for c in clients for s in sequences(c.train, m.images, rng)]
        order = rng.permutation(len(seqs))
        for i in range(0, len(order), m.sequences_per_step):
            group = [seqs[j] for j in order[i:i + m.sequences_per_step]]
            x, mask = pad([feats[s] for s in group], m.images)
            y = pad_labels([labels[s] for s in group], m.images)
            logits = module(x, mask)
            yield F.cross_entropy(logits[~mask], y[~mask])

    @torch.no_grad()
    def iciia_val() -> float:
        correct = total = 0
        for s in val_seqs:
            correct += int((module(feats[s]).argmax(-1) == labels[s]).sum())
            total += len(s)
        return correct / max(total, 1)

    iciia_log = fit(module, iciia_batches, iciia_val, epochs=m.max_epochs, patience=m.patience,
                     lr=m.lr, momentum=m.momentum, clip=m.clip, label=f"{m.name} (ICIIA)")

    # 3. prompt tuning: one token per client, trained with the classifier
    prompt = None
    prompt_log = None
    if m.prompt_tuning:
        rng = stage_rng(3)
        prompt = PromptClassifier(spec.embed_dim, spec.num_classes, len(clients))
        owner_t = torch.from_numpy(owner)

        def prompt_batches():
            for b in sequences(train_idx, CLASSIFIER_BATCH, rng):
                yield F.cross_entropy(prompt(feats[b], owner_t[b]), labels[b])

        @torch.no_grad()
        def prompt_val() -> float:
            return _accuracy(prompt(feats[val_idx], owner_t[val_idx]), labels[val_idx])

        prompt_log = fit(prompt, prompt_batches, prompt_val, epochs=m.classifier_epochs,
                         patience=m.patience, lr=m.lr, momentum=m.momentum,
                         label="prompt tuning")
    return {"original": original.eval(), "module": module.eval(),
            "prompt": None if prompt is None else prompt.eval(),
            "log": {"original": original_log, "iciia": iciia_log, "prompt": prompt_log}}


def pad(seqs: list[torch.Tensor], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[S, size, D]`` zero-padded sequences and their padding mask (True = padding)."""
    x = torch.zeros(len(seqs), size, seqs[0].shape[-1])
    mask = torch.ones(len(seqs), size, dtype=torch.bool)
    for i, s in enumerate(seqs):
        x[i, :len(s)], mask[i, :len(s)] = s, False
    return x, mask


def pad_labels(ys: list[torch.Tensor], size: int) -> torch.Tensor:
    y = torch.zeros(len(ys), size, dtype=torch.long)
    for i, s in enumerate(ys):
        y[i, :len(s)] = s
    return y


def client_arrays(trained: dict, cid: int) -> dict[str, torch.Tensor]:
    """What client ``cid`` receives: the module (with its classifier), the original classifier
    and, for prompt tuning, the shared classifier and ITS token only."""
    out = {f"iciia.{k}": v for k, v in trained["module"].state_dict().items()}
    out.update({f"original.{k}": v for k, v in trained["original"].state_dict().items()})
    if trained["prompt"] is not None:
        p = trained["prompt"]
        out.update({f"prompt.linear.{k}": v for k, v in p.linear.state_dict().items()})
        out["prompt.token"] = p.tokens[cid].detach().clone()
    return {k: v.detach().cpu().clone() for k, v in out.items()}


@torch.no_grad()
def recognize(spec: RunSpec, cid: int, arrays: dict[str, torch.Tensor]) -> dict:
    """The client's side: recognise its test split with what it received (no training, except
    the fine-tuning baseline's last layer on its own labeled training split)."""
    m = spec.method
    module = build_module(spec)
    module.load_state_dict({k[6:]: v for k, v in arrays.items() if k.startswith("iciia.")})
    module.eval()
    original = nn.Linear(spec.embed_dim, spec.num_classes)
    original.load_state_dict({k[9:]: v for k, v in arrays.items() if k.startswith("original.")})
    split = spec.clients[cid]
    # the order the images arrive in: a seeded permutation (stored order may be class-sorted)
    order = np.random.default_rng([spec.seed, 0xA77, cid]).permutation(split.test)
    x, y = spec.train_source.get(order)
    out = {"num-examples": len(y), "acc_original": _accuracy(original(x), y)}
    batch_logits = [module(x[i:i + m.images]) for i in range(0, len(y), m.images)]
    out["acc_batch"] = _accuracy(torch.cat(batch_logits), y) if len(y) else float("nan")
    stream = recognize_stream(module, original, x, m.images - 1, m.min_history) if len(y) \
        else torch.empty(0, spec.num_classes)
    out["acc_stream"] = _accuracy(stream, y)
    for h in m.history_sweep:  # Figure 6: exactly h cached features per recognised image
        if len(y) > h:
            logits = recognize_stream(module, original, x, h, h)[h:]
            out[f"acc_h{h}"] = _accuracy(logits, y[h:])
            out[f"n_h{h}"] = len(y) - h
    seen = len(split.train) > 0  # unseen test clients ("by client"): no labels, no tuning
    if "prompt.token" in arrays and seen:
        linear = nn.Linear(spec.embed_dim + spec.embed_dim // 2, spec.num_classes)
        linear.load_state_dict({k[14:]: v for k, v in arrays.items()
                                if k.startswith("prompt.linear.")})
        token = arrays["prompt.token"].expand(len(y), -1)
        out["acc_prompt"] = _accuracy(linear(torch.cat([x, token], dim=-1)), y)
    out["acc_finetune"] = _finetune_last_layer(spec, cid, original, x, y) if seen \
        else float("nan")
    return out


def _finetune_last_layer(spec: RunSpec, cid: int, original: nn.Linear, x_test, y_test) -> float:
    """The fine-tuning baseline as the authors run it (mikudehuane/ICIIA, ``code/finetune.py``):
    the original classifier trained on the client's labeled training split, SGD
    (``method.lr``, ``method.momentum``), batches of ``method.finetune_batch``, gradient-norm
    clipping ``method.clip``; evaluated on the client's validation split before every epoch
    (epoch 0: the original classifier), stopped after ``method.patience`` epochs without gain,
    at most ``method.finetune_epochs``; returns the test accuracy of the best validation epoch
    (the last epoch's when the client has no validation split)."""
    m = spec.method
    if m.finetune_epochs == 0:
        return float("nan")
    split = spec.clients[cid]
    layer = copy.deepcopy(original)
    xs, ys = spec.train_source.get(split.train)
    xv, yv = spec.train_source.get(split.val) if len(split.val) else (None, None)
    gen = torch.Generator().manual_seed(derive_seed(spec.seed, 0xF1, cid))
    opt = torch.optim.SGD(layer.parameters(), lr=m.lr, momentum=m.momentum)
    best_val, best_test, waited = float("-inf"), float("nan"), 0
    for epoch in range(m.finetune_epochs + 1):  # evaluate, then train (none after the last)
        if xv is not None:  # early stopping on the client's own validation split
            val = _accuracy(layer(xv), yv)
            if val > best_val:
                best_val, best_test, waited = val, _accuracy(layer(x_test), y_test), 0
            elif (waited := waited + 1) >= m.patience:
                break
        if epoch < m.finetune_epochs:
            _sgd_epoch(layer, opt, xs, ys, m.finetune_batch, m.clip, gen)
    return best_test if xv is not None else _accuracy(layer(x_test), y_test)


def _sgd_epoch(layer: nn.Module, opt: torch.optim.Optimizer, xs: torch.Tensor, ys: torch.Tensor,
               batch: int, clip: float, gen: torch.Generator) -> None:
    """One epoch of shuffled mini-batches with gradient-norm clipping."""
    perm = torch.randperm(len(ys), generator=gen)
    with torch.enable_grad():
        for i in range(0, len(ys), batch):
            b = perm[i:i + batch]
            loss = F.cross_entropy(layer(xs[b]), ys[b])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(layer.parameters(), clip)
            opt.step()


RESULT_KEYS = ("acc_original", "acc_finetune", "acc_prompt", "acc_batch", "acc_stream")


def accuracy_over_clients(rows: list[dict], key: str, count: str = "num-examples"
                          ) -> Optional[dict]:
    """One metric over the clients' rows: the accuracy over all their test images (weighted by
    ``count``), the mean over clients, and how many clients have it (None: none has)."""
    ok = [(r[key], r[count]) for r in rows if key in r and np.isfinite(r[key]) and r[count] > 0]
    if not ok:
        return None
    n = sum(w for _, w in ok)
    return {"images": float(sum(v * w for v, w in ok) / n),
            "client_mean": float(np.mean([v for v, _ in ok])), "clients": len(ok)}


def summarize_recognition(rows: list[dict]) -> dict:
    """Per metric: the accuracy over all clients' test images (example-weighted, Table 4) and
    the mean over clients."""
    history = sorted({k for r in rows for k in r if k.startswith("acc_h")},
                     key=lambda k: int(k[5:]))
    out = {key: accuracy_over_clients(rows, key) for key in RESULT_KEYS}
    out.update({key: accuracy_over_clients(rows, key, "n_h" + key[5:]) for key in history})
    return {k: v for k, v in out.items() if v is not None}
