"""Messages that carry several clients: how records are named inside one Flower message.

A strategy sends one message per client (:mod:`fedadapt.federation.wire.grid` shows it one node per
client). Underneath, the messages for the clients of one worker travel as one Flower message:
records that all of them share (the global arrays, the round's config: the same objects in every
client's message) have plain names and travel once; a client's own records are prefixed with its
partition id: ``c17/arrays``. The record :data:`GRID` lists the clients the message is for and
how the worker trains them; it is the worker's, and no client sees it.

A reply holds per-client records: each client's arrays and metrics, or ``c17/error`` (a
ConfigRecord with the reason) when that client failed; a client with no record at all did not
answer in time. Its own :data:`GRID` record names the Ray node that served it (:data:`NODE`,
empty outside Ray). On the deployment engine a node is one client and a message names just it.
"""

from __future__ import annotations

import copy

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedadapt.codec import record

#: The packing record: ``clients`` (partition ids), ``group-size``, ``nodes``, ``timeout``.
GRID = "fedadapt.grid"
CLIENTS = "clients"
#: The exchange's timeout in seconds (0: none), for the worker to judge its clients' lateness.
TIMEOUT = "timeout"
#: A reply's Ray node id (first 8 hex digits), for the rounds' ``trained_on``.
NODE = "node"
ERROR = "error"


def key(cid: int, name: str) -> str:
    return f"c{cid}/{name}"


def packing(content: RecordDict) -> ConfigRecord:
    """The message's :data:`GRID` record (empty when there is none)."""
    return record(content, ConfigRecord, GRID) or ConfigRecord({})


def clients_of(content: RecordDict) -> list[int]:
    """The partition ids a message is for."""
    grid = packing(content)
    return [int(c) for c in grid[CLIENTS]] if CLIENTS in grid else []


def view(content: RecordDict, cid: int) -> RecordDict:
    """Client ``cid``'s records: the shared ones and its own, prefix removed (its own win); the
    worker's :data:`GRID` record left out."""
    own = f"c{cid}/"
    out = RecordDict()
    for name, rec in content.items():
        if "/" not in name and name != GRID:
            out[name] = rec
    for name, rec in content.items():
        if name.startswith(own):
            out[name[len(own):]] = rec
    return out


def own(content: RecordDict) -> RecordDict:
    """A client's own copy of its records, as a ClientApp gets its message off the wire: every
    record and every value new, so a mod that changes its message in place (``msg.content[
    "config"]["lr"] *= 0.5``) changes no other client's. An ``Array``'s bytes are immutable and
    shared (its object is new); a ConfigRecord's or MetricRecord's values are copied deeply
    (lists in them included)."""
    out = RecordDict()
    for name, rec in content.items():
        if isinstance(rec, ArrayRecord):
            arrays = ArrayRecord()
            for key, array in rec.items():
                fresh = Array.__new__(Array)
                fresh.__dict__.update(array.__dict__)
                arrays[key] = fresh
            out[name] = arrays
        else:
            out[name] = copy.deepcopy(rec)
    return out


def pack(replies: dict[int, RecordDict], out: RecordDict | None = None) -> RecordDict:
    """One reply content from per-client contents (``{cid: RecordDict}``)."""
    out = RecordDict() if out is None else out
    for cid, content in replies.items():
        for name, rec in content.items():
            out[key(cid, name)] = rec
    return out


def served_by(content: RecordDict) -> RecordDict:
    """``content`` with a :data:`GRID` record naming the Ray node this process runs on."""
    import sys

    ray = sys.modules.get("ray")  # never imported here: only an actor has it loaded
    node = ray.get_runtime_context().get_node_id()[:8] if ray and ray.is_initialized() else ""
    content[GRID] = ConfigRecord({NODE: node})
    return content


def error(reason: str) -> RecordDict:
    return RecordDict({ERROR: ConfigRecord({"reason": reason})})


def unpack(content: RecordDict) -> dict[int, RecordDict]:
    """``{cid: that client's records}`` of a reply."""
    out: dict[int, RecordDict] = {}
    for name, rec in content.items():
        prefix, _, rest = name.partition("/")
        if rest and prefix.startswith("c") and prefix[1:].isdigit():
            out.setdefault(int(prefix[1:]), RecordDict())[rest] = rec
    return out


def error_of(content: RecordDict) -> str | None:
    found = record(content, ConfigRecord, ERROR)
    return None if found is None else str(found["reason"])
