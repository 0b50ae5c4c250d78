"""Messages that carry several clients: how records are named inside one Flower message.

A strategy sends one message per client (:mod:`fedadapt.federation.grid` shows it one node per
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
import io
import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

#: The packing record: ``clients`` (partition ids), ``group-size``, ``nodes``, ``timeout``.
GRID = "fedadapt.grid"
CLIENTS = "clients"
#: The exchange's timeout in seconds (0: none), for the worker to judge its clients' lateness.
TIMEOUT = "timeout"
#: A reply's Ray node id (first 8 hex digits), for the rounds' ``trained_on``.
NODE = "node"
ERROR = "error"
#: Train replies carry this metric (1 per client) for ``method.weighting=uniform``.
UNIFORM_KEY = "unit-weight"
#: The config key that tells a client how many of its training examples to train in a round
#: (``fleet.partial_work``: its work cut at the simulated deadline); absent: all of them.
TRAIN_EXAMPLES = "train-examples"


def record(content: RecordDict, kind: type, name: str | None = None):
    """``content.<kind>_records.get(name)`` (the first record of ``kind`` when ``name`` is None)
    without Flower's typed view of the records, which is built anew at every access (6 us
    each; a round reads each reply's records several times)."""
    if name is None:
        return next((r for r in content.values() if isinstance(r, kind)), None)
    found = content[name] if name in content else None
    return found if isinstance(found, kind) else None


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
    for name, record in content.items():
        if "/" not in name and name != GRID:
            out[name] = record
    for name, record in content.items():
        if name.startswith(own):
            out[name[len(own):]] = record
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
        for name, record in content.items():
            out[key(cid, name)] = record
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
    for name, record in content.items():
        prefix, _, rest = name.partition("/")
        if rest and prefix.startswith("c") and prefix[1:].isdigit():
            out.setdefault(int(prefix[1:]), RecordDict())[rest] = record
    return out


def error_of(content: RecordDict) -> str | None:
    found = record(content, ConfigRecord, ERROR)
    return None if found is None else str(found["reason"])


_NPY_MAGIC = b"\x93NUMPY"


def as_numpy(array: Array) -> np.ndarray:
    """``array.numpy()`` as a read-only view of the message's bytes. Flower's ``Array.numpy``
    goes through ``np.load``, which parses each tensor's ``.npy`` header with ``ast`` and copies
    the data (about 80 us a tensor: a server decoding every reply twice, to screen it and to
    average it, spent 3.6 ms a round on it); the header's length is in its first bytes, and the
    dtype and shape are the Array's own fields. Anything but a C-ordered ``.npy`` of versions
    1-3 goes through ``Array.numpy``."""
    data = array.data
    if array.stype == "numpy.ndarray" and data[:6] == _NPY_MAGIC and data[6] in (1, 2, 3):
        size = 2 if data[6] == 1 else 4
        start = 8 + size + int.from_bytes(data[8:8 + size], "little")
        if b"'fortran_order': False" in data[8 + size:start]:
            return np.frombuffer(data, dtype=np.dtype(array.dtype), offset=start,
                                 count=math.prod(array.shape)).reshape(array.shape)
    return array.numpy()


#: ``(.npy header, dtype name, shape)`` by ``(dtype, shape)``: a model sends the same shapes
#: every round.
_NPY_HEADERS: dict[tuple, tuple[bytes, str, tuple]] = {}


def to_array(value) -> Array:
    """``Array.from_numpy_ndarray`` / ``Array.from_torch_tensor`` to the same bytes, without
    formatting the ``.npy`` header anew for every tensor of every message (``np.save`` builds
    it as a dict's repr each time: a tenth of a millisecond a tensor, a round's 66 tensors on
    a small CNN): the header of each ``(dtype, shape)`` is kept."""
    import torch

    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else value
    if not isinstance(a, np.ndarray) or not a.flags.c_contiguous or a.dtype.hasobject:
        return Array.from_numpy_ndarray(np.asarray(a))
    key = (a.dtype.str, a.shape)
    known = _NPY_HEADERS.get(key)
    if known is None:
        buffer = io.BytesIO()
        np.save(buffer, a, allow_pickle=False)
        data = buffer.getvalue()
        _NPY_HEADERS[key] = (data[:len(data) - a.nbytes], str(a.dtype),
                             tuple(int(d) for d in a.shape))
        return Array(dtype=str(a.dtype), shape=tuple(a.shape), stype="numpy.ndarray", data=data)
    header, dtype, shape = known
    return Array(dtype, shape, "numpy.ndarray", header + a.tobytes())
