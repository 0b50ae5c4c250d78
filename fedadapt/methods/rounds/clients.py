"""The ``rounds`` family's client side: what a worker does with a TRAIN or EVALUATE message.

Every client a message names trains from the global arrays it received, with its own config
(round, learning rate, FedProx's mu), side by side with the others
(:func:`fedadapt.federation.client.worker.train_groups`); the reply holds one record set per client
(its arrays and metrics, or its error). The run's mods wrap each client's handler as Flower's
ClientApp does (:mod:`fedadapt.federation.client.mods`), each client with its own ``Context``
(:func:`fedadapt.federation.client.worker.client_contexts`). Personal tensors never leave: the
client keeps them in ``<state_dir>/<client>/`` (any worker reads the newest, with a per-process
cache), or, without a state folder (a deployment client), in its ``context.state``. After the
rounds, :func:`personalize_clients` fine-tunes each client on its own data
(``setting=personalization``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fedadapt.adapters.lora import is_base_delta
from fedadapt.codec import TRAIN_EXAMPLES, UNIFORM_KEY, record, to_array
from fedadapt.devices import return_freed_memory
from fedadapt.federation.client import mods
from fedadapt.federation.client.grouped import ClientJob, ClientResult
from fedadapt.federation.client.training import (
    RunSpec,
    cached_model,
    derive_seed,
    evaluate,
    evaluate_exits,
    initial_personal,
)
from fedadapt.federation.client.worker import (
    Deadline,
    client_contexts,
    client_exits,
    client_fault,
    for_each_client,
    keep_contexts,
    reason_of,
    sent_names,
    train_groups,
)
from fedadapt.federation.server.checkpoint import (
    client_rounds,
    load_client_state,
    save_client_state,
)
from fedadapt.federation.server.faults import TENSOR_FAULTS, corrupt
from fedadapt.federation.wire import records
from fedadapt.federation.wire.grid import node_id
from fedadapt.pfl.rule import RULE_PREFIX, RoundWork, split_received
from fedadapt.settings import only_training, part_names

#: ``context.state`` key of a deployment client's personal tensors.
PERSONAL_KEY = "personal"
_PERSONAL: dict[tuple[str, int], tuple[int, dict[str, torch.Tensor]]] = {}
_PERSONAL_CACHE = 4096

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




RULE_KEY = "rule"


def load_rule_state(spec: RunSpec, cid: int, up_to: int, context: Context
                    ) -> dict[str, torch.Tensor]:
    """The state the run's client rule keeps for client ``cid`` (:mod:`fedadapt.pfl.rule`) as
    it was after its last round up to ``up_to``; {} before its first."""
    folder = _state_dir(spec, cid)
    if folder is None:
        if RULE_KEY in context.state.array_records:
            return dict(context.state.array_records[RULE_KEY].to_torch_state_dict())
        return {}
    return load_client_state(folder / RULE_KEY, up_to) or {}


def keep_rule_state(spec: RunSpec, cid: int, rnd: int, tensors: dict[str, torch.Tensor],
                    checkpoint_round: int, context: Context) -> None:
    folder = _state_dir(spec, cid)
    if folder is None:
        context.state[RULE_KEY] = ArrayRecord(tensors)
        return
    save_client_state(folder / RULE_KEY, rnd, tensors, checkpoint_round)


def arrays_decoder() -> Callable[[RecordDict], dict[str, torch.Tensor]]:
    """The global arrays a client received (its records' ``arrays``), each content decoded
    once: the clients of a worker's message hold the same record, or (with mods) their own
    copies of it whose ``Array`` objects share its bytes (each client copies the tensors into
    the model and none changes them), so a whole CLIP is not decoded once per client. A record
    is known by its names, dtypes, shapes and the identity of its bytes (held here while the
    decoder lives, so no identity is reused): an array a mod replaced is decoded for itself."""
    decoded: dict[tuple, tuple[list, dict[str, torch.Tensor]]] = {}

    def of(mine: RecordDict) -> dict[str, torch.Tensor]:
        arrays = record(mine, ArrayRecord, "arrays")
        if arrays is None:
            return {}
        items = list(arrays.items())
        key = tuple((n, a.dtype, tuple(a.shape), a.stype, id(a.data)) for n, a in items)
        if key not in decoded:
            decoded[key] = ([a.data for _, a in items], dict(arrays.to_torch_state_dict()))
        return decoded[key][1]

    return of


def client_tensors(spec: RunSpec, model, cid: int, received: dict[str, torch.Tensor],
                   up_to: int, context: Context) -> dict[str, torch.Tensor]:
    """Every trainable tensor of the client's model: what it needs from the server, its
    personal ones, and (unused by it) the process model's current values for the rest."""
    needed = sent_names(spec, cid, model)
    folded = {n: t for n, t in received.items() if is_base_delta(n)}
    missing = sorted(set(needed) - set(received))
    unknown = sorted(set(received) - set(model.communicated_names()) - set(folded))
    if missing or unknown:
        raise ValueError(f"client {cid}: the server sent tensors {sorted(received)[:4]}..., "
                         f"expected {needed[:4]}... (missing {missing[:3]}, unknown "
                         f"{unknown[:3]})")
    given = set(needed)
    out = model.tensors([n for n in model.trainable_names() if n not in given])
    given_tensors = {n: received[n] for n in needed}
    out.update(_at_model_rank(model, given_tensors) if spec.client_ranks else given_tensors)
    out.update(load_personal(spec, model, cid, up_to, context))
    out.update(folded)  # FLoRA's / FedEx-LoRA's update of the frozen weights: the model folds it
    return out


# -- LoRA of a client's own rank (method.ranks) ------------------------------------------------

def _rank_axis(name: str) -> Optional[int]:
    """The rank's axis of a LoRA factor (0 of ``A``, 1 of ``B``); None for other tensors."""
    parts = name.split(".")
    return 0 if "lora_A" in parts else 1 if "lora_B" in parts else None


def _at_model_rank(model, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A client's LoRA factors of its own rank as the process's largest-rank model holds them:
    the missing components zero (their gradients are zero, so they stay zero: the client
    trains exactly its rank)."""
    shapes = None
    for name, t in list(tensors.items()):
        axis = _rank_axis(name)
        if axis is None:
            continue
        shapes = shapes or {n: p.shape for n, p in model.named_parameters()}
        if tuple(t.shape) == tuple(shapes[name]):
            continue
        full = t.new_zeros(shapes[name])
        full.narrow(axis, 0, t.shape[axis]).copy_(t)
        tensors[name] = full
    return tensors


def _at_client_rank(sent: dict[str, torch.Tensor], rank: Optional[int], gamma: float
                    ) -> dict[str, torch.Tensor]:
    """What a client of LoRA rank ``rank`` sends: its factors' first ``rank`` components; with
    HetLoRA's ``gamma`` > 0 fewer, the trailing components every layer can spare
    (:func:`fedadapt.strategies.hetlora.self_prune`, one rank for all the client's layers:
    the largest any layer keeps)."""
    if rank is None:
        return sent
    keep = rank
    if gamma > 0:
        from fedadapt.adapters.lora import lora_pairs
        from fedadapt.strategies.hetlora import self_prune

        pairs = lora_pairs(n for n in sent if _rank_axis(n) is not None)
        kept = [self_prune(sent[a].narrow(0, 0, rank), sent[b].narrow(1, 0, rank), gamma)[0]
                .shape[0] for a, b in pairs.items()]
        keep = max(kept) if kept else rank
    return {n: (t.narrow(axis, 0, keep).contiguous() if (axis := _rank_axis(n)) is not None
                else t) for n, t in sent.items()}


# -- training ---------------------------------------------------------------------------------

def _shared_config(content: RecordDict) -> ConfigRecord:
    """The round's config a message's clients share (empty when there is none)."""
    cids = records.clients_of(content)
    if not cids:
        return ConfigRecord({})
    config = record(records.view(content, cids[0]), ConfigRecord, "config")
    return config if config is not None else ConfigRecord({})


def _trained_view(spec: RunSpec, model, cid: int, mine: RecordDict) -> RecordDict:
    """The client's records with its arrays cut to the tensors it trains (what a deployment
    client receives, and what a mod compares the reply's arrays with)."""
    arrays = record(mine, ArrayRecord, "arrays")
    names = sent_names(spec, cid, model)
    if arrays is not None:  # and what the server sent the client's rule (SCAFFOLD's c)
        names += [n for n in arrays.keys() if n.startswith(RULE_PREFIX)]
    if arrays is None or list(arrays.keys()) == names:
        return mine
    out = RecordDict(dict(mine.items()))
    out["arrays"] = ArrayRecord({n: arrays[n] for n in names if n in arrays})
    return out


def train_clients(spec: RunSpec, msg: Message, context: Context) -> RecordDict:
    """A TRAIN message: every named client trains (:func:`train_views`), each through the run's
    train mods with its own context when there are mods."""
    content = msg.content
    deadline = Deadline(content, spec.faults.delay_s)
    size = int(records.packing(content).get("group-size", 1))
    model = cached_model(spec)
    views = {cid: records.view(content, cid) for cid in records.clients_of(content)}
    if not spec.train_mods:
        replies = train_views(spec, model, views, deadline, size, context)
    else:
        config = _shared_config(content)
        rnd = int(config.get("server-round", 0))
        contexts, loaded = client_contexts(spec, content, context, rnd - 1)
        # each client its own message, as a ClientApp gets it: a mod that changes it in
        # place changes no other client's
        msgs = {cid: mods.as_message(records.own(_trained_view(spec, model, cid, mine)), msg,
                                     cid, node_id(cid)) for cid, mine in views.items()}
        replies = mods.around_clients(
            spec.train_mods, msgs, contexts,
            lambda arrived: train_views(spec, model, {c: m.content for c, m in arrived.items()},
                                        deadline, size, context))
        keep_contexts(spec, contexts, loaded, rnd, int(config.get("checkpoint-round", 0)))
    del views
    return_freed_memory()
    deadline.wait()
    return records.served_by(records.pack(replies))


def train_views(spec: RunSpec, model, views: dict[int, RecordDict], deadline: Deadline,
                size: int, context: Context) -> dict[int, RecordDict]:
    """Each client trains from its records (``views``: the global arrays and its config, as the
    mods passed them on), ``size`` side by side; ``{cid: reply records}``, none for a client
    that was late."""
    replies: dict[int, RecordDict] = {}
    jobs, faults, rates, configs, received = [], {}, {}, {}, arrays_decoder()
    examples: dict[int, int] = {}  # how many of its examples each client trains
    for_rule: dict[int, dict[str, torch.Tensor]] = {}  # the rule's arrays each received
    for cid, mine in views.items():
        try:
            config = configs[cid] = record(mine, ConfigRecord, "config")
            if config is None:
                raise KeyError("config")
            rnd = int(config["server-round"])
            rates[cid] = (float(config["lr"]), float(config.get("proximal-mu", 0.0)))
            faults[cid] = client_fault(spec, rnd, cid, f"in round {rnd}")
            arrays, for_rule[cid] = split_received(received(mine))
            tensors = client_tensors(spec, model, cid, arrays, rnd - 1, context)
        except Exception as err:
            replies[cid] = records.error(reason_of(err))
            continue
        indices = _work_share(spec, cid, rnd, config.get(TRAIN_EXAMPLES))
        examples[cid] = len(indices)
        jobs.append(ClientJob(cid=cid, indices=indices, tensors=tensors,
                              seed=derive_seed(spec.seed, rnd, cid),
                              crop_seed=(derive_seed(spec.seed, rnd, cid, 7)
                                         if spec.train.crop_scale is not None else None),
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
        sent = _at_client_rank({n: res.tensors[n] for n in sent_names(spec, cid, model)},
                               spec.client_ranks[cid] if spec.client_ranks else None,
                               float(config.get("prune-gamma", 0.0)))
        sent.update({RULE_PREFIX + n: t for n, t in extras.get(cid, {}).items()})
        res.tensors.clear()  # the record below holds the only copy of what is sent
        if faults[cid] in TENSOR_FAULTS:
            sent = corrupt(sent, faults[cid])
        if not deadline.in_time(faults[cid]):
            return None
        arrays = ArrayRecord()  # filled in place: ArrayRecord(dict) costs 4x as much
        for n in list(sent):
            arrays[n] = to_array(sent.pop(n))
        return RecordDict({
            "arrays": arrays,
            "metrics": MetricRecord({"num-examples": examples[cid],
                                     UNIFORM_KEY: _share(spec, cid, examples[cid]),
                                     "train_loss": res.loss, **_dpsgd_round(spec, cid)})})

    extras: dict[int, dict[str, torch.Tensor]] = {}  # what each client's rule sends back
    if spec.rule is None:
        made = train_groups(spec, model, jobs, size, rates, finish=reply, private=True)
    else:
        results = _rule_round(spec, model, jobs, size, rates, for_rule, configs, extras,
                              context)
        made = {cid: reply(cid, res) for cid, res in results.items()}
    replies.update({cid: r for cid, r in made.items() if r is not None})
    return replies


def _rule_round(spec: RunSpec, model, jobs: list[ClientJob], size: int, rates: dict,
                for_rule: dict, configs: dict, extras: dict, context: Context) -> dict:
    """The round of the run's client rule (:mod:`fedadapt.pfl.rule`): each client's result,
    its state kept after the round, what it sends back beside its tensors put in ``extras``."""
    rule = spec.rule
    rnd = {j.cid: int(configs[j.cid]["server-round"]) for j in jobs}
    state = {j.cid: load_rule_state(spec, j.cid, rnd[j.cid] - 1, context) for j in jobs}
    work = RoundWork(
        spec=spec, model=model, jobs=jobs, state=state, rates=rates, train_config=spec.train,
        num_classes=spec.num_classes,
        received={cid: {n[len(RULE_PREFIX):]: t for n, t in arrays.items()}
                  for cid, arrays in for_rule.items()},
        _train=lambda js, train, r: train_groups(
            spec, model, js, 1 if rule.alone_because else size, r, train, private=True),
        send=extras, group_size=1 if rule.alone_because else size)
    results = rule.train_round(work)
    for job in jobs:
        if not isinstance(results.get(job.cid), str) and state[job.cid]:
            keep_rule_state(spec, job.cid, rnd[job.cid], state[job.cid],
                            int(configs[job.cid].get("checkpoint-round", 0)), context)
    return results


def _dpsgd_round(spec: RunSpec, cid: int) -> dict:
    """A DP-SGD client's round for its accounting (``dp=dpsgd``'s mod,
    :class:`fedadapt.strategies.privacy.DPSGDAccounting`): its noise, sample rate, steps and
    delta; {} without DP-SGD."""
    from fedadapt.strategies.privacy import dpsgd_schedule

    if spec.dpsgd is None:
        return {}
    q, steps = dpsgd_schedule(len(spec.clients[cid].train), spec.train.batch_size,
                              spec.train.local_epochs)
    return {"dpsgd_noise": spec.dpsgd.noise[cid], "dpsgd_sample_rate": q, "dpsgd_steps": steps,
            "dpsgd_delta": spec.dpsgd.delta[cid]}


#: The seed stream of the examples a client trains when its work is cut at the deadline.
WORK_SHARE_STREAM = 0x9A27


def _work_share(spec: RunSpec, cid: int, rnd: int, cut) -> "np.ndarray":
    """The training examples client ``cid`` trains in round ``rnd``: all of them, or with
    ``train-examples`` = k below their number (``fleet.partial_work``: its work cut at the
    simulated deadline) a seeded k of them, kept in their order, over its local epochs (the
    share k / n of its work)."""
    indices = spec.clients[cid].train
    if cut is None or not 0 < int(cut) < len(indices):
        return indices
    rng = np.random.default_rng([derive_seed(spec.seed, rnd, cid), WORK_SHARE_STREAM])
    return indices[np.sort(rng.permutation(len(indices))[:int(cut)])]


def _share(spec: RunSpec, cid: int, trained: int) -> float:
    """A client's uniform weight (``method.weighting=uniform``): 1, times the share of its
    examples it trained when its work was cut."""
    total = len(spec.clients[cid].train)
    return 1.0 if trained >= total else trained / total


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
    received = arrays_decoder()
    for cid in records.clients_of(content):
        try:
            start[cid] = {**frozen, **client_tensors(
                spec, model, cid, split_received(received(records.view(content, cid)))[0],
                rnd - 1, context)}
            model.load_tensors(start[cid])
            source, exits = _personal_data(spec, cid)
            before[cid] = local_accuracy(model, spec, spec.clients[cid].test, exits, source)[1]
            jobs.append(ClientJob(cid=cid, indices=spec.clients[cid].train,
                                  tensors=model.tensors(names),
                                  seed=derive_seed(spec.seed, 0xC1, cid),
                                  crop_seed=derive_seed(spec.seed, 0xC2, cid), exits=exits,
                                  source=source))
        except Exception as err:
            replies[cid] = records.error(reason_of(err))
    with only_training(model, names):
        results = train_groups(spec, model, jobs, int(records.packing(content).get(
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
    tensors = client_tensors(spec, model, cid, split_received(arrays_decoder()(content))[0],
                             up_to, context)
    if spec.rule is not None:  # Ditto's personal copy, APFL's mixture
        tensors = spec.rule.evaluated(model, tensors,
                                      load_rule_state(spec, cid, up_to, context))
    model.load_tensors(tensors)
    exits = client_exits(spec, cid)
    loss, acc, n = local_accuracy(model, spec, spec.clients[cid].test, exits)
    # the same keys from every client (Flower checks that); NaN when there is no test data
    metrics = {"num-examples": n, UNIFORM_KEY: 1.0, "accuracy": acc, "loss": loss}
    if spec.evaluate_val:  # model selection by validation accuracy (federation.select)
        metrics["val_accuracy"] = local_accuracy(model, spec, spec.clients[cid].val, exits)[1]
    if spec.client_exits:
        metrics["tier"] = spec.client_exits[cid]
    return RecordDict({"metrics": MetricRecord(metrics)})


def evaluate_clients(spec: RunSpec, msg: Message, context: Context) -> RecordDict:
    """An EVALUATE message: each client's accuracy (:func:`evaluate_one`), through the run's
    evaluate mods with its own context when there are mods."""
    content = msg.content
    if not spec.evaluate_mods:
        return for_each_client(content, lambda cid, mine: evaluate_one(spec, cid, mine, context))
    rnd = int(_shared_config(content).get("server-round", 0))
    contexts, loaded = client_contexts(spec, content, context, rnd)
    out = for_each_client(content, lambda cid, mine: mods.around_one(
        spec.evaluate_mods, mods.as_message(records.own(mine), msg, cid, node_id(cid)),
        contexts[cid],
        lambda m: evaluate_one(spec, cid, m.content, context)))
    keep_contexts(spec, contexts, loaded, rnd, 0)
    return out


__all__ = ["PERSONAL_KEY", "arrays_decoder", "client_tensors", "evaluate_clients",
           "evaluate_one", "keep_personal", "load_personal", "local_accuracy",
           "personalize_clients", "train_clients", "train_views"]
