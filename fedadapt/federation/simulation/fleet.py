"""Simulated devices (``fleet=tiers|lognormal|trace|fedscale``): a seeded profile per client
and a simulated clock for the rounds; nothing sleeps.

* **Profiles** (:func:`profiles`): compute in FLOP/s, downlink and uplink in bytes/s. ``tiers``
  gives tier i's ``compute[i]`` to a seeded share ``fractions[i]`` of the clients (equal shares
  by default) and every client the same bandwidths; ``lognormal`` draws each client's compute
  and bandwidths from log-normals around the medians (seeded per client); ``fedscale`` gives
  each client an entry of FedScale's ``client_device_capacity`` by a seeded draw, read as
  FedScale's simulator reads it (3 x its ms per sample per training example, its kbit/s both
  ways; :func:`read_capacity`, through :class:`TraceUnpickler`, which runs no code). With
  ``fleet.fedscale_semantics=exact`` the rest is FedScale's simulator's too: client k on entry
  ``k % n``, its stateful availability (:class:`FedScaleTrace`), ``batch x local_steps``
  samples a round (:func:`charged_samples`) and its round rule (:meth:`Fleet.select`,
  :meth:`Fleet.round`); docs/fleet.md's table says each difference.
* **Availability**: a two-state on/off process per client (exponential periods of means
  ``mean_on`` / ``mean_off``, the first state drawn from the stationary split), or the intervals
  of a CSV trace (``client,start,end`` in simulated seconds), or those of an entry of FedScale's
  ``client_behave_trace`` repeating every ``finish_time`` (:func:`read_behaviour`), or always
  on.
* **A client's time in a round** (:meth:`Fleet.seconds`): its local training FLOPs (the model's
  FLOPs per training example at the client's exit, measured once with
  ``torch.utils.flop_counter``, times its examples and local epochs) / its FLOP/s, plus the
  bytes it was sent / its downlink, plus the bytes it sent / its uplink.
* **A round on the clock** (:func:`fedadapt.federation.server.loop`): it starts when the previous
  one ended; the strategy samples among the clients available then; a client that goes offline
  before it would finish fails; one that would finish after ``federation.round_timeout``
  (simulated seconds) is dropped as the real timeout drops it; with ``keep_first`` only the
  first N to arrive are kept. The round lasts until its last kept client arrives (the deadline
  when a client was late). ``metrics.jsonl`` gets ``sim_round_s``, ``sim_time_s``,
  ``sim_unavailable``, ``sim_offline``, ``sim_late`` and ``sim_discarded``.

The profiles, each client's work and the availability's parameters are written to
``fleet.json`` in the run directory; everything is a function of the config and the seed, so a
resumed run continues on the same clock (the last row's ``sim_time_s``).
"""

from __future__ import annotations

import csv
import math
import pickle
import random
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fedadapt.config import FEDSCALE_TRACES, ConfigError, FleetConfig

#: The seed streams of the profiles and of each client's availability (and of the draw of a
#: FedScale behaviour entry per client).
PROFILE_STREAM, AVAILABILITY_STREAM, BEHAVIOUR_STREAM = 0xF1EE7, 0xA7A1, 0xBE4A
#: FedScale's completion time counts a training example as 3 forward passes (forward, and a
#: backward of about twice its cost) of its measured per-sample latency.
FEDSCALE_AUGMENTATION = 3.0
#: FedScale's sizes are kbit of 1,024 bits (``bytes / 1024 * 8``) over bandwidths in kbit/s:
#: one kbit/s carries this many bytes a second.
KBPS_BYTES = 1024 / 8
#: ``fleet.fedscale_semantics=exact``: FedScale's aggregator over-selects this many times the
#: round's target count (its ``--overcommitment`` default).
FEDSCALE_OVERCOMMITMENT = 1.3
#: ``fleet.fedscale_semantics=exact``: the speeds FedScale's aggregator gives a client whose
#: mapped key (``k % n``) is not in its capacity file: 1 ms per sample, 1 kbit/s.
FEDSCALE_MISSING_SPEEDS = (1.0, 1.0)

TraceId = Union[int, str]


@dataclass(frozen=True)
class Profile:
    """One client's device."""

    compute: float  # FLOP/s
    downlink: float  # bytes/s
    uplink: float  # bytes/s
    tier: Optional[int] = None  # tiers / trace: its index in fleet.compute (0: slowest)
    #: fedscale: the client_device_capacity entry it was given, its milliseconds per sample
    #: (one forward) and its kbit/s (both ways), as the file holds them.
    capacity_id: Optional[TraceId] = None
    ms_per_sample: Optional[float] = None
    kbps: Optional[float] = None
    #: fedscale with fleet.behaviour: the client_behave_trace entry it was given.
    behaviour_id: Optional[TraceId] = None
    #: fleet.memory: the device's memory in bytes (None: no cap).
    memory: Optional[float] = None


def profiles(cfg: FleetConfig, num_clients: int, seed: int,
             reference_flops: float = 1.0) -> list[Profile]:
    """Each client's seeded :class:`Profile` (:func:`_devices`), with ``fleet.memory``'s
    memory by compute (:func:`assign_memory`)."""
    out = _devices(cfg, num_clients, seed, reference_flops)
    if cfg.memory is None:
        return out
    return [replace(p, memory=m) for p, m in
            zip(out, assign_memory(cfg, [p.compute for p in out]))]


