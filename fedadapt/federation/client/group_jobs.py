"""What each client of a group trains and when: its job and result, its batches and exit draws
as :func:`fedadapt.federation.client.training.train_local` would draw them, and which of its
tensors each step reaches (:mod:`fedadapt.federation.client.grouped` trains the group)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

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
    #: The point the proximal term ``mu/2 ||w - anchor||^2`` pulls towards (Ditto's personal
    #: model towards the global one, FedDyn's towards the server's); None: its starting
    #: tensors (FedProx's). Per tensor; a tensor it does not name anchors at its start.
    anchor: Optional[dict[str, torch.Tensor]] = None
    #: A linear term ``<linear, w>`` added to its loss, i.e. ``linear`` added to every step's
    #: gradient (SCAFFOLD's correction ``c - c_i``, FedDyn's ``-grad L_k``); None: none. Per
    #: tensor; a tensor it does not name has none.
    linear: Optional[dict[str, torch.Tensor]] = None


def job_terms(jobs: list[ClientJob], names: list[str], mu: float,
              stacked: Callable[[str, list[torch.Tensor]], torch.Tensor],
              start: Callable[[], dict[str, torch.Tensor]]
              ) -> tuple[Optional[dict[str, torch.Tensor]], Optional[dict[str, torch.Tensor]]]:
    """A group's ``(anchors, linear terms)``, each ``{name: [K, ...]}`` made by
    ``stacked(name, per-job tensors)`` (in the engine's layout, on its device), or None where no
    job has one: the anchors only with ``mu > 0`` (``start()``: the starting tensors, when no
    job names its own)."""
    anchors = None
    if mu > 0:
        if all(j.anchor is None for j in jobs):
            anchors = start()
        else:
            anchors = {n: stacked(n, [(j.anchor if j.anchor is not None and n in j.anchor
                                       else j.tensors)[n] for j in jobs]) for n in names}
    linear = None
    if any(j.linear is not None for j in jobs):
        linear = {n: stacked(n, [j.linear[n] if j.linear is not None and n in j.linear
                                 else torch.zeros_like(j.tensors[n]) for j in jobs])
                  for n in names}
    return anchors, linear


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
    with a proximal or linear term, which reaches every tensor)."""
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
