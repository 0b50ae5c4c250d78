"""The one client training loop and the one evaluation loop, shared by every method.

Methods differ only in their model's forward (and, later, a registered loss); nothing here
branches on a method name. Randomness (shuffling, exits, crops, dropout) is drawn from
generators seeded by ``(seed, round, client)``, so a run is reproducible and independent of which
Ray worker (or which order) executes a client. Batches come from :meth:`DataSource.stream` on the
run's device (prepared one batch ahead), forward passes run under the run's precision
(:mod:`fedadapt.devices`).
"""

from __future__ import annotations

import math
import threading
from contextlib import nullcontext
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
    PflConfig,
    SettingConfig,
    TrainConfig,
)
from fedadapt.data.partition import ClientSplit
from fedadapt.data.sources import DataSource


@dataclass(frozen=True)
class BackboneInfo:
    """What a method needs of a backbone it does not run (training from cached features)."""

    embed_dim: int
    has_exits = False  # a cache holds pooled features only


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
    #: ``method.ranks``: each client's LoRA rank ([] when every client has the model's).
    client_ranks: list[int] = field(default_factory=list)
    #: personalization: each client's ``(corruption, severity)``.
    client_corruptions: list[tuple[str, int]] = field(default_factory=list)
    #: Class prompts and their text features (methods registered with ``uses_text``).
    class_text: Optional[object] = None
    #: Clients also report their validation accuracy (model selection by validation).
    evaluate_val: bool = False
    #: Where models run (``cpu`` / ``cuda``) and in which precision (``fp32`` / ``bf16``),
    #: resolved once in the driver (:mod:`fedadapt.devices`).
    device: str = "cpu"
    precision: str = "fp32"
    #: Clients side by side run a step captured by ``torch.compile`` (``federation.compile``,
    #: resolved in the driver).
    compile: bool = False
    #: torch's intra-op threads in each client process (``federation.num_cpus``, at least 1),
    #: set explicitly: CPU results depend on it, and Ray sets it (through OMP_NUM_THREADS)
    #: only where the environment does not.
    client_threads: int = 1
    #: Flower ClientApp mods (``module:function``) applied to each client's training and
    #: evaluation replies (``federation.*_mods``; ``dp=client_*`` puts Flower's clipping mod
    #: first).
    train_mods: list[str] = field(default_factory=list)
    evaluate_mods: list[str] = field(default_factory=list)
    #: The method family's own fields (:meth:`fedadapt.methods.Family.prepare`; e.g.
    #: :class:`fedadapt.methods.server_trained.ServerFields`), None where it has none.
    family: Optional[object] = None
    #: ``dp=dpsgd``: each client's DP-SGD (a :class:`fedadapt.strategies.privacy.DPSGDPlan`);
    #: None without it.
    dpsgd: Optional[object] = None
    #: ``pfl=``: what stays on each client (:class:`~fedadapt.config.PflConfig`).
    pfl: PflConfig = field(default_factory=PflConfig)
    #: The client round the clients follow beyond FedAvg's (a
    #: :class:`fedadapt.pfl.rule.ClientRule`: a ``pfl`` kind's, or a strategy's client side);
    #: None: FedAvg's local training.
    rule: Optional[object] = None

    @property
    def num_clients(self) -> int:
        return len(self.clients)


#: Run specs already fetched by this process (see :class:`SpecRef`), newest last.
_SPECS: dict[str, "RunSpec"] = {}


