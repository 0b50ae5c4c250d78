"""``fedadapt-pretrain``: train a small ViT from scratch and save it in the Hugging Face format.

No pretrained hub weights can be fetched offline, so the server pretrains the backbone itself on
one real offline data set (Fashion-MNIST by default) and a later federated run loads it as a
frozen backbone through the ordinary ``from_pretrained`` path::

    fedadapt-pretrain [--out DIR] [--epochs 5] [--lr 1e-3] [--batch-size 128] [--force] \\
        dataset=fashion_mnist backbone=small_vit [other Hydra overrides]
    fedadapt method=accumulator backbone=small_vit backbone.weights=DIR ...

The output folder holds ``config.json`` + ``model.safetensors`` (a ``ViTModel`` without pooling
layer; the config carries the ``image_mean``/``image_std`` used in training) and
``pretrain.json`` (settings, per-epoch test accuracy, versions). It is written to a temporary
folder beside ``DIR`` and renamed, so ``DIR`` is either complete or absent.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from fedadapt.config import ConfigError, RunConfig

PRETRAIN_JSON = "pretrain.json"
WEIGHT_DECAY = 0.05
DEFAULTS = {"dataset": "fashion_mnist", "backbone": "small_vit"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def default_out(run: RunConfig) -> Path:
    """``<cache_dir>/pretrained/<backbone>-<dataset>-s<seed>``."""
    return (Path(run.cache_dir).expanduser() / "pretrained"
            / f"{run.backbone.name}-{run.dataset.name}-s{run.seed}")


def random_crop(x: torch.Tensor, pad: int, gen: torch.Generator) -> torch.Tensor:
    """Zero-pad ``x [B, C, S, S]`` by ``pad`` and crop each image at a random offset."""
    b, _, s, _ = x.shape
    padded = nn.functional.pad(x, (pad, pad, pad, pad))
    dy, dx = torch.randint(0, 2 * pad + 1, (2, b, 1), generator=gen)
    rows, cols = dy + torch.arange(s), dx + torch.arange(s)  # [B, S] each
    out = padded[torch.arange(b)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2).contiguous()  # [B, S, S, C] -> [B, C, S, S]


def _lr_lambda(total: int) -> Callable[[int], float]:
    """Linear warm-up over the first 5% of the steps, then cosine decay to 0."""
    warmup = max(1, total // 20)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

    return factor


@torch.no_grad()
def accuracy(backbone, head: nn.Module, source, n: int, batch_size: int = 512) -> float:
    """Top-1 accuracy of ``head(backbone(x))`` on the first ``n`` samples of ``source``."""
    backbone.eval()
    correct = 0
    for start in range(0, n, batch_size):
        x, y = source.get(np.arange(start, min(n, start + batch_size)))
        correct += int((head(backbone(x)).argmax(1) == y).sum())
    return correct / n


def _optimizer(params: list, lr: float, total_steps: int):
    """AdamW (weight decay on matrices only) with the warm-up + cosine schedule."""
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.ndim > 1]},
         {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}],
        lr=lr, weight_decay=WEIGHT_DECAY)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(total_steps))


def train_backbone(run: RunConfig, *, epochs: int, lr: float, batch_size: int,
                   test_samples: int | None = None, log: Callable[[str], None] = _log):
    """Train ``run.backbone`` from random weights with a linear classifier on its pooled output:
    ``run``'s data set (``train`` trains, ``test`` evaluates: its first ``test_samples``
    samples after each epoch, all of them when None), backbone, seed and cache_dir; AdamW
    (weight decay 0.05 on matrices), cosine schedule after a short warm-up; one ``log`` line per
    epoch. Returns the trained backbone (frozen, eval mode) and the facts ``pretrain.json``
    records."""
    import transformers

    from fedadapt.backbones import build_backbone
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.sources import DataSource
    from fedadapt.data.store import geometry, image_store
    from fedadapt.data.transforms import Preprocess
    from fedadapt.progress import quiet_libraries

    t0 = time.time()
    quiet_libraries()  # progress bars off (save_pretrained's "Writing model shards" too)
    prepared = prepare_dataset(run.dataset, run.cache_dir, run.seed)
    backbone = build_backbone(run.backbone, load_weights=False)
    preprocess = Preprocess.for_backbone(backbone)
    geo = geometry(load_card(run.dataset.name), preprocess)
    train, test = (DataSource(prepared, split, preprocess=preprocess,
                              store=image_store(prepared, split, geo, run.cache_dir))
                   for split in ("train", "test"))

    num_test = prepared.num_test if test_samples is None else min(test_samples,
                                                                    prepared.num_test)
    torch.manual_seed(run.seed)
    gen = torch.Generator().manual_seed(run.seed)
    head = nn.Linear(backbone.embed_dim, prepared.num_classes)
    params = [p for m in (backbone, head) for p in m.parameters()]
    steps_per_epoch = math.ceil(prepared.num_train / batch_size)
    optimizer, schedule = _optimizer(params, lr, epochs * steps_per_epoch)
    log(f"[pretrain] {run.backbone.name} ({backbone.num_params():,} params, "
        f"{backbone.num_layers} blocks) on {prepared.name}: {prepared.num_train} train / "
        f"{num_test} test, {epochs} epoch(s) x {steps_per_epoch} steps")

    losses, accs = [], []
    for epoch in range(1, epochs + 1):
        t_epoch = time.time()
        backbone.train()
        order = torch.randperm(prepared.num_train, generator=gen).numpy()
        batches = [order[s:s + batch_size] for s in range(0, prepared.num_train, batch_size)]
        total = 0.0
        for x, y in train.stream(batches, "cpu"):
            loss = nn.functional.cross_entropy(head(backbone(random_crop(x, 2, gen))), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            total += loss.item() * len(y)
        losses.append(total / prepared.num_train)
        accs.append(accuracy(backbone, head, test, num_test))
        secs = time.time() - t_epoch
        log(f"[pretrain] epoch {epoch}/{epochs} | loss {losses[-1]:.4f} | "
            f"test acc {100 * accs[-1]:.2f}% | {secs:.1f} s | ~{secs * (epochs - epoch):.0f} s "
            f"left")

    info = {
        "dataset": prepared.name, "backbone": run.backbone.name, "arch": dict(run.backbone.arch),
        "image_size": backbone.image_size, "image_mean": list(backbone.mean),
        "image_std": list(backbone.std), "num_classes": prepared.num_classes, "epochs": epochs,
        "lr": lr, "batch_size": batch_size, "weight_decay": WEIGHT_DECAY, "seed": run.seed,
        "train_loss": losses, "test_acc": accs, "final_test_acc": accs[-1],
        "train_samples": prepared.num_train, "test_samples": num_test,
        "wall_s": time.time() - t0,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    return backbone.freeze(), info


def save_backbone(backbone, info: dict, out: Path, *, force: bool = False) -> Path:
    """Write ``backbone.model`` (Hugging Face format) and ``pretrain.json`` to ``out`` atomically.

    ``out`` must not exist unless ``force`` (then it is replaced). The folder is sealed
    (:func:`fedadapt.data.integrity.seal_folder`): a file changed later is refused on load.
    """
    from fedadapt.data.integrity import seal_folder
    from fedadapt.results.store import write_json

    out = Path(out).expanduser()
    if out.exists() and not force:
        raise ConfigError(f"--out={out} exists already; pass --force to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f"{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        backbone.model.config.image_mean = list(backbone.mean)  # read back by ViTBackbone
        backbone.model.config.image_std = list(backbone.std)
        backbone.model.save_pretrained(tmp)
        image_processor(backbone).save_pretrained(tmp)  # the preprocessing it was trained with
        write_json(tmp / PRETRAIN_JSON, info)
        seal_folder(tmp)  # checked whenever the weights are loaded (fedadapt.backbones)
        if out.exists():  # force
            old = out.parent / f"{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            if old.is_dir():
                shutil.rmtree(old)
            else:
                old.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def image_processor(backbone):
    """A transformers image processor describing ``backbone``'s preprocessing (saved with the
    weights, read back when they load, as with hub weights)."""
    from transformers import ViTImageProcessor

    size = backbone.image_size
    short = int(math.floor(size / backbone.crop_pct))
    return ViTImageProcessor(
        do_resize=True, size={"shortest_edge": short} if short != size else
        {"height": size, "width": size}, resample=3 if backbone.interpolation == "bicubic" else 2,
        do_center_crop=short != size, crop_size={"height": size, "width": size},
        image_mean=list(backbone.mean), image_std=list(backbone.std))


def pretrain(run: RunConfig, *, out: Path, epochs: int, lr: float, batch_size: int,
             force: bool = False, log: Callable[[str], None] = _log) -> dict:
    """Pretrain ``run.backbone`` (family ``vit``) on ``run.dataset`` and save it to ``out``.

    ``backbone.weights`` is ignored: training always starts from the random weights ``arch``
    describes. Returns what ``pretrain.json`` holds, plus ``out``.
    """
    if epochs < 1:
        raise ConfigError(f"--epochs={epochs} is invalid: must be >= 1")
    if not (lr > 0 and math.isfinite(lr)):
        raise ConfigError(f"--lr={lr} is invalid: must be > 0")
    if batch_size < 1:
        raise ConfigError(f"--batch-size={batch_size} is invalid: must be >= 1")
    if run.backbone.family != "vit":
        raise ConfigError(f"backbone.family={run.backbone.family!r} is invalid: fedadapt-pretrain "
                          f"trains ViTs (family 'vit', e.g. backbone=small_vit)")
    out = Path(out).expanduser()
    if out.exists() and not force:  # checked again when saving
        raise ConfigError(f"--out={out} exists already; pass --force to replace it")
    backbone, info = train_backbone(run, epochs=epochs, lr=lr, batch_size=batch_size, log=log)
    save_backbone(backbone, info, out, force=force)
    log(f"[pretrain] saved {out} (test acc {100 * info['final_test_acc']:.2f}%); use it with "
        f"backbone={run.backbone.name} backbone.weights={out}")
    return {**info, "out": str(out)}


def _main(argv: list[str]) -> int:
    from fedadapt.entry import compose_config, to_run_config

    parser = argparse.ArgumentParser(
        prog="fedadapt-pretrain",
        description="Train a small ViT from scratch and save it in the Hugging Face format.")
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default <cache_dir>/pretrained/"
                             "<backbone>-<dataset>-s<seed>)")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: a small ViT's matrices gain nothing "
                             "from more, and lose a lot when other jobs share the cores)")
    parser.add_argument("--force", action="store_true",
                        help="replace --out if it exists (features cached for it go stale: "
                             "the feature cache keys local weights by their path)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. dataset=fashion_mnist")
    args = parser.parse_intermixed_args(argv)
    if args.threads < 1:
        raise ConfigError(f"--threads={args.threads} is invalid: must be >= 1")
    torch.set_num_threads(args.threads)
    named = {o.split("=")[0].lstrip("+~") for o in args.overrides}
    overrides = [f"{k}={v}" for k, v in DEFAULTS.items() if k not in named] + args.overrides
    run = to_run_config(compose_config(overrides))
    pretrain(run, out=args.out or default_out(run), epochs=args.epochs, lr=args.lr,
             batch_size=args.batch_size, force=args.force)
    return 0


def main() -> None:
    """Console-script entry point."""
    from fedadapt.entry import run_cli

    run_cli(_main)


if __name__ == "__main__":
    main()
