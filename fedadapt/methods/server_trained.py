"""What the server-trained families (``plugin``, ``sessions``) share.

Their run-spec fields (:class:`ServerFields`); server training from the training clients' cached
features: the original model (:func:`train_original`), SGD with early stopping on the clients'
validation data (:func:`fit`), the server's view of the data (:class:`ServerData`); and the run
directory of a run whose one phase with the clients comes after its training
(:func:`serve_clients`, :func:`finish_server_run`).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.config import ConfigError, RunConfig
from fedadapt.data.partition import ClientSplit
from fedadapt.data.sources import DataSource
from fedadapt.federation.client.training import RunSpec
from fedadapt.log import log
from fedadapt.methods.run import (
    PreparedRun,
    node_layout,
    run_tracker,
    simulation,
    summary_head,
    summary_tail,
    write_partition,
)

if TYPE_CHECKING:  # pragma: no cover
    from flwr.clientapp import ClientApp


@dataclass
class ServerFields:
    """A server-trained run's own fields of the run spec (``spec.family``)."""

    #: The original model's classifier from the original-model phase (``original.train_backbone``,
    #: :mod:`fedadapt.federation.server.original`); None = trained on the cached features.
    original_classifier: Optional[dict[str, torch.Tensor]] = None
    #: The raw (preprocessed) images of the training split, for session methods whose devices
    #: upload samples (``method.upload=samples``).
    image_source: Optional[DataSource] = None
    #: CDC-MMPG's text query (``method.query``) through the backbone's text tower, fused into
    #: every frame of every session.
    query_feature: Optional[torch.Tensor] = None


def prepare_fields(cfg: RunConfig, prep: PreparedRun, *, backbone, images: Callable,
                   original) -> None:
    """Fill ``prep.spec.family`` (:class:`ServerFields`)."""
    query = None
    if getattr(cfg.method, "query", None):  # CDC-MMPG's text query, through the text tower
        if not hasattr(backbone, "encode_prompts"):
            raise ConfigError(f"method.query={cfg.method.query!r} is invalid for "
                              f"backbone={cfg.backbone.name}: a text query needs a backbone with "
                              f"a text tower (backbone=clip_vit_b32)")
        with torch.no_grad():
            query = backbone.encode_prompts([cfg.method.query])[0].float().cpu()
    prep.spec.family = ServerFields(
        original_classifier=original.classifier if original else None,
        image_source=images("train") if getattr(cfg.method, "upload", None) == "samples" else None,
        query_feature=query)


def sequences(indices: np.ndarray, size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A seeded permutation of ``indices`` cut into pieces of ``size``: one client's sequences,
    or the classifiers' batches."""
    perm = rng.permutation(np.asarray(indices))
    return [perm[i:i + size] for i in range(0, len(perm), size)]


def accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(-1) == y).float().mean()) if len(y) else float("nan")


def fit(model: nn.Module, loss_of: Callable[[], list[torch.Tensor]],
        val_acc: Callable[[], float], *, epochs: int, patience: int, lr: float,
        momentum: float = 0.9, weight_decay: float = 0.0, clip: Optional[float] = None,
        label: str = "", optimizer: Optional[torch.optim.Optimizer] = None, score: str = "val",
        schedule: Optional[Callable[[torch.optim.Optimizer], object]] = None) -> dict:
    """SGD (or ``optimizer``) on each loss ``loss_of()`` yields in an epoch (one batch each),
    early stopping on ``val_acc`` (higher is better; ``score`` names it in the log); ``model``
    ends with its best epoch's weights. ``schedule(opt)`` builds a learning-rate scheduler
    stepped after every optimiser step."""
    opt = optimizer or torch.optim.SGD([p for p in model.parameters() if p.requires_grad],
                                       lr=lr, momentum=momentum, weight_decay=weight_decay)
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
    if spec.family.original_classifier is not None:  # trained with the backbone (original.*)
        original.load_state_dict(spec.family.original_classifier)
        with torch.no_grad():
            val = accuracy(original(feats[data.val_idx]), labels[data.val_idx])
        log(f"[original classifier] trained with the backbone: {100 * val:.2f}% on the "
            f"clients' validation features")
        return original.eval(), {"trained_with_backbone": True, "best_val_acc": val}

    def batches():
        for b in sequences(data.train_idx, CLASSIFIER_BATCH, rng):
            yield F.cross_entropy(original(feats[b]), labels[b])

    @torch.no_grad()
    def val() -> float:
        return accuracy(original(feats[data.val_idx]), labels[data.val_idx])

    log_ = fit(original, batches, val, epochs=m.classifier_epochs, patience=m.patience, lr=lr,
               label="original classifier")
    return original.eval(), log_


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


def serve_clients(cfg: RunConfig, run_dir: Path, prep: PreparedRun, config_yaml: str,
                  execute: Optional[Callable], client_app: "ClientApp", **plan_extra):
    """A server-trained method after its training: write the run directory's config and
    partition, then run its one phase with every client, served by ``client_app``
    (``plan_extra``: what the server sends them); returns the final server state."""
    from flwr.app import ArrayRecord

    from fedadapt.federation.server.loop import ServerPlan
    from fedadapt.files import atomic_write

    spec = prep.spec
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "config.yaml", lambda fh: fh.write(config_yaml))
    write_partition(run_dir, cfg, prep)
    plan = ServerPlan(
        num_clients=spec.num_clients,
        make_strategy=None, seed=cfg.seed, initial_arrays=ArrayRecord({}), num_rounds=0,
        lr_at=lambda r: 0.0, eval_every=1,
        global_eval=None, counts={}, timeout=cfg.federation.round_timeout,
        min_reply_fraction=cfg.federation.min_reply_fraction,
        **node_layout(cfg, prep, execute, spec.num_clients), **plan_extra)
    return (execute or simulation(cfg))(plan, client_app)


def finish_server_run(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state, *, label: str,
                       t0: float, setting: str, results: dict, params: dict,
                       client_acc: Optional[dict]) -> dict:
    """The summary of a server-trained method's run (``results``: its result sections), its
    ``table.md``, and ``summary.json`` last."""
    from fedadapt.files import atomic_write
    from fedadapt.results.store import SUMMARY, write_json
    from fedadapt.results.tables import run_tables

    summary = {
        **summary_head(cfg, label, prep, rounds=0, setting=setting),
        **results,
        "final": {"round": 1, "global_acc": None,
                  "client_acc": client_acc["client_mean"] if client_acc else None},
        "best": {"global_acc": None, "client_acc": None},
        "params": {**prep.counts, **params},
        "total_bytes": state.cum_bytes,
        "bytes_down": state.history[-1]["bytes_down"],
        "bytes_up": state.history[-1]["bytes_up"],
        "wall_s": time.time() - t0,
        "seconds_per_round": None,
        **summary_tail(prep),
    }
    table = run_tables([summary], title=f"## {cfg.experiment}: {label} on {cfg.dataset.name}")
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    write_json(run_dir / SUMMARY, summary)  # last: marks the run directory complete
    tracker = run_tracker(cfg, run_dir, (run_dir / "config.yaml").read_text(), label)
    for row in state.history:  # its one phase with the clients
        tracker.log_round(row)
    tracker.close(run_dir)
    return summary
