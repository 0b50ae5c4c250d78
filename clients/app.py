"""The ClientApp: a Flower node that trains, evaluates or serves the clients a message names.

In simulation a node is a worker holding the frozen backbone once and training several clients
side by side; on the deployment engine a node is one client. The handlers below only dispatch;
what a node does lives in :mod:`fedadapt.federation.worker` and the message layout in
:mod:`fedadapt.federation.records` (shared arrays once, per-client records prefixed ``c<id>/``).

What crosses the wire is named: a client's reply holds only the communicated tensors it trained,
by name; personal tensors (a client token, a local-only head, ...) stay on the client
(``<state_dir>/<client>/`` or the deployment client's ``context.state``) and never appear in a
reply.

With ``faults.fraction > 0`` a seeded subset of clients misbehaves each round (raises, sends
NaN, wrong names or shapes, or answers too late) to exercise the server's screening.
"""

from __future__ import annotations

from typing import Callable

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedadapt.federation import mods, records
from fedadapt.federation.faults import TENSOR_FAULTS, corrupt
from fedadapt.federation.training import RunSpec, cached_model, make_optimizer
from fedadapt.federation.worker import (
    PERSONAL_KEY,
    _injected,
    client_exits,
    evaluate_one,
    for_each_client,
    personalize_clients,
    train_clients,
    used_tensors,
)

__all__ = ["PERSONAL_KEY", "make_client_app", "partition_id"]


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def phase_of(content: RecordDict) -> str | None:
    """The message's phase (``config["phase"]`` of its clients; None: the rounds)."""
    clients = records.clients_of(content)
    mine = records.view(content, clients[0]) if clients else content
    config = mine.config_records.get("config")
    return config.get("phase") if config is not None else None


def warm_up(spec: RunSpec) -> None:
    """Build the model, open the data, find which tensors each exit trains, and take one step
    of the configured optimizer on a throwaway tensor (torch's lazy imports take seconds), so
    that round timeouts measure rounds, not start-up."""
    import torch

    from fedadapt.adapters import method_spec

    model = cached_model(spec)
    spec.train_source.labels()
    if method_spec(spec.method).trainer == "clients":  # trained on the clients
        used = used_tensors(spec, model)
        for e in sorted({e for c in range(spec.num_clients)
                         for e in (client_exits(spec, c) or [None])}, key=str):
            used(e)
    p = torch.zeros(1, requires_grad=True)
    opt = make_optimizer([p], spec.train, lr=0.1)
    p.sum().backward()
    opt.step()


def make_client_app(get_spec: Callable[[Context], RunSpec]) -> ClientApp:
    """Build the ClientApp; ``get_spec(context)`` returns the run's :class:`RunSpec`."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        if phase_of(msg.content) == "session-upload":  # session plug-in
            content = for_each_client(msg.content, lambda cid, _: session_upload(spec, cid))
            return Message(content, reply_to=msg)
        warm_up(spec)  # the handshake: which node is this
        return Message(RecordDict({"metrics": MetricRecord(
            {"partition-id": partition_id(context)})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        if phase_of(msg.content) == "personalize":
            return Message(personalize_clients(spec, msg.content, context), reply_to=msg)
        return Message(train_clients(spec, msg, context), reply_to=msg)

    @app.evaluate()
    def evaluate_local(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        phase = phase_of(msg.content)
        if phase == "plugin":  # a server-trained plug-in
            from fedadapt.federation.plugin import recognize

            def one(cid: int, mine: RecordDict) -> RecordDict:
                arrays = dict(mine.array_records["arrays"].to_torch_state_dict())
                return RecordDict({"metrics": MetricRecord(recognize(spec, cid, arrays))})
        elif phase == "session-predict":
            def one(cid: int, mine: RecordDict) -> RecordDict:
                return session_predict(spec, cid, mine)
        else:  # the rounds' evaluation, through the run's evaluate mods
            def one(cid: int, mine: RecordDict) -> RecordDict:
                return mods.apply(spec.evaluate_mods, msg, mine,
                                  evaluate_one(spec, cid, mine, context), context)
        return Message(for_each_client(msg.content, one), reply_to=msg)

    return app


def session_upload(spec: RunSpec, cid: int) -> RecordDict:
    """A session plug-in's first message: one ArrayRecord per test session."""
    from fedadapt.federation.sessions import session_upload as uploads_of

    fault = _injected(spec, 1, cid, "in its session upload")
    uploads, metrics = uploads_of(spec, cid)
    if fault in TENSOR_FAULTS:
        uploads = {name: corrupt(arrays, fault) for name, arrays in uploads.items()}
    elif fault == "timeout":
        return None  # answered too late
    content = RecordDict({"metrics": MetricRecord(metrics)})
    for name, arrays in uploads.items():
        content[name] = ArrayRecord(arrays)
    return content


def session_predict(spec: RunSpec, cid: int, mine: RecordDict) -> RecordDict:
    """A session plug-in's second message: every session predicted with its generated layers."""
    from fedadapt.federation.sessions import session_predict as predict

    arrays = {k: dict(v.to_torch_state_dict()) for k, v in mine.array_records.items()}
    metrics, scores = predict(spec, cid, arrays)
    content = RecordDict({"metrics": MetricRecord(metrics)})
    if scores is not None:
        content["scores"] = ArrayRecord(scores)
    return content
