"""The one client training loop and the one evaluation loop, shared by every method.

Methods differ only in their model's forward (and, later, a registered loss); nothing here
branches on a method name. Randomness (shuffling, dropout) is drawn from generators seeded by
``(seed, round, client)``, so a run is reproducible and independent of which Ray worker (or
which order) executes a client.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedadapt.adapters import AdaptedModel, build_model
from fedadapt.config import (
    BackboneConfig,
    FaultConfig,
    MethodConfig,
    SettingConfig,
    TrainConfig,
)
from fedadapt.data.partition import ClientSplit
from fedadapt.data.sources import DataSource


@dataclass(frozen=True)
class BackboneInfo:
    """What a method needs of a backbone it does not run (training from cached features)."""

    embed_dim: int


@dataclass
class RunSpec:
    """Everything a client (or the server's evaluation) needs; picklable for Ray workers."""

    run_id: str
    method: MethodConfig
    backbone: BackboneConfig
    train: TrainConfig
    seed: int
    rounds: int
    num_classes: int
    embed_dim: int
    train_source: DataSource
    #: The global test split (None for server-trained methods, which never use it).
    test_source: Optional[DataSource]
    clients: list[ClientSplit] = field(default_factory=list)
    faults: FaultConfig = field(default_factory=FaultConfig)
    #: Where each client saves its personal tensors (``<state_dir>/<partition-id>/``).
    state_dir: Optional[str] = None
    setting: SettingConfig = field(default_factory=SettingConfig)
    #: Exits of the backbone (0 for methods without exits) and each client's exit (its tier).
    num_exits: int = 0
    client_exits: list[int] = field(default_factory=list)
    #: personalization: each client's ``(corruption, severity)``.
    client_corruptions: list[tuple[str, int]] = field(default_factory=list)
    #: Class prompts and their text features (methods registered with ``uses_text``).
    class_text: Optional[object] = None
    #: Clients also report their validation accuracy (model selection by validation).
    evaluate_val: bool = False
    #: The raw (preprocessed) images of ``train_source``'s split, for session plug-ins whose
    #: devices upload samples (``method.upload=samples``).
    image_source: Optional[DataSource] = None
    #: CDC-MMPG's text query (``method.query``) through the backbone's text tower, fused into
    #: every frame of every session.
    query_feature: Optional[torch.Tensor] = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0]
               >> np.uint64(1))


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def build_run_model(spec: RunSpec, backbone=None) -> AdaptedModel:
    """The method's model with its seeded initial weights (identical in every process)."""
    needs_backbone = spec.train_source.kind == "images"
    if needs_backbone and backbone is None:
        from fedadapt.backbones import build_backbone

        backbone = build_backbone(spec.backbone)
    torch.manual_seed(derive_seed(spec.seed, 0x1417))
    model = build_model(spec.method, backbone if needs_backbone else BackboneInfo(spec.embed_dim),
                        spec.num_classes, with_backbone=needs_backbone,
                        class_text=spec.class_text)
    return model.to(device())


_MODELS: dict[str, tuple[AdaptedModel, dict]] = {}


def cached_model(spec: RunSpec) -> AdaptedModel:
    """One model per process and run; every call overwrites all trainable tensors before use."""
    return _cached(spec)[0]


def initial_personal(spec: RunSpec) -> dict[str, torch.Tensor]:
    """The seeded initial values of the personal tensors (a client's state on its first visit)."""
    return _cached(spec)[1]


def _cached(spec: RunSpec) -> tuple[AdaptedModel, dict]:
    if spec.run_id not in _MODELS:
        _MODELS.clear()
        model = build_run_model(spec)
        _MODELS[spec.run_id] = (model, model.tensors(model.personal_names()))
    return _MODELS[spec.run_id]


def lr_at(train: TrainConfig, server_round: int, rounds: int) -> float:
    """Learning rate of a round: constant, or cosine-annealed over the rounds."""
    if not train.cosine:
        return train.lr
    return 0.5 * train.lr * (1 + math.cos(math.pi * (server_round - 1) / max(rounds, 1)))


def make_optimizer(params, train: TrainConfig, lr: float) -> torch.optim.Optimizer:
    if train.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=train.momentum,
                               weight_decay=train.weight_decay)
    cls = torch.optim.Adam if train.optimizer == "adam" else torch.optim.AdamW
    return cls(params, lr=lr, betas=tuple(train.betas), eps=train.eps,
               weight_decay=train.weight_decay)