class SpecRef:
    """The ClientApp's ``get_spec(context)`` for a simulation: the run's :class:`RunSpec`.

    Flower's Ray backend sends the ClientApp with every task, so whatever its handlers close over
    is pickled into every message: a spec of 10,000 clients (every client's index arrays) cost
    half a second a round. Pickled, this is the run id and a Ray object reference (``ray.put``
    once, in the driver); each worker process fetches the spec once and keeps it."""

    def __init__(self, spec: "RunSpec") -> None:
        self.run_id, self._spec, self._ref = spec.run_id, spec, None

    def __call__(self, context=None) -> "RunSpec":
        if self._spec is None:
            self._spec = _SPECS.get(self.run_id)
        if self._spec is None:
            import ray

            while len(_SPECS) >= 2:  # an earlier run's spec in a reused worker
                _SPECS.pop(next(iter(_SPECS)))
            self._spec = _SPECS[self.run_id] = ray.get(self._ref)
        return self._spec

    def __getstate__(self) -> dict:
        import ray

        if self._ref is None:
            if not ray.is_initialized():  # not on its way to a Ray worker: the spec itself
                return {"run_id": self.run_id, "spec": self._spec, "ref": None}
            self._ref = ray.put(self._spec)
        return {"run_id": self.run_id, "spec": None, "ref": self._ref}

    def __setstate__(self, state: dict) -> None:
        self.run_id, self._spec, self._ref = state["run_id"], state["spec"], state["ref"]


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client, ...)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, np.uint64)[0]
               >> np.uint64(1))


def build_run_model(spec: RunSpec, backbone=None) -> AdaptedModel:
    """The method's model with its seeded initial weights (identical in every process), on the
    run's device; under bf16 its frozen backbone weights are held in bf16."""
    from fedadapt.adapters.personal import keep_on_client
    from fedadapt.devices import hold_frozen, setup

    if spec.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("this run uses the GPU (federation.num_gpus), but this process sees "
                           "none; set federation.num_gpus=0 to run on the CPU")
    setup(spec.device, spec.train.deterministic)
    needs_backbone = spec.train_source.kind == "images"
    if needs_backbone and backbone is None:
        from fedadapt.backbones import build_backbone

        backbone = build_backbone(spec.backbone)
    model = seeded_model(spec.method, spec.seed,
                         backbone if needs_backbone else BackboneInfo(spec.embed_dim),
                         spec.num_classes, with_backbone=needs_backbone,
                         class_text=spec.class_text)
    keep_on_client(model, spec.pfl.keeps, spec.pfl.norms, spec.num_classes,
                   spec.pfl.name)
    if spec.rule is not None:
        spec.rule.check_model(model, spec.num_classes)
    model = model.to(spec.device)
    st = spec.setting
    personalize_all = st.kind.personal_phase and st.personalize == "full"
    if needs_backbone and not personalize_all:  # full personalization trains the backbone
        hold_frozen(model.backbone, spec.precision)
    return model


def seeded_model(method, seed: int, backbone, num_classes: int, *, with_backbone: bool,
                 class_text=None) -> AdaptedModel:
    """``method``'s model with the run's seeded initialisation (every process, and an export
    rebuilt later, draws the same initial tensors, FFA-LoRA's frozen ``A`` among them)."""
    torch.manual_seed(derive_seed(seed, 0x1417))
    return build_model(method, backbone, num_classes, with_backbone=with_backbone,
                       class_text=class_text)


#: The client models of this process: one per run and thread (in process, each worker is a
#: thread of its own: :mod:`fedadapt.federation.simulation.inprocess`), built one at a time
#: (the seeded initialisation draws from torch's global generator).
_MODELS: dict[tuple[str, int], tuple[AdaptedModel, dict]] = {}
_BUILDING = threading.Lock()


def drop_cached_model() -> None:
    """Forget this process's client models (:func:`cached_model` builds them again)."""
    _MODELS.clear()


def cached_model(spec: RunSpec) -> AdaptedModel:
    """One model per process, run and thread; every call overwrites all trainable tensors
    before use."""
    return _cached(spec)[0]


def initial_personal(spec: RunSpec) -> dict[str, torch.Tensor]:
    """The seeded initial values of the personal tensors (a client's state on its first visit)."""
    return _cached(spec)[1]


