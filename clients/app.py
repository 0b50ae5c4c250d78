"""The ClientApp: trains and evaluates one simulated client.

What crosses the wire is named: the reply's ``ArrayRecord`` holds only the communicated
trainable tensors, by name; personal tensors (a client token, a local-only head, ...) live in
``context.state`` under ``personal`` and never appear in a reply. When the run has a state
folder, the client also saves them there after each round (its own disk), so a resumed run
picks them up; see :mod:`fedadapt.federation.checkpoint`.

With ``faults.fraction > 0`` a seeded subset of clients misbehaves each round (raises, sends
NaN, wrong names or shapes, or answers too late) to exercise the server's screening.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from fedadapt.strategies.fedavg import UNIFORM_KEY
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedadapt.federation.checkpoint import load_client_state, save_client_state
from fedadapt.federation.faults import TENSOR_FAULTS, corrupt, injected_fault
from fedadapt.federation.training import (
    RunSpec,
    cached_model,
    derive_seed,
    evaluate,
    evaluate_exits,
    initial_personal,
    train_local,
)
from fedadapt.settings import only_training, part_names, step_exits

PERSONAL_KEY = "personal"


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def _state_dir(spec: RunSpec, cid: int):
    return Path(spec.state_dir) / str(cid) if spec.state_dir else None


def load_client_model(spec: RunSpec, msg: Message, context: Context):
    """The process's model with this client's tensors: communicated from the message, personal
    from ``context.state``; on a first visit from the client's saved state of a resumed run
    (rounds up to ``resume-round``), else the seeded initial values."""
    model = cached_model(spec)
    arrays = msg.content.array_records.get("arrays")
    expected = set(model.communicated_names())
    received = dict(arrays.to_torch_state_dict()) if arrays is not None else {}
    if set(received) != expected:
        raise ValueError(f"server sent tensors {sorted(received)[:4]}..., expected "
                         f"{sorted(expected)[:4]}...")
    personal_names = model.personal_names()
    if personal_names:
        config = msg.content.config_records.get("config")
        resume_round = int(config.get("resume-round", 0)) if config is not None else 0
        folder = _state_dir(spec, partition_id(context))
        if PERSONAL_KEY in context.state.array_records:
            personal = dict(context.state.array_records[PERSONAL_KEY].to_torch_state_dict())
        elif folder is not None and (saved := load_client_state(folder, resume_round)):
            personal = saved
        else:  # first visit: the run's seeded initial values
            personal = initial_personal(spec)
        received.update(personal)
    if set(received) != set(model.trainable_names()):  # nothing left from the previous client
        missing = sorted(set(model.trainable_names()) - set(received))
        raise ValueError(f"client {partition_id(context)}: no values for {missing[:4]}")
    model.load_tensors(received)
    return model


def warm_up_optimizer(train) -> None:
    """One step of the configured optimizer on a throwaway tensor: the first step in a process
    pulls in torch's lazy imports (seconds), which must not count against a round timeout."""
    import torch

    from fedadapt.federation.training import make_optimizer

    p = torch.zeros(1, requires_grad=True)
    opt = make_optimizer([p], train, lr=0.1)
    p.sum().backward()
    opt.step()


