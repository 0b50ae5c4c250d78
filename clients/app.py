"""The ClientApp: a Flower node that trains, evaluates or serves the clients a message names.

In simulation a node is a worker holding the frozen backbone once and training several clients
side by side; on the deployment engine a node is one client. The handlers below only dispatch;
what a node does lives in its method family (:mod:`fedadapt.methods`; the rounds family's in
:mod:`fedadapt.methods.rounds.clients`) and :mod:`fedadapt.federation.client.worker`, the message
layout in :mod:`fedadapt.federation.wire.records` (shared arrays once, per-client records prefixed
``c<id>/``).

What crosses the wire is named: a client's reply holds only the communicated tensors it trained,
by name; personal tensors (a client token, a local-only head, ...) stay on the client
(``<state_dir>/<client>/`` or the deployment client's ``context.state``) and never appear in a
reply.

With ``faults.fraction > 0`` a seeded subset of clients misbehaves each round (raises, sends
NaN, wrong names or shapes, or answers too late) to exercise the server's screening.
"""

from __future__ import annotations

from typing import Callable

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedadapt.federation.client.secagg import secagg_mod
from fedadapt.federation.client.training import RunSpec, cached_model, local_optimizer
from fedadapt.federation.wire import records
from fedadapt.methods import client_handler, family_of

__all__ = ["make_client_app", "partition_id"]


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def phase_of(content: RecordDict) -> str | None:
    """The message's phase (``config["phase"]`` of its clients; None: the rounds)."""
    clients = records.clients_of(content)
    mine = records.view(content, clients[0]) if clients else content
    config = mine.config_records.get("config")
    return config.get("phase") if config is not None else None


def warm_up(spec: RunSpec) -> None:
    """Build the model, open the data, let the method's family warm up (the rounds: which
    tensors each exit trains), and take one step of the local optimizer on a throwaway tensor
    (a ``torch.optim`` optimizer's first use imports ``torch._dynamo``, about 2 s here), so that
    round timeouts measure rounds, not start-up. Plain SGD (:class:`PlainSGD`) never uses
    ``torch.optim``, and so never pays that import."""
    import torch

    model = cached_model(spec)
    spec.train_source.labels()
    family_of(spec.method).warm_up(spec, model)
    p = torch.zeros(1, requires_grad=True)
    opt = local_optimizer([p], spec.train, lr=0.1)
    p.sum().backward()
    opt.step()


def make_client_app(get_spec: Callable[[Context], RunSpec]) -> ClientApp:
    """Build the ClientApp; ``get_spec(context)`` returns the run's :class:`RunSpec`. Every
    message goes to the handler its method family registered for its type and phase
    (:func:`fedadapt.methods.client_handler`); a query without a phase is the handshake."""
    from fedadapt.progress import quiet_libraries

    app = ClientApp()

    def reply(kind: str, msg: Message, context: Context) -> Message:
        quiet_libraries()  # here, in the node's own process (a Ray worker): once per process
        spec = get_spec(context)
        phase = phase_of(msg.content)
        if kind == "query" and phase is None:  # the handshake: which node is this
            warm_up(spec)
            return Message(RecordDict({"metrics": MetricRecord(
                {"partition-id": partition_id(context)})}), reply_to=msg)
        return Message(client_handler(kind, phase)(spec, msg, context), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return reply("query", msg, context)

    # secagg=secaggplus: Flower's secaggplus_mod (SecAgg+'s messages only; every other message
    # passes through unchanged)
    @app.train(mods=[secagg_mod])
    def train(msg: Message, context: Context) -> Message:
        return reply("train", msg, context)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        return reply("evaluate", msg, context)

    return app
