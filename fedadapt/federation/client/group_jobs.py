"""What each client of a group trains and when: its job and result, its batches and exit draws
as :func:`fedadapt.federation.client.training.train_local` would draw them, and which of its
tensors each step reaches (:mod:`fedadapt.federation.client.grouped` trains the group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.config import TrainConfig
from fedadapt.data.sources import DataSource
from fedadapt.devices import autocast
from fedadapt.federation.client.training import local_schedule


@dataclass
class ClientJob:
    """One client's local training, as :func:`train_local` would run it."""

    cid: int
    indices: np.ndarray
    #: Its starting trainable tensors (the global communicated ones and its personal ones).
    tensors: dict[str, torch.Tensor]
    #: ``train_local``'s ``seed`` (shuffling, exit draws) and ``crop_seed``.
    seed: int
    crop_seed: Optional[int] = None
    #: The exits a step draws from (None: the model's own forward).
    exits: Optional[list[int]] = None
    #: The client's own data when it differs from the group's (a personalizing client's
    #: corrupted images); None = the shared source.
    source: Optional[DataSource] = None


@dataclass
class ClientResult:
    tensors: dict[str, torch.Tensor]  # final trainable tensors, on the CPU
    loss: float
    seen: int


class StepLoss(nn.Module):
    """What one client's step computes, as a module ``functional_call`` can reparametrise."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor, exit_: Optional[int]) -> torch.Tensor:
        if exit_ is None:
            return self.model.training_loss(x, y)
        logits = self.model.exit_logits(x, last_exit=exit_, all_exits=False)[-1]
        return F.cross_entropy(logits, y)


@dataclass
class Schedule:
    """One client's batches and exit draws, as ``train_local`` would draw them."""

    batches: list[np.ndarray]
    exits: list[Optional[int]]


def schedule(job: ClientJob, train: TrainConfig) -> Schedule:
    return Schedule(*local_schedule(job.indices, train, job.seed, job.exits))


def step_masks(plan, scheds: list[Schedule], names: list[str], used, every: bool
               ) -> np.ndarray:
    """``[steps, tensors, K]``: whether client k's step t gives tensor n a gradient (all of them
    with FedProx, whose term reaches every tensor)."""
    steps = max((len(s.batches) for s in scheds), default=0)
    out = np.zeros((steps, len(names), len(scheds)), dtype=bool)
    rows: dict = {}  # per exit: which tensors its step reaches

    def reached(exit_: Optional[int]) -> np.ndarray:
        if exit_ not in rows:
            hit = frozenset(names) if every else used(exit_)
            rows[exit_] = np.array([n in hit for n in names], dtype=bool)
        return rows[exit_]
    for t, ks in plan:
        for k in ks:
            out[t, :, k] = reached(scheds[k].exits[t])
    return out


class UsedTensors:
    """Which trainable tensors a training step at a given exit gives a gradient (found once per
    exit with a one-sample step: torch leaves the others' gradients None)."""

    def __init__(self, model: nn.Module, source: DataSource, sample_index: int, *,
                 precision: str) -> None:
        self.model, self.source, self.index, self.cache = model, source, sample_index, {}
        self.precision = precision

    def __call__(self, exit_: Optional[int]) -> frozenset[str]:
        model = self.model
        params = model.named_params() if hasattr(model, "named_params") else list(
            model.named_parameters())
        key = (exit_, tuple(n for n, p in params if p.requires_grad))
        if key not in self.cache:  # per exit and trainable set (personalization changes it)
            dev = next(model.parameters()).device
            x, y = self.source.get(np.array([self.index]), dev)
            model.zero_grad(set_to_none=True)
            with torch.enable_grad(), autocast(dev.type, self.precision):
                loss = StepLoss(model)(x, y, exit_)
            loss.float().backward()
            self.cache[key] = frozenset(n for n, p in model.named_parameters()
                                        if p.requires_grad and p.grad is not None)
            model.zero_grad(set_to_none=True)
        return self.cache[key]


def first_index(jobs: list[ClientJob]) -> int:
    return next((int(j.indices[0]) for j in jobs if len(j.indices)), 0)


#: The seed stream of a group's draws other than its clients' own (none should happen).
OTHER_STREAM = 0xD809