def make_client_app(get_spec: Callable[[Context], RunSpec]) -> ClientApp:
    """Build the ClientApp; ``get_spec(context)`` returns the run's :class:`RunSpec`."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """Handshake: tell the server which partition this node holds, after warming up (build
        the model, open the data), so that round timeouts measure rounds, not start-up."""
        spec = get_spec(context)
        config = msg.content.config_records.get("config")
        if config is not None and config.get("phase") == "session-upload":  # session plug-in
            from fedadapt.federation.sessions import session_upload

            cid = partition_id(context)
            fault = _injected(spec, 1, cid, "in its session upload")
            uploads, metrics = session_upload(spec, cid)
            if fault in TENSOR_FAULTS:
                uploads = {name: corrupt(arrays, fault) for name, arrays in uploads.items()}
            elif fault == "timeout":
                _sleep_past_timeout(spec, config)
            content = RecordDict({"metrics": MetricRecord(metrics)})
            for name, arrays in uploads.items():
                content[name] = ArrayRecord(arrays)
            return Message(content, reply_to=msg)
        cached_model(spec)
        spec.train_source.labels()
        warm_up_optimizer(spec.train)
        return Message(RecordDict({"metrics": MetricRecord(
            {"partition-id": partition_id(context)})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        cid = partition_id(context)
        config = msg.content.config_records["config"]
        if config.get("phase") == "personalize":
            return personalize(spec, cid, msg, context)
        rnd = int(config["server-round"])
        fault = _injected(spec, rnd, cid, f"in round {rnd}")
        model = load_client_model(spec, msg, context)
        loss, seen = train_local(
            model, spec.train_source, spec.clients[cid].train, spec.train,
            lr=float(config["lr"]), seed=derive_seed(spec.seed, rnd, cid),
            proximal_mu=float(config.get("proximal-mu", 0.0)), exits=client_step_exits(spec, cid),
            crop_seed=derive_seed(spec.seed, rnd, cid, 7), precision=spec.precision)
        personal = model.personal_names()
        if personal:
            tensors = model.tensors(personal)
            context.state[PERSONAL_KEY] = ArrayRecord(tensors)
            if (folder := _state_dir(spec, cid)) is not None:
                save_client_state(folder, rnd, tensors, int(config.get("checkpoint-round", 0)))
        sent = model.tensors(model.communicated_names())
        if fault in TENSOR_FAULTS:
            sent = corrupt(sent, fault)
        elif fault == "timeout":
            _sleep_past_timeout(spec, config)
        content = RecordDict({
            "arrays": ArrayRecord(sent),
            "metrics": MetricRecord({"num-examples": len(spec.clients[cid].train),
                                     UNIFORM_KEY: 1.0, "train_loss": loss}),
        })
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate_local(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        cid = partition_id(context)
        config = msg.content.config_records.get("config")
        if config is not None and config.get("phase") == "plugin":  # a server-trained plug-in
            from fedadapt.federation.plugin import recognize

            arrays = dict(msg.content.array_records["arrays"].to_torch_state_dict())
            return Message(RecordDict({"metrics": MetricRecord(recognize(spec, cid, arrays))}),
                           reply_to=msg)
        if config is not None and config.get("phase") == "session-predict":
            from fedadapt.federation.sessions import session_predict

            arrays = {k: dict(v.to_torch_state_dict())
                      for k, v in msg.content.array_records.items()}
            metrics, scores = session_predict(spec, cid, arrays)
            content = RecordDict({"metrics": MetricRecord(metrics)})
            if scores is not None:
                content["scores"] = ArrayRecord(scores)
            return Message(content, reply_to=msg)
        model = load_client_model(spec, msg, context)
        exits = client_step_exits(spec, cid)
        loss, acc, n = local_accuracy(model, spec, cid, spec.clients[cid].test, exits)
        # The same keys from every client (Flower checks that); NaN when there is no test data.
        metrics = {"num-examples": n, "accuracy": acc, "loss": loss}
        if spec.evaluate_val:  # model selection by validation accuracy (federation.select)
            metrics["val_accuracy"] = local_accuracy(model, spec, cid, spec.clients[cid].val,
                                                     exits)[1]
        if spec.client_exits:
            metrics["tier"] = spec.client_exits[cid]
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app


def _injected(spec: RunSpec, server_round: int, cid: int, where: str) -> Optional[str]:
    """The seeded fault this client injects (``faults.*``); a ``raise`` fault raises here."""
    fault = injected_fault(spec.seed, server_round, cid, spec.faults.fraction, spec.faults.kinds)
    if fault == "raise":
        raise RuntimeError(f"injected fault (faults.fraction={spec.faults.fraction}): "
                           f"client {cid} raises {where}")
    return fault


def _sleep_past_timeout(spec: RunSpec, config) -> None:
    """A ``timeout`` fault: reply after ``faults.delay_s``, or after the round's timeout."""
    time.sleep(spec.faults.delay_s or float(config.get("round-timeout", 0)) + 2.0)


def local_accuracy(model, spec: RunSpec, cid: int, indices, exits, source=None):
    """(loss, accuracy, n) of the client's model on ``indices`` of its data; with ``exits``
    the mean over them (anytime: all; multi-tier: its tier)."""
    source = spec.train_source if source is None else source
    if exits is None:
        return evaluate(model, source, indices, precision=spec.precision)
    losses, accs, n = evaluate_exits(model, source, exits, indices, precision=spec.precision)
    return sum(losses) / len(losses), sum(accs) / len(accs), n


def client_step_exits(spec: RunSpec, cid: int):
    if not spec.num_exits:  # a model without exits (its own forward), whatever the setting
        return None
    exit_of = spec.client_exits[cid] if spec.client_exits else 0
    return step_exits(spec.setting, exit_of, spec.num_exits)


def personalize(spec: RunSpec, cid: int, msg: Message, context: Context) -> Message:
    """The personalization step: from the global model, fine-tune ``setting.personalize`` for
    ``setting.epochs`` epochs on this client's (corrupted, if it has a corruption) training split
    at its tier's exit (if the model has exits); accuracy on its test split before and after.
    The personalized tensors stay here (``<state_dir>/<client>/personalized/``); the reply
    carries metrics only."""
    from dataclasses import replace

    st = spec.setting
    model = load_client_model(spec, msg, context)
    kind, severity = spec.client_corruptions[cid] if spec.client_corruptions else ("none", 0)
    source = spec.train_source
    if severity > 0:
        source = source.corrupted(kind, severity, derive_seed(spec.seed, 0xC0, cid))
    split = spec.clients[cid]
    tier = spec.client_exits[cid] if spec.client_exits else None  # None: a model without exits
    exits = None if tier is None else [tier]
    _, before, _ = local_accuracy(model, spec, cid, split.test, exits, source)
    names = part_names(model, st.personalize)
    # The process's model is shared by the clients it runs: frozen tensors this step changes
    # (setting.personalize=full) are put back afterwards.
    frozen = model.tensors(sorted(set(names) - set(model.trainable_names())))
    train = replace(spec.train, local_epochs=st.epochs, lr=st.lr or spec.train.lr)
    with only_training(model, names):
        loss, _ = train_local(model, source, split.train, train, lr=train.lr,
                              seed=derive_seed(spec.seed, 0xC1, cid), exits=exits,
                              crop_seed=derive_seed(spec.seed, 0xC2, cid),
                              precision=spec.precision)
    tensors = model.tensors(names)
    _, after, n = local_accuracy(model, spec, cid, split.test, exits, source)
    model.load_tensors(frozen)
    if (folder := _state_dir(spec, cid)) is not None:
        save_client_state(folder / "personalized", int(msg.content.config_records["config"]
                                                        ["server-round"]), tensors)
    metrics = {"num-examples": n, "tier": -1 if tier is None else tier, "severity": severity,
               "acc_before": before, "acc_after": after,
               "train_loss": loss, "personalized_params": sum(t.numel() for t in
                                                               tensors.values())}
    return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)
