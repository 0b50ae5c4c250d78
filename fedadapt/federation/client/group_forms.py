"""The grouped forms' engine: K clients as one batch of K x B rows, the frozen backbone once
for every row, each client's trainable modules applied to its own rows
(:mod:`fedadapt.grouping.forms`; :mod:`fedadapt.federation.client.grouped` says when it runs)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import nn

from fedadapt.config import TrainConfig
from fedadapt.data.sources import DataSource
from fedadapt.devices import autocast, seed_torch
from fedadapt.federation.client.group_jobs import (
    OTHER_STREAM,
    ClientJob,
    ClientResult,
    Schedule,
    UsedTensors,
    first_index,
    job_terms,
    schedule,
    step_masks,
)
from fedadapt.federation.client.group_optim import FlatOptimizer, StackedOptimizer, clip_per_client
from fedadapt.federation.client.training import derive_seed
from fedadapt.grouping import dropout, forms


@dataclass
class _Plan:
    """A group's steps laid out in slots (host arrays, uploaded once): slot ``s`` is
    ``jobs[order[s]]``, the clients with the most steps first, so the clients still training
    at a step are always the first ``going[t]`` slots. A step's batch holds ``width[t]`` slots:
    the going ones, or (fixed shapes, for a captured step) every slot, a finished client's
    rows all padding."""

    order: list[int]
    scheds: list[Schedule]  # in slot order
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


def _plan_slots(jobs: list[ClientJob], scheds: list[Schedule], rows: int,
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
            weight = np.zeros(rows, np.float32)  # its real rows' mean, its padding 0
            weight[:b] = 1.0 / max(b, 1)
            weights.append(weight)
            sizes.append(b)
    return _Plan(order=order, scheds=sch, going=going, width=width, perms=perms, exits=exits,
                 rows=batch_rows, sources=sources,
                 weights=np.concatenate(weights) if weights else np.zeros(0, np.float32),
                 sizes=np.asarray(sizes, dtype=np.float64))


def _batch(sched: Schedule, t: int, first: Schedule) -> np.ndarray:
    """The slot's batch at step ``t``; a finished slot's padding (its last batch's first
    index, or the first slot's for a client without data: rows that weigh 0)."""
    if t < len(sched.batches):
        return sched.batches[t]
    return (sched.batches or first.batches)[-1][:1]


def _distinct_rows(sizes: np.ndarray, rows: int
                   ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """A step's :attr:`fedadapt.grouping.forms.Slots.distinct` from its slots' real rows
    (``sizes``, in the step's order); None where no row is padding (or none is real)."""
    b = sizes.astype(np.int64)
    if (b == rows).all() or not b.any():
        return None
    real = np.concatenate([s * rows + np.arange(k) for s, k in enumerate(b)])
    first = np.r_[0, np.cumsum(b)[:-1]]  # each slot's first real row among ``real``
    at = np.arange(rows)
    within = np.where(at < b[:, None], at, 0)  # a padding row: its slot's first (its image)
    take = (np.where(b > 0, first, 0)[:, None] + within).reshape(-1)
    return torch.from_numpy(real), torch.from_numpy(take)


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


def train_forms(model: nn.Module, source: DataSource, jobs: list[ClientJob],
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
    plan = _plan_slots(jobs, [schedule(j, train) for j in jobs], rows, fixed=compile)
    slot_jobs = [jobs[k] for k in plan.order]
    # every client's tensors, stacked in slot order and in the forms' layouts, one upload
    host = [forms.to_layout(model, n, _stacked([j.tensors[n] for j in slot_jobs]))
            for n in names]
    flat, stored = _stored(model, names, host, dev, persistent=compile)
    anchors, linear = job_terms(
        slot_jobs, names, proximal_mu,
        lambda n, ts: forms.to_layout(model, n, _stacked(ts)).to(dev),
        lambda: {n: t.detach().clone() for n, t in stored.items()})
    terms = anchors is not None or linear is not None
    used = used or UsedTensors(model, source, first_index(jobs), precision=precision)
    steps = len(plan.going)
    # which tensors each going client's step trains (a finished slot's: none)
    host_masks = step_masks([(t, list(range(plan.going[t]))) for t in range(steps)],
                            plan.scheds, names, used, every=terms)
    opt = FlatOptimizer(flat, stored, train, lr) if flat is not None \
        else StackedOptimizer(stored, train, lr)
    masks = torch.from_numpy(host_masks).to(dev)
    active = host_masks.any(axis=2)
    perms_host = [p for p in plan.perms if p is not None]
    keys_host = np.array([dropout.step_key(slot_jobs[k].seed, t) if has_dropout else 0
                          for t in range(steps) for k in plan.sources[t]], dtype=np.int64)
    small = [torch.from_numpy(plan.weights), torch.from_numpy(plan.sizes),
             torch.from_numpy(np.concatenate(perms_host) if perms_host
                              else np.zeros(0, np.int64)),
             torch.arange(len(jobs), dtype=torch.int64), torch.from_numpy(keys_host)]
    # on the CPU they are where the step reads them (no transfer to gather them for)
    weights, sizes, perm_flat, slot_index, keys = small if dev.type == "cpu" \
        else _upload(small, dev)
    loss_sum = torch.zeros(len(jobs), dtype=torch.float64, device=dev)
    seed_torch(derive_seed(jobs[0].seed, len(jobs), OTHER_STREAM), dev)  # any other draw
    model.train()
    at_w = at_s = at_p = 0
    slots = forms.Slots(rows, stored)
    # a frozen backbone in the step, on the CPU: it runs on the real rows only
    distinct = dev.type == "cpu" and not compile and getattr(model, "backbone", None) is not None
    for t, (x, y) in enumerate(_slot_stream(source, slot_jobs, plan, train, dev)):
        n, real = plan.width[t], plan.going[t]
        pos = slot_index[:n]
        slots.params = stored
        slots.distinct = _distinct_rows(plan.sizes[at_s:at_s + n], rows) if distinct else None
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
        if terms:  # each going client's own proximal and linear terms
            extra = _terms(slots.params, anchors, linear, proximal_mu, names, real,
                           None if plan.perms[t] is None else pos)
            losses = torch.cat([losses[:real] + extra, losses[real:]]) if real < n \
                else losses + extra
        opt.zero_grad()
        losses.sum().backward()
        loss_sum.index_add_(0, pos, losses.detach().double() * sizes[at_s:at_s + n])
        at_w += n * rows
        at_s += n
        if train.clip_grad_norm is not None:
            clip_per_client(stored, train.clip_grad_norm)
        opt.step(masks[t], active[t])
    return _forms_results(model, names, shapes, stored, flat, loss_sum, plan, jobs)


def _terms(params: dict, anchors: Optional[dict], linear: Optional[dict], mu: float,
           names: list[str], real: int, pos: Optional[torch.Tensor]) -> torch.Tensor:
    """``[real]``: each going slot's ``mu/2 ||w - anchor||^2 + <linear, w>`` (``pos``: the
    step's slot order, None: in order)."""
    def at(d: dict) -> dict:
        return d if pos is None else {k: v.index_select(0, pos) for k, v in d.items()}

    out = 0.0
    if anchors is not None:
        a = at(anchors)
        out = 0.5 * mu * sum((params[k][:real] - a[k][:real]).pow(2).reshape(real, -1).sum(1)
                             for k in names)
    if linear is not None:
        lin = at(linear)
        out = out + sum((params[k][:real] * lin[k][:real]).reshape(real, -1).sum(1)
                        for k in names)
    return out


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