def _cached(spec: RunSpec) -> tuple[AdaptedModel, dict]:
    key = (spec.run_id, threading.get_ident())
    if key not in _MODELS:
        with _BUILDING:
            for old in [k for k in _MODELS if k[0] != spec.run_id]:
                del _MODELS[old]
            torch.set_num_threads(spec.client_threads)  # the client's process: as every run's
            model = build_run_model(spec)
            _MODELS[key] = (model, model.tensors(model.personal_names()))
    return _MODELS[key]


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


class PlainSGD:
    """SGD without momentum, torch's update to the bit (``p -= lr * (g + weight_decay * p)``,
    as ``torch.optim.SGD`` computes it per tensor on the CPU and with the same foreach operator
    on a GPU), without ``torch.optim``'s machinery around each call (step hooks, a profiler
    range, two dynamo guards): on ``benchmarks/investigations/peer_pfl.py``'s W3 (10 linear
    heads, 17 steps a
    round) creating, zeroing and stepping torch's SGD took 1.5 ms of a 6.5 ms round."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> None:
        self.params, self.lr, self.weight_decay = list(params), float(lr), float(weight_decay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        ps = [p for p in self.params if p.grad is not None]
        if not ps:
            return
        with torch.no_grad():
            grads = [p.grad for p in ps]
            if self.weight_decay:
                grads = torch._foreach_add(grads, ps, alpha=self.weight_decay)
            torch._foreach_add_(ps, grads, alpha=-self.lr)


def local_optimizer(params, train: TrainConfig, lr: float):
    """The optimiser of a client's local training: :class:`PlainSGD` for SGD without momentum,
    else :func:`make_optimizer`'s."""
    if train.optimizer == "sgd" and not train.momentum:
        return PlainSGD(params, lr, train.weight_decay)
    return make_optimizer(params, train, lr)


