"""The original model's server-side phase: train the backbone with its classifier on the training
clients' pooled images, before any feature is cached.

ICIIA (``iciia.txt``, Sec. 4.1, "Original backbone model"): "the backbone model is optimized over
the global training dataset (i.e., a mixture of all the clients' training datasets) ... For
iNaturalist 2019 ... we further tune the pre-trained models over the global training dataset. For
FEMNIST, we train the CNN model from scratch." DUET's Universal Meta Network and CDC-MMPG's cloud
model are the same thing: a model trained on the cloud from every device's history. This module
runs that phase for any backbone whose weights load from a state-dict file (``leaf_cnn``,
``timm``, ``small_cnn``): SGD over the pooled training splits of the
training clients (validation and test clients contribute nothing), early stopping on the
clients' validation data, the best epoch kept (``original.*``,
:class:`fedadapt.config.OriginalConfig`; the defaults are the ICIIA authors' ``main.py
--phase=pretrain`` settings).

The result is saved once under ``<cache_dir>/original/<backbone>-<dataset>-<key>/``
(``backbone.safetensors``, ``classifier.safetensors``, ``original.json``; written to a temporary
folder and renamed, so a folder that exists is complete). The key hashes everything the training
depends on (backbone and its starting weights, data, the clients' training and validation rows,
``original.*``, classes, seed), so every method of a ``compare`` job and every later run with the
same data reuse it. The run then builds the backbone from ``backbone.safetensors`` (its features
are cached as any backbone's) and the classifier is the methods' original model.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.config import BackboneConfig, ConfigError, OriginalConfig
from fedadapt.log import log as _log

#: Families whose ``backbone.weights`` may be a state-dict file of ``Backbone.weights_state()``
#: (what this phase writes).
TRAINABLE_FAMILIES = ("leaf_cnn", "timm", "small_cnn")
INFO = "original.json"


@dataclass(frozen=True)
class OriginalModel:
    """What the phase produced: the trained backbone's config and the classifier's tensors."""

    backbone: BackboneConfig
    classifier: dict[str, torch.Tensor]
    info: dict


def phase_key(backbone, backbone_cfg: BackboneConfig, fingerprint: str, clients,
              cfg: OriginalConfig, num_classes: int, seed: int) -> str:
    """A hash of everything the phase's result depends on."""
    from fedadapt.data.cache import backbone_fingerprint

    rows = hashlib.sha256()
    for c in clients:
        rows.update(np.asarray(c.train, dtype=np.int64).tobytes() + b"|")
        rows.update(np.asarray(c.val, dtype=np.int64).tobytes() + b";")
    blob = json.dumps({"backbone": backbone_fingerprint(backbone), "family": backbone_cfg.family,
                       "arch": dict(backbone_cfg.arch), "image_size": backbone_cfg.image_size,
                       "data": fingerprint, "rows": rows.hexdigest(),
                       "original": dataclasses.asdict(cfg), "classes": num_classes,
                       "seed": seed}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def original_model(backbone, backbone_cfg: BackboneConfig, images, clients, cfg: OriginalConfig,
                   *, num_classes: int, seed: int, cache_dir: str, device: str = "cpu",
                   log: Callable[[str], None] = _log) -> OriginalModel:
    """The trained original model for this run: loaded from the cache, or trained and saved.

    Parameters
    ----------
    backbone : Backbone
        The backbone as built from ``backbone_cfg`` (its starting weights: ImageNet, or the
        seeded random initialisation for a network trained from scratch).
    images : DataSource
        The prepared training split's images through the backbone's preprocessing.
    clients : list of ClientSplit
        The partition: training rows (``train``) and early-stopping rows (``val``) of each client.
    """
    if backbone_cfg.family not in TRAINABLE_FAMILIES:
        raise ConfigError(f"original.train_backbone=true is invalid for backbone="
                          f"{backbone_cfg.name}: the phase saves a state dict, which backbones of "
                          f"the families {TRAINABLE_FAMILIES} load")
    train_idx = np.concatenate([c.train for c in clients]).astype(np.int64)
    val_idx = np.concatenate([c.val for c in clients]).astype(np.int64)
    if len(train_idx) == 0 or len(val_idx) == 0:
        raise ConfigError("original.train_backbone=true trains on the training clients' pooled "
                          "data and stops early on their validation data: it needs both "
                          "(partition.val_fraction or partition.val_clients > 0)")
    key = phase_key(backbone, backbone_cfg, images.prepared.fingerprint, clients, cfg,
                    num_classes, seed)
    folder = (Path(cache_dir).expanduser() / "original"
              / f"{backbone_cfg.name}-{images.prepared.name}-{key}")
    if not (folder / INFO).is_file():
        log(f"[original] training {backbone_cfg.name} and its classifier on the training "
            f"clients' pooled data ({len(train_idx)} images; {len(val_idx)} validation): "
            f"{folder}")
        head, info = train(backbone, images, train_idx, val_idx, cfg, num_classes=num_classes,
                           seed=seed, device=device, log=log)
        save(folder, backbone, head, info)
    else:
        log(f"[original] reusing {folder}")
    from safetensors.torch import load_file

    info = json.loads((folder / INFO).read_text())
    trained = dataclasses.replace(backbone_cfg, weights=str(folder / "backbone.safetensors"))
    return OriginalModel(backbone=trained, classifier=load_file(folder / "classifier.safetensors"),
                         info=info)


def _optimizer(backbone, head: nn.Module, cfg: OriginalConfig) -> torch.optim.SGD:
    groups = [{"params": list(backbone.parameters()), "lr": cfg.lr * cfg.backbone_lr_scale},
              {"params": list(head.parameters()), "lr": cfg.lr}]
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum,
                           weight_decay=cfg.weight_decay)


