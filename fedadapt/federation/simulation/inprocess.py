"""Run a plan with every client in this process, one message at a time: no Ray, no simulation
engine. The server code (:func:`fedadapt.federation.server.loop.execute_plan`) and the ClientApp are
the real ones; messages are copied on the way there and back, as a transport would, and every
exchange can be watched (``on_reply``).

``federation.backend=inprocess`` runs a simulation this way
(:func:`fedadapt.methods.run.simulation`): the simulation's layout, its workers taking turns in
this process (one worker with every CPU unless ``federation.workers`` says otherwise), with no
Ray start-up, no actor processes and no engine polling between the server and the workers
(docs/speed.md).

Usage: ``run_experiment(cfg, run_dir, config_yaml=..., execute=run_in_process)``: one node per
client, as on the deployment engine; ``execute=in_process(nodes="workers")``: the simulation's
layout (workers that train the clients a message names, ``federation.clients_per_worker`` side
by side).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
import uuid
from typing import Callable, Iterable, Iterator, Optional

import torch
from flwr.app import ArrayRecord, Context, Error, Message, RecordDict

from fedadapt.federation.server.loop import ServerPlan, ServerState, execute_plan

#: ``on_reply(sent, reply, context)``: called for every exchange, ``context`` being the
#: replying node's (its ``state`` as the ClientApp left it).
OnReply = Callable[[Message, Message, Context], None]


def transport_copy(msg: Message) -> Message:
    """A copy of ``msg`` as the other side of a transport gets it: every record and the message
    itself new, the arrays' ``Array`` objects shared (their fields are strings, a tuple and the
    bytes, which a deep copy shares too; copying the objects around them was half the copy's
    cost: 260 us a reply of 10 clients' linear heads)."""
    keep = {id(a): a for record in msg.content.values() if isinstance(record, ArrayRecord)
            for a in record.values()} if msg.has_content() else {}
    return copy.deepcopy(msg, keep)


class InProcessGrid:
    """The part of Flower's ``Grid`` the server uses, with one ClientApp per node called in this
    process. Node ids are not partition ids (the server learns the mapping in its handshake, as
    on Flower's engines). A reply that took longer than the call's ``timeout`` is dropped, as a
    late one would be."""

    def __init__(self, client_app, num_nodes: int, *, on_reply: Optional[OnReply] = None,
                 first_node_id: int = 1001) -> None:
        self.app = client_app
        self.on_reply = on_reply
        #: torch's threads as the clients left them (a worker pins them once: a process of
        #: its own would keep them), set around each call; the server keeps its own
        self.client_threads: Optional[int] = None
        self.contexts = {
            first_node_id + 7 * cid: Context(run_id=1, node_id=first_node_id + 7 * cid,
                                             node_config={"partition-id": cid,
                                                          "num-partitions": num_nodes},
                                             state=RecordDict(), run_config={})
            for cid in range(num_nodes)}

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: Optional[float] = None) -> list[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            context = self.contexts[msg.metadata.dst_node_id]
            t0 = time.monotonic()
            server_threads = torch.get_num_threads()
            if self.client_threads is not None:
                torch.set_num_threads(self.client_threads)
            try:
                reply = self.app(transport_copy(msg), context)
            except Exception as err:  # as the engines report a raising ClientApp
                reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"),
                                reply_to=msg)
            finally:  # as two processes would: the clients' threads and the server's own
                self.client_threads = torch.get_num_threads()
                torch.set_num_threads(server_threads)
            if timeout is not None and time.monotonic() - t0 > timeout:
                continue  # too late: the server never sees it
            reply = transport_copy(reply)
            if self.on_reply is not None:
                self.on_reply(msg, reply, context)
            replies.append(reply)
        return replies


@contextlib.contextmanager
def _task_identity() -> Iterator[None]:
    """Flower builds a Message only inside a run: give this process one while the plan runs."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    if saved[0] is None:
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def run_in_process(plan: ServerPlan, client_app, *,
                   on_reply: Optional[OnReply] = None) -> ServerState:
    """Execute ``plan`` against ``plan.num_nodes`` in-process nodes; the final state."""
    threads = torch.get_num_threads()  # a client pins its process's threads: this one's
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)  # as on the simulation engine (federation.verbose)
    try:
        with _task_identity():
            return execute_plan(InProcessGrid(client_app, plan.num_nodes, on_reply=on_reply),
                                plan)
    finally:
        torch.set_num_threads(threads)
        flwr_logger.setLevel(level)


def in_process(nodes: str = "clients", on_reply: Optional[OnReply] = None) -> Callable:
    """An ``execute`` for :func:`fedadapt.experiment.run_experiment` that runs in this process
    with ``nodes`` as the Flower nodes: ``clients`` (one per client) or ``workers`` (the
    simulation's workers and their grouping)."""
    def execute(plan: ServerPlan, client_app) -> ServerState:
        return run_in_process(plan, client_app, on_reply=on_reply)

    execute.nodes = nodes
    return execute