def batches_of(indices: np.ndarray, batch_size: int, epochs: int, gen: torch.Generator
               ) -> list[np.ndarray]:
    """A fresh seeded permutation of ``indices`` per epoch, each cut into batches (the last of
    an epoch may be smaller)."""
    indices = np.asarray(indices)
    out = []
    for _ in range(epochs):
        order = indices[torch.randperm(len(indices), generator=gen).numpy()]
        out += [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    return out


#: The seed streams of a client's local training, drawn alike alone (:func:`train_local`) and side
#: by side (:func:`fedadapt.federation.client.grouped.train_group`), so a client's result never
#: depends on its group: its batches come from ``seed`` itself, the exit each step trains from
#: ``derive_seed(seed, EXIT_STREAM)``, its dropout masks from
#: :func:`fedadapt.grouping.dropout.step_key` (``DROPOUT_STREAM``) and its crops from the
#: ``crop_seed`` its caller derives.
EXIT_STREAM = 0xE817


def local_schedule(indices: np.ndarray, train: TrainConfig, seed: int,
                   exits: Optional[list[int]], batches: Optional[list[np.ndarray]] = None
                   ) -> tuple[list[np.ndarray], list[Optional[int]]]:
    """A client's batches (``batches``, or its seeded shuffles) and the exit each of its steps
    trains (None: the model's own forward), drawn uniformly from ``exits``: one schedule, alone
    or in a group."""
    if batches is None:
        batches = batches_of(indices, train.batch_size, train.local_epochs,
                             torch.Generator().manual_seed(seed))
    if exits is None:
        return batches, [None] * len(batches)
    gen = torch.Generator().manual_seed(derive_seed(seed, EXIT_STREAM))
    return batches, [exits[int(torch.randint(len(exits), (1,), generator=gen))] for _ in batches]


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
    crop_seed: Optional[int] = None,
    precision: str,
    private=None,
    anchor: Optional[dict[str, torch.Tensor]] = None,
    linear: Optional[dict[str, torch.Tensor]] = None,
) -> tuple[float, int]:
    """Train ``model`` in place on ``source[indices]``; return (mean loss, samples seen).

    With ``proximal_mu > 0`` adds FedProx's ``mu/2 * ||w - w_global||^2`` over the trainable
    tensors, ``w_global`` being their values on entry, or ``anchor``'s where it names them
    (Ditto, FedDyn). ``linear`` adds ``<linear, w>`` (a constant added to the gradient:
    SCAFFOLD's correction, FedDyn's linear term) for the tensors it names. With ``exits`` (an
    early-exit model), each step draws one exit uniformly from them (seeded) and trains that
    exit's logits, running only the blocks up to it. With ``crop_seed`` (and
    ``train.crop_scale``), every image gets its seeded ``RandomResizedCrop``.
    ``train.clip_grad_norm`` clips the gradients' norm. ``precision`` (``fp32`` / ``bf16``, the
    run's :attr:`RunSpec.precision`) is the forward's. With ``private`` (a
    :class:`~fedadapt.federation.client.dpsgd.PrivateSteps`) the steps are DP-SGD's
    (:mod:`fedadapt.federation.client.dpsgd`): Poisson-sampled batches, each example's gradient
    clipped, Gaussian noise.
    """
    from fedadapt.devices import autocast, seed_torch
    from fedadapt.federation.client import dpsgd
    from fedadapt.grouping import dropout

    dev = next(model.parameters()).device
    masks = dropout.install(model)  # the client's own masks, as when it trains in a group
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    anchor = None if proximal_mu <= 0 else [
        anchor[n].to(p.device, p.dtype) if anchor is not None and n in anchor
        else p.detach().clone() for n, p in named]
    linear = None if linear is None else [
        linear[n].to(p.device, p.dtype) if n in linear else torch.zeros_like(p)
        for n, p in named]
    drawn = None if private is None else \
        dpsgd.poisson_batches(indices, train.batch_size, train.local_epochs,
                              derive_seed(seed, dpsgd.BATCH_STREAM))
    batches, step_exits = local_schedule(indices, train, seed, exits,
                                         drawn and [b for b in drawn if len(b)])
    seed_torch(seed, dev)  # any draw other than dropout's
    model.train()
    if private is None:
        opt = local_optimizer(params, train, lr)
    else:  # an empty batch is a step of noise alone, before the next batch's
        opt = dpsgd.PrivateOptimizer(model, params, make_optimizer(params, train, lr), private,
                                     len(indices), train.batch_size,
                                     derive_seed(seed, dpsgd.NOISE_STREAM))
        empty, run = [], 0  # the empty batches before each drawn one, and after the last
        for b in drawn:
            empty, run = (empty + [run], 0) if len(b) else (empty, run + 1)
        empty.append(run)
    losses, sizes = [], []
    crops = None
    if crop_seed is not None and train.crop_scale is not None:
        scale = (float(train.crop_scale[0]), float(train.crop_scale[1]))
        crops = [(scale, np.full(len(b), crop_seed, dtype=np.uint64)) for b in batches]
    for t, (x, y) in enumerate(source.stream(batches, dev, crops)):
        for _ in range(empty[t] if private is not None else 0):
            opt.noise_step(proximal(params, anchor, proximal_mu, linear))
        keyed = dropout.keyed(torch.tensor(dropout.step_key(seed, t))) if masks else nullcontext()
        with autocast(dev.type, precision), keyed:
            if step_exits[t] is None:
                loss = model.training_loss(x, y)
            else:
                loss = F.cross_entropy(model.exit_logits(x, last_exit=step_exits[t],
                                                         all_exits=False)[-1], y)
        loss = loss.float()
        if private is not None:
            opt.zero_grad(set_to_none=True)
            loss.backward()  # the proximal term holds no example: added after the noise
            opt.step(proximal(params, anchor, proximal_mu, linear))
            losses.append(loss.detach())
            sizes.append(len(y))
            continue
        if anchor is not None:
            loss = loss + 0.5 * proximal_mu * sum(
                (p - a).pow(2).sum() for p, a in zip(params, anchor))
        if linear is not None:
            loss = loss + sum((p * c).sum() for p, c in zip(params, linear))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if train.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, train.clip_grad_norm)
        opt.step()
        losses.append(loss.detach())
        sizes.append(len(y))
    if private is not None:
        for _ in range(empty[-1]):
            opt.noise_step(proximal(params, anchor, proximal_mu, linear))
        opt.close()
    # read once, after the last step; summed in float64 in step order, as a running total would
    total = 0.0
    for value, n in zip(torch.stack(losses).double().tolist() if losses else [], sizes):
        total += value * n
    seen = sum(sizes)
    return total / max(seen, 1), seen


