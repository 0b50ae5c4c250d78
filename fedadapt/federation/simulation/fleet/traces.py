"""Trace files a fleet reads: the availability CSV of ``fleet=trace`` (:func:`read_trace`) and
FedScale's device traces (``fleet=fedscale``): its ``client_device_capacity``
(:func:`read_capacity`) and ``client_behave_trace`` (:func:`read_behaviour`,
:func:`behaviour_lists`, :class:`FedScaleTrace`), unpickled by :class:`TraceUnpickler`, which
runs no code. Every refusal is a :class:`~fedadapt.config.ConfigError` naming the key, in one
line."""

from __future__ import annotations

import csv
import math
import pickle
from pathlib import Path
from typing import Union

import numpy as np

from fedadapt.config import ConfigError

#: Where FedScale publishes its device traces (said when ``fleet.capacity`` is missing).
FEDSCALE_TRACES = ("FedScale publishes client_device_capacity and client_behave_trace in "
                   "https://github.com/SymbioticLab/FedScale under "
                   "benchmark/dataset/data/device_info/")

TraceId = Union[int, str]


class FedScaleTrace:
    """One client's availability as FedScale's simulator decides it (``ClientMetadata.
    is_active``): the clock read modulo ``finish_time``, both ends of an interval online, and a
    cursor into the entry's intervals (in the file's order) that moves on by one interval when
    a query falls after the current one's end, and wraps to the first after the last. So the
    answer depends on the queries before it: after a jump over an interval, or a cycle's wrap,
    the cursor lags behind the clock; an entry whose last interval ends at ``finish_time`` is
    never past it, and stays on it. An entry without an interval is never online (FedScale's
    own code fails on one)."""

    def __init__(self, finish: float, active: list[float], inactive: list[float]) -> None:
        self.finish = float(finish)
        self.intervals = list(zip(active, inactive))
        self.cursor = 0

    def online(self, t: float) -> bool:
        """Whether the client is online at simulated second ``t``; moves the cursor."""
        if not self.intervals:
            return False
        within = t % self.finish
        if within > self.intervals[self.cursor][1]:
            self.cursor += 1
        self.cursor %= len(self.intervals)
        start, end = self.intervals[self.cursor]
        return start <= within <= end


