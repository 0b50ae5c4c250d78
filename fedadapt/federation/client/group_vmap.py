"""The vmap engine, the general path for what has no grouped form (full fine-tuning, a user's
module without a form): ``torch.func.vmap`` over ``torch.func.functional_call``, clients in
buckets of one batch size and exit; with the bf16 casts and the attention kernel that ``vmap``
needs (:mod:`fedadapt.federation.client.grouped` says when it runs)."""

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
from fedadapt.federation.client.group_jobs import (
    OTHER_STREAM,
    ClientJob,
    ClientResult,
    Schedule,
    StepLoss,
    UsedTensors,
    first_index,
    job_terms,
    schedule,
    step_masks,
)
from fedadapt.federation.client.group_optim import StackedOptimizer, clip_per_client
from fedadapt.federation.client.training import derive_seed
from fedadapt.grouping import dropout


def _plan(scheds: list[Schedule]) -> list[tuple[int, list[int]]]:
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


@dataclass
class _Group:
    """A group's training state on the device, set up once (:func:`_set_up`)."""

    jobs: list[ClientJob]
    names: list[str]  # the trainable tensors, in the model's order
    frozen: dict[str, torch.Tensor]  # shared by every client (weights and buffers)
    stacked: dict[str, torch.Tensor]  # ``[K, ...]`` trainable tensors, fp32
    final: dict[str, torch.Tensor]  # each client's tensors at its last step
    start: Optional[dict[str, torch.Tensor]]  # the proximal term's anchors
    linear: Optional[dict[str, torch.Tensor]]  # the linear terms
    opt: StackedOptimizer
    scheds: list[Schedule]
    plan: list[tuple[int, list[int]]]  # ``(step, clients)`` buckets, in order
    masks: torch.Tensor  # ``[steps, tensors, K]`` on the device
    active: np.ndarray  # ``[steps, tensors]`` on the host
    loss_sum: torch.Tensor  # ``[K]`` float64, on the device
    seen: np.ndarray  # ``[K]``
    precision: str
    proximal_mu: float
    dev: torch.device


def train_vmap(model: nn.Module, source: DataSource, jobs: list[ClientJob], train: TrainConfig,
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
    start, linear = job_terms(
        jobs, names, proximal_mu, lambda n, ts: torch.stack([t.detach().float().cpu()
                                                             for t in ts]).to(dev),
        lambda: {n: t.detach().clone() for n, t in stacked.items()})
    scheds = [schedule(j, train) for j in jobs]
    plan = _plan(scheds)
    used = used or UsedTensors(model, source, first_index(jobs), precision=precision)
    host_masks = step_masks(plan, scheds, names, used,
                            every=start is not None or linear is not None)
    return _Group(
        jobs=jobs, names=names, frozen=frozen, stacked=stacked,
        # filled at each client's last step (a client with no batch returns its tensors as
        # they came)
        final={n: torch.empty_like(t) for n, t in stacked.items()}, start=start, linear=linear,
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
    if g.linear is not None:
        losses = losses + sum((g.stacked[n][pos] * g.linear[n][pos]).reshape(len(ks), -1)
                              .sum(1) for n in g.names)
    losses.sum().backward()
    g.loss_sum.index_add_(0, pos, losses.detach().double() * size)
    g.seen[ks] += size


def _update(g: _Group, t: int, train: TrainConfig) -> None:
    """The end of step ``t``: clip, step each client that trained, and keep the tensors of
    the clients whose last step it was."""
    if train.clip_grad_norm is not None:
        clip_per_client(g.stacked, train.clip_grad_norm)
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


def _stream(source: DataSource, jobs: list[ClientJob], scheds: list[Schedule], plan, dev,
            crops):
    """The buckets' batches on the device: from the shared source, or assembled from each
    client's own source when clients bring their own (corrupted) data."""
    if all(j.source is None for j in jobs):
        batches = [np.concatenate([scheds[k].batches[t] for k in ks]) for t, ks in plan]
        return source.stream(batches, dev, crops)
    from fedadapt.data.sources import stream_parts

    return stream_parts([[(jobs[k].source or source, scheds[k].batches[t]) for k in ks]
                         for t, ks in plan], dev, crops)


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
    CUDA (an H200, torch 2.11, ``benchmarks/investigations/vmap_attention.py``: each kernel
    under ``vmap``,
    forward and backward, against the math form one client at a time) the memory-efficient
    kernel's backward fails ("LSE is not correctly aligned (strideH)", fp32 and bf16), cuDNN's
    returns wrong values in bf16 and has no fp32 kernel, and flash has no fp32 kernel; flash in
    bf16 matched (and took 1.2 ms against the math form's 1.8-2.1 ms at 10 clients x batch 10),
    but no grouped run has used it yet. Until one has, the math form: its matmuls and softmax
    have batching rules and run as one batched call for the group.

    ``FEDADAPT_VMAP_ATTENTION=flash`` (an experiment, for ``fedadapt-gpu-check``) lets flash
    take bf16 attention on CUDA, the math form everything else."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if (os.environ.get("FEDADAPT_VMAP_ATTENTION") == "flash" and dev.type == "cuda"
            and precision == "bf16"):
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH])
    return sdpa_kernel(SDPBackend.MATH)
