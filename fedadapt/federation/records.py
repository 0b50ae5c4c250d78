"""Messages that carry several clients: how records are named inside one Flower message.

In simulation a Flower node is a *worker* that trains the clients a message names; on the
deployment engine a node is one client (the message names just it). Either way a message's
``config`` lists the partition ids it is for (``clients``); records shared by those clients (the
global arrays, once) have plain names, and a client's own records are prefixed with its id:
``c17/arrays``, ``c17/metrics``. A reply holds only per-client records: each client's arrays and
metrics, or ``c17/error`` (a ConfigRecord with the reason) when that client failed; a client
with no record at all did not answer in time.
"""

from __future__ import annotations

from flwr.app import ConfigRecord, RecordDict

CLIENTS = "clients"
ERROR = "error"
#: Train replies carry this metric (1 per client) for ``method.weighting=uniform``.
UNIFORM_KEY = "unit-weight"


def key(cid: int, name: str) -> str:
    return f"c{cid}/{name}"


def clients_of(content: RecordDict) -> list[int]:
    """The partition ids a message is for."""
    config = content.config_records.get("config")
    return [int(c) for c in config[CLIENTS]] if config is not None and CLIENTS in config else []


def view(content: RecordDict, cid: int) -> RecordDict:
    """Client ``cid``'s records: the shared ones and its own, prefix removed (its own win)."""
    own = f"c{cid}/"
    out = RecordDict()
    for name, record in content.items():
        if "/" not in name:
            out[name] = record
    for name, record in content.items():
        if name.startswith(own):
            out[name[len(own):]] = record
    return out


def pack(replies: dict[int, RecordDict], out: RecordDict | None = None) -> RecordDict:
    """One reply content from per-client contents (``{cid: RecordDict}``)."""
    out = RecordDict() if out is None else out
    for cid, content in replies.items():
        for name, record in content.items():
            out[key(cid, name)] = record
    return out


def error(reason: str) -> RecordDict:
    return RecordDict({ERROR: ConfigRecord({"reason": reason})})


def unpack(content: RecordDict) -> dict[int, RecordDict]:
    """``{cid: that client's records}`` of a reply."""
    out: dict[int, RecordDict] = {}
    for name, record in content.items():
        prefix, _, rest = name.partition("/")
        if rest and prefix.startswith("c") and prefix[1:].isdigit():
            out.setdefault(int(prefix[1:]), RecordDict())[rest] = record
    return out


def error_of(content: RecordDict) -> str | None:
    record = content.config_records.get(ERROR)
    return None if record is None else str(record["reason"])
