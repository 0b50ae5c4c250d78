"""FLOP and memory costs of a client's training, measured on the run's model, and what is
built from them: each client's tier from its device (``setting.tiers_from=fleet``), the samples
FedScale charges, and the run's :class:`~.clock.Fleet` (:func:`build_fleet`)."""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from fedadapt.federation.simulation.fleet.clock import Fleet
from fedadapt.federation.simulation.fleet.kinds import FedScaleFleet
from fedadapt.federation.simulation.fleet.profiles import profiles


def train_flops_per_example(model, source, index: int, exits: Optional[list[int]], *,
                            device: str, precision: str) -> float:
    """The FLOPs one training example costs the model at ``exits`` (their mean: an anytime
    client draws one per step; None: the model's own forward): forward and backward of a batch
    of two copies of example ``index`` under ``torch.utils.flop_counter.FlopCounterMode``,
    halved, on the run's device and in its precision (a bf16-held model needs autocast; the
    count does not depend on either). The counter counts matrix products, convolutions and
    attention (forward and backward), not elementwise operations."""
    from torch.utils.flop_counter import FlopCounterMode

    from fedadapt.devices import autocast
    from fedadapt.federation.client.grouped import StepLoss

    x, y = source.get(np.array([index, index]), device)
    call, out = StepLoss(model), []
    was_training = model.training
    model.train()
    try:
        for e in exits if exits else [None]:
            model.zero_grad(set_to_none=True)
            with FlopCounterMode(display=False) as counter:
                with autocast(device, precision):
                    loss = call(x, y, e)
                if loss.requires_grad:
                    loss.backward()
            out.append(counter.get_total_flops() / 2)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return float(np.mean(out))


#: FLOPs per training example by ``(run, exit)``: each exit of a run measured once (the
#: tiers from the fleet and the fleet's work ask for the same ones).
_FLOPS: dict[tuple, float] = {}


def _flops_at(spec, model, exits: Optional[list[int]]) -> float:
    """:func:`train_flops_per_example` at ``exits`` (their mean; None: the model's own
    forward), each exit measured once per run."""
    from fedadapt.federation.client.worker import first_train_index

    if any(key[0] != spec.run_id for key in _FLOPS):
        _FLOPS.clear()  # another run's model
    for e in exits or [None]:
        if (spec.run_id, e) not in _FLOPS:
            _FLOPS[(spec.run_id, e)] = train_flops_per_example(
                model, spec.train_source, first_train_index(spec), None if e is None else [e],
                device=spec.device, precision=spec.precision)
    return float(np.mean([_FLOPS[(spec.run_id, e)] for e in exits or [None]]))


