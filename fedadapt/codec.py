"""The Array codec and the metric and config keys that the strategies and the wire both read.

The lowest layer under :mod:`fedadapt.strategies` and :mod:`fedadapt.federation` (it imports
flwr, numpy and torch only): :func:`record` reads one record of a ``RecordDict``,
:func:`as_numpy` decodes an ``Array`` as a read-only view of its bytes and :func:`to_array`
encodes a numpy array or torch tensor to the bytes Flower's own constructors make.
"""

from __future__ import annotations

import io
import math

import numpy as np
from flwr.app import Array, RecordDict

#: Train replies carry this metric (1 per client) for ``method.weighting=uniform``.
UNIFORM_KEY = "unit-weight"
#: The config key that tells a client how many of its training examples to train in a round
#: (``fleet.partial_work``: its work cut at the simulated deadline); absent: all of them.
TRAIN_EXAMPLES = "train-examples"
#: Arrays between a client rule's server and client sides (SCAFFOLD's control variates) are
#: named ``rule/<what>/<tensor>``: they travel beside the model's tensors, are counted in the
#: round's bytes and are not model tensors (:mod:`fedadapt.pfl.rule`).
RULE_PREFIX = "rule/"


def record(content: RecordDict, kind: type, name: str | None = None):
    """``content.<kind>_records.get(name)`` (the first record of ``kind`` when ``name`` is None)
    without Flower's typed view of the records, which is built anew at every access (6 us
    each; a round reads each reply's records several times)."""
    if name is None:
        return next((r for r in content.values() if isinstance(r, kind)), None)
    found = content[name] if name in content else None
    return found if isinstance(found, kind) else None


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
    return Array(dtype, shape, "numpy.ndarray", b"".join((header, a.data)))  # one copy
