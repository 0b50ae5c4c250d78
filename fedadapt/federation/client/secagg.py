"""The client's side of ``secagg=secaggplus``: Flower's ``secaggplus_mod`` around fedadapt's
ClientApp (see :mod:`fedadapt.federation.server.secagg` for the protocol and why it runs
through Flower's legacy workflow).

:func:`secagg_mod` is the ClientApp's train mod. A message without SecAgg+'s config record
(``secaggplus_configs``: every message of a run with ``secagg=none``) passes straight through,
as if there were no mod. A SecAgg+ message goes to Flower's ``secaggplus_mod``, which answers
the protocol's stages itself and, at the stage that collects the masked vectors, asks the
ClientApp to train: :func:`_train_as_fitres` gives fedadapt's train handler the message it
knows (the global tensors by name, the round's config, this node's one client) and returns its
reply as the legacy ``FitRes`` the mod quantises and masks (the parameters in the order the
server named them, ``num_examples``, ``train_loss``). A client that fails to train raises, and
the server counts it as dropped out at that stage.
"""

from __future__ import annotations

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat

from fedadapt.codec import record
from fedadapt.federation.server.secagg import NAMES_KEY
from fedadapt.federation.wire import records

__all__ = ["secagg_mod"]


def secagg_mod(msg: Message, context: Context, call_next) -> Message:
    """Flower's ``secaggplus_mod`` for SecAgg+'s messages; every other message unchanged."""
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content:
        return call_next(msg, context)
    return secaggplus_mod(msg, context,
                          lambda inner, ctxt: _train_as_fitres(inner, ctxt, call_next))


def _train_as_fitres(msg: Message, context: Context, call_next) -> Message:
    """The legacy ``FitIns`` the workflow sent, trained by fedadapt's handler as this node's
    client; its reply as a legacy ``FitRes``."""
    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = dict(fitins.config)
    names = str(config.pop(NAMES_KEY)).split("\n")
    tensors = parameters_to_ndarrays(fitins.parameters)
    if len(tensors) != len(names):
        raise ValueError(f"SecAgg+'s fit instructions hold {len(tensors)} tensors for "
                         f"{len(names)} names")
    cid = int(context.node_config["partition-id"])
    arrays = ArrayRecord()
    for name, tensor in zip(names, tensors):
        arrays[name] = Array(tensor)
    content = RecordDict({
        "arrays": arrays, "config": ConfigRecord(config),
        records.GRID: ConfigRecord({records.CLIENTS: [cid], "group-size": 1,
                                    "nodes": "clients", records.TIMEOUT: 0.0})})
    original = msg.content
    msg.content = content
    try:
        reply = call_next(msg, context)
    finally:
        msg.content = original
    if reply.has_error():
        raise RuntimeError(reply.error.reason)
    mine = records.unpack(reply.content).get(cid)
    if mine is None:
        raise RuntimeError(f"client {cid} sent no reply")
    reason = records.error_of(mine)
    if reason is not None:
        raise RuntimeError(reason)
    trained = record(mine, ArrayRecord, "arrays")
    if trained is None or list(trained.keys()) != names:
        sent = [] if trained is None else list(trained.keys())
        raise ValueError(f"client {cid} sent {len(sent)} tensors, SecAgg+ sums the "
                         f"{len(names)} global ones in order")
    metrics = mine.metric_records["metrics"]
    fitres = FitRes(status=Status(code=Code.OK, message=""),
                    parameters=ndarrays_to_parameters([trained[n].numpy() for n in names]),
                    num_examples=int(metrics["num-examples"]),
                    metrics={"train_loss": float(metrics["train_loss"])})
    return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)
