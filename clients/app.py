"""The ClientApp: trains and evaluates one simulated client.

What crosses the wire is named: the reply's ``ArrayRecord`` holds only the communicated
trainable tensors, by name; personal tensors (a client token, a local-only head, ...) live in
``context.state`` under ``personal`` and never appear in a reply.
"""

from __future__ import annotations

from typing import Callable

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedadapt.federation.training import (
    RunSpec,
    cached_model,
    derive_seed,
    evaluate,
    train_local,
)

PERSONAL_KEY = "personal"


def partition_id(context: Context) -> int:
    return int(context.node_config["partition-id"])


def load_client_model(spec: RunSpec, msg: Message, context: Context):
    """The process's model with this client's tensors: communicated from the message, personal
    from ``context.state`` (or the seeded initial values the first time)."""
    model = cached_model(spec)
    arrays = msg.content.array_records.get("arrays")
    expected = set(model.communicated_names())
    received = dict(arrays.to_torch_state_dict()) if arrays is not None else {}
    if set(received) != expected:
        raise ValueError(f"server sent tensors {sorted(received)[:4]}..., expected "
                         f"{sorted(expected)[:4]}...")
    personal_names = model.personal_names()
    if personal_names:
        if PERSONAL_KEY in context.state.array_records:
            personal = dict(context.state.array_records[PERSONAL_KEY].to_torch_state_dict())
        else:  # first visit: the run's seeded initial values
            from fedadapt.federation.training import build_run_model

            personal = build_run_model(spec).tensors(personal_names)
        received.update(personal)
    model.load_tensors(received)
    return model


def make_client_app(get_spec: Callable[[Context], RunSpec]) -> ClientApp:
    """Build the ClientApp; ``get_spec(context)`` returns the run's :class:`RunSpec`."""
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        """Handshake: tell the server which partition this node holds."""
        return Message(RecordDict({"metrics": MetricRecord(
            {"partition-id": partition_id(context)})}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        cid = partition_id(context)
        config = msg.content.config_records["config"]
        rnd = int(config["server-round"])
        model = load_client_model(spec, msg, context)
        loss, seen = train_local(
            model, spec.train_source, spec.clients[cid].train, spec.train,
            lr=float(config["lr"]), seed=derive_seed(spec.seed, rnd, cid),
            proximal_mu=float(config.get("proximal-mu", 0.0)))
        personal = model.personal_names()
        if personal:
            context.state[PERSONAL_KEY] = ArrayRecord(model.tensors(personal))
        content = RecordDict({
            "arrays": ArrayRecord(model.tensors(model.communicated_names())),
            "metrics": MetricRecord({"num-examples": len(spec.clients[cid].train),
                                     "train_loss": loss}),
        })
        return Message(content, reply_to=msg)

    @app.evaluate()
    def evaluate_local(msg: Message, context: Context) -> Message:
        spec = get_spec(context)
        cid = partition_id(context)
        model = load_client_model(spec, msg, context)
        loss, acc, n = evaluate(model, spec.train_source, spec.clients[cid].test)
        metrics = {"num-examples": n}
        if n:
            metrics.update({"accuracy": acc, "loss": loss})
        return Message(RecordDict({"metrics": MetricRecord(metrics)}), reply_to=msg)

    return app