@torch.no_grad()
def accuracy(backbone, head: nn.Module, images, idx: np.ndarray, device: str,
             batch_size: int = 256) -> float:
    """Top-1 accuracy of ``head(backbone(x))`` (eval mode) on the rows ``idx``."""
    backbone.eval()
    head.eval()
    batches = [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    correct = sum(int((head(backbone(x)).argmax(-1) == y).sum())
                  for x, y in images.stream(batches, device))
    return correct / max(len(idx), 1)


def train(backbone, images, train_idx: np.ndarray, val_idx: np.ndarray, cfg: OriginalConfig, *,
          num_classes: int, seed: int, device: str = "cpu",
          log: Callable[[str], None] = _log) -> tuple[nn.Linear, dict]:
    """Train ``backbone`` (in place) and a new ``Linear(D, C)`` on ``train_idx``; keep the epoch
    with the best accuracy on ``val_idx`` (evaluated before every epoch, epoch 0 being the start,
    as the ICIIA authors' ``main.py``). Returns the classifier and a log."""
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 0x0816])
    head = nn.Linear(backbone.embed_dim, num_classes)
    backbone.to(device)
    head.to(device)
    for p in backbone.parameters():
        p.requires_grad_(True)
    opt = _optimizer(backbone, head, cfg)
    best, best_epoch, waited = float("-inf"), 0, 0
    state = None
    curve: list[dict] = []
    t0 = time.time()
    for epoch in range(cfg.max_epochs + 1):  # evaluate (epoch 0: the start), then train
        val = accuracy(backbone, head, images, val_idx, device)
        curve.append({"epoch": epoch, "val_acc": val})
        if val > best:
            best, best_epoch, waited = val, epoch, 0
            state = (copy.deepcopy(backbone.state_dict()), copy.deepcopy(head.state_dict()))
        else:
            waited += 1
        log(f"[original] epoch {epoch}/{cfg.max_epochs} | val {100 * val:.2f}% | best "
            f"{100 * best:.2f}% (epoch {best_epoch}) | {time.time() - t0:.0f} s")
        if waited >= cfg.patience or epoch == cfg.max_epochs:
            break
        curve[-1]["train_loss_next"] = _epoch(backbone, head, opt, images,
                                              rng.permutation(train_idx), cfg.batch_size, device)
        if (epoch + 1) % cfg.decay_every == 0 and cfg.lr_decay != 1.0:
            for group in opt.param_groups:
                group["lr"] *= cfg.lr_decay
    backbone.load_state_dict(state[0])
    head.load_state_dict(state[1])
    backbone.freeze()
    head.eval().requires_grad_(False)
    info = {"best_val_acc": best, "best_epoch": best_epoch, "epochs_trained": len(curve) - 1,
            "train_images": int(len(train_idx)), "val_images": int(len(val_idx)),
            "settings": dataclasses.asdict(cfg), "seed": seed, "curve": curve,
            "train_s": time.time() - t0}
    return head.cpu(), info


def _epoch(backbone, head: nn.Module, opt: torch.optim.Optimizer, images, order: np.ndarray,
           batch_size: int, device: str) -> float:
    """One pass over ``order`` in mini-batches (BatchNorm in training mode); the mean loss."""
    backbone.train()
    head.train()
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    total = 0.0
    for x, y in images.stream(batches, device):
        loss = F.cross_entropy(head(backbone(x)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        if not math.isfinite(value):
            raise ConfigError(f"original: the training loss became {value}; lower original.lr")
        total += value * len(y)
    return total / max(len(order), 1)


def save(folder: Path, backbone, head: nn.Module, info: dict) -> None:
    """``backbone.safetensors``, ``classifier.safetensors`` and ``original.json`` (last), in a
    temporary folder renamed into place."""
    from safetensors.torch import save_file

    from fedadapt.results.store import write_json

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file({k: v.detach().cpu().contiguous()
                   for k, v in backbone.weights_state().items()}, tmp / "backbone.safetensors")
        save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()},
                  tmp / "classifier.safetensors")
        write_json(tmp / INFO, info)
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (folder / INFO).is_file():  # not another process's finished copy: a real error
            raise