def merged_intervals(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """``spans`` sorted, overlapping or touching intervals joined into one."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def read_trace(path: str, num_clients: int) -> list[list[tuple[float, float]]]:
    """Each client's available intervals from the CSV ``path`` (``client,start,end``, sorted
    and merged); :class:`ConfigError` naming ``fleet.trace`` for a file that is missing or
    malformed, an unknown client or an interval that ends before it starts."""
    where = f"fleet.trace={path!r}"
    try:
        with open(Path(path).expanduser(), newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError as err:
        raise ConfigError(f"{where} is invalid: {err.strerror or err}") from None
    if not rows or not {"client", "start", "end"} <= set(rows[0]):
        raise ConfigError(f"{where} is invalid: a CSV with the header client,start,end and one "
                          f"row per available interval is needed")
    out: list[list[tuple[float, float]]] = [[] for _ in range(num_clients)]
    for line, row in enumerate(rows, start=2):
        try:
            cid, start, end = int(row["client"]), float(row["start"]), float(row["end"])
        except (TypeError, ValueError):
            raise ConfigError(f"{where} is invalid: line {line} ({dict(row)}) is not an "
                              f"integer client and two numbers") from None
        if not 0 <= cid < num_clients:
            raise ConfigError(f"{where} is invalid: line {line} names client {cid}, but the "
                              f"run has clients 0..{num_clients - 1}")
        if not (math.isfinite(start) and math.isfinite(end) and 0 <= start < end):
            raise ConfigError(f"{where} is invalid: line {line}: an interval needs "
                              f"0 <= start < end (got {start}, {end})")
        out[cid].append((start, end))
    for cid, spans in enumerate(out):
        out[cid] = merged_intervals(spans)
    if not any(out):
        raise ConfigError(f"{where} is invalid: no client is ever available")
    return out



# -- FedScale's device traces ------------------------------------------------------------------

def _numeric_dtype(obj, align=False, copy=False):
    """numpy's ``dtype`` for a number's dtype only (a numpy scalar in a pickle names it)."""
    if not isinstance(obj, str) or np.dtype(obj).kind not in "biuf":
        raise pickle.UnpicklingError(f"it names numpy.dtype({obj!r}); only numbers are read")
    return np.dtype(obj)


def _numeric_scalar(dtype, data=None):
    """A numpy number in a pickle (``numpy.core.multiarray.scalar``), as a Python number."""
    if not (isinstance(dtype, np.dtype) and dtype.kind in "biuf" and isinstance(data, bytes)
            and len(data) == dtype.itemsize):
        raise pickle.UnpicklingError("it holds a numpy scalar that is not a number")
    return np.frombuffer(data, dtype=dtype)[0].item()


_NUMPY_SCALARS = {("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar")}


class TraceUnpickler(pickle.Unpickler):
    """An unpickler that builds dicts, lists, tuples, numbers (numpy's too), strings and None
    only: a pickle that names any other class or function (``os.system``, a ``__reduce__``
    payload) is refused before anything runs."""

    def find_class(self, module: str, name: str):
        if (module, name) in _NUMPY_SCALARS:
            return _numeric_scalar
        if (module, name) == ("numpy", "dtype"):
            return _numeric_dtype
        raise pickle.UnpicklingError(f"it names {module}.{name}; a trace holds only dicts, "
                                     f"lists, tuples, numbers, strings and None")

    def persistent_load(self, persistent_id):
        raise pickle.UnpicklingError("it holds a persistent id")


#: The traces read, by (path, size, modification time): the profiles are asked for more than
#: once while a run is prepared (tiers, ranks, the fleet), and FedScale's files are large.
_TRACES: dict[tuple, object] = {}


def _load_trace(path: str, key: str, what: str) -> tuple[str, dict]:
    """``(where, data)``: the pickle at ``path`` (``key``: the config key that names it) read
    by :class:`TraceUnpickler`; :class:`ConfigError` naming the key, in one line, for a file
    that is missing, not such a pickle, or not a non-empty dict."""
    where = f"{key}={path!r}"
    file = Path(path).expanduser()
    try:
        stat = file.stat()
    except OSError:
        raise ConfigError(f"{where} is invalid: no such file ({FEDSCALE_TRACES})") from None
    cache = (str(file.resolve()), stat.st_size, stat.st_mtime_ns)
    if cache not in _TRACES:
        try:
            with open(file, "rb") as fh:
                data = TraceUnpickler(fh).load()
        except pickle.UnpicklingError as err:
            raise ConfigError(f"{where} is invalid: refused, {_one_line(err)}") from None
        except Exception as err:  # a truncated or foreign file
            raise ConfigError(f"{where} is invalid: not a pickle FedScale's simulator reads "
                              f"({type(err).__name__}: {_one_line(err)})") from None
        if len(_TRACES) >= 4:
            _TRACES.clear()
        _TRACES[cache] = data
    data = _TRACES[cache]
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{where} is invalid: {what} (it holds "
                          f"{'an empty dict' if isinstance(data, dict) else type(data).__name__})")
    for cid in data:
        if isinstance(cid, bool) or not isinstance(cid, (int, str)):
            raise ConfigError(f"{where} is invalid: client id {cid!r} is not an integer or a "
                              f"string ({what})")
    return where, data


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_capacity(path: str) -> dict[TraceId, tuple[float, float]]:
    """FedScale's ``client_device_capacity``: ``{client id: (ms per sample, kbit/s)}`` from its
    ``{'computation': ms, 'communication': kbit/s}``; :class:`ConfigError` naming
    ``fleet.capacity`` and the entry's key for a wrong shape or a speed that is not > 0."""
    what = ("a pickled dict of client id -> {'computation': ms per sample, 'communication': "
            "kbit/s} (FedScale's client_device_capacity)")
    where, data = _load_trace(path, "fleet.capacity", what)
    out = {}
    for cid, entry in data.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} is invalid: client {cid!r}'s entry is "
                              f"{type(entry).__name__}, not a dict with 'computation' and "
                              f"'communication' ({what})")
        speeds = []
        for name in ("computation", "communication"):
            value = entry.get(name)
            if not _number(value):
                raise ConfigError(f"{where} is invalid: client {cid!r} has "
                                  f"{'no' if value is None else repr(value)} {name!r}: a "
                                  f"number is needed ({what})")
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{where} is invalid: client {cid!r}'s {name!r} is {value}: "
                                  f"a speed must be > 0")
            speeds.append(float(value))
        out[cid] = (speeds[0], speeds[1])
    return out


