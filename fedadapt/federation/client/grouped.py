"""Grouped local training: K clients trained side by side on one worker, one frozen backbone.

Every client keeps its own trainable tensors and optimiser state, stacked along a leading client
dimension ``[K, ...]``. Two engines, chosen per model (:func:`engine_of`, named in the run's
layout line):

* **Grouped forms** (:mod:`fedadapt.grouping.forms`; every client-trained method of the
  presets): at each local step the K clients' batches are one batch of K x B rows (a client's
  last batch padded, its padding weighing 0); the frozen backbone runs once on all of them as
  plain PyTorch (its fused attention, native autocast), and each module a client trains applies
  that client's tensors to its rows by batched products (``bmm`` / ``baddbmm`` over the stacked
  tensors). Clients at different exits (anytime) share one forward: the blocks every client runs
  once for all, each deeper block on the clients that go deeper (ordered deepest first).
  ``compile=True`` (``federation.compile``) runs the step through ``torch.compile`` at fixed
  shapes (every slot present at every step, a finished client's rows all padding;
  ``mode="reduce-overhead"``, CUDA graphs, on a GPU; steps whose clients drew different exits
  stay eager).
* **vmap** (the general path, for what has no grouped form: full fine-tuning, a user's module
  without a form): ``torch.func.vmap`` over ``torch.func.functional_call``, clients in buckets
  of one batch size and exit.

The same semantics as :func:`fedadapt.federation.client.training.train_local` run K times,
either way:

* every random draw comes from the client's own seed: its shuffling, its exit per step (anytime),
  its crops (a hash of its crop seed and the image), its dropout masks (a hash of its step key,
  :mod:`fedadapt.grouping.dropout`), so results never depend on which clients share a group;
* clients of different sizes run their own number of steps (a finished client's tensors stay
  as its last step left them);
* the optimiser (:class:`StackedOptimizer`: SGD with momentum / Adam / AdamW, torch's update
  rules) keeps per-client state and updates a client's tensor only at steps where that client's
  loss used it, as torch's optimisers skip tensors without a gradient: an anytime client that
  draws exit 3 leaves exit 7's head (and its momentum) alone; plain SGD updates every tensor in
  one fused call;
* FedProx's ``mu/2 ||w - w_start||^2`` and gradient-norm clipping are per client.

With these the grouped result equals K sequential clients to floating-point tolerance in fp32
(``tests/test_grouped.py``: K = 1, 3, 8, unequal sizes, every client-trained method), and in
bf16 adds no more error than bf16 itself makes (``tests/test_grouped_bf16.py``, on the CPU and
on CUDA).

Precision and kernels inside ``vmap`` (seen with torch 2.11 on an H200 and 2.13 on the CPU):

* **bf16.** Autocast does not reach several ops inside ``vmap`` (a convolution meets a
  bf16-held weight with an fp32 input and raises; ``linear`` adds its bias in fp32; attention
  runs in fp32); :class:`VmapAutocast` applies autocast's casts to those ops by hand and runs
  them with autocast off, as autocast does, so a grouped client computes in the dtypes one
  client computes in.
* **Attention.** The math kernel, on every device (:func:`attention_for_vmap`):
  ``scripts/vmap_attention.py`` found on an H200 that the memory-efficient kernel's backward
  fails under ``vmap`` (fp32 and bf16), cuDNN's runs in bf16 but returns wrong values (3.5
  relative error), and flash runs in bf16 only (1.2e-2 from fp32, as the math kernel's 1.5e-2).
* **Fallback.** A group that raises is retried one client at a time
  (:mod:`fedadapt.federation.client.worker`), and the sizing probe that raises makes a run train one
  client at a time from the start (:func:`fedadapt.federation.simulation.sizing.size_simulation`),
  each with one line naming the cause.

The step loop reads nothing back from the device: which tensors each client's step updates is
known on the host from its exit (one ``[steps, tensors, K]`` mask sent once per group), losses
are summed on the device; the start tensors go up in one transfer and the final tensors and
losses come back in two (through a pinned buffer on CUDA; ``tests/test_grouped.py`` counts
the reads).
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap
from torch.overrides import TorchFunctionMode

from fedadapt.config import TrainConfig
from fedadapt.data.sources import DataSource
from fedadapt.devices import autocast, seed_torch
from fedadapt.federation.client.training import derive_seed, local_schedule
from fedadapt.grouping import dropout, forms


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


class StackedOptimizer:
    """Per-client SGD (momentum, weight decay) / Adam / AdamW over ``[K, ...]`` tensors, torch's
    update rules; ``step(used, active)`` updates client k's slice of the i-th tensor only where
    ``used[i, k]`` (a device tensor), as torch skips a tensor without a gradient (its state
    untouched too); ``active[i]`` (on the host): whether any client used it. Plain SGD (no
    momentum, no weight decay) needs no mask (an unused slice's gradient is zero): one fused
    update of every tensor."""

    def __init__(self, stacked: dict[str, torch.Tensor], train: TrainConfig, lr: float) -> None:
        self.tensors, self.train, self.lr = stacked, train, lr
        self.state: dict[str, dict[str, torch.Tensor]] = {}

    def zero_grad(self) -> None:
        for t in self.tensors.values():
            t.grad = None

    @torch.no_grad()
    def step(self, used: torch.Tensor, active) -> None:
        t = self.train
        if t.optimizer == "sgd" and not t.momentum and not t.weight_decay:
            # plain SGD: a client's slice of a tensor its step did not reach has a zero
            # gradient (its loss does not depend on it), so p - lr * g leaves it as torch's
            # skip would; one fused update for every tensor, as torch's own foreach SGD
            ps = [p for i, p in enumerate(self.tensors.values())
                  if p.grad is not None and active[i]]
            if ps:
                torch._foreach_add_(ps, [p.grad for p in ps], alpha=-self.lr)
            return
        for i, (name, p) in enumerate(self.tensors.items()):
            if p.grad is None or not active[i]:
                continue
            shape = (-1,) + (1,) * (p.dim() - 1)
            m = used[i].view(shape)
            new = self._sgd(name, p, m) if self.train.optimizer == "sgd" else \
                self._adam(name, p, m, shape)
            p.copy_(torch.where(m, new, p))

    def _sgd(self, name: str, p: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        t = self.train
        d_p = p.grad if t.weight_decay == 0 else p.grad + t.weight_decay * p
        if t.momentum:
            st = self.state.setdefault(name, {"buf": torch.zeros_like(p),
                                              "started": torch.zeros_like(m)})
            buf = torch.where(st["started"], st["buf"] * t.momentum + d_p, d_p)
            st["buf"] = torch.where(m, buf, st["buf"])
            st["started"] = st["started"] | m
            d_p = buf
        return p - self.lr * d_p

    def _adam(self, name: str, p: torch.Tensor, m: torch.Tensor, shape) -> torch.Tensor:
        t = self.train
        beta1, beta2 = t.betas
        st = self.state.setdefault(name, {"exp_avg": torch.zeros_like(p),
                                          "exp_avg_sq": torch.zeros_like(p),
                                          "step": torch.zeros(p.shape[0], device=p.device)})
        step = st["step"] + m.view(-1).to(st["step"].dtype)
        grad, base = p.grad, p
        if t.weight_decay and t.optimizer == "adamw":
            base = p * (1 - self.lr * t.weight_decay)
        elif t.weight_decay:
            grad = grad + t.weight_decay * p
        exp_avg = torch.where(m, st["exp_avg"].lerp(grad, 1 - beta1), st["exp_avg"])
        exp_avg_sq = torch.where(m, st["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad,
                                 st["exp_avg_sq"])
        st.update(exp_avg=exp_avg, exp_avg_sq=exp_avg_sq, step=step)
        safe = step.clamp(min=1).view(shape)
        bias1, bias2 = 1 - beta1 ** safe, 1 - beta2 ** safe
        denom = exp_avg_sq.sqrt() / bias2.sqrt() + t.eps
        return base - (self.lr / bias1) * exp_avg / denom


class FlatOptimizer:
    """:class:`StackedOptimizer`'s update rules over one flat buffer: every client's every
    trainable tensor is a view of ``flat`` (slot-major within each tensor), their gradients
    views of one flat gradient (set before the backward, which accumulates into them in place),
    so each step is a handful of operations whatever the number of tensors. ``used[i, k]``
    (whether client k's step reached tensor i) becomes an element mask by one
    ``repeat_interleave``; a step leaves what a client did not reach, and its state, as torch's
    optimisers leave a tensor without a gradient."""

    def __init__(self, flat: torch.Tensor, stored: dict[str, torch.Tensor], train: TrainConfig,
                 lr: float) -> None:
        self.flat, self.train, self.lr = flat, train, lr
        self.grad = torch.zeros_like(flat)
        counts = []
        for p in stored.values():
            at = p.storage_offset() - flat.storage_offset()
            p.grad = self.grad[at:at + p.numel()].view(p.shape)
            counts += [p.numel() // p.shape[0]] * p.shape[0]
        self.counts = torch.tensor(counts, dtype=torch.int64, device=flat.device)
        self.state: dict[str, torch.Tensor] = {}

    def zero_grad(self) -> None:
        self.grad.zero_()

    def _mask(self, used: torch.Tensor) -> torch.Tensor:
        """``[tensors, K]`` -> an element mask of the flat buffer."""
        return used.reshape(-1).repeat_interleave(self.counts, output_size=self.flat.numel())

    @torch.no_grad()
    def step(self, used: torch.Tensor, active=None) -> None:
        t, p, g = self.train, self.flat, self.grad
        if t.optimizer == "sgd" and not t.momentum and not t.weight_decay:
            p.add_(g, alpha=-self.lr)  # an unreached slice's gradient is zero: left as it was
            return
        m = self._mask(used)
        if t.optimizer == "sgd":
            d_p = g if not t.weight_decay else g + t.weight_decay * p
            if t.momentum:
                st = self.state
                if "buf" not in st:
                    st["buf"], st["started"] = torch.zeros_like(p), torch.zeros_like(m)
                buf = torch.where(st["started"], st["buf"] * t.momentum + d_p, d_p)
                st["buf"] = torch.where(m, buf, st["buf"])
                st["started"] = st["started"] | m
                d_p = buf
            p.copy_(torch.where(m, p - self.lr * d_p, p))
            return
        beta1, beta2 = t.betas
        st = self.state
        if "exp_avg" not in st:
            st.update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                      step=torch.zeros(len(self.counts), device=p.device))
        st["step"] = st["step"] + used.reshape(-1).to(st["step"].dtype)
        step = st["step"].repeat_interleave(self.counts, output_size=p.numel())
        grad, base = g, p
        if t.weight_decay and t.optimizer == "adamw":
            base = p * (1 - self.lr * t.weight_decay)
        elif t.weight_decay:
            grad = grad + t.weight_decay * p
        st["exp_avg"] = torch.where(m, st["exp_avg"].lerp(grad, 1 - beta1), st["exp_avg"])
        st["exp_avg_sq"] = torch.where(m, st["exp_avg_sq"] * beta2 + (1 - beta2) * grad * grad,
                                       st["exp_avg_sq"])
        safe = step.clamp(min=1)
        bias1, bias2 = 1 - beta1 ** safe, 1 - beta2 ** safe
        denom = st["exp_avg_sq"].sqrt() / bias2.sqrt() + t.eps
        p.copy_(torch.where(m, base - (self.lr / bias1) * st["exp_avg"] / denom, p))


def _clip(stacked: dict[str, torch.Tensor], max_norm: float) -> None:
    """Each client's gradient norm over all its tensors clipped to ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does for one client."""
    grads = [t.grad for t in stacked.values() if t.grad is not None]
    if not grads:
        return
    sq = sum(g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads)
    coef = (max_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    for g in grads:
        g.mul_(coef.view((-1,) + (1,) * (g.dim() - 1)))


@dataclass
class _Schedule:
    """One client's batches and exit draws, as ``train_local`` would draw them."""

    batches: list[np.ndarray]
    exits: list[Optional[int]]


def _schedule(job: ClientJob, train: TrainConfig) -> _Schedule:
    return _Schedule(*local_schedule(job.indices, train, job.seed, job.exits))


def _plan(scheds: list[_Schedule]) -> list[tuple[int, list[int]]]:
    """``(step, clients)`` buckets: at each step the clients with a batch left, split by batch
    size (a client's last batch of an epoch may be smaller) and by the exit they drew."""
    out = []
    for t in range(max((len(s.batches) for s in scheds), default=0)):
        by_kind: dict[tuple, list[int]] = {}
        for k, s in enumerate(scheds):
            if t < len(s.batches):
                kind = (len(s.batches[t]), -1 if s.exits[t] is None else s.exits[t])
                by_kind.setdefault(kind, []).append(k)
        out += [(t, ks) for _, ks in sorted(by_kind.items(), reverse=True)]
    return out


def _masks(plan, scheds: list[_Schedule], names: list[str], used, every: bool
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


@dataclass
class _Group:
    """A group's training state on the device, set up once (:func:`_set_up`)."""

    jobs: list[ClientJob]
    names: list[str]  # the trainable tensors, in the model's order
    frozen: dict[str, torch.Tensor]  # shared by every client (weights and buffers)
    stacked: dict[str, torch.Tensor]  # ``[K, ...]`` trainable tensors, fp32
    final: dict[str, torch.Tensor]  # each client's tensors at its last step
    start: Optional[dict[str, torch.Tensor]]  # FedProx's anchor
    opt: StackedOptimizer
    scheds: list[_Schedule]
    plan: list[tuple[int, list[int]]]  # ``(step, clients)`` buckets, in order
    masks: torch.Tensor  # ``[steps, tensors, K]`` on the device
    active: np.ndarray  # ``[steps, tensors]`` on the host
    loss_sum: torch.Tensor  # ``[K]`` float64, on the device
    seen: np.ndarray  # ``[K]``
    precision: str
    proximal_mu: float
    dev: torch.device


def train_group(model: nn.Module, source: DataSource, jobs: list[ClientJob], train: TrainConfig,
                *, lr: float, precision: str, proximal_mu: float = 0.0,
                used: Optional[UsedTensors] = None, compile: bool = False
                ) -> list[ClientResult]:
    """Train ``jobs`` side by side (see the module docstring) in ``precision`` (``fp32`` /
    ``bf16``, the run's); one result per job, in order. Through the grouped forms where the
    model has them (:func:`engine_of`), else through ``vmap``; ``compile``: the grouped forms'
    step captured by ``torch.compile`` (:mod:`fedadapt.federation.capture`)."""
    if engine_of(model)[0] == "forms":
        return _train_forms(model, source, jobs, train, lr=lr, precision=precision,
                            proximal_mu=proximal_mu, used=used, compile=compile)
    return _train_vmap(model, source, jobs, train, lr=lr, precision=precision,
                       proximal_mu=proximal_mu, used=used)


def engine_of(model: nn.Module) -> tuple[str, Optional[str]]:
    """How ``model``'s clients train side by side: ``("forms", None)``, or ``("vmap", why)``
    where a trainable module has no grouped form (:func:`fedadapt.grouping.forms.unsupported`)."""
    why = forms.unsupported(model)
    return ("vmap", why) if why else ("forms", None)


def _train_vmap(model: nn.Module, source: DataSource, jobs: list[ClientJob], train: TrainConfig,
                *, lr: float, precision: str, proximal_mu: float = 0.0,
                used: Optional[UsedTensors] = None) -> list[ClientResult]:
    """The general path: ``vmap`` over the model's functional step, clients in buckets of one
    batch size and exit."""
    dev = next(model.parameters()).device
    g = _set_up(model, source, jobs, train, lr, precision, proximal_mu, used, dev)
    call = StepLoss(model)
    seed_torch(derive_seed(jobs[0].seed, len(jobs), OTHER_STREAM), dev)  # any other draw
    model.train()
    crops = _crops(jobs, g.scheds, g.plan, train, source)
    for i, (x, y) in enumerate(_stream(source, jobs, g.scheds, g.plan, dev, crops)):
        t = g.plan[i][0]
        if i == 0 or g.plan[i - 1][0] != t:
            g.opt.zero_grad()
        _bucket_step(g, call, g.plan[i][1], t, x, y)
        if i + 1 == len(g.plan) or g.plan[i + 1][0] != t:  # the step's last bucket: update
            _update(g, t, train)
    return _results(g)


# -- the grouped forms' engine ----------------------------------------------------------------


@dataclass
class _Plan:
    """A group's steps laid out in slots (host arrays, uploaded once): slot ``s`` is
    ``jobs[order[s]]``, the clients with the most steps first, so the clients still training
    at a step are always the first ``going[t]`` slots. A step's batch holds ``width[t]`` slots:
    the going ones, or (fixed shapes, for a captured step) every slot, a finished client's
    rows all padding."""

    order: list[int]
    scheds: list[_Schedule]  # in slot order
    going: list[int]  # per step: slots with a batch
    width: list[int]  # per step: slots in the batch
    #: Per step: the slots in the step's order (by exit, deepest first; None: 0..width-1) and
    #: each slot's exit in that order (None: every slot the model's own forward).
    perms: list[Optional[np.ndarray]]
    exits: list[Optional[list[int]]]
    rows: list[np.ndarray]  # per step: the slots' indices, each padded to B rows
    #: Per step and slot (in the step's order): its data source's client (own data).
    sources: list[list[int]]
    weights: np.ndarray  # every step's row weights, concatenated (1 / b real, 0 padding)
    sizes: np.ndarray  # every step's real rows per slot (in the step's order), concatenated


def _plan_slots(jobs: list[ClientJob], scheds: list[_Schedule], rows: int,
                fixed: bool = False) -> _Plan:
    order = sorted(range(len(jobs)), key=lambda k: -len(scheds[k].batches))  # stable
    sch = [scheds[k] for k in order]
    steps = len(sch[0].batches) if sch else 0
    going, width, perms, exits, batch_rows, sources, weights, sizes = ([] for _ in range(8))
    for t in range(steps):
        n = sum(1 for s in sch if t < len(s.batches))
        m = len(sch) if fixed else n
        drawn = [sch[k].exits[t] for k in range(n)]
        if drawn[0] is not None:  # a finished slot (fixed shapes) takes the shallowest exit
            drawn += [min(drawn)] * (m - n)
        perm = None
        if drawn[0] is not None and len(set(drawn)) > 1:  # deepest exit first, stable
            perm = np.array(sorted(range(m), key=lambda k: -drawn[k]), dtype=np.int64)
        ks = list(range(m) if perm is None else perm)
        going.append(n)
        width.append(m)
        perms.append(perm)
        exits.append(None if drawn[0] is None else [drawn[k] for k in ks])
        batch_rows.append(np.concatenate([_padded(_batch(sch[k], t, sch[0]), rows)
                                          for k in ks]))
        sources.append(ks)
        for k in ks:
            b = len(sch[k].batches[t]) if t < len(sch[k].batches) else 0
            weights.append(np.r_[np.full(b, 1.0 / max(b, 1), np.float32),
                                 np.zeros(rows - b, np.float32)])
            sizes.append(b)
    return _Plan(order=order, scheds=sch, going=going, width=width, perms=perms, exits=exits,
                 rows=batch_rows, sources=sources,
                 weights=np.concatenate(weights) if weights else np.zeros(0, np.float32),
                 sizes=np.asarray(sizes, dtype=np.float64))


def _batch(sched: _Schedule, t: int, first: _Schedule) -> np.ndarray:
    """The slot's batch at step ``t``; a finished slot's padding (its last batch's first
    index, or the first slot's for a client without data: rows that weigh 0)."""
    if t < len(sched.batches):
        return sched.batches[t]
    return (sched.batches or first.batches)[-1][:1]


def _stacked(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[K, ...]`` fp32 on the host."""
    if any(t.requires_grad for t in tensors):
        tensors = [t.detach() for t in tensors]
    if any(t.device.type != "cpu" for t in tensors):
        tensors = [t.cpu() for t in tensors]
    out = torch.stack(tensors)
    return out if out.dtype == torch.float32 else out.float()


def _padded(batch: np.ndarray, rows: int) -> np.ndarray:
    """A client's batch padded to ``rows`` rows with its first index (weight 0)."""
    if len(batch) == rows:
        return batch
    return np.concatenate([batch, np.full(rows - len(batch), batch[0], dtype=batch.dtype)])


def _upload(host: list[torch.Tensor], dev: torch.device) -> list[torch.Tensor]:
    """Host tensors on ``dev`` in one transfer per dtype (a pinned buffer on CUDA): views of
    one flat tensor per dtype."""
    if len({t.dtype for t in host}) > 1:
        out: list[Optional[torch.Tensor]] = [None] * len(host)
        for dtype in {t.dtype for t in host}:
            at = [i for i, t in enumerate(host) if t.dtype == dtype]
            for i, t in zip(at, _upload([host[i] for i in at], dev)):
                out[i] = t
        return out
    flat = torch.cat([t.reshape(-1) for t in host]) if host else torch.zeros(0)
    if dev.type == "cuda":
        flat = flat.pin_memory().to(dev, non_blocking=True)
    else:
        flat = flat.to(dev)
    out, at = [], 0
    for t in host:
        out.append(flat[at:at + t.numel()].view(t.shape))
        at += t.numel()
    return out


def _download(flat: torch.Tensor) -> torch.Tensor:
    """A device tensor on the host in one transfer, through a pinned buffer on CUDA."""
    if flat.device.type != "cuda":
        return flat.detach().clone()
    buf = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    buf.copy_(flat.detach(), non_blocking=True)
    torch.cuda.current_stream(flat.device).synchronize()
    return buf


def _train_forms(model: nn.Module, source: DataSource, jobs: list[ClientJob],
                 train: TrainConfig, *, lr: float, precision: str, proximal_mu: float,
                 used: Optional[UsedTensors], compile: bool) -> list[ClientResult]:
    """K clients as one batch of K x B rows: the frozen backbone once for every row, each
    client's trainable modules per slot (:mod:`fedadapt.grouping.forms`)."""
    dev = next(model.parameters()).device
    forms.install(model)
    has_dropout = dropout.install(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    rows = int(train.batch_size)
    plan = _plan_slots(jobs, [_schedule(j, train) for j in jobs], rows, fixed=compile)
    slot_jobs = [jobs[k] for k in plan.order]
    # every client's tensors, stacked in slot order and in the forms' layouts, one upload
    host = [forms.to_layout(model, n, _stacked([j.tensors[n] for j in slot_jobs]))
            for n in names]
    flat, stored = _stored(model, names, host, dev, persistent=compile)
    start = {n: t.detach().clone() for n, t in stored.items()} if proximal_mu > 0 else None
    used = used or UsedTensors(model, source, _first_index(jobs), precision=precision)
    steps = len(plan.going)
    # which tensors each going client's step trains (a finished slot's: none)
    host_masks = _masks([(t, list(range(plan.going[t]))) for t in range(steps)], plan.scheds,
                        names, used, every=start is not None)
    opt = FlatOptimizer(flat, stored, train, lr) if flat is not None \
        else StackedOptimizer(stored, train, lr)
    masks = torch.from_numpy(host_masks).to(dev)
    active = host_masks.any(axis=2)
    perms_host = [p for p in plan.perms if p is not None]
    keys_host = np.array([dropout.step_key(slot_jobs[k].seed, t) if has_dropout else 0
                          for t in range(steps) for k in plan.sources[t]], dtype=np.int64)
    weights, sizes, perm_flat, slot_index, keys = _upload(
        [torch.from_numpy(plan.weights), torch.from_numpy(plan.sizes),
         torch.from_numpy(np.concatenate(perms_host) if perms_host
                          else np.zeros(0, np.int64)),
         torch.arange(len(jobs), dtype=torch.int64), torch.from_numpy(keys_host)], dev)
    loss_sum = torch.zeros(len(jobs), dtype=torch.float64, device=dev)
    seed_torch(derive_seed(jobs[0].seed, len(jobs), OTHER_STREAM), dev)  # any other draw
    model.train()
    at_w = at_s = at_p = 0
    slots = forms.Slots(rows, stored)
    for t, (x, y) in enumerate(_slot_stream(source, slot_jobs, plan, train, dev)):
        n, real = plan.width[t], plan.going[t]
        pos = slot_index[:n]
        slots.params = stored
        if plan.perms[t] is not None:
            pos = perm_flat[at_p:at_p + n]
            at_p += n
            slots.params = {k: v.index_select(0, pos) for k, v in stored.items()}
        w = weights[at_w:at_w + n * rows]
        with forms.slots_active(slots), autocast(dev.type, precision), \
                (dropout.keyed(keys[at_s:at_s + n]) if has_dropout
                 else contextlib.nullcontext()):
            exits = plan.exits[t]
            if compile and (exits is None or exits[0] == exits[-1]):
                losses = _captured(model, x, y, w, exits, dev)
            else:
                losses = _step_losses(model, x, y, w, exits)
        if start is not None:  # each going client's own FedProx term
            params = slots.params
            anchor = start if plan.perms[t] is None else {
                k: v.index_select(0, pos) for k, v in start.items()}
            prox = 0.5 * proximal_mu * sum((params[k][:real] - anchor[k][:real]).pow(2)
                                           .reshape(real, -1).sum(1) for k in names)
            losses = torch.cat([losses[:real] + prox, losses[real:]]) if real < n \
                else losses + prox
        opt.zero_grad()
        losses.sum().backward()
        loss_sum.index_add_(0, pos, losses.detach().double() * sizes[at_s:at_s + n])
        at_w += n * rows
        at_s += n
        if train.clip_grad_norm is not None:
            _clip(stored, train.clip_grad_norm)
        opt.step(masks[t], active[t])
    return _forms_results(model, names, shapes, stored, flat, loss_sum, plan, jobs)


def _step_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
                 exits: Optional[list[int]]) -> torch.Tensor:
    """``[n]`` the slots' losses of one step (inside :func:`fedadapt.grouping.forms
    .slots_active`)."""
    return model.slot_losses(x, y, w, exits).float()


#: This process's captured step (one compiled function; torch.compile keeps one graph per
#: model and shape) and the shapes it has compiled, with the seconds each took.
_CAPTURED: dict = {}


def _captured(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor,
              exits: Optional[list[int]], dev: torch.device) -> torch.Tensor:
    """:func:`_step_losses` through ``torch.compile`` (``mode="reduce-overhead"``, CUDA
    graphs, on a GPU; inductor's default on the CPU); the time of each new shape's compile
    said once."""
    import time

    if "fn" not in _CAPTURED:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        mode = "reduce-overhead" if dev.type == "cuda" else None
        _CAPTURED.update(fn=torch.compile(_step_losses, dynamic=False, mode=mode), seen={})
    key = (id(model), tuple(x.shape), None if exits is None else exits[0])
    if key in _CAPTURED["seen"]:
        return _CAPTURED["fn"](model, x, y, w, exits)
    t0 = time.perf_counter()
    out = _CAPTURED["fn"](model, x, y, w, exits)
    _CAPTURED["seen"][key] = time.perf_counter() - t0
    from fedadapt.log import log

    log(f"[worker] the grouped step of {len(x) // int(forms.active().rows)} clients x "
        f"{forms.active().rows} rows captured by torch.compile in "
        f"{_CAPTURED['seen'][key]:.1f} s (once per shape; federation.compile=false turns it "
        f"off)")
    return out


#: Stored tensors kept per model and size for captured steps: a CUDA graph reads its inputs
#: where it was recorded, so the next group's tensors are copied into the same buffer.
_BUFFERS: dict = {}


def _stored(model: nn.Module, names: list[str], host: list[torch.Tensor], dev: torch.device,
            *, persistent: bool) -> tuple[Optional[torch.Tensor], dict[str, torch.Tensor]]:
    """The stacked trainable tensors on the device, each a leaf view of one flat buffer (the
    optimiser updates them in place; the results come back in one transfer)."""
    parts = _upload(host, dev)
    flat = parts[0]._base if parts and parts[0]._base is not None else None
    if persistent and flat is not None:
        key = (id(model), tuple(names), flat.numel(), dev.type)
        kept = _BUFFERS.get(key)
        if kept is None:
            _BUFFERS.clear()
            kept = _BUFFERS[key] = (flat, [p.detach().requires_grad_(True) for p in parts])
            if dev.type == "cuda":
                for p in kept[1]:
                    torch._dynamo.mark_static_address(p)
        else:
            with torch.no_grad():
                kept[0].copy_(flat)
            for p in kept[1]:
                p.grad = None
        return kept[0], dict(zip(names, kept[1]))
    return flat, {n: t.detach().requires_grad_(True) for n, t in zip(names, parts)}


def _slot_stream(source: DataSource, slot_jobs: list[ClientJob], plan: _Plan,
                 train: TrainConfig, dev: torch.device):
    """Each step's rows on the device, slot after slot (each padded to B rows)."""
    rows = int(train.batch_size)
    crops = None
    if train.crop_scale is not None and source.kind == "images":
        scale = (float(train.crop_scale[0]), float(train.crop_scale[1]))
        crops = [(scale, np.repeat(np.array([slot_jobs[k].crop_seed for k in ks],
                                            dtype=np.uint64), rows))
                 if all(slot_jobs[k].crop_seed is not None for k in ks) else None
                 for ks in plan.sources]
    if all(j.source is None for j in slot_jobs):
        return source.stream(plan.rows, dev, crops)
    from fedadapt.data.sources import stream_parts

    return stream_parts([[(slot_jobs[k].source or source,
                           _padded(_batch(plan.scheds[k], t, plan.scheds[0]), rows)) for k in ks]
                         for t, ks in enumerate(plan.sources)], dev, crops)


def _forms_results(model, names, shapes, stored, flat, loss_sum, plan: _Plan,
                   jobs: list[ClientJob]) -> list[ClientResult]:
    """Every client's tensors and mean loss, in two transfers from the device (the stored
    tensors are views of one buffer the optimiser updates in place)."""
    if flat is None:
        flat = torch.cat([stored[n].detach().reshape(-1) for n in names]) if names \
            else torch.zeros(0)
    host = _download(flat)
    losses = _download(loss_sum).numpy()
    per_name, at = {}, 0
    for n in names:  # each name's [K, ...] made contiguous once, then a view per client
        t = stored[n]
        part = host[at:at + t.numel()].view(t.shape)
        per_name[n] = forms.from_layout(model, n, part, shapes[n]).contiguous().unbind(0)
        at += t.numel()
    seen = np.zeros(len(jobs), dtype=np.int64)
    for s, sch in enumerate(plan.scheds):
        seen[s] = sum(len(b) for b in sch.batches)
    out: list[Optional[ClientResult]] = [None] * len(jobs)
    for s, k in enumerate(plan.order):
        job = jobs[k]
        if seen[s] == 0:  # no batch: its tensors as they came
            out[k] = ClientResult({n: job.tensors[n].detach().cpu().clone() for n in names},
                                  0.0, 0)
            continue
        out[k] = ClientResult({n: per_name[n][s] for n in names}, float(losses[s] / seen[s]),
                              int(seen[s]))
    return out


#: The seed stream of a group's draws other than its clients' own (none should happen).
OTHER_STREAM = 0xD809


def _set_up(model: nn.Module, source: DataSource, jobs: list[ClientJob], train: TrainConfig,
            lr: float, precision: str, proximal_mu: float, used: Optional[UsedTensors],
            dev: torch.device) -> _Group:
    """The stacked tensors, the optimiser, the clients' schedules, their buckets and masks."""
    dropout.install(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = {f"model.{n}": p for n, p in model.named_parameters() if not p.requires_grad}
    frozen.update({f"model.{n}": b for n, b in model.named_buffers()})
    # stacked where the first client's tensors are (the host), then one transfer per tensor
    stacked = {n: torch.stack([j.tensors[n].to(jobs[0].tensors[n].device, torch.float32)
                               for j in jobs]).to(dev).requires_grad_(True) for n in names}
    start = {n: t.detach().clone() for n, t in stacked.items()} if proximal_mu > 0 else None
    scheds = [_schedule(j, train) for j in jobs]
    plan = _plan(scheds)
    used = used or UsedTensors(model, source, _first_index(jobs), precision=precision)
    host_masks = _masks(plan, scheds, names, used, every=start is not None)
    return _Group(
        jobs=jobs, names=names, frozen=frozen, stacked=stacked,
        # filled at each client's last step (a client with no batch returns its tensors as
        # they came)
        final={n: torch.empty_like(t) for n, t in stacked.items()}, start=start,
        opt=StackedOptimizer(stacked, train, lr), scheds=scheds, plan=plan,
        masks=torch.from_numpy(host_masks).to(dev), active=host_masks.any(axis=2),
        loss_sum=torch.zeros(len(jobs), dtype=torch.float64, device=dev),
        seen=np.zeros(len(jobs), dtype=np.int64), precision=precision,
        proximal_mu=proximal_mu, dev=dev)


def _bucket_step(g: _Group, call: "StepLoss", ks: list[int], t: int, x: torch.Tensor,
                 y: torch.Tensor) -> None:
    """One bucket (clients ``ks`` at step ``t``, one batch size and exit): its losses'
    gradients accumulated into the stacked tensors, its losses into the running sums."""
    size = len(g.scheds[ks[0]].batches[t])
    pos = torch.tensor(ks, device=g.dev)
    keys = torch.tensor([dropout.step_key(g.jobs[k].seed, t) for k in ks], device=g.dev)
    every = ks == list(range(len(g.jobs)))  # the whole group, in order: no gather
    losses = _bucket_losses(call, g.stacked, g.frozen, None if every else pos, x, y, keys,
                            g.scheds[ks[0]].exits[t], g.precision, g.dev)
    if g.start is not None:
        losses = losses + 0.5 * g.proximal_mu * sum(
            (g.stacked[n][pos] - g.start[n][pos]).pow(2).reshape(len(ks), -1).sum(1)
            for n in g.names)
    losses.sum().backward()
    g.loss_sum.index_add_(0, pos, losses.detach().double() * size)
    g.seen[ks] += size


def _update(g: _Group, t: int, train: TrainConfig) -> None:
    """The end of step ``t``: clip, step each client that trained, and keep the tensors of
    the clients whose last step it was."""
    if train.clip_grad_norm is not None:
        _clip(g.stacked, train.clip_grad_norm)
    g.opt.step(g.masks[t], g.active[t])
    done = [k for k in range(len(g.jobs)) if len(g.scheds[k].batches) == t + 1]
    if done:
        at = torch.tensor(done, device=g.dev)
        for n in g.names:
            g.final[n].index_copy_(0, at, g.stacked[n].detach().index_select(0, at))


def _results(g: _Group) -> list[ClientResult]:
    """Every client's tensors and mean loss, in two transfers from the device."""
    jobs, names, final = g.jobs, g.names, g.final
    flat = torch.cat([final[n].reshape(len(jobs), -1) for n in names], 1).cpu() if names \
        else torch.zeros(len(jobs), 0)
    losses = g.loss_sum.cpu().numpy()
    sizes = [final[n][0].numel() for n in names]
    out = []
    for k, job in enumerate(jobs):
        if g.seen[k] == 0:  # no batch: its tensors as they came
            out.append(ClientResult({n: job.tensors[n].detach().cpu().clone() for n in names},
                                    0.0, 0))
            continue
        parts = flat[k].split(sizes) if names else []
        out.append(ClientResult({n: part.view(final[n].shape[1:]).clone()
                                 for n, part in zip(names, parts)},
                                float(losses[k] / g.seen[k]), int(g.seen[k])))
    return out


def _stream(source: DataSource, jobs: list[ClientJob], scheds: list[_Schedule], plan, dev,
            crops):
    """The buckets' batches on the device: from the shared source, or assembled from each
    client's own source when clients bring their own (corrupted) data."""
    if all(j.source is None for j in jobs):
        batches = [np.concatenate([scheds[k].batches[t] for k in ks]) for t, ks in plan]
        return source.stream(batches, dev, crops)
    from fedadapt.data.sources import stream_parts

    return stream_parts([[(jobs[k].source or source, scheds[k].batches[t]) for k in ks]
                         for t, ks in plan], dev, crops)


def _first_index(jobs: list[ClientJob]) -> int:
    return next((int(j.indices[0]) for j in jobs if len(j.indices)), 0)


def _crops(jobs, scheds, plan, train: TrainConfig, source: DataSource):
    if train.crop_scale is None or source.kind != "images":
        return None
    scale = (float(train.crop_scale[0]), float(train.crop_scale[1]))
    return [(scale, np.concatenate([np.full(len(scheds[k].batches[t]), jobs[k].crop_seed,
                                            dtype=np.uint64) for k in ks]))
            if all(jobs[k].crop_seed is not None for k in ks) else None for t, ks in plan]


def _bucket_losses(call: StepLoss, stacked: dict, frozen: dict, pos: Optional[torch.Tensor],
                   x: torch.Tensor, y: torch.Tensor, keys: torch.Tensor, exit_: Optional[int],
                   precision: str, dev: torch.device) -> torch.Tensor:
    """``[len(keys)]`` losses of one bucket (its clients ``pos`` at one exit; None: every client
    of the group, in order, whose stacked tensors need no gather): their batches through the
    model at once, each client's dropout drawn from its own ``keys`` entry."""
    kb = len(keys)
    params = {f"model.{n}": t if pos is None else t.index_select(0, pos)
              for n, t in stacked.items()}
    xs, ys = x.reshape(kb, -1, *x.shape[1:]), y.reshape(kb, -1)

    def one(p, xk, yk, key):  # one client: its tensors, its batch, its dropout key
        with dropout.keyed(key):
            return functional_call(call, {**frozen, **p}, (xk, yk, exit_), strict=False)

    with autocast(dev.type, precision), vmap_autocast(dev.type, precision), \
            attention_for_vmap(dev, precision), _no_mha_fast_path():
        out = vmap(one, randomness="different")(params, xs, ys, keys)
    return out.float()


@contextmanager
def _no_mha_fast_path():
    """``nn.MultiheadAttention``'s fused inference path (CLIP's frozen attention takes it when
    nothing in it needs a gradient) has no batching rule: under ``vmap`` torch would run it
    once per client. Its plain path (``multi_head_attention_forward``) is batched."""
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(was)


#: The ops whose autocast does not reach inside ``vmap`` (torch 2.11-2.13, CPU and CUDA):
#: convolutions run in their inputs' dtype (an fp32 input meets a bf16-held weight: "Input type
#: (float) and bias type (c10::BFloat16) should be the same"), ``linear``, ``addmm`` and
#: ``baddbmm`` add their bias in fp32, attention runs in fp32, and ``cross_entropy`` in bf16;
#: ``batch_norm``'s batching rule refuses a bf16 input with fp32 statistics ("expected scalar
#: type BFloat16 but found Float", EfficientNet), so it gets fp32, as CPU autocast gives it;
#: ``softmax`` of a bf16 input reaches CUDA as ``softmax(x, dtype=float32)``, whose backward
#: CUDA refuses for bf16 ("expected input and grad types to match, or input to be at::Half and
#: grad to be at::Float", seen on an H200), so it gets an fp32 input, as CUDA autocast gives it.
#: Nested calls inside a function the mode intercepts are not seen again, hence
#: ``multi_head_attention_forward`` (CLIP's attention), whose inner ``linear`` would escape.
_BF16_OPS = frozenset({F.linear, F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d,
                       F.conv_transpose2d, F.conv_transpose3d, F.scaled_dot_product_attention,
                       F.multi_head_attention_forward, torch.addmm, torch.baddbmm})
_FP32_OPS = frozenset({F.cross_entropy, F.batch_norm, F.softmax, F.log_softmax, torch.softmax,
                       torch.log_softmax, torch.Tensor.softmax, torch.Tensor.log_softmax})


def vmap_autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """:class:`VmapAutocast` under ``bf16``; a no-op for fp32 (as
    :func:`fedadapt.devices.autocast`)."""
    return VmapAutocast(device) if precision == "bf16" else contextlib.nullcontext()


class VmapAutocast(TorchFunctionMode):
    """bf16 autocast's casts, applied by hand to the ops whose autocast does not reach inside
    ``vmap`` (:data:`_BF16_OPS` get bf16 inputs, :data:`_FP32_OPS` fp32 ones), each then run
    with autocast off on ``device``, as autocast runs an op it has cast (the math attention
    kernel's own softmax must not be cast again). Grouped clients compute what one client
    computes under :func:`fedadapt.devices.autocast`, in the same dtypes, on the CPU and on
    CUDA. Costs one Python call per torch function in the forward (~380 for DeiT-S: well under
    a millisecond)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device_type = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = torch.bfloat16 if func in _BF16_OPS else \
            torch.float32 if func in _FP32_OPS else None
        if dtype is None:
            return func(*args, **kwargs)
        args = tuple(_cast(a, dtype) for a in args)
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
        with torch.autocast(self.device_type, enabled=False):
            return func(*args, **kwargs)


def _cast(value, dtype: torch.dtype):
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def attention_for_vmap(dev: torch.device, precision: str = "fp32"):
    """The attention kernel grouped clients use: the math form, on the CPU and on CUDA.

    On the CPU the fused kernel has no batching rule (torch would loop over the clients). On
    CUDA (an H200, torch 2.11, ``scripts/vmap_attention.py``: each kernel under ``vmap``,
    forward and backward, against the math form one client at a time) the memory-efficient
    kernel's backward fails ("LSE is not correctly aligned (strideH)", fp32 and bf16), cuDNN's
    returns wrong values in bf16 and has no fp32 kernel, and flash has no fp32 kernel; flash in
    bf16 matched (and took 1.2 ms against the math form's 1.8-2.1 ms at 10 clients x batch 10),
    but no grouped run has used it yet. Until one has, the math form: its matmuls and softmax
    have batching rules and run as one batched call for the group.

    ``FEDADAPT_VMAP_ATTENTION=flash`` (an experiment, for ``scripts/gpu_check.sh``) lets flash
    take bf16 attention on CUDA, the math form everything else."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if (os.environ.get("FEDADAPT_VMAP_ATTENTION") == "flash" and dev.type == "cuda"
            and precision == "bf16"):
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return sdpa_kernel(SDPBackend.MATH)


__all__ = ["ClientJob", "ClientResult", "StackedOptimizer", "UsedTensors", "VmapAutocast",
           "engine_of", "train_group", "vmap_autocast"]
