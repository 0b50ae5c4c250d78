"""What a Flower node does with a message: train, evaluate or serve the clients it names.

In simulation a node is a *worker*: one process holding the frozen backbone once, which trains
the clients a message lists in groups of ``group-size`` side by side
(:mod:`fedadapt.federation.grouped`); with a group size of 1 it trains them one after another
with :func:`~fedadapt.federation.training.train_local`. On the deployment engine a node is one
client and a message names just it. Each client's outcome is packed into the reply under its own
prefix (:mod:`fedadapt.federation.records`): its arrays and metrics, or an error, so a client
that fails is dropped alone, not its group.

What a client sends is what it trained: the communicated tensors that its exits give a gradient
(a tier-3 client of a layer-wise model sends exit 3's head, not the other eleven), the same set
the server expects and aggregates (:func:`sent_names`). Personal tensors never leave: the client
keeps them in ``<state_dir>/<client>/`` (any worker reads the newest, with a per-process cache),
or, without a state folder (a deployment client), in its ``context.state``.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict

from fedadapt.devices import return_freed_memory
from fedadapt.federation import mods, records
from fedadapt.federation.checkpoint import client_rounds, load_client_state, save_client_state
from fedadapt.federation.faults import TENSOR_FAULTS, corrupt, injected_fault
from fedadapt.federation.grouped import ClientJob, ClientResult, UsedTensors, train_group
from fedadapt.federation.training import (
    RunSpec,
    cached_model,
    derive_seed,
    evaluate,
    evaluate_exits,
    initial_personal,
    train_local,
)
from fedadapt.log import log
from fedadapt.settings import only_training, part_names, step_exits

#: ``context.state`` key of a deployment client's personal tensors.
PERSONAL_KEY = "personal"
_PERSONAL: dict[tuple[str, int], tuple[int, dict[str, torch.Tensor]]] = {}
_PERSONAL_CACHE = 4096
_USED: dict[str, UsedTensors] = {}


def client_exits(spec: RunSpec, cid: int) -> Optional[list[int]]:
    """The exits client ``cid`` trains and is evaluated at (None: the model's own forward)."""
    if not spec.num_exits:  # a model without exits (its own forward), whatever the setting
        return None
    exit_of = spec.client_exits[cid] if spec.client_exits else 0
    return step_exits(spec.setting, exit_of, spec.num_exits)


def used_tensors(spec: RunSpec, model=None) -> UsedTensors:
    """Which trainable tensors a step at each exit trains (found once per process and run)."""
    if spec.run_id not in _USED:
        _USED.clear()
        model = cached_model(spec) if model is None else model
        sample = next((int(c.train[0]) for c in spec.clients if len(c.train)), 0)
        _USED[spec.run_id] = UsedTensors(model, spec.train_source, sample,
                                            precision=spec.precision)
    return _USED[spec.run_id]


def sent_names(spec: RunSpec, cid: int, model=None) -> list[str]:
    """The communicated tensors client ``cid`` trains, hence receives and sends back."""
    model = cached_model(spec) if model is None else model
    used = used_tensors(spec, model)
    trained = set().union(*(used(e) for e in (client_exits(spec, cid) or [None])))
    return [n for n in model.communicated_names() if n in trained]


# -- personal tensors -------------------------------------------------------------------------

def _state_dir(spec: RunSpec, cid: int) -> Optional[Path]:
    return Path(spec.state_dir) / str(cid) if spec.state_dir else None


def load_personal(spec: RunSpec, model, cid: int, up_to: int, context: Context
                  ) -> dict[str, torch.Tensor]:
    """The client's personal tensors as they were after its last training up to round
    ``up_to``; the run's seeded initial values before its first."""
    if not model.personal_names():
        return {}
    folder = _state_dir(spec, cid)
    if folder is None:  # a deployment client: its own context
        if PERSONAL_KEY in context.state.array_records:
            return dict(context.state.array_records[PERSONAL_KEY].to_torch_state_dict())
        return initial_personal(spec)
    rounds = [r for r in client_rounds(folder) if r <= up_to]
    if not rounds:
        return initial_personal(spec)
    cached = _PERSONAL.get((spec.run_id, cid))
    if cached is not None and cached[0] == rounds[-1]:
        return cached[1]
    return load_client_state(folder, up_to)


def keep_personal(spec: RunSpec, cid: int, rnd: int, tensors: dict[str, torch.Tensor],
                  checkpoint_round: int, context: Context) -> None:
    folder = _state_dir(spec, cid)
    if folder is None:
        context.state[PERSONAL_KEY] = ArrayRecord(tensors)
        return
    save_client_state(folder, rnd, tensors, checkpoint_round)
    if len(_PERSONAL) >= _PERSONAL_CACHE:
        _PERSONAL.pop(next(iter(_PERSONAL)))
    _PERSONAL[(spec.run_id, cid)] = (rnd, tensors)


def received_arrays(content: RecordDict, cid: Optional[int] = None
                    ) -> dict[str, torch.Tensor]:
    """The global arrays a client received: the message's shared ``arrays``, or its own
    (``c<id>/arrays``: a deployment client gets only what it trains)."""
    mine = content if cid is None else records.view(content, cid)
    arrays = mine.array_records.get("arrays")
    return dict(arrays.to_torch_state_dict()) if arrays is not None else {}


def arrays_by_client(content: RecordDict) -> Callable[[int], dict[str, torch.Tensor]]:
    """:func:`received_arrays` for each client of a message, the shared arrays decoded once:
    every client of a worker's message starts from the same global tensors (each copies them
    into the model and none changes them), so a whole CLIP is not decoded once per client."""
    shared: list[dict[str, torch.Tensor]] = []

    def of(cid: int) -> dict[str, torch.Tensor]:
        if records.key(cid, "arrays") in content:
            return received_arrays(content, cid)
        if not shared:
            shared.append(received_arrays(content))
        return shared[0]

    return of


def client_tensors(spec: RunSpec, model, cid: int, received: dict[str, torch.Tensor],
                   up_to: int, context: Context) -> dict[str, torch.Tensor]:
    """Every trainable tensor of the client's model: what it needs from the server, its
    personal ones, and (unused by it) the process model's current values for the rest."""
    needed = sent_names(spec, cid, model)
    missing = sorted(set(needed) - set(received))
    unknown = sorted(set(received) - set(model.communicated_names()))
    if missing or unknown:
        raise ValueError(f"client {cid}: the server sent tensors {sorted(received)[:4]}..., "
                         f"expected {needed[:4]}... (missing {missing[:3]}, unknown "
                         f"{unknown[:3]})")
    given = set(needed)
    out = model.tensors([n for n in model.trainable_names() if n not in given])
    out.update({n: received[n] for n in needed})
    out.update(load_personal(spec, model, cid, up_to, context))
    return out


# -- training ---------------------------------------------------------------------------------

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
        time.sleep(max(0.0, until - (time.monotonic() - self.start)))


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _run_group(spec: RunSpec, model, jobs: list[ClientJob], lr: float, mu: float, train
               ) -> list[ClientResult]:
    """``jobs`` trained side by side (one: :func:`train_local`) at learning rate ``lr`` and
    FedProx's ``mu``."""
    if len(jobs) > 1:
        return train_group(model, spec.train_source, jobs, train, lr=lr,
                           precision=spec.precision, proximal_mu=mu, used=used_tensors(spec))
    (job,) = jobs
    model.load_tensors(job.tensors)
    loss, seen = train_local(model, job.source or spec.train_source, job.indices, train, lr=lr,
                             seed=job.seed, proximal_mu=mu, exits=job.exits,
                             crop_seed=job.crop_seed, precision=spec.precision)
    return [ClientResult(model.tensors(model.trainable_names()), loss, seen)]


def _groups(jobs: list[ClientJob], size: int, rates: dict[int, tuple[float, float]]
            ) -> list[tuple[tuple[float, float], list[ClientJob]]]:
    """Clients with the same exits (a tier) and the same ``(lr, mu)`` train together, ``size``
    at a time."""
    by_key: dict[tuple, list[ClientJob]] = {}
    for job in jobs:
        by_key.setdefault((tuple(job.exits or ()), rates[job.cid]), []).append(job)
    return [(key[1], group[i:i + size]) for key, group in by_key.items()
            for i in range(0, len(group), max(1, size))]


def _train_groups(spec: RunSpec, model, jobs: list[ClientJob], size: int,
                  rates: dict[int, tuple[float, float]], train=None,
                  finish: Optional[Callable] = None) -> dict:
    """Each client's result, or the reason it failed; ``rates[cid]``: its ``(lr, mu)``. A group
    that raises is retried one client at a time, so only the client at fault fails; a group
    that does not fit in GPU memory is split in halves until it does (with a warning naming the
    size that fits). ``finish(cid, result_or_reason)``, when given, turns each result into what
    is kept as soon as its group is done (a reply record: a large model's trained tensors are
    not all held at once)."""
    train = train or spec.train
    out: dict = {}
    pending = _groups(jobs, size, rates)

    def keep(cid: int, res: ClientResult | str) -> None:
        out[cid] = finish(cid, res) if finish else res

    while pending:
        (lr, mu), group = pending.pop(0)
        try:
            results = _run_group(spec, model, group, lr, mu, train)
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
                keep(group[0].cid, _reason(err))
                continue
            _log_fallback(len(group), err)
            for job in group:
                try:
                    res = _run_group(spec, model, [job], lr, mu, train)[0]
                except Exception as err:
                    res = _reason(err)
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
    cause = _reason(err)
    if cause not in _FALLBACK_CAUSES:
        _FALLBACK_CAUSES.add(cause)
        log(f"[worker] a group of {size} clients failed side by side ({cause}): training its "
            f"clients one at a time (only this group)")


def train_clients(spec: RunSpec, msg: Message, context: Context) -> RecordDict:
    """A TRAIN message: every named client trains from the global arrays, with its own config
    (round, learning rate, FedProx's mu); one record set per client in the reply, each through
    the run's train mods."""
    content = msg.content
    grid = records.packing(content)
    deadline = Deadline(content, spec.faults.delay_s)
    model = cached_model(spec)
    replies: dict[int, RecordDict] = {}
    jobs, faults, rates, configs, received = [], {}, {}, {}, arrays_by_client(content)
    for cid in records.clients_of(content):
        try:
            config = configs[cid] = records.view(content, cid).config_records["config"]
            rnd = int(config["server-round"])
            rates[cid] = (float(config["lr"]), float(config.get("proximal-mu", 0.0)))
            faults[cid] = client_fault(spec, rnd, cid, f"in round {rnd}")
            tensors = client_tensors(spec, model, cid, received(cid), rnd - 1, context)
        except Exception as err:
            replies[cid] = records.error(_reason(err))
            continue
        jobs.append(ClientJob(cid=cid, indices=spec.clients[cid].train, tensors=tensors,
                              seed=derive_seed(spec.seed, rnd, cid),
                              crop_seed=derive_seed(spec.seed, rnd, cid, 7),
                              exits=client_exits(spec, cid)))

    def reply(cid: int, res: ClientResult | str) -> Optional[RecordDict]:
        """The client's reply record, made as soon as it has trained; None: it was late."""
        if isinstance(res, str):
            return records.error(res) if deadline.in_time(None) else None
        config = configs[cid]
        rnd = int(config["server-round"])
        personal = model.personal_names()
        if personal:
            keep_personal(spec, cid, rnd, {n: res.tensors[n] for n in personal},
                          int(config.get("checkpoint-round", 0)), context)
        names = sent_names(spec, cid, model)
        sent = {n: res.tensors[n] for n in names}
        res.tensors.clear()  # the record below holds the only copy of what is sent
        if faults[cid] in TENSOR_FAULTS:
            sent = corrupt(sent, faults[cid])
        if not deadline.in_time(faults[cid]):
            return None
        out = RecordDict({
            "arrays": ArrayRecord(torch_state_dict=sent, keep_input=False),
            "metrics": MetricRecord({"num-examples": len(spec.clients[cid].train),
                                     records.UNIFORM_KEY: 1.0, "train_loss": res.loss})})
        return mods.apply(spec.train_mods, msg, records.view(content, cid), out, context,
                          trained=names)

    made = _train_groups(spec, model, jobs, int(grid.get("group-size", 1)), rates,
                         finish=reply)
    replies.update({cid: r for cid, r in made.items() if r is not None})
    del jobs, received
    return_freed_memory()
    deadline.wait()
    return records.served_by(records.pack(replies))


def personalize_clients(spec: RunSpec, content: RecordDict, context: Context) -> RecordDict:
    """The personalization step for every named client: from the global model, fine-tune
    ``setting.personalize`` for ``setting.epochs`` epochs on its own (corrupted, if it has a
    corruption) training split at its tier's exit, side by side like training; accuracy on its
    test split before and after. The personalized tensors stay on the client
    (``<state_dir>/<client>/personalized/``); the reply carries metrics only."""
    st, config = spec.setting, content.config_records["config"]
    rnd = int(config["server-round"])
    model = cached_model(spec)
    names = part_names(model, st.personalize)
    # the process's model serves every client: frozen tensors a part trains (personalize=full)
    # are put back afterwards
    frozen = model.tensors(sorted(set(names) - set(model.trainable_names())))
    train = replace(spec.train, local_epochs=st.epochs, lr=st.lr or spec.train.lr)
    replies, jobs, before, start = {}, [], {}, {}
    received = arrays_by_client(content)
    for cid in records.clients_of(content):
        try:
            start[cid] = {**frozen, **client_tensors(spec, model, cid, received(cid), rnd - 1,
                                                     context)}
            model.load_tensors(start[cid])
            source, exits = _personal_data(spec, cid)
            before[cid] = local_accuracy(model, spec, spec.clients[cid].test, exits, source)[1]
            jobs.append(ClientJob(cid=cid, indices=spec.clients[cid].train,
                                  tensors=model.tensors(names),
                                  seed=derive_seed(spec.seed, 0xC1, cid),
                                  crop_seed=derive_seed(spec.seed, 0xC2, cid), exits=exits,
                                  source=source))
        except Exception as err:
            replies[cid] = records.error(_reason(err))
    with only_training(model, names):
        results = _train_groups(spec, model, jobs, int(records.packing(content).get(
            "group-size", 1)), {job.cid: (train.lr, 0.0) for job in jobs}, train)
    for job in jobs:
        res = results[job.cid]
        if isinstance(res, str):
            replies[job.cid] = records.error(res)
            continue
        model.load_tensors({**start[job.cid], **res.tensors})
        source, exits = _personal_data(spec, job.cid)
        _, after, n = local_accuracy(model, spec, spec.clients[job.cid].test, exits, source)
        if (folder := _state_dir(spec, job.cid)) is not None:
            save_client_state(folder / "personalized", rnd, res.tensors)
        tier = spec.client_exits[job.cid] if spec.client_exits else -1
        replies[job.cid] = RecordDict({"metrics": MetricRecord({
            "num-examples": n, "tier": tier, "severity": _personal_data(spec, job.cid, True),
            "acc_before": before[job.cid], "acc_after": after, "train_loss": res.loss,
            "personalized_params": sum(t.numel() for t in res.tensors.values())})})
    model.load_tensors(frozen)
    return records.pack(replies)


def _personal_data(spec: RunSpec, cid: int, severity_only: bool = False):
    """A personalizing client's data (corrupted with its kind and severity) and exits."""
    kind, severity = spec.client_corruptions[cid] if spec.client_corruptions else ("none", 0)
    if severity_only:
        return severity
    source = spec.train_source
    if severity > 0:
        source = source.corrupted(kind, severity, derive_seed(spec.seed, 0xC0, cid))
    tier = spec.client_exits[cid] if spec.client_exits else None  # None: no exits
    return source, None if tier is None else [tier]


# -- evaluation and per-client phases ---------------------------------------------------------

def local_accuracy(model, spec: RunSpec, indices, exits, source=None):
    """(loss, accuracy, n) of the client's model on ``indices`` of its data; with ``exits``
    the mean over them (anytime: all; multi-tier: its tier)."""
    source = spec.train_source if source is None else source
    if exits is None:
        return evaluate(model, source, indices, precision=spec.precision)
    losses, accs, n = evaluate_exits(model, source, exits, indices, precision=spec.precision)
    return sum(losses) / len(losses), sum(accs) / len(accs), n


def evaluate_one(spec: RunSpec, cid: int, content: RecordDict, context: Context) -> RecordDict:
    """One client's accuracy on its local test split (and validation split, when the run
    selects rounds by validation) with the global arrays and its personal tensors."""
    config = content.config_records["config"]
    model = cached_model(spec)
    up_to = int(config.get("server-round", 0))
    model.load_tensors(client_tensors(spec, model, cid, received_arrays(content), up_to,
                                      context))
    exits = client_exits(spec, cid)
    loss, acc, n = local_accuracy(model, spec, spec.clients[cid].test, exits)
    # the same keys from every client (Flower checks that); NaN when there is no test data
    metrics = {"num-examples": n, records.UNIFORM_KEY: 1.0, "accuracy": acc, "loss": loss}
    if spec.evaluate_val:  # model selection by validation accuracy (federation.select)
        metrics["val_accuracy"] = local_accuracy(model, spec, spec.clients[cid].val, exits)[1]
    if spec.client_exits:
        metrics["tier"] = spec.client_exits[cid]
    return RecordDict({"metrics": MetricRecord(metrics)})


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
            out = records.error(_reason(err))
        if deadline.in_time(fault(cid) if fault else None):
            replies[cid] = out
    deadline.wait()
    return records.pack(replies)


__all__ = ["PERSONAL_KEY", "Deadline", "client_exits", "client_fault", "evaluate_one",
           "fault_of", "for_each_client", "keep_personal", "load_personal", "local_accuracy",
           "personalize_clients", "sent_names", "train_clients"]