def train_local(
    model: AdaptedModel,
    source: DataSource,
    indices: np.ndarray,
    train: TrainConfig,
    *,
    lr: float,
    seed: int,
    proximal_mu: float = 0.0,
    exits: Optional[list[int]] = None,
) -> tuple[float, int]:
    """Train ``model`` in place on ``source[indices]``; return (mean loss, samples seen).

    With ``proximal_mu > 0`` adds FedProx's ``mu/2 * ||w - w_global||^2`` over the trainable
    tensors, ``w_global`` being their values on entry. With ``exits`` (an early-exit model),
    each step draws one exit uniformly from them (seeded) and trains that exit's logits,
    running only the blocks up to it.
    """
    dev = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if proximal_mu > 0 else None
    opt = make_optimizer(params, train, lr)
    gen = torch.Generator().manual_seed(seed)
    exit_gen = torch.Generator().manual_seed(derive_seed(seed, 0xE817))
    torch.manual_seed(seed)  # dropout / drop-connect
    model.train()
    total, seen = 0.0, 0
    indices = np.asarray(indices)
    for _ in range(train.local_epochs):
        order = indices[torch.randperm(len(indices), generator=gen).numpy()]
        for start in range(0, len(order), train.batch_size):
            x, y = source.get(order[start:start + train.batch_size])
            x, y = x.to(dev), y.to(dev)
            if exits is None:
                loss = model.training_loss(x, y)
            else:
                e = exits[int(torch.randint(len(exits), (1,), generator=exit_gen))]
                loss = F.cross_entropy(model.exit_logits(x, last_exit=e, all_exits=False)[-1], y)
            if anchor is not None:
                loss = loss + 0.5 * proximal_mu * sum(
                    (p - a).pow(2).sum() for p, a in zip(params, anchor))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(y)
            seen += len(y)
    return total / max(seen, 1), seen


@torch.no_grad()
def _evaluate_logits(model, source: DataSource, indices: Optional[np.ndarray], batch_size: int,
                     forward: Callable[[torch.Tensor], list[torch.Tensor]]
                     ) -> tuple[list[float], list[float], int]:
    """The one evaluation loop: per output of ``forward(x)``, (mean losses, accuracies, n);
    NaN when there are no samples."""
    if indices is None:
        indices = np.arange(len(source.labels()))
    dev = next(model.parameters()).device
    model.eval()
    loss_sum, correct, n = None, None, 0
    for start in range(0, len(indices), batch_size):
        x, y = source.get(indices[start:start + batch_size])
        outputs = forward(x.to(dev))
        y = y.to(dev)
        if loss_sum is None:
            loss_sum, correct = np.zeros(len(outputs)), np.zeros(len(outputs))
        for j, logits in enumerate(outputs):
            loss_sum[j] += float(F.cross_entropy(logits, y, reduction="sum"))
            correct[j] += int((logits.argmax(1) == y).sum())
        n += len(y)
    if n == 0:
        return [float("nan")], [float("nan")], 0
    return list(map(float, loss_sum / n)), list(map(float, correct / n)), n


def evaluate(model: AdaptedModel, source: DataSource, indices: Optional[np.ndarray] = None,
             batch_size: int = 256) -> tuple[float, float, int]:
    """(mean loss, accuracy, n) of ``model`` on ``source[indices]`` (all samples if None)."""
    losses, accs, n = _evaluate_logits(model, source, indices, batch_size,
                                       lambda x: [model(x)])
    return losses[0], accs[0], n


def evaluate_exits(model, source: DataSource, exits: list[int],
                   indices: Optional[np.ndarray] = None, batch_size: int = 256
                   ) -> tuple[list[float], list[float], int]:
    """Per-exit (losses, accuracies, n) of an early-exit model: one pass up to ``max(exits)``
    serves every exit."""
    last = max(exits)

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        all_logits = model.exit_logits(x, last_exit=last)
        return [all_logits[e] for e in exits]

    losses, accs, n = _evaluate_logits(model, source, indices, batch_size, forward)
    if n == 0:
        return [float("nan")] * len(exits), [float("nan")] * len(exits), 0
    return losses, accs, n