def _share_bounds(fractions: list[float], n: int) -> np.ndarray:
    """Where each share of ``n`` items ends (as the tiers are cut)."""
    return np.round(np.cumsum([0.0, *fractions]) * n).astype(int)


def assign_memory(cfg: FleetConfig, compute: list[float]) -> list[float]:
    """``fleet.memory``: the clients ordered by their compute (the slowest first; a tie by
    client) take the memory values, smallest first, in the shares ``memory_fractions`` (equal
    by default); so with ``fleet=tiers`` and shares as the tiers', tier i gets ``memory[i]``."""
    values = list(cfg.memory)
    fractions = list(cfg.memory_fractions or [1 / len(values)] * len(values))
    order = sorted(range(len(compute)), key=lambda c: (compute[c], c))
    out = [0.0] * len(compute)
    bounds = _share_bounds(fractions, len(compute))
    for value, lo, hi in zip(values, bounds, bounds[1:]):
        for c in order[lo:hi]:
            out[c] = float(value)
    return out


def _devices(cfg: FleetConfig, num_clients: int, seed: int,
             reference_flops: float = 1.0) -> list[Profile]:
    """Each client's seeded :class:`Profile`. ``fedscale``: each client is given a
    ``fleet.capacity`` entry by a seeded draw (:func:`draw_entries`), its compute the FLOP/s at
    which one training example of ``reference_flops`` (the run's model's own training step)
    takes FedScale's time, 3 x its milliseconds per sample; its bandwidths its kbit/s both
    ways (the default ``reference_flops`` of 1 keeps only the devices' order)."""
    rng = np.random.default_rng([int(seed), PROFILE_STREAM])
    if cfg.name == "fedscale" and exact_fedscale(cfg):
        return _mapped_devices(cfg, num_clients, reference_flops)
    if cfg.name == "fedscale":
        capacity = read_capacity(cfg.capacity)
        out = []
        for key in draw_entries(list(capacity), num_clients, rng):
            ms, kbps = capacity[key]
            out.append(Profile(reference_flops / (FEDSCALE_AUGMENTATION * ms / 1000.0),
                               kbps * KBPS_BYTES, kbps * KBPS_BYTES, capacity_id=key,
                               ms_per_sample=ms, kbps=kbps))
        if cfg.behaviour is not None:
            behaviour = read_behaviour(cfg.behaviour)
            keys = draw_entries(list(behaviour), num_clients,
                                np.random.default_rng([int(seed), BEHAVIOUR_STREAM]))
            out = [replace(p, behaviour_id=k) for p, k in zip(out, keys)]
        return out
    if cfg.name == "lognormal":
        c = cfg.compute_median * np.exp(cfg.compute_sigma * rng.standard_normal(num_clients))
        d = cfg.downlink * np.exp(cfg.bandwidth_sigma * rng.standard_normal(num_clients))
        u = cfg.uplink * np.exp(cfg.bandwidth_sigma * rng.standard_normal(num_clients))
        return [Profile(float(a), float(b), float(e)) for a, b, e in zip(c, d, u)]
    tiers = len(cfg.compute)
    fractions = list(cfg.fractions or [1 / tiers] * tiers)
    bounds = _share_bounds(fractions, num_clients)
    tier_of = np.zeros(num_clients, dtype=int)
    order = rng.permutation(num_clients)
    for t, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        tier_of[order[lo:hi]] = t
    return [Profile(float(cfg.compute[t]), float(cfg.downlink), float(cfg.uplink), int(t))
            for t in tier_of]


def exact_fedscale(cfg: FleetConfig) -> bool:
    """``fleet=fedscale`` with ``fleet.fedscale_semantics=exact``: FedScale's simulator to the
    letter (see :class:`FedScaleTrace` and :meth:`Fleet.select`)."""
    return cfg.name == "fedscale" and getattr(cfg, "fedscale_semantics", "fedadapt") == "exact"


def fedscale_entry(cid: int, entries: int) -> int:
    """The position FedScale gives fedadapt's client ``cid``: its aggregator numbers clients
    from 1 (client k = cid + 1) and maps client k to capacity key ``k % n`` and to the behaviour
    file's ``k % n``-th key (in the file's order)."""
    return (cid + 1) % entries


def _mapped_devices(cfg: FleetConfig, num_clients: int, reference_flops: float
                    ) -> list[Profile]:
    """``fleet.fedscale_semantics=exact``: each client's device by FedScale's mapping (no
    randomness; :func:`fedscale_entry`), a capacity key the file lacks giving FedScale's
    fallback speeds (:data:`FEDSCALE_MISSING_SPEEDS`)."""
    capacity = read_capacity(cfg.capacity)
    out = []
    for cid in range(num_clients):
        key = fedscale_entry(cid, len(capacity))
        ms, kbps = capacity.get(key, FEDSCALE_MISSING_SPEEDS)
        out.append(Profile(reference_flops / (FEDSCALE_AUGMENTATION * ms / 1000.0),
                           kbps * KBPS_BYTES, kbps * KBPS_BYTES, capacity_id=key,
                           ms_per_sample=ms, kbps=kbps))
    if cfg.behaviour is not None:
        keys = list(behaviour_lists(cfg.behaviour))
        out = [replace(p, behaviour_id=keys[fedscale_entry(c, len(keys))])
               for c, p in enumerate(out)]
    return out


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