def behaviour_lists(path: str) -> dict[TraceId, tuple[float, list[float], list[float]]]:
    """FedScale's ``client_behave_trace`` as its file holds it, in its order: ``{client id:
    (finish_time, active, inactive)}``; :class:`ConfigError` naming ``fleet.behaviour`` and the
    entry's key for a wrong shape, or an interval that ends before it starts."""
    what = ("a pickled dict of client id -> {'active': [s], 'inactive': [s], 'finish_time': s, "
            "...} (FedScale's client_behave_trace)")
    where, data = _load_trace(path, "fleet.behaviour", what)
    out = {}
    for cid, entry in data.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} is invalid: client {cid!r}'s entry is "
                              f"{type(entry).__name__}, not a dict ({what})")
        finish = entry.get("finish_time")
        if not (_number(finish) and math.isfinite(finish) and finish > 0):
            raise ConfigError(f"{where} is invalid: client {cid!r}'s 'finish_time' is "
                              f"{finish!r}: a cycle of > 0 seconds is needed ({what})")
        lists = [entry.get(name) for name in ("active", "inactive")]
        for name, values in zip(("active", "inactive"), lists):
            if not (isinstance(values, (list, tuple)) and all(
                    _number(v) and math.isfinite(v) for v in values)):
                raise ConfigError(f"{where} is invalid: client {cid!r}'s {name!r} is not a list "
                                  f"of numbers ({what})")
        if len(lists[0]) != len(lists[1]):
            raise ConfigError(f"{where} is invalid: client {cid!r} has {len(lists[0])} "
                              f"'active' and {len(lists[1])} 'inactive' times: one of each per "
                              f"interval")
        for i, (a, b) in enumerate(zip(*lists)):
            if not 0 <= a <= b:
                raise ConfigError(f"{where} is invalid: client {cid!r}'s interval {i} has "
                                  f"'active' {a} and 'inactive' {b}: it needs 0 <= active <= "
                                  f"inactive")
        out[cid] = (finish, list(lists[0]), list(lists[1]))
    return out


def read_behaviour(path: str) -> dict[TraceId, tuple[float, list[tuple[float, float]]]]:
    """FedScale's ``client_behave_trace`` as fedadapt reads it by default: ``{client id:
    (finish_time, [(active, inactive), ...])}``, the intervals (seconds into a cycle of
    ``finish_time``) sorted, merged and cut at ``finish_time`` (FedScale reads the clock modulo
    ``finish_time``: nothing later is ever reached); ``duration`` and ``model`` are not used.
    :class:`ConfigError` as :func:`behaviour_lists` says."""
    out = {}
    for cid, (finish, active, inactive) in behaviour_lists(path).items():
        spans = [(float(a), float(min(b, finish))) for a, b in zip(active, inactive)
                 if a < finish and a < b]
        out[cid] = (float(finish), merged_intervals(spans))
    return out

