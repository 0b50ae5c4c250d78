"""Run a plan with every client in this process: no Ray, no simulation engine. The server code
(:func:`fedadapt.federation.server.loop.execute_plan`) and the ClientApp are the real ones;
messages are copied on the way there and back, as a transport would, and every exchange can be
watched (``on_reply``).

``federation.backend=inprocess`` runs a simulation this way
(:func:`fedadapt.methods.run.simulation`): the simulation's layout with no Ray start-up, no
actor processes and no engine polling between the server and the workers (docs/speed.md). One
worker has every free core, unless the model trains whole on the CPU and the round gives each
worker two clients or more: then each free core is a worker of its own, with one torch thread,
and the workers train at once, each on its own thread (``ServerPlan.workers_at_once``:
:func:`fedadapt.methods.run.node_layout` says when); a ``federation.workers`` set by hand takes
turns.

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
from concurrent.futures import ThreadPoolExecutor, wait
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
    late one would be.

    ``at_once``: the nodes (the simulation's workers) serve their messages at the same time,
    each on a thread of its own, as Ray's worker processes would; each thread keeps its own
    client model (:func:`fedadapt.federation.client.training.cached_model`). Otherwise they take
    turns in this thread. Either way the replies come back in the messages' order."""

    def __init__(self, client_app, num_nodes: int, *, on_reply: Optional[OnReply] = None,
                 first_node_id: int = 1001, at_once: bool = False) -> None:
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
        #: one thread per node (its own, every round: its model stays on it), made on first use
        self.threads: Optional[dict[int, ThreadPoolExecutor]] = {} if at_once else None

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: Optional[float] = None) -> list[Message]:
        messages = list(messages)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        server_threads = torch.get_num_threads()
        if self.client_threads is not None:
            torch.set_num_threads(self.client_threads)
        try:  # torch's threads are the process's: the clients', then the server's again
            if self.threads is None or len(messages) < 2:
                served = [self._serve(msg, timeout) for msg in messages]
            else:
                served = self._at_once(messages, timeout)
        finally:  # as two processes would: the clients' threads and the server's own
            self.client_threads = torch.get_num_threads()
            torch.set_num_threads(server_threads)
        replies = []
        for msg, reply in zip(messages, served):
            if reply is None:
                continue  # too late: the server never sees it
            reply = transport_copy(reply)
            if self.on_reply is not None:
                self.on_reply(msg, reply, self.contexts[msg.metadata.dst_node_id])
            replies.append(reply)
        return replies

    def _serve(self, msg: Message, timeout: Optional[float]) -> Optional[Message]:
        """The node's reply to ``msg``; None when it came later than ``timeout``."""
        context = self.contexts[msg.metadata.dst_node_id]
        t0 = time.monotonic()
        try:
            reply = self.app(transport_copy(msg), context)
        except Exception as err:  # as the engines report a raising ClientApp
            reply = Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)
        return None if timeout is not None and time.monotonic() - t0 > timeout else reply

    def _at_once(self, messages: list[Message], timeout: Optional[float]) -> list:
        """Each message served on its node's thread, all at the same time. Every one is waited
        for, even when the server is stopped meanwhile (a signal): no thread outlives the
        exchange with a node's model half-trained."""
        futures = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.threads:  # torch's own set-up of a new thread first (it
                # takes the threads last set anywhere), so that the client's pin holds on it
                self.threads[node] = ThreadPoolExecutor(1, thread_name_prefix=f"worker-{node}",
                                                        initializer=torch.get_num_threads)
            futures.append(self.threads[node].submit(self._serve, msg, timeout))
        try:
            return [f.result() for f in futures]
        finally:
            wait(futures)

    def close(self) -> None:
        """End the nodes' threads (each after its message)."""
        for pool in (self.threads or {}).values():
            pool.shutdown(wait=True)


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
    """Execute ``plan`` against ``plan.num_nodes`` in-process nodes; the final state. The
    simulation's workers serve at once when the plan says so (``plan.workers_at_once``)."""
    threads = torch.get_num_threads()  # a client pins its process's threads: this one's
    flwr_logger = logging.getLogger("flwr")
    level = flwr_logger.level
    flwr_logger.setLevel(logging.WARNING)  # as on the simulation engine (federation.verbose)
    grid = InProcessGrid(client_app, plan.num_nodes, on_reply=on_reply,
                         at_once=plan.workers_at_once and plan.nodes == "workers")
    try:
        with _task_identity():
            return execute_plan(grid, plan)
    finally:
        grid.close()
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