def draw_entries(keys: list, num_clients: int, rng: np.random.Generator) -> list:
    """The trace entry of each of ``num_clients`` clients, drawn (seeded) from ``keys``:
    distinct entries while there are enough; with more clients than entries, every entry is
    used as evenly as can be (each in one seeded pass over them, then the next)."""
    keys = sorted(keys, key=lambda k: (isinstance(k, str), k))
    if num_clients <= len(keys):
        return [keys[i] for i in rng.choice(len(keys), num_clients, replace=False)]
    passes = math.ceil(num_clients / len(keys))
    order = np.concatenate([rng.permutation(len(keys)) for _ in range(passes)])
    return [keys[i] for i in order[:num_clients]]


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


class Fleet:
    """The run's devices and their availability; :meth:`seconds` is a client's time in a
    round. ``work[cid]``: the FLOPs of the client's local training in one round."""

    def __init__(self, cfg: FleetConfig, num_clients: int, seed: int, work: list[float],
                 deadline: Optional[float] = None, reference_flops: float = 1.0,
                 examples: Optional[list[int]] = None,
                 train_memory: Optional[list[float]] = None, *,
                 target: Optional[int] = None, samples: Optional[list[int]] = None,
                 exit_share: Optional[list[float]] = None) -> None:
        """``target``, ``samples`` and ``exit_share``: ``fleet.fedscale_semantics=exact`` only:
        the clients a round keeps (FedScale's ``num_participants``), the samples each client is
        charged a round (``train.batch_size`` x its local steps) and the share of the model's own
        training step its exit costs (1: the whole model)."""
        if len(work) != num_clients:
            raise ValueError(f"work for {len(work)} clients, the run has {num_clients}")
        #: fleet.fedscale_semantics=exact: FedScale's simulator to the letter
        self.exact = exact_fedscale(cfg)
        if self.exact:
            if target is None or target < 1 or samples is None or len(samples) != num_clients:
                raise ValueError("fleet.fedscale_semantics=exact needs the round's target count "
                                 "and each client's charged samples")
            if deadline is not None or cfg.partial_work or cfg.keep_first or cfg.memory:
                raise ValueError("fleet.fedscale_semantics=exact takes no deadline, "
                                 "partial_work, keep_first or memory")
            self.target = int(target)
            self.samples = [int(n) for n in samples]
            self.exit_share = ([1.0] * num_clients if exit_share is None
                               else [float(x) for x in exit_share])
        self.cfg, self.seed, self.work = cfg, int(seed), [float(w) for w in work]
        self.deadline = deadline
        #: Each client's training examples (``work`` is for all of them); needed to cut a
        #: client's work at the deadline (``fleet.partial_work``).
        self.examples = None if examples is None else [int(n) for n in examples]
        self.partial_work = bool(cfg.partial_work)
        if self.partial_work and (self.examples is None or deadline is None):
            raise ValueError("fleet.partial_work needs each client's examples and a deadline")
        self.keep_first = cfg.keep_first
        self.reference_flops = float(reference_flops)
        self.profiles = profiles(cfg, num_clients, seed, reference_flops)
        #: fleet.memory: the bytes each client's training needs (measured at its exits), and
        #: whether its device holds them; a client that does not fit is never sampled.
        self.memory_capped = cfg.memory is not None
        if self.memory_capped and train_memory is None:
            raise ValueError("fleet.memory needs each client's training memory")
        self.train_memory = None if train_memory is None else [float(m) for m in train_memory]
        self.fits = [not self.memory_capped or self.train_memory[c] <= p.memory
                     for c, p in enumerate(self.profiles)]
        if self.memory_capped and not any(self.fits):
            least = min(self.train_memory)
            raise ConfigError(
                f"fleet.memory={list(cfg.memory)} is invalid: no device can hold its client's "
                f"training (the least a client needs is {least / 2**20:.4g} MiB, the largest "
                f"device has {max(cfg.memory) / 2**20:.4g} MiB)")
        self._trace = read_trace(cfg.trace, num_clients) if cfg.name == "trace" else None
        #: fedscale with fleet.behaviour: each client's (finish_time, intervals in a cycle);
        #: None for one available all through its cycle
        self._cycles: Optional[list[Optional[tuple[float, list[tuple[float, float]]]]]] = None
        #: exact: each client's FedScale availability (None: always online), its cursor's state
        #: moved by each query; the clients online at the round's start (next_available's); the
        #: over-selection's generator (Python's, seeded by the run's seed: FedScale's is 233)
        self._stateful: Optional[list[Optional[FedScaleTrace]]] = None
        self._asked: Optional[tuple[float, list[int]]] = None
        self._selector = random.Random(self.seed)
        if self.exact and cfg.behaviour is not None:
            entries = behaviour_lists(cfg.behaviour)
            self._stateful = [FedScaleTrace(*entries[p.behaviour_id]) for p in self.profiles]
        elif cfg.name == "fedscale" and cfg.behaviour is not None:
            behaviour = read_behaviour(cfg.behaviour)
            self._cycles = [None if behaviour[p.behaviour_id][1] == [
                (0.0, behaviour[p.behaviour_id][0])] else behaviour[p.behaviour_id]
                for p in self.profiles]
        self._spans: list[list[tuple[float, float]]] = [[] for _ in range(num_clients)]
        self._until = [0.0] * num_clients  # how far each client's on/off process is drawn
        self._rngs: dict[int, np.random.Generator] = {}
        self._on = [False] * num_clients
        if self.deadline is not None and self.work:
            least = 1 if self.partial_work else None  # partial work: one example will do
            fastest = min(self.seconds(c, 0, 0, least) for c in range(num_clients)
                          if self.fits[c])
            if fastest > self.deadline:
                raise ConfigError(
                    f"federation.round_timeout={self.deadline} is invalid with fleet="
                    f"{cfg.name}: no client can meet it (the fastest needs {fastest:.4g} "
                    f"simulated seconds to train{' one example' if least else ''}, before any "
                    f"bytes travel)")

    @property
    def num_clients(self) -> int:
        return len(self.profiles)

    # -- time -------------------------------------------------------------------------------
    def seconds(self, cid: int, bytes_down: int, bytes_up: int,
                examples: Optional[int] = None) -> float:
        """Client ``cid``'s simulated seconds in a round: its training FLOPs / its FLOP/s, plus
        ``bytes_down`` / its downlink and ``bytes_up`` / its uplink. ``examples``: it trains
        that many of its examples (``fleet.partial_work``), its FLOPs their share."""
        p = self.profiles[cid]
        if self.exact:
            return self._fedscale_seconds(cid, bytes_down, bytes_up)
        work = self.work[cid]
        if examples is not None and self.examples is not None and self.examples[cid]:
            work *= examples / self.examples[cid]
        return work / p.compute + bytes_down / p.downlink + bytes_up / p.uplink

    def _fedscale_seconds(self, cid: int, bytes_down: int, bytes_up: int) -> float:
        """``fleet.fedscale_semantics=exact``: FedScale's ``get_completion_time`` in its own
        arithmetic: 3 x the samples charged x ms per sample / 1000 (times the exit's share of
        the model's step), plus the kbit down and up (``bytes / 1024 * 8``) / kbit/s."""
        p = self.profiles[cid]
        compute = FEDSCALE_AUGMENTATION * self.samples[cid] * float(p.ms_per_sample) / 1000.
        if self.exit_share[cid] != 1.0:
            compute *= self.exit_share[cid]
        kbit = bytes_up / 1024.0 * 8.0 + bytes_down / 1024.0 * 8.0
        return compute + kbit / float(p.kbps)

    def partial_examples(self, cid: int, bytes_down: int, bytes_up: int) -> int:
        """``fleet.partial_work``: how many of its examples client ``cid`` trains in a round so
        that it arrives by the deadline, its bytes included (all of them: it finishes; 0: not
        even one, or its bytes alone miss the deadline: it is late)."""
        n = self.examples[cid]
        if self.seconds(cid, bytes_down, bytes_up) <= self.deadline or n == 0:
            return n
        p = self.profiles[cid]
        left = self.deadline - bytes_down / p.downlink - bytes_up / p.uplink
        if left <= 0:
            return 0
        k = min(n, int(math.floor(left * p.compute / (self.work[cid] / n))))
        while k > 0 and self.seconds(cid, bytes_down, bytes_up, k) > self.deadline:
            k -= 1  # a rounding past the deadline
        while k < n and self.seconds(cid, bytes_down, bytes_up, k + 1) <= self.deadline:
            k += 1  # a rounding short of it (5.999... examples' time left: 6 fit)
        return k

    # -- availability -----------------------------------------------------------------------
    def _always(self) -> bool:
        """Every client always available (no on/off, trace or behaviour)."""
        return self._trace is None and self._cycles is None and self.cfg.mean_on is None

    def _intervals(self, cid: int, t: float) -> list[tuple[float, float]]:
        """The client's available intervals, drawn (on/off) or repeated (FedScale's cycles) at
        least up to ``t``."""
        if self._trace is not None:
            return self._trace[cid]
        if self._cycles is not None:
            return self._cycled(cid, t)
        if self.cfg.mean_on is None:
            return [(0.0, math.inf)]
        rng = self._rngs.get(cid)
        if rng is None:
            rng = self._rngs[cid] = np.random.default_rng([self.seed, AVAILABILITY_STREAM, cid])
            on, off = self.cfg.mean_on, self.cfg.mean_off
            self._on[cid] = bool(rng.random() < on / (on + off))  # the stationary split
        spans = self._spans[cid]
        while self._until[cid] <= t:
            start = self._until[cid]
            mean = self.cfg.mean_on if self._on[cid] else self.cfg.mean_off
            end = start + float(rng.exponential(mean))
            if self._on[cid]:
                spans.append((start, end))
            self._until[cid], self._on[cid] = end, not self._on[cid]
        return spans

    def _cycled(self, cid: int, t: float) -> list[tuple[float, float]]:
        """FedScale's availability: the entry's intervals in every cycle of ``finish_time``
        seconds (FedScale reads its clock modulo ``finish_time``), repeated two cycles past
        ``t``: an interval that reaches a cycle's end joins one at the next cycle's start, and
        as a cycle has a gap (one without is always available), no joined interval is longer
        than two cycles."""
        if self._cycles[cid] is None:
            return [(0.0, math.inf)]
        finish, base = self._cycles[cid]
        spans = self._spans[cid]
        while base and self._until[cid] <= t + 2 * finish:
            k0 = self._until[cid]
            for a, b in base:
                if spans and k0 + a <= spans[-1][1]:
                    spans[-1] = (spans[-1][0], max(spans[-1][1], k0 + b))
                else:
                    spans.append((k0 + a, k0 + b))
            self._until[cid] = k0 + finish
        return spans

    def online_until(self, cid: int, t: float) -> Optional[float]:
        """When the client's available interval holding ``t`` ends; None: it is not available
        at ``t``."""
        if self.exact:
            raise RuntimeError("fleet.fedscale_semantics=exact: availability is FedScale's "
                               "stateful query (Fleet.available, Fleet.round), not intervals")
        for a, b in self._intervals(cid, t):
            if a <= t < b:
                return b
        return None

    def offline_before(self, cid: int, start: float, seconds: float) -> Optional[float]:
        """When the client goes offline, if that is before it finishes ``seconds`` of work
        started at ``start``; None: it finishes online."""
        until = self.online_until(cid, start)
        return until if until is not None and start + seconds > until else None

    def available(self, t: float) -> list[int]:
        """The clients available at simulated time ``t`` (whether or not they fit in their
        device's memory: :attr:`fits`). exact: FedScale's query of every client in turn (which
        moves their cursors), or the answer :meth:`next_available` got at ``t``."""
        if self.exact:
            if self._asked is not None and self._asked[0] == t:
                online, self._asked = self._asked[1], None
                return list(online)
            return self._online(t)
        return [c for c in range(self.num_clients) if self.online_until(c, t) is not None]

    def _next_start(self, cid: int, t: float) -> Optional[float]:
        """When the client's next available interval after ``t`` starts (None: never)."""
        if self._always():
            return None  # always available
        if self._cycles is not None and self._cycles[cid] is None:
            return None  # available all through its cycle
        if self._cycles is not None and not self._cycles[cid][1]:
            return None  # a FedScale entry without an interval: never available
        horizon = t
        while True:
            later = [a for a, _ in self._intervals(cid, horizon) if a > t]
            if later or self._trace is not None:
                return later[0] if later else None
            horizon = self._until[cid]  # draw (or repeat) the next period

    def next_available(self, t: float) -> Optional[float]:
        """The first time >= ``t`` at which some client that fits in its device's memory is
        available (None: never again). exact: FedScale's round starts at ``t`` whoever is
        online (its simulator waits for no one): ``t``, or None when no client is online then
        (where FedScale's own simulator fails with an IndexError)."""
        if self.exact:
            self._asked = (t, self._online(t))
            return t if self._asked[1] else None
        if any(self.fits[c] for c in self.available(t)):
            return t
        starts = [s for c in range(self.num_clients)
                  if self.fits[c] and (s := self._next_start(c, t)) is not None]
        return min(starts) if starts else None

    def _online(self, t: float) -> list[int]:
        """exact: the clients FedScale's ``getFeasibleClients`` finds online at ``t``, each
        client's trace asked in turn (clients without one are always online)."""
        if self._stateful is None:
            return list(range(self.num_clients))
        return [c for c, trace in enumerate(self._stateful) if trace is None or trace.online(t)]

    def _still_online(self, cid: int, t: float) -> bool:
        trace = None if self._stateful is None else self._stateful[cid]
        return trace is None or trace.online(t)

    def select(self, online: list[int]) -> list[int]:
        """exact: the clients a round over-selects among ``online`` (sorted), as FedScale's
        aggregator and client manager do: ``int(target x 1.3)`` of them, all of them when they
        are no more, else the first of a shuffle (by this fleet's seeded generator) of the online
        list, at most all but one."""
        wanted = int(self.target * FEDSCALE_OVERCOMMITMENT)
        pool = list(online)
        if len(pool) <= wanted:
            return sorted(pool)
        self._selector.shuffle(pool)
        return sorted(pool[:min(wanted, len(pool) - 1)])

    def _fedscale_round(self, start: float, sampled: list[int], sent: dict[int, int],
                        received: dict[int, int]) -> tuple[dict[int, str], float]:
        """exact: FedScale's round rule (``tictak_client_tasks``): each sampled client in
        order of its id is kept if it is online when it would complete (``offline`` if not);
        the ``target`` fastest of those kept stay, a tie to the lower id (``discarded``: the
        rest); the round lasts until the last of them completes. With no client kept
        (FedScale's simulator fails with an IndexError there), until the last sampled one would
        have completed."""
        dropped: dict[int, str] = {}
        kept: list[tuple[float, int]] = []
        times = []
        for c in sorted(sampled):
            t = self.seconds(c, sent.get(c, 0), received.get(c, 0))
            times.append(t)
            if self._still_online(c, start + t):
                kept.append((t, c))
            else:
                dropped[c] = "offline"
        order = sorted(range(len(kept)), key=lambda i: kept[i][0])
        keep = min(self.target, len(kept))
        for i in order[keep:]:
            dropped[kept[i][1]] = "discarded"
        if keep:
            return dropped, kept[order[keep - 1]][0]
        return dropped, max(times, default=0.0)

    # -- the round --------------------------------------------------------------------------
    def round(self, start: float, sampled: list[int], sent: dict[int, int],
              received: dict[int, int], trained: Optional[dict[int, int]] = None
              ) -> tuple[dict[int, str], float]:
        """The simulated round that starts at ``start`` with the clients ``sampled`` (those
        that replied; ``sent`` / ``received``: the bytes each got and sent; ``trained``: the
        examples of those whose work was cut at the deadline): ``({client: why}`` of the
        clients dropped (``offline``, ``late``, ``discarded``), the round's simulated
        seconds)."""
        if self.exact:
            return self._fedscale_round(start, sampled, sent, received)
        trained = trained or {}
        times = {c: self.seconds(c, sent.get(c, 0), received.get(c, 0), trained.get(c))
                 for c in sampled}
        dropped: dict[int, str] = {}
        end = 0.0
        for c, t in times.items():
            until = self.offline_before(c, start, t)
            if until is not None:
                dropped[c] = "offline"
                end = max(end, min(until - start, self.deadline or math.inf))
            elif self.deadline is not None and t > self.deadline:
                dropped[c] = "late"
                end = max(end, self.deadline)
        arrived = sorted((t, c) for c, t in times.items() if c not in dropped)
        if self.keep_first is not None and len(arrived) > self.keep_first:
            for _, c in arrived[self.keep_first:]:
                dropped[c] = "discarded"
            # the server stops waiting at the N-th arrival: the others cost it nothing
            return dropped, arrived[self.keep_first - 1][0]
        if arrived:
            end = max(end, arrived[-1][0])
        return dropped, end

    def notes(self) -> list[str]:
        """What a user should be told about the fleet (a FedScale trace with fewer entries
        than the run has clients)."""
        out = []
        if self.cfg.name != "fedscale":
            return out
        if self.exact:
            return self._mapping_notes()
        for key, path, field in (("fleet.capacity", self.cfg.capacity, "capacity_id"),
                                 ("fleet.behaviour", self.cfg.behaviour, "behaviour_id")):
            if path is None:
                continue
            entries = len(read_capacity(path) if field == "capacity_id" else read_behaviour(path))
            if entries < self.num_clients:
                most = max(np.unique([str(getattr(p, field)) for p in self.profiles],
                                     return_counts=True)[1])
                out.append(f"fleet=fedscale: {self.num_clients} clients and {entries} entries "
                           f"in {key}: entries are reused (a seeded draw; each by at most "
                           f"{most} clients)")
        return out

    def _mapping_notes(self) -> list[str]:
        """exact: what FedScale's mapping does with these files (entries reused, keys the
        capacity file lacks)."""
        out = []
        capacity = read_capacity(self.cfg.capacity)
        files = [("fleet.capacity", len(capacity))]
        if self.cfg.behaviour is not None:
            files.append(("fleet.behaviour", len(behaviour_lists(self.cfg.behaviour))))
        for key, entries in files:
            if entries < self.num_clients:
                out.append(f"fleet=fedscale (exact): {self.num_clients} clients and {entries} "
                           f"entries in {key}: client k (from 1) takes entry k % {entries}, as "
                           f"FedScale maps them, so entries are reused")
        missing = [c for c, p in enumerate(self.profiles) if p.capacity_id not in capacity]
        if missing:
            out.append(f"fleet=fedscale (exact): {len(missing)} client(s) ({missing[:5]}"
                       f"{' ...' if len(missing) > 5 else ''}) map to a key fleet.capacity "
                       f"lacks (k % {len(capacity)}) and get FedScale's fallback of "
                       f"{FEDSCALE_MISSING_SPEEDS[0]:g} ms per sample and "
                       f"{FEDSCALE_MISSING_SPEEDS[1]:g} kbit/s")
        return out

    def describe(self) -> dict:
        """What ``fleet.json`` holds: the config, each client's profile and work (fedscale:
        the trace entries it was given, as the files hold them, and its availability's cycle),
        and the notes."""
        clients = []
        for c, p in enumerate(self.profiles):
            row = {k: v for k, v in asdict(p).items() if v is not None or k == "tier"}
            if self._cycles is not None and self._cycles[c] is not None:
                row["cycle_s"], row["available"] = self._cycles[c][0], self._cycles[c][1]
            if self._stateful is not None and self._stateful[c] is not None:
                trace = self._stateful[c]
                row["cycle_s"], row["available"] = trace.finish, trace.intervals
            if self.exact:
                row["samples"] = self.samples[c]
            if self.memory_capped:
                row["train_memory"], row["fits"] = self.train_memory[c], self.fits[c]
            clients.append({"client": c, **row, "train_flops": self.work[c]})
        return {"config": asdict(self.cfg), "seed": self.seed, "deadline_s": self.deadline,
                **({"reference_flops": self.reference_flops} if self.cfg.name == "fedscale"
                   else {}),
                **({"target": self.target, "overcommitment": FEDSCALE_OVERCOMMITMENT}
                   if self.exact else {}),
                "notes": self.notes(), "clients": clients}