def train_memory_bytes(model, source, index: int, exit_: Optional[int], *, device: str,
                       precision: str, optimizer_states: int) -> tuple[float, float]:
    """``(fixed, per_example)``: the bytes one training step of the model at ``exit_`` (None:
    its own forward) holds, as ``fixed + per_example x batch``, measured on the run's device in
    its precision:

    * the weights (parameters and buffers) the step reads, measured by a dispatch mode that
      sees every tensor an operation reads;
    * for those the optimiser updates (trainable and read), their gradients and
      ``optimizer_states`` optimiser tensors of the same size each (SGD with momentum 1, Adam
      2, plain SGD 0);
    * the tensors autograd saves for the backward (the activations: every storage a
      ``saved_tensors_hooks`` pack sees, once, the weights left out), measured at batches of 2
      and 3 copies of example ``index``: their difference is one example's, linear in the
      batch.

    What the step frees as it goes (the backward's transient buffers, the allocator's slack)
    is not counted: it is the training state a device must hold, not a peak of any one
    allocator."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from fedadapt.devices import autocast
    from fedadapt.federation.client.grouped import StepLoss

    def ptr(t) -> int:
        return t.untyped_storage().data_ptr()

    held = {ptr(t): t for t in (*model.parameters(), *model.buffers())}
    call = StepLoss(model)

    def measure(batch: int) -> tuple[float, set]:
        read: set[int] = set()
        saved: dict[int, int] = {}

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                for leaf in tree_leaves((args, kwargs or {})):
                    if isinstance(leaf, torch.Tensor):
                        read.add(ptr(leaf))
                return func(*args, **(kwargs or {}))

        def pack(t):
            if isinstance(t, torch.Tensor) and ptr(t) not in held:
                saved[ptr(t)] = t.untyped_storage().nbytes()
            return t

        x, y = source.get(np.array([index] * batch), device)
        model.zero_grad(set_to_none=True)
        with Reads(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast(device, precision):
                loss = call(x, y, exit_)
            if loss.requires_grad:
                loss.backward()
        return float(sum(saved.values())), read & set(held)

    was_training = model.training
    model.train()
    try:
        two, read = measure(2)
        three, _ = measure(3)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    weights = sum(held[p].untyped_storage().nbytes() for p in read)
    trainable = sum(held[p].untyped_storage().nbytes() for p in read
                    if held[p].requires_grad)
    per_example = max(three - two, 0.0)
    fixed = weights + trainable * (1 + optimizer_states) + (two - 2 * per_example)
    return float(fixed), float(per_example)


#: Training memory ``(fixed, per example)`` by ``(run, exit)``, each exit measured once per
#: run (as the FLOPs are).
_MEMORY: dict[tuple, tuple[float, float]] = {}


def optimizer_states(train) -> int:
    """Optimiser tensors per trainable tensor: Adam's two moments, SGD's momentum buffer."""
    if train.optimizer in ("adam", "adamw"):
        return 2
    return 1 if train.momentum else 0


def _memory_at(spec, model, exits: Optional[list[int]], batch: int) -> float:
    """The bytes a client's training at ``exits`` holds at batches of ``batch`` (its steps draw
    any of the exits: the largest of theirs), each exit measured once per run."""
    from fedadapt.federation.client.worker import first_train_index

    if any(key[0] != spec.run_id for key in _MEMORY):
        _MEMORY.clear()  # another run's model
    for e in exits or [None]:
        if (spec.run_id, e) not in _MEMORY:
            _MEMORY[(spec.run_id, e)] = train_memory_bytes(
                model, spec.train_source, first_train_index(spec), e, device=spec.device,
                precision=spec.precision, optimizer_states=optimizer_states(spec.train))
    return max(fixed + per * batch for fixed, per in
               (_MEMORY[(spec.run_id, e)] for e in exits or [None]))


def _batch_of(spec, client) -> int:
    """The largest batch a client trains: ``train.batch_size``, or all its examples."""
    return max(1, min(spec.train.batch_size, len(client.train)))


def tiers_from_fleet(cfg, spec, model) -> list[int]:
    """``setting.tiers_from=fleet``: each client's exit, the deepest whose local training its
    device finishes within ``federation.round_timeout`` simulated seconds (compute only: FLOPs
    per example x its examples x local epochs / its FLOP/s). Multi-tier: its tier, among the
    setting's exits (``setting.tiers``, default every exit), at that exit's cost. Anytime: the
    deepest exit its steps may draw, at the mean cost of the exits up to it. A client too slow
    even for the shallowest gets the shallowest (and is late)."""
    anytime = cfg.setting.kind.exit_per_step
    exits = sorted(set(cfg.setting.tiers if cfg.setting.tiers is not None and not anytime
                       else range(spec.num_exits)))
    # anytime: a step draws uniformly from the exits up to the cap
    flops = {e: _flops_at(spec, model, [d for d in exits if d <= e] if anytime else [e])
             for e in exits}
    out = []
    reference = _flops_at(spec, model, None) if cfg.fleet.fedscale_traces else 1.0
    for client, p in zip(spec.clients, profiles(cfg.fleet, spec.num_clients, cfg.seed,
                                                reference)):
        work = len(client.train) * cfg.train.local_epochs / p.compute
        fits = [e for e in exits if flops[e] * work <= cfg.federation.round_timeout
                and (p.memory is None or _memory_at(
                    spec, model, [d for d in exits if d <= e] if anytime else [e],
                    _batch_of(spec, client)) <= p.memory)]
        out.append(fits[-1] if fits else exits[0])
    return out


def charged_samples(fleet_cfg: FedScaleFleet, train, examples: int) -> int:
    """``fleet.fedscale_semantics=exact``: the samples FedScale charges a client a round,
    ``train.batch_size`` x its local steps: ``fleet.local_steps``, or (null) the steps of the
    client's own local epochs, ``ceil(examples / batch) x train.local_epochs``."""
    steps = fleet_cfg.local_steps
    if steps is None:
        steps = math.ceil(examples / train.batch_size) * train.local_epochs
    return int(train.batch_size) * int(steps)


def _fedscale_fleet(cfg, spec, model) -> Fleet:
    """``fleet.fedscale_semantics=exact``: the fleet with FedScale's work (each client charged
    :func:`charged_samples` at its exit's share of the model's own step) and target count (the
    clients ``partition.fraction_fit`` samples of the run's, as the strategy counts them)."""
    from fedadapt.federation.client.worker import client_exits
    from fedadapt.strategies.build import sample_size

    reference = _flops_at(spec, model, None)
    per_example = [_flops_at(spec, model, client_exits(spec, cid))
                   for cid in range(spec.num_clients)]
    samples = [charged_samples(cfg.fleet, cfg.train, len(client.train))
               for client in spec.clients]
    return Fleet(cfg.fleet, spec.num_clients, cfg.seed,
                 [f * n for f, n in zip(per_example, samples)], deadline=None,
                 reference_flops=reference,
                 examples=[len(client.train) for client in spec.clients],
                 target=sample_size(spec.num_clients, cfg.partition.fraction_fit),
                 samples=samples, exit_share=[f / reference for f in per_example])


def build_fleet(cfg, spec, model) -> Optional[Fleet]:
    """The run's :class:`Fleet` (``fleet=``; None for ``fleet=none``): each client's training
    FLOPs per round measured on ``model`` at its exits, times its examples and local epochs."""
    from fedadapt.federation.client.worker import client_exits

    if not cfg.fleet.simulated:
        return None
    from fedadapt.log import log

    if cfg.fleet.exact:
        fleet = _fedscale_fleet(cfg, spec, model)
        for note in fleet.notes():
            log(note)
        return fleet
    work = [_flops_at(spec, model, client_exits(spec, cid)) * len(client.train)
            * cfg.train.local_epochs for cid, client in enumerate(spec.clients)]
    fleet = Fleet(cfg.fleet, spec.num_clients, cfg.seed, work,
                  deadline=cfg.federation.round_timeout,
                  reference_flops=(_flops_at(spec, model, None) if cfg.fleet.fedscale_traces
                                   else 1.0),
                  examples=[len(client.train) for client in spec.clients],
                  train_memory=([_memory_at(spec, model, client_exits(spec, cid),
                                            _batch_of(spec, client))
                                 for cid, client in enumerate(spec.clients)]
                                if cfg.fleet.memory is not None else None))
    for note in fleet.notes():
        log(note)
    return fleet

