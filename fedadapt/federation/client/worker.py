"""What a simulated worker does with the clients a message names, whatever the family.

In simulation a Flower node is a *worker*: one process holding the frozen backbone once, which
trains the clients a message lists in groups of ``group-size`` side by side
(:mod:`fedadapt.federation.client.grouped`; with a group size of 1 one after another with
:func:`~fedadapt.federation.client.training.train_local`): :func:`train_groups`, with a client at
fault failing alone. On the deployment engine a node is one client and a message names just it. Here
live what every family's client side uses: which exits and tensors a client trains
(:func:`client_exits`, :func:`sent_names`), the seeded fault injection, the round's deadline
(:class:`Deadline`) and :func:`for_each_client`. A family's own client code lives in its folder
(the rounds family's: :mod:`fedadapt.methods.rounds.clients`).

What a client sends is what it trained: the communicated tensors that its exits give a gradient
(a tier-3 client of a layer-wise model sends exit 3's head, not the other eleven), the same set
the server expects and aggregates (:func:`sent_names`).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Callable, Optional

import torch
from flwr.app import Context, RecordDict

from fedadapt.adapters.lora import is_base_delta
from fedadapt.federation.client.dpsgd import PrivateSteps
from fedadapt.federation.client.grouped import ClientJob, ClientResult, UsedTensors, train_group
from fedadapt.federation.client.training import RunSpec, cached_model, train_local
from fedadapt.federation.server.checkpoint import load_client_context, save_client_context
from fedadapt.federation.server.faults import injected_fault
from fedadapt.federation.wire import records
from fedadapt.federation.wire.grid import node_id
from fedadapt.log import log
from fedadapt.settings import step_exits

_USED: dict[str, UsedTensors] = {}
#: :func:`sent_names` per (run, exits): a round asks it several times for each client.
_SENT: dict[tuple, tuple[str, ...]] = {}


def release_process_caches() -> None:
    """Free what this process keeps between a run's messages: the client model, the tensors
    each exit trains, labels, input stores, corrupted rows and the feature and image mappings
    (each made again on use). After a run's rounds, before its plots: W3 of
    ``benchmarks/investigations/peer_pfl.py`` in process peaked at 899 MB while drawing them,
    788 MB with this
    (the end of the rounds; 512 MB just after it)."""
    from fedadapt.data.sources import clear_cache
    from fedadapt.devices import return_freed_memory
    from fedadapt.federation.client.training import drop_cached_model

    drop_cached_model()
    _USED.clear()
    _SENT.clear()
    clear_cache()
    gc.collect()  # a model's modules hold reference cycles
    return_freed_memory(check_every_s=0)


def client_exits(spec: RunSpec, cid: int) -> Optional[list[int]]:
    """The exits client ``cid`` trains and is evaluated at (None: the model's own forward)."""
    if not spec.num_exits:  # a model without exits (its own forward), whatever the setting
        return None
    exit_of = spec.client_exits[cid] if spec.client_exits else 0
    return step_exits(spec.setting, exit_of, spec.num_exits)


def first_train_index(spec: RunSpec) -> int:
    """The first training example of the first client that has one: the sample a one-step
    probe of the model runs on (which tensors train, how many FLOPs)."""
    return next((int(c.train[0]) for c in spec.clients if len(c.train)), 0)


def used_tensors(spec: RunSpec, model=None) -> UsedTensors:
    """Which trainable tensors a step at each exit trains (found once per process and run)."""
    if spec.run_id not in _USED:
        _USED.clear()
        model = cached_model(spec) if model is None else model
        _USED[spec.run_id] = UsedTensors(model, spec.train_source, first_train_index(spec),
                                            precision=spec.precision)
    return _USED[spec.run_id]


def sent_names(spec: RunSpec, cid: int, model=None) -> list[str]:
    """The communicated tensors client ``cid`` trains, hence receives and sends back."""
    exits = client_exits(spec, cid)
    key = (spec.run_id, tuple(exits or ()))
    if key not in _SENT:
        if any(k[0] != spec.run_id for k in _SENT):
            _SENT.clear()
        model = cached_model(spec) if model is None else model
        used = used_tensors(spec, model)
        trained = set().union(*(used(e) for e in (exits or [None])))
        _SENT[key] = tuple(n for n in model.communicated_names() if n in trained)
    return list(_SENT[key])


# -- personal tensors -------------------------------------------------------------------------


def fault_of(spec: RunSpec, server_round: int, cid: int) -> Optional[str]:
    """The seeded fault this client injects in this round (``faults.*``), or None."""
    return injected_fault(spec.seed, server_round, cid, spec.faults.fraction, spec.faults.kinds)


def client_fault(spec: RunSpec, server_round: int, cid: int, where: str) -> Optional[str]:
    """:func:`fault_of`; a ``raise`` fault raises here."""
    fault = fault_of(spec, server_round, cid)
    if fault == "raise":
        raise RuntimeError(f"injected fault (faults.fraction={spec.faults.fraction}): "
                           f"client {cid} raises {where}")
    return fault


#: How many seconds after the round's timeout a ``timeout`` fault's client replies.
TIMEOUT_OVERRUN_S = 2.0


class Deadline:
    """When the replies of a message's clients arrive, and which are too late.

    A client's reply arrives when it is made (seconds after the message reached this node) plus
    the delay its fault injects: ``timeout`` replies :data:`TIMEOUT_OVERRUN_S` after the
    exchange's timeout, ``straggler`` ``faults.delay_s`` late. On the deployment engine a node
    is one client: it sleeps that long and the server's grid drops it if it is late. A
    simulated worker answers for many clients, so it judges each itself: a client whose reply
    would arrive after the timeout is left out (it was late), and the worker replies when its
    last punctual client's reply arrives, or at the timeout when one was late, so the round
    lasts what it would with real devices."""

    def __init__(self, content: RecordDict, straggle_s: Optional[float] = None) -> None:
        grid = records.packing(content)
        self.start = time.monotonic()
        self.timeout = float(grid.get(records.TIMEOUT, 0.0)) or None
        self.deployment = grid.get("nodes", "workers") == "clients"
        self.straggle_s = float(straggle_s or 0.0)
        self.due = 0.0
        self.any_late = False

    def delay(self, fault: Optional[str]) -> float:
        if fault == "timeout":
            return (self.timeout or 0.0) + TIMEOUT_OVERRUN_S
        return self.straggle_s if fault == "straggler" else 0.0

    def in_time(self, fault: Optional[str]) -> bool:
        """Whether a reply made now, delayed by ``fault``, arrives within the timeout."""
        delay = self.delay(fault)
        if self.deployment:
            time.sleep(delay)
            return True
        at = time.monotonic() - self.start + delay
        if self.timeout is not None and at > self.timeout:
            self.any_late = True
            return False
        self.due = max(self.due, at)
        return True

    def wait(self) -> None:
        """Sleep until the worker's reply is due (see the class docstring)."""
        until = self.timeout if self.any_late else self.due
        left = until - (time.monotonic() - self.start)
        if left > 0:  # time.sleep(0) still yields the CPU: 70 us a message on this machine
            time.sleep(left)


def reason_of(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _run_group(spec: RunSpec, model, jobs: list[ClientJob], lr: float, mu: float, train,
               private: bool = False) -> list[ClientResult]:
    """``jobs`` trained side by side (one: :func:`train_local`) at learning rate ``lr`` and
    FedProx's ``mu``; ``private``: by ``spec.dpsgd``'s DP-SGD (one client)."""
    if len(jobs) > 1:
        folded = _folded(jobs[0])
        if folded:  # FLoRA / FedEx-LoRA: the group's frozen weights (one per group: _groups)
            model.fold(folded)
        return train_group(model, spec.train_source, jobs, train, lr=lr,
                           precision=spec.precision, proximal_mu=mu, used=used_tensors(spec),
                           compile=spec.compile)
    (job,) = jobs
    model.load_tensors(job.tensors)
    loss, seen = train_local(model, job.source or spec.train_source, job.indices, train, lr=lr,
                             seed=job.seed, proximal_mu=mu, anchor=job.anchor,
                             linear=job.linear, exits=job.exits,
                             crop_seed=job.crop_seed, precision=spec.precision,
                             private=PrivateSteps(spec.dpsgd.noise[job.cid],
                                                  spec.dpsgd.max_grad_norm) if private else None)
    return [ClientResult(model.tensors(model.trainable_names()), loss, seen)]


def _groups(jobs: list[ClientJob], size: int, rates: dict[int, tuple[float, float]]
            ) -> list[tuple[tuple[float, float], list[ClientJob]]]:
    """Clients with the same ``(lr, mu)`` and the same folded frozen weights (FLoRA's and
    FedEx-LoRA's ``base_delta``: the same received tensors) train together, ``size`` at a
    time, whatever exits they train (tiers share a group: each deeper block runs on the
    clients that go deeper)."""
    by_key: dict[tuple, list[ClientJob]] = {}
    for job in jobs:
        folded = tuple(sorted((n, id(t)) for n, t in _folded(job).items()))
        by_key.setdefault((rates[job.cid], folded), []).append(job)
    return [(key[0], group[i:i + size]) for key, group in by_key.items()
            for i in range(0, len(group), max(1, size))]


def _folded(job: ClientJob) -> dict[str, torch.Tensor]:
    """The update of the frozen weights the client received (``X.base_delta``; none: {})."""
    return {n: t for n, t in job.tensors.items() if is_base_delta(n)}


def train_groups(spec: RunSpec, model, jobs: list[ClientJob], size: int,
                  rates: dict[int, tuple[float, float]], train=None,
                  finish: Optional[Callable] = None, private: bool = False) -> dict:
    """Each client's result, or the reason it failed; ``rates[cid]``: its ``(lr, mu)``. A group
    that raises is retried one client at a time, so only the client at fault fails; a group
    that does not fit in GPU memory is split in halves until it does (with a warning naming the
    size that fits). ``finish(cid, result_or_reason)``, when given, turns each result into what
    is kept as soon as its group is done (a reply record: a large model's trained tensors are
    not all held at once). ``private``: the clients train by DP-SGD (``spec.dpsgd``), one at
    a time (Opacus's per-sample gradients are one model's)."""
    train = train or spec.train
    out: dict = {}
    private = private and spec.dpsgd is not None
    pending = _groups(jobs, 1 if private else size, rates)

    def keep(cid: int, res: ClientResult | str) -> None:
        out[cid] = finish(cid, res) if finish else res

    while pending:
        (lr, mu), group = pending.pop(0)
        try:
            results = _run_group(spec, model, group, lr, mu, train, private)
        except torch.cuda.OutOfMemoryError as err:
            torch.cuda.empty_cache()
            if len(group) == 1:
                keep(group[0].cid, f"one client's step does not fit in GPU memory at "
                                   f"train.batch_size={train.batch_size} ({err})")
                continue
            half = (len(group) + 1) // 2
            log(f"[worker] a group of {len(group)} clients does not fit in GPU memory: training "
                f"groups of {half} (set federation.clients_per_worker={half})")
            pending[:0] = [((lr, mu), group[:half]), ((lr, mu), group[half:])]
            continue
        except Exception as err:  # isolate the client at fault
            if len(group) == 1:
                keep(group[0].cid, reason_of(err))
                continue
            _log_fallback(len(group), err)
            for job in group:
                try:
                    res = _run_group(spec, model, [job], lr, mu, train)[0]
                except Exception as err:
                    res = reason_of(err)
                keep(job.cid, res)
            continue
        for job, res in zip(group, results):
            keep(job.cid, res)
    return out


#: The causes already logged by :func:`_log_fallback` in this process.
_FALLBACK_CAUSES: set[str] = set()


def _log_fallback(size: int, err: BaseException) -> None:
    """A group that raised is trained one client at a time: say so, with the cause, once per
    cause (a grouped path that silently fell back would make every speed figure a lie)."""
    cause = reason_of(err)
    if cause not in _FALLBACK_CAUSES:
        _FALLBACK_CAUSES.add(cause)
        log(f"[worker] a group of {size} clients failed side by side ({cause}): training its "
            f"clients one at a time (only this group)")


def for_each_client(content: RecordDict,
                    one: Callable[[int, RecordDict], RecordDict],
                    fault: Optional[Callable[[int], Optional[str]]] = None,
                    straggle_s: Optional[float] = None) -> RecordDict:
    """``one(cid, that client's records)`` for every client the message names; an exception
    becomes that client's error record. Each reply is timed as it is made (:class:`Deadline`;
    ``fault(cid)``: the client's injected fault, ``straggle_s``: a straggler's delay) and a
    late one left out."""
    deadline = Deadline(content, straggle_s)
    replies = {}
    for cid in records.clients_of(content):
        try:
            out = one(cid, records.view(content, cid))
        except Exception as err:
            out = records.error(reason_of(err))
        if deadline.in_time(fault(cid) if fault else None):
            replies[cid] = out
    deadline.wait()
    return records.pack(replies)


# -- each client's own Context ----------------------------------------------------------------

#: Client states of runs without a run directory (``spec.state_dir`` unset), in this process.
_STATES: dict[tuple[str, int], bytes] = {}


def _state_bytes(state: RecordDict) -> bytes:
    from flwr.common.serde import recorddict_to_proto

    return recorddict_to_proto(state).SerializeToString()


def _state_of(data: Optional[bytes]) -> RecordDict:
    from flwr.common.serde import ProtoRecordDict, recorddict_from_proto

    return recorddict_from_proto(ProtoRecordDict.FromString(data)) if data else RecordDict()


def _context_dir(spec: RunSpec, cid: int) -> Optional[Path]:
    return Path(spec.state_dir) / str(cid) / "context" if spec.state_dir else None


def client_contexts(spec: RunSpec, content: RecordDict, context: Context, up_to: int
                    ) -> tuple[dict[int, Context], dict[int, bytes]]:
    """A Flower ``Context`` for each client of the message, as its own ClientApp would have:
    its node id, ``partition-id`` / ``num-partitions`` and its ``state`` as it was after round
    ``up_to`` (kept in the run directory, so it follows the client from worker to worker and
    across a resume). On the deployment engine a node is the client: its own context. Also
    returns each state as loaded, for :func:`keep_contexts` (none on the deployment engine)."""
    cids = records.clients_of(content)
    if records.packing(content).get("nodes", "workers") == "clients":
        return {cid: context for cid in cids}, {}
    out, loaded = {}, {}
    for cid in cids:
        folder = _context_dir(spec, cid)
        data = (load_client_context(folder, up_to) if folder is not None
                else _STATES.get((spec.run_id, cid)))
        out[cid] = Context(run_id=context.run_id, node_id=node_id(cid),
                           node_config={**context.node_config, "partition-id": cid,
                                        "num-partitions": spec.num_clients},
                           state=_state_of(data), run_config=context.run_config)
        loaded[cid] = data or b""
    return out, loaded


def keep_contexts(spec: RunSpec, contexts: dict[int, Context], loaded: dict[int, bytes],
                  server_round: int, checkpoint_round: int) -> None:
    """Save each client's ``context.state`` that its handler or mods changed (``loaded``: as
    :func:`client_contexts` read them; a deployment node's own context is Flower's to keep)."""
    for cid, before in loaded.items():
        data = _state_bytes(contexts[cid].state)
        if data == before:
            continue
        folder = _context_dir(spec, cid)
        if folder is None:
            _STATES[(spec.run_id, cid)] = data
        else:
            save_client_context(folder, server_round, data, checkpoint_round)


__all__ = ["Deadline", "client_contexts", "client_exits", "client_fault", "fault_of",
           "for_each_client", "keep_contexts", "reason_of", "sent_names", "train_groups",
           "used_tensors"]