def train_flops_per_example(model, source, index: int, exits: Optional[list[int]], *,
                            device: str, precision: str) -> float:
    """The FLOPs one training example costs the model at ``exits`` (their mean: an anytime
    client draws one per step; None: the model's own forward): forward and backward of a batch
    of two copies of example ``index`` under ``torch.utils.flop_counter.FlopCounterMode``,
    halved, on the run's device and in its precision (a bf16-held model needs autocast; the
    count does not depend on either). The counter counts matrix products, convolutions and
    attention (forward and backward), not elementwise operations."""
    from torch.utils.flop_counter import FlopCounterMode

    from fedadapt.devices import autocast
    from fedadapt.federation.client.grouped import StepLoss

    x, y = source.get(np.array([index, index]), device)
    call, out = StepLoss(model), []
    was_training = model.training
    model.train()
    try:
        for e in exits if exits else [None]:
            model.zero_grad(set_to_none=True)
            with FlopCounterMode(display=False) as counter:
                with autocast(device, precision):
                    loss = call(x, y, e)
                if loss.requires_grad:
                    loss.backward()
            out.append(counter.get_total_flops() / 2)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return float(np.mean(out))


#: FLOPs per training example by ``(run, exit)``: each exit of a run measured once (the
#: tiers from the fleet and the fleet's work ask for the same ones).
_FLOPS: dict[tuple, float] = {}


