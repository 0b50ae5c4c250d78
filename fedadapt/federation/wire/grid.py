"""The grid a Flower strategy sees: one node per client, the workers underneath.

In simulation a Flower node is a *worker* that trains many clients side by side; on the
deployment engine a node is one client. A strategy must see neither: :class:`ClientGrid` is a
Flower ``Grid`` whose ``get_node_ids()`` lists one node per client (:func:`node_id`, stable
across runs and resumes: the partition id plus :data:`NODE_BASE`), in partition order, and whose
``send_and_receive`` takes the strategy's messages, one per client, and

* packs the messages for the clients of one worker into one Flower message
  (:mod:`fedadapt.federation.wire.records`): a record that every one of those messages holds (the
  same object: FedAvg sends one RecordDict to all) travels once, the rest under each client's
  prefix;
* unpacks each worker's reply into one reply ``Message`` per client, from that client's node:
  its content, or an error carrying its own failure (a worker message that failed as a whole
  gives each of its clients that error); a client that did not answer in time gets no reply,
  as on Flower's own grids. In simulation the worker judges that per client (the packing
  record carries the timeout; :class:`fedadapt.federation.client.worker.Deadline`): it replies at
  the timeout without the late ones, so its other clients are not lost with them, and the worker's
  own message is given :data:`TRANSPORT_GRACE_S` more to travel back;
* counts the bytes each client would send and receive on a real device
  (:meth:`ClientGrid.take_bytes`): the arrays addressed to it, restricted to the tensors it
  trains when the server says which (:attr:`ClientGrid.trained`), although a worker receives
  shared arrays once.

Nothing here costs per registered client per exchange: the node list is built once, and an
exchange touches only the clients it addresses.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from fedadapt.codec import RULE_PREFIX
from fedadapt.federation.wire import records

#: A client's node id is its partition id plus this: readable, and never a real node's.
NODE_BASE = 1_000_000_000
#: Clients per worker message when the clients' records are their own (each holds its own
#: copy of arrays): larger messages would hold too many copies at once.
CHUNK = 32
#: Seconds a simulated worker's reply may take past the round's timeout to reach the server: the
#: worker itself leaves out the clients that were late (a worker that does not answer at all is
#: dropped, with all its clients, this long after the timeout).
TRANSPORT_GRACE_S = 2.0


def node_id(cid: int) -> int:
    return NODE_BASE + cid


@dataclass
class Nodes:
    """The Flower nodes: ``workers`` (simulation: a message names the clients a worker trains)
    or ``clients`` (deployment: one node per client). ``node_ids`` maps each node's
    ``partition-id`` to its node id."""

    kind: str
    node_ids: dict[int, int]
    #: ``work(cid)``: what a client brings to a round (its training examples); the workers'
    #: shares are balanced by it. None: the clients split evenly by count.
    work: Optional[Callable[[int], float]] = None

    def assign(self, cids: list[int], per_message: Optional[int] = None
               ) -> list[tuple[int, list[int]]]:
        """``(node id, clients)`` of each message: one per client on the deployment engine;
        in simulation the clients split over the workers, by :attr:`work` when it is known
        (:meth:`balanced`), else evenly and in order (at most ``per_message`` clients a
        message)."""
        if self.kind == "clients":
            return [(self.node_ids[p], [p]) for p in cids]
        workers = sorted(self.node_ids)
        if self.work is not None and per_message is None and len(workers) > 1:
            return self.balanced(cids, workers)
        n = len(cids)
        chunks = len(workers) if per_message is None else max(
            len(workers), -(-n // per_message))
        bounds = [round(i * n / chunks) for i in range(chunks + 1)]
        return [(self.node_ids[workers[i % len(workers)]], cids[a:b])
                for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]


    def balanced(self, cids: list[int], workers: list[int]) -> list[tuple[int, list[int]]]:
        """The round's work spread over the workers, which train at once, so that the last
        to finish has as little as can be: the largest client first, each to the worker with
        the least work so far (ties: the lower one), each worker's clients then in the
        round's order. Fashion-MNIST's Dirichlet(0.5) partition of 1,000 clients, 10 a round,
        two workers (benchmarks/investigations/peer_pfl.py's W1): over 60 rounds the busier
        worker held 239.8 examples on average split in order, 217.8 balanced (half the round:
        214.1)."""
        loads = [0.0] * len(workers)
        shares: list[list[int]] = [[] for _ in workers]
        for cid in sorted(cids, key=lambda c: (-self.work(c), c)):
            i = min(range(len(workers)), key=lambda j: (loads[j], j))
            shares[i].append(cid)
            loads[i] += self.work(cid)
        place = {cid: k for k, cid in enumerate(cids)}
        return [(self.node_ids[workers[i]], sorted(share, key=place.__getitem__))
                for i, share in enumerate(shares) if share]


def wait_for_nodes(grid, n: int, timeout: float = 300.0) -> list[int]:
    """Block until ``n`` nodes are connected (the ServerApp may start before they register)."""
    deadline = time.time() + timeout
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.time() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {n} nodes connected within {timeout} s")
        time.sleep(0.1)


def handshake(grid, n: int) -> dict[int, int]:
    """Ask every node for its partition id (once per run); return ``{partition_id: node_id}``.
    The nodes warm up first (model, data), so round timeouts measure rounds, not start-up."""
    nodes = wait_for_nodes(grid, n)
    msgs = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=nid,
                    message_type=MessageType.QUERY) for nid in nodes]
    mapping = {}
    for reply in grid.send_and_receive(msgs):
        if reply.has_error():
            raise RuntimeError(f"handshake failed on node {reply.metadata.src_node_id}: "
                               f"{reply.error.reason}")
        cid = int(reply.content.metric_records["metrics"]["partition-id"])
        mapping[cid] = reply.metadata.src_node_id
    if sorted(mapping) != list(range(n)):
        raise RuntimeError(f"handshake: partitions {sorted(mapping)} != 0..{n - 1}")
    return mapping


def _set_id(msg: Message) -> str:
    msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # as Flower's own grids do
    return msg.metadata.message_id


class ClientGrid(Grid):
    """One node per client over ``grid``'s nodes (see the module docstring)."""

    def __init__(self, grid, nodes: Nodes, num_clients: int, *, group_size: int = 1) -> None:
        self._grid = grid
        self.nodes = nodes
        self.num_clients = num_clients
        self.group_size = group_size
        self._ids = [node_id(p) for p in range(num_clients)]
        #: The clients a strategy may sample now (None: all; see :meth:`get_node_ids`).
        self.only: Optional[set[int]] = None
        #: ``trained(cid)``: the tensors a client trains; its arrays are counted restricted to
        #: them (and, on the deployment engine, sent so). None: every tensor it is sent.
        self.trained: Optional[Callable[[int], list[str]]] = None
        self._down: dict[int, int] = {}
        self._up: dict[int, int] = {}
        self._served: dict[str, int] = {}
        self._sizes: dict[tuple, int] = {}
        self._pending: dict[str, Message] = {}
        self._replies: dict[str, Message] = {}
        self._run = None

    # -- Flower's Grid ----------------------------------------------------------------------
    def set_run(self, run) -> None:
        self._run = run

    @property
    def run(self):
        return self._run if self._run is not None else getattr(self._grid, "run", None)

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int,
                       group_id: str, ttl: Optional[float] = None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type,
                       group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> list[int]:
        """Every client's node, or only those of the clients in :attr:`only` (a simulated
        fleet's clients available at the round's start)."""
        if self.only is not None:
            return [node_id(c) for c in sorted(self.only)]
        return self._ids

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            ids.append(_set_id(msg))
            self._pending[ids[-1]] = msg
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        wanted = list(message_ids)
        if any(i in self._pending for i in wanted):
            self._exchange(list(self._pending.values()), None)
        return [self._replies.pop(i) for i in wanted if i in self._replies]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: Optional[float] = None) -> list[Message]:
        """The replies, in the order of ``messages``; none for a client that was late."""
        ids = self.push_messages(messages)
        self._exchange([self._pending[i] for i in ids], timeout)
        return [self._replies.pop(i) for i in ids if i in self._replies]

    # -- fedadapt's -------------------------------------------------------------------------
    def partition_of(self, node: int) -> int:
        cid = node - NODE_BASE
        if not 0 <= cid < self.num_clients:
            raise ValueError(f"no client has node id {node} (the grid's nodes are "
                             f"{NODE_BASE}..{NODE_BASE + self.num_clients - 1})")
        return cid

    def take_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        """Bytes down and up per client since the last call."""
        out = (self._down, self._up)
        self._down, self._up = {}, {}
        return out

    def bytes_of(self, cid: int, content: RecordDict) -> tuple[int, int]:
        """``(down, up)``: the bytes client ``cid`` receives of a message's ``content`` (as
        :meth:`take_bytes` counts them), and sends back if it returns the tensors it trains as
        it received them (at most that: a LoRA client of HetLoRA may send fewer)."""
        from fedadapt.adapters.lora import is_base_delta

        down = up = 0
        for record in content.values():
            if isinstance(record, ArrayRecord):
                counted = self._counted(record, cid)
                down += counted.count_bytes()
                up += sum(len(a.data) + len(n) for n, a in counted.items()
                          if not is_base_delta(n))
        return down, up

    def take_nodes(self) -> dict[str, int]:
        """``{Ray node: clients whose replies it sent}`` since the last call (a worker tags
        its reply with its node; empty outside Ray)."""
        out, self._served = self._served, {}
        return out

    def _counted(self, record: ArrayRecord, cid: int) -> ArrayRecord:
        """What of ``record`` the client needs: the tensors it trains, the folded updates
        of its frozen weights (FLoRA's and FedEx-LoRA's ``X.base_delta``) and its client rule's
        arrays (SCAFFOLD's control variate ``rule/c/...``)."""
        if self.trained is None:
            return record
        from fedadapt.adapters.lora import is_base_delta

        names = [*self.trained(cid), *(n for n in record.keys()
                                       if is_base_delta(n) or n.startswith(RULE_PREFIX))]
        return ArrayRecord({n: record[n] for n in names if n in record})

    def _size(self, record: ArrayRecord, cid: int) -> int:
        names = tuple(self.trained(cid)) if self.trained is not None else None
        key = (id(record), names)
        if key not in self._sizes:
            self._sizes[key] = self._counted(record, cid).count_bytes()
        return self._sizes[key]

    def _pack(self, group: list[tuple[int, Message]], timeout: Optional[float] = None
              ) -> RecordDict:
        """One Flower message's content for ``group``'s clients."""
        names: list[str] = []
        for _, msg in group:
            names += [n for n in msg.content.keys() if n not in names]
        out = RecordDict()
        deployment = self.nodes.kind == "clients"
        for name in names:
            if "/" in name or name == records.GRID:
                raise ValueError(f"record name {name!r} is reserved by fedadapt's message "
                                 f"layout (no '/', not {records.GRID!r})")
            held = [msg.content.get(name) for _, msg in group]
            shared = held[0] is not None and all(r is held[0] for r in held)
            for (cid, _), record in zip(group, held):
                if record is None:
                    continue
                if isinstance(record, ArrayRecord):
                    self._down[cid] = self._down.get(cid, 0) + self._size(record, cid)
                    if deployment:
                        record = self._counted(record, cid)
                if not shared:
                    out[records.key(cid, name)] = record
            if shared:
                out[name] = (self._counted(held[0], group[0][0]) if deployment
                             and isinstance(held[0], ArrayRecord) else held[0])
        out[records.GRID] = ConfigRecord({records.CLIENTS: [p for p, _ in group],
                                          "group-size": self.group_size,
                                          "nodes": self.nodes.kind,
                                          records.TIMEOUT: float(timeout or 0.0)})
        return out

    def _exchange(self, messages: list[Message], timeout: Optional[float]) -> None:
        """Send ``messages`` (one per client) packed per worker; file the unpacked replies."""
        for msg in messages:
            self._pending.pop(msg.metadata.message_id, None)
        self._sizes = {}  # keyed by the records' ids: valid within one exchange only
        if not messages:
            return
        sent = self._worker_messages(messages, timeout)
        if timeout is not None and self.nodes.kind == "workers":
            timeout += TRANSPORT_GRACE_S  # the worker leaves its late clients out itself
        replies = list(self._grid.send_and_receive([m for m, _ in sent], timeout=timeout))
        groups = {m.metadata.message_id: group for m, group in sent}  # ids set by the push
        for reply in replies:
            self._unpack(reply, groups.get(reply.metadata.reply_to_message_id, []))

    def _worker_messages(self, messages: list[Message], timeout: Optional[float]
                         ) -> list[tuple[Message, list[tuple[int, Message]]]]:
        """The strategy's messages (one per client) packed into one Flower message per worker
        (per client on the deployment engine), each with the clients it carries."""
        types = {m.metadata.message_type for m in messages}
        if len(types) != 1:
            raise ValueError(f"one exchange sends one message type, not {sorted(types)}")
        by_pid: dict[int, Message] = {}
        for msg in messages:
            cid = self.partition_of(msg.metadata.dst_node_id)
            if cid in by_pid:
                raise ValueError(f"two messages for client {cid} (node "
                                 f"{msg.metadata.dst_node_id}) in one exchange")
            by_pid[cid] = msg
        cids = sorted(by_pid)
        first = by_pid[cids[0]].content
        own = any(isinstance(r, ArrayRecord) and any(m.content.get(n) is not r
                                                      for m in by_pid.values())
                  for n, r in first.items())  # per-client arrays: smaller messages
        kind = messages[0].metadata.message_type
        out = []
        for node, part in self.nodes.assign(cids, CHUNK if own else None):
            group = [(p, by_pid[p]) for p in part]
            out.append((Message(self._pack(group, timeout), dst_node_id=node,
                                message_type=kind), group))
        return out

    def _unpack(self, reply: Message, group: list[tuple[int, Message]]) -> None:
        """File one reply per client of a worker's reply: its content, its own error, or the
        worker's error when the whole message failed; nothing for a client that was late."""
        if reply.has_error():  # the whole message failed: each of its clients
            for _, msg in group:
                self._file(Message(Error(code=reply.error.code, reason=reply.error.reason),
                                   reply_to=msg))
            return
        per_client = records.unpack(reply.content)
        node = str(records.packing(reply.content).get(records.NODE, ""))
        if node and per_client:
            self._served[node] = self._served.get(node, 0) + len(per_client)
        for cid, msg in group:
            content = per_client.get(cid)
            if content is None:  # no record: it answered too late
                continue
            reason = records.error_of(content)
            if reason is not None:
                self._file(Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                         reason=reason), reply_to=msg))
                continue
            self._up[cid] = self._up.get(cid, 0) + sum(
                r.count_bytes() for r in content.values() if isinstance(r, ArrayRecord))
            self._file(Message(content, reply_to=msg))

    def _file(self, reply: Message) -> None:
        _set_id(reply)
        self._replies[reply.metadata.reply_to_message_id] = reply
