"""Device profiles: each client's seeded compute (FLOP/s), downlink and uplink (bytes/s), and
memory. Each fleet kind builds its devices (``devices``, :mod:`.kinds`) from these functions:
:func:`tier_devices` (``tiers``, ``trace``), :func:`lognormal_devices` and
:func:`fedscale_devices` (an entry of FedScale's ``client_device_capacity`` per client, by a
seeded draw or, with ``fleet.fedscale_semantics=exact``, by FedScale's own mapping)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from fedadapt.federation.simulation.fleet.traces import (
    TraceId,
    behaviour_lists,
    read_behaviour,
    read_capacity,
)

#: The seed streams of the profiles and of the draw of a FedScale behaviour entry per client.
PROFILE_STREAM, BEHAVIOUR_STREAM = 0xF1EE7, 0xBE4A
#: FedScale's completion time counts a training example as 3 forward passes (forward, and a
#: backward of about twice its cost) of its measured per-sample latency.
FEDSCALE_AUGMENTATION = 3.0
#: FedScale's sizes are kbit of 1,024 bits (``bytes / 1024 * 8``) over bandwidths in kbit/s:
#: one kbit/s carries this many bytes a second.
KBPS_BYTES = 1024 / 8
#: ``fleet.fedscale_semantics=exact``: the speeds FedScale's aggregator gives a client whose
#: mapped key (``k % n``) is not in its capacity file: 1 ms per sample, 1 kbit/s.
FEDSCALE_MISSING_SPEEDS = (1.0, 1.0)


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


def profiles(cfg, num_clients: int, seed: int, reference_flops: float = 1.0) -> list[Profile]:
    """Each client's seeded :class:`Profile` (the fleet kind's ``devices``), with
    ``fleet.memory``'s memory by compute (:func:`assign_memory`)."""
    out = cfg.devices(num_clients, seed, reference_flops)
    if cfg.memory is None:
        return out
    return [replace(p, memory=m) for p, m in
            zip(out, assign_memory(cfg, [p.compute for p in out]))]


def _profile_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), PROFILE_STREAM])


def tier_devices(cfg, num_clients: int, seed: int) -> list[Profile]:
    """``tiers`` / ``trace``: tier i's ``compute[i]`` for a seeded share ``fractions[i]`` of
    the clients (equal shares by default), every client the same bandwidths."""
    tiers = len(cfg.compute)
    fractions = list(cfg.fractions or [1 / tiers] * tiers)
    bounds = _share_bounds(fractions, num_clients)
    tier_of = np.zeros(num_clients, dtype=int)
    order = _profile_rng(seed).permutation(num_clients)
    for t, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        tier_of[order[lo:hi]] = t
    return [Profile(float(cfg.compute[t]), float(cfg.downlink), float(cfg.uplink), int(t))
            for t in tier_of]


def lognormal_devices(cfg, num_clients: int, seed: int) -> list[Profile]:
    """``lognormal``: each client's compute and bandwidths drawn log-normally around the
    medians (compute, then downlink, then uplink, from one seeded stream)."""
    rng = _profile_rng(seed)
    c = cfg.compute_median * np.exp(cfg.compute_sigma * rng.standard_normal(num_clients))
    d = cfg.downlink * np.exp(cfg.bandwidth_sigma * rng.standard_normal(num_clients))
    u = cfg.uplink * np.exp(cfg.bandwidth_sigma * rng.standard_normal(num_clients))
    return [Profile(float(a), float(b), float(e)) for a, b, e in zip(c, d, u)]


def fedscale_devices(cfg, num_clients: int, seed: int, reference_flops: float = 1.0
                     ) -> list[Profile]:
    """``fedscale``: each client is given a ``fleet.capacity`` entry by a seeded draw
    (:func:`draw_entries`; with ``fleet.fedscale_semantics=exact`` by FedScale's mapping,
    :func:`_mapped_devices`), its compute the FLOP/s at which one training example of
    ``reference_flops`` (the run's model's own training step) takes FedScale's time, 3 x its
    milliseconds per sample; its bandwidths its kbit/s both ways (the default
    ``reference_flops`` of 1 keeps only the devices' order)."""
    if cfg.exact:
        return _mapped_devices(cfg, num_clients, reference_flops)
    capacity = read_capacity(cfg.capacity)
    out = []
    for key in draw_entries(list(capacity), num_clients, _profile_rng(seed)):
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


def _share_bounds(fractions: list[float], n: int) -> np.ndarray:
    """Where each share of ``n`` items ends (as the tiers are cut)."""
    return np.round(np.cumsum([0.0, *fractions]) * n).astype(int)


def assign_memory(cfg, compute: list[float]) -> list[float]:
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


def fedscale_entry(cid: int, entries: int) -> int:
    """The position FedScale gives fedadapt's client ``cid``: its aggregator numbers clients
    from 1 (client k = cid + 1) and maps client k to capacity key ``k % n`` and to the behaviour
    file's ``k % n``-th key (in the file's order)."""
    return (cid + 1) % entries


def _mapped_devices(cfg, num_clients: int, reference_flops: float
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