def _flops_at(spec, model, exits: Optional[list[int]]) -> float:
    """:func:`train_flops_per_example` at ``exits`` (their mean; None: the model's own
    forward), each exit measured once per run."""
    from fedadapt.federation.client.worker import first_train_index

    if any(key[0] != spec.run_id for key in _FLOPS):
        _FLOPS.clear()  # another run's model
    for e in exits or [None]:
        if (spec.run_id, e) not in _FLOPS:
            _FLOPS[(spec.run_id, e)] = train_flops_per_example(
                model, spec.train_source, first_train_index(spec), None if e is None else [e],
                device=spec.device, precision=spec.precision)
    return float(np.mean([_FLOPS[(spec.run_id, e)] for e in exits or [None]]))


def train_memory_bytes(model, source, index: int, exit_: Optional[int], *, device: str,
                       precision: str, optimizer_states: int) -> tuple[float, float]:
    """``(fixed, per_example)``: the bytes one training step of the model at ``exit_`` (None:
    its own forward) holds, as ``fixed + per_example x batch``, measured on the run's device in
    its precision:

    * the weights (parameters and buffers) the step reads, measured by a dispatch mode that
      sees every tensor an operation reads;
    * for those the optimiser updates (trainable and read), their gradients and
      ``optimizer_states`` optimiser tensors of the same size each (SGD with momentum 1, Adam
      2, plain SGD 0);
    * the tensors autograd saves for the backward (the activations: every storage a
      ``saved_tensors_hooks`` pack sees, once, the weights left out), measured at batches of 2
      and 3 copies of example ``index``: their difference is one example's, linear in the
      batch.

    What the step frees as it goes (the backward's transient buffers, the allocator's slack)
    is not counted: it is the training state a device must hold, not a peak of any one
    allocator."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from fedadapt.devices import autocast
    from fedadapt.federation.client.grouped import StepLoss

    def ptr(t) -> int:
        return t.untyped_storage().data_ptr()

    held = {ptr(t): t for t in (*model.parameters(), *model.buffers())}
    call = StepLoss(model)

    def measure(batch: int) -> tuple[float, set]:
        read: set[int] = set()
        saved: dict[int, int] = {}

        class Reads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                for leaf in tree_leaves((args, kwargs or {})):
                    if isinstance(leaf, torch.Tensor):
                        read.add(ptr(leaf))
                return func(*args, **(kwargs or {}))

        def pack(t):
            if isinstance(t, torch.Tensor) and ptr(t) not in held:
                saved[ptr(t)] = t.untyped_storage().nbytes()
            return t

        x, y = source.get(np.array([index] * batch), device)
        model.zero_grad(set_to_none=True)
        with Reads(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with autocast(device, precision):
                loss = call(x, y, exit_)
            if loss.requires_grad:
                loss.backward()
        return float(sum(saved.values())), read & set(held)

    was_training = model.training
    model.train()
    try:
        two, read = measure(2)
        three, _ = measure(3)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    weights = sum(held[p].untyped_storage().nbytes() for p in read)
    trainable = sum(held[p].untyped_storage().nbytes() for p in read
                    if held[p].requires_grad)
    per_example = max(three - two, 0.0)
    fixed = weights + trainable * (1 + optimizer_states) + (two - 2 * per_example)
    return float(fixed), float(per_example)


#: Training memory ``(fixed, per example)`` by ``(run, exit)``, each exit measured once per
#: run (as the FLOPs are).
_MEMORY: dict[tuple, tuple[float, float]] = {}


def optimizer_states(train) -> int:
    """Optimiser tensors per trainable tensor: Adam's two moments, SGD's momentum buffer."""
    if train.optimizer in ("adam", "adamw"):
        return 2
    return 1 if train.momentum else 0


def _memory_at(spec, model, exits: Optional[list[int]], batch: int) -> float:
    """The bytes a client's training at ``exits`` holds at batches of ``batch`` (its steps draw
    any of the exits: the largest of theirs), each exit measured once per run."""
    from fedadapt.federation.client.worker import first_train_index

    if any(key[0] != spec.run_id for key in _MEMORY):
        _MEMORY.clear()  # another run's model
    for e in exits or [None]:
        if (spec.run_id, e) not in _MEMORY:
            _MEMORY[(spec.run_id, e)] = train_memory_bytes(
                model, spec.train_source, first_train_index(spec), e, device=spec.device,
                precision=spec.precision, optimizer_states=optimizer_states(spec.train))
    return max(fixed + per * batch for fixed, per in
               (_MEMORY[(spec.run_id, e)] for e in exits or [None]))


def _batch_of(spec, client) -> int:
    """The largest batch a client trains: ``train.batch_size``, or all its examples."""
    return max(1, min(spec.train.batch_size, len(client.train)))


def tiers_from_fleet(cfg, spec, model) -> list[int]:
    """``setting.tiers_from=fleet``: each client's exit, the deepest whose local training its
    device finishes within ``federation.round_timeout`` simulated seconds (compute only: FLOPs
    per example x its examples x local epochs / its FLOP/s). Multi-tier: its tier, among the
    setting's exits (``setting.tiers``, default every exit), at that exit's cost. Anytime: the
    deepest exit its steps may draw, at the mean cost of the exits up to it. A client too slow
    even for the shallowest gets the shallowest (and is late)."""
    anytime = cfg.setting.name == "anytime"
    exits = sorted(set(cfg.setting.tiers if cfg.setting.tiers is not None and not anytime
                       else range(spec.num_exits)))
    # anytime: a step draws uniformly from the exits up to the cap
    flops = {e: _flops_at(spec, model, [d for d in exits if d <= e] if anytime else [e])
             for e in exits}
    out = []
    reference = _flops_at(spec, model, None) if cfg.fleet.name == "fedscale" else 1.0
    for client, p in zip(spec.clients, profiles(cfg.fleet, spec.num_clients, cfg.seed,
                                                reference)):
        work = len(client.train) * cfg.train.local_epochs / p.compute
        fits = [e for e in exits if flops[e] * work <= cfg.federation.round_timeout
                and (p.memory is None or _memory_at(
                    spec, model, [d for d in exits if d <= e] if anytime else [e],
                    _batch_of(spec, client)) <= p.memory)]
        out.append(fits[-1] if fits else exits[0])
    return out


def charged_samples(fleet_cfg: FleetConfig, train, examples: int) -> int:
    """``fleet.fedscale_semantics=exact``: the samples FedScale charges a client a round,
    ``train.batch_size`` x its local steps: ``fleet.local_steps``, or (null) the steps of the
    client's own local epochs, ``ceil(examples / batch) x train.local_epochs``."""
    steps = fleet_cfg.local_steps
    if steps is None:
        steps = math.ceil(examples / train.batch_size) * train.local_epochs
    return int(train.batch_size) * int(steps)