def proximal(params: list, anchor: Optional[list], mu: float,
             linear: Optional[list] = None) -> Optional[list[torch.Tensor]]:
    """The gradient of ``mu/2 * ||w - anchor||^2 + <linear, w>`` (FedProx's term, and the
    drift corrections' linear term); None without either."""
    if anchor is None and linear is None:
        return None
    out = [torch.zeros_like(p) for p in params] if anchor is None else \
        [mu * (p.detach() - a) for p, a in zip(params, anchor)]
    return out if linear is None else [g + c for g, c in zip(out, linear)]


@torch.no_grad()
def _evaluate_logits(model, source: DataSource, indices: Optional[np.ndarray], batch_size: int,
                     forward: Callable[[torch.Tensor], list[torch.Tensor]], precision: str
                     ) -> tuple[list[float], list[float], int]:
    """The one evaluation loop: per output of ``forward(x)``, (mean losses, accuracies, n);
    NaN when there are no samples."""
    from fedadapt.devices import autocast

    if indices is None:
        indices = np.arange(len(source.labels()))
    indices = np.asarray(indices)
    dev = next(model.parameters()).device
    model.eval()
    loss_sum, correct, n = None, None, 0
    batches = [indices[s:s + batch_size] for s in range(0, len(indices), batch_size)]
    for x, y in source.stream(batches, dev):
        with autocast(dev.type, precision):
            outputs = forward(x)
        if loss_sum is None:
            loss_sum = torch.zeros(len(outputs), dtype=torch.float64, device=dev)
            correct = torch.zeros(len(outputs), dtype=torch.int64, device=dev)
        for j, logits in enumerate(outputs):
            logits = logits.float()
            loss_sum[j] += F.cross_entropy(logits, y, reduction="sum").double()
            correct[j] += (logits.argmax(1) == y).sum()
        n += len(y)
    if n == 0:
        return [float("nan")], [float("nan")], 0
    return (list(map(float, (loss_sum / n).tolist())), list(map(float, (correct / n).tolist())),
            n)


def evaluate(model: AdaptedModel, source: DataSource, indices: Optional[np.ndarray] = None,
             batch_size: int = 256, *, precision: str) -> tuple[float, float, int]:
    """(mean loss, accuracy, n) of ``model`` on ``source[indices]`` (all samples if None), its
    forward in ``precision`` (the run's)."""
    losses, accs, n = _evaluate_logits(model, source, indices, batch_size,
                                       lambda x: [model(x)], precision)
    return losses[0], accs[0], n


def evaluate_exits(model, source: DataSource, exits: list[int],
                   indices: Optional[np.ndarray] = None, batch_size: int = 256, *,
                   precision: str) -> tuple[list[float], list[float], int]:
    """Per-exit (losses, accuracies, n) of an early-exit model: one pass up to ``max(exits)``
    serves every exit."""
    last = max(exits)

    def forward(x: torch.Tensor) -> list[torch.Tensor]:
        all_logits = model.exit_logits(x, last_exit=last)
        return [all_logits[e] for e in exits]

    losses, accs, n = _evaluate_logits(model, source, indices, batch_size, forward, precision)
    if n == 0:
        return [float("nan")] * len(exits), [float("nan")] * len(exits), 0
    return losses, accs, n