def _fedscale_fleet(cfg, spec, model) -> Fleet:
    """``fleet.fedscale_semantics=exact``: the fleet with FedScale's work (each client charged
    :func:`charged_samples` at its exit's share of the model's own step) and target count (the
    clients ``partition.fraction_fit`` samples of the run's, as the strategy counts them)."""
    from fedadapt.federation.client.worker import client_exits
    from fedadapt.strategies.build import sample_size

    reference = _flops_at(spec, model, None)
    per_example = [_flops_at(spec, model, client_exits(spec, cid))
                   for cid in range(spec.num_clients)]
    samples = [charged_samples(cfg.fleet, cfg.train, len(client.train))
               for client in spec.clients]
    return Fleet(cfg.fleet, spec.num_clients, cfg.seed,
                 [f * n for f, n in zip(per_example, samples)], deadline=None,
                 reference_flops=reference,
                 examples=[len(client.train) for client in spec.clients],
                 target=sample_size(spec.num_clients, cfg.partition.fraction_fit),
                 samples=samples, exit_share=[f / reference for f in per_example])


def build_fleet(cfg, spec, model) -> Optional[Fleet]:
    """The run's :class:`Fleet` (``fleet=``; None for ``fleet=none``): each client's training
    FLOPs per round measured on ``model`` at its exits, times its examples and local epochs."""
    from fedadapt.federation.client.worker import client_exits

    if cfg.fleet.name == "none":
        return None
    from fedadapt.log import log

    if exact_fedscale(cfg.fleet):
        fleet = _fedscale_fleet(cfg, spec, model)
        for note in fleet.notes():
            log(note)
        return fleet
    work = [_flops_at(spec, model, client_exits(spec, cid)) * len(client.train)
            * cfg.train.local_epochs for cid, client in enumerate(spec.clients)]
    fleet = Fleet(cfg.fleet, spec.num_clients, cfg.seed, work,
                  deadline=cfg.federation.round_timeout,
                  reference_flops=(_flops_at(spec, model, None) if cfg.fleet.name == "fedscale"
                                   else 1.0),
                  examples=[len(client.train) for client in spec.clients],
                  train_memory=([_memory_at(spec, model, client_exits(spec, cid),
                                            _batch_of(spec, client))
                                 for cid, client in enumerate(spec.clients)]
                                if cfg.fleet.memory is not None else None))
    for note in fleet.notes():
        log(note)
    return fleet


__all__ = ["FedScaleTrace", "Fleet", "Profile", "TraceUnpickler", "assign_memory",
           "behaviour_lists", "build_fleet", "charged_samples", "draw_entries", "exact_fedscale",
           "fedscale_entry", "profiles", "read_behaviour", "read_capacity", "read_trace",
           "tiers_from_fleet", "train_flops_per_example", "train_memory_bytes"]
