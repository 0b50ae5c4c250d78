"""The fleet kinds (``fleet=`` options), each a schema over :class:`~fedadapt.config.FleetConfig`
(whose own kind is ``none``) with its keys, its capabilities as class attributes
(``simulated``, ``fedscale_traces``, ``availability_csv``: not config keys), its devices
(``devices``) and its refusals (``check``, which :func:`fedadapt.config.validate` calls before
any data is read). :func:`register_fleet` registers a kind (a user's too: a subclass of
:class:`SimulatedFleet` with its ``devices``); :func:`fleet_kinds` is the registry
:func:`fedadapt.entry.register_configs` stores as ``schema/fleet/<name>``. Outside this module
a kind is asked for its capabilities, never compared by its name."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Optional

from fedadapt.config import FleetConfig, RunConfig, check
from fedadapt.federation.simulation.fleet.profiles import (
    Profile,
    fedscale_devices,
    lognormal_devices,
    tier_devices,
)
from fedadapt.federation.simulation.fleet.traces import FEDSCALE_TRACES

#: ``fleet.fedscale_semantics``: fedadapt's reading of FedScale's traces, or FedScale's own.
FEDSCALE_SEMANTICS = ("fedadapt", "exact")
#: The kinds by ``fleet=`` option (:func:`register_fleet`); ``none`` is the base itself.
_KINDS: dict[str, type[FleetConfig]] = {"none": FleetConfig}


def register_fleet(kind: type[FleetConfig]) -> type[FleetConfig]:
    """Class decorator: ``kind`` becomes the ``fleet=`` option named by its ``name`` default (a
    preset ``conf/fleet/<name>.yaml`` extends ``/schema/fleet/<name>@_here_``)."""
    _KINDS[kind.name] = kind
    return kind


def _shares(fractions: Optional[list[float]], entries: int) -> bool:
    """One share >= 0 per entry, summing to 1 (null: equal shares)."""
    return fractions is None or (len(fractions) == entries and all(f >= 0 for f in fractions)
                                 and abs(sum(fractions) - 1) < 1e-6)


def _speeds(kind: FleetConfig, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = getattr(kind, key)
        check(math.isfinite(value) and value > 0, f"fleet.{key}", value,
              "must be > 0 (a speed can be neither 0 nor negative)")


def _existing(key: str, path: str, hint: str = "") -> None:
    """A file a kind reads, refused in one line with its resolved path when it is not there."""
    file = Path(path).expanduser().resolve()
    check(file.is_file(), key, path, f"no such file: {file}{hint}")


@dataclass
class SimulatedFleet(FleetConfig):
    """The keys of every fleet that simulates devices: a profile per client (compute, downlink,
    uplink) and an availability, each round on a simulated clock: a client's time is its
    training FLOPs / its FLOP/s plus the bytes it receives / its downlink and sends / its
    uplink; ``federation.round_timeout`` is then the round's deadline in simulated seconds."""

    simulated: ClassVar[bool] = True
    #: Availability: a two-state on/off process per client with these mean durations in
    #: simulated seconds (exponential); null: always available (``trace``: from the CSV).
    mean_on: Optional[float] = None
    mean_off: Optional[float] = None
    #: Over-selection: keep only the first N clients to arrive (the others are discarded, as
    #: FedScale's over-commitment); null: every client that arrives in time.
    keep_first: Optional[int] = None
    #: A client that cannot finish by the deadline (``federation.round_timeout``) trains the
    #: share of its examples it can in time and sends that (its weight scaled by its work)
    #: instead of being dropped; ``sim_partial`` counts them per round.
    partial_work: bool = False
    #: Each device's memory in bytes, smallest first: the clients, ordered by their device's
    #: compute, take the values in the shares ``memory_fractions`` (the slowest the smallest).
    #: A client whose training (measured per exit) does not fit is not sampled
    #: (``sim_no_memory``), or with ``setting.tiers_from=fleet`` trains the deepest exit that
    #: fits. null: no cap.
    memory: Optional[list[float]] = None
    #: The share of the clients with each entry of ``memory``; null: equal shares.
    memory_fractions: Optional[list[float]] = None

    def devices(self, num_clients: int, seed: int, reference_flops: float = 1.0
                ) -> list[Profile]:
        """Each client's seeded device (:mod:`.profiles`), before ``memory`` is assigned."""
        raise NotImplementedError(f"fleet={self.name} builds no devices")

    def check(self, cfg: RunConfig) -> None:
        check(not self.partial_work or cfg.federation.round_timeout is not None,
              "fleet.partial_work", self.partial_work,
              "true needs a fleet and its deadline federation.round_timeout (simulated seconds), "
              "at which a client's work is cut (not strategy=fedbuff, which has no deadline)")
        check((self.mean_on is None) == (self.mean_off is None), "fleet.mean_on", self.mean_on,
              "set fleet.mean_on and fleet.mean_off together (null both: always available)")
        for key in ("mean_on", "mean_off"):
            value = getattr(self, key)
            check(value is None or (math.isfinite(value) and value > 0), f"fleet.{key}", value,
                  "must be > 0 simulated seconds, or null")
        if self.memory is not None:
            mem = list(self.memory)
            check(bool(mem) and all(math.isfinite(m) and m > 0 for m in mem), "fleet.memory",
                  mem, "each device's memory in bytes must be > 0")
            check(mem == sorted(mem), "fleet.memory", mem,
                  "smallest first (the slowest devices take the first entry)")
        if self.memory_fractions is not None:
            fr = list(self.memory_fractions)
            check(self.memory is not None and _shares(fr, len(self.memory)),
                  "fleet.memory_fractions", fr,
                  "one share >= 0 per entry of fleet.memory, summing to 1")
        check(self.keep_first is None or self.keep_first >= 1, "fleet.keep_first",
              self.keep_first, "must be >= 1 or null")


@register_fleet
@dataclass
class TiersFleet(SimulatedFleet):
    """``fleet=tiers``: ``compute[i]`` for a seeded share ``fractions[i]`` of the clients, every
    client the same bandwidths."""

    name: str = "tiers"
    #: Each tier's compute in FLOP/s, slowest first.
    compute: list[float] = field(default_factory=lambda: [1e9, 3e9, 1e10])
    #: The share of clients in each tier; null: equal shares.
    fractions: Optional[list[float]] = None
    #: Downlink and uplink in bytes/s.
    downlink: float = 2.5e6
    uplink: float = 1.25e6

    def devices(self, num_clients: int, seed: int, reference_flops: float = 1.0
                ) -> list[Profile]:
        return tier_devices(self, num_clients, seed)

    def check(self, cfg: RunConfig) -> None:
        _speeds(self, ("downlink", "uplink"))
        check(bool(self.compute) and all(math.isfinite(c) and c > 0 for c in self.compute),
              "fleet.compute", list(self.compute),
              "each tier's FLOP/s must be > 0 (a speed can be neither 0 nor negative)")
        fr = None if self.fractions is None else list(self.fractions)
        check(_shares(fr, len(self.compute)), "fleet.fractions", fr,
              "one share >= 0 per entry of fleet.compute, summing to 1")
        super().check(cfg)


@register_fleet
@dataclass
class LognormalFleet(SimulatedFleet):
    """``fleet=lognormal``: each client's compute and bandwidths drawn log-normally (seeded)
    around the medians."""

    name: str = "lognormal"
    #: The median compute (FLOP/s) and the sigma of its log.
    compute_median: float = 3e9
    compute_sigma: float = 0.8
    #: The median downlink and uplink in bytes/s.
    downlink: float = 2.5e6
    uplink: float = 1.25e6
    #: The sigma of the bandwidths' log (0: every client the medians).
    bandwidth_sigma: float = 0.5

    def devices(self, num_clients: int, seed: int, reference_flops: float = 1.0
                ) -> list[Profile]:
        return lognormal_devices(self, num_clients, seed)

    def check(self, cfg: RunConfig) -> None:
        _speeds(self, ("compute_median", "downlink", "uplink"))
        for key in ("compute_sigma", "bandwidth_sigma"):
            value = getattr(self, key)
            check(math.isfinite(value) and value >= 0, f"fleet.{key}", value, "must be >= 0")
        super().check(cfg)


@register_fleet
@dataclass
class TraceFleet(TiersFleet):
    """``fleet=trace``: compute and bandwidths by tier (as ``tiers``), the availability read from
    the CSV ``trace``."""

    name: str = "trace"
    availability_csv: ClassVar[bool] = True
    #: A CSV with a header ``client,start,end``: the simulated seconds each client is available
    #: (one row per interval; a client without a row is never available).
    trace: Optional[str] = None

    def check(self, cfg: RunConfig) -> None:
        check(self.trace is not None, "fleet.trace", self.trace,
              "fleet=trace reads its availability from fleet.trace (a CSV client,start,end)")
        _existing("fleet.trace", self.trace)
        check(self.mean_on is None, "fleet.mean_on", self.mean_on,
              "fleet=trace reads availability from its CSV: leave fleet.mean_on null")
        super().check(cfg)


@register_fleet
@dataclass
class FedScaleFleet(SimulatedFleet):
    """``fleet=fedscale``: FedScale's device traces: speeds from ``capacity``, availability from
    ``behaviour``, read as ``fedscale_semantics`` says."""

    name: str = "fedscale"
    fedscale_traces: ClassVar[bool] = True
    #: FedScale's ``client_device_capacity`` pickle (client id -> ``{'computation': ms per
    #: sample, 'communication': kbit/s}``), read as FedScale's simulator reads it.
    capacity: Optional[str] = None
    #: FedScale's ``client_behave_trace`` pickle (client id -> ``{'active': [s], 'inactive':
    #: [s], 'finish_time': s, ...}``, cycling every ``finish_time``); null: every device always
    #: available.
    behaviour: Optional[str] = None
    #: ``fedadapt`` (fedadapt's reading: FedScale's speeds, availability as fixed half-open
    #: intervals, each client's own examples x epochs, entries by a seeded draw) or ``exact``
    #: (FedScale's simulator to the letter: its stateful availability over closed intervals,
    #: ``train.batch_size`` x ``local_steps`` samples a round, client k on entry k % n, and its
    #: round rule: 1.3x over-selection among the clients online at the round's start, those
    #: still online at completion kept, the round ending at the target count's fastest). See
    #: docs/fleet.md.
    fedscale_semantics: str = "fedadapt"
    #: fedscale_semantics=exact: the local steps FedScale charges every client a round (its
    #: ``--local_steps``), each of ``train.batch_size`` samples; null: the steps of each
    #: client's own local epochs (ceil(examples / batch) x ``train.local_epochs``).
    local_steps: Optional[int] = None

    @property
    def exact(self) -> bool:
        return self.fedscale_semantics == "exact"

    def devices(self, num_clients: int, seed: int, reference_flops: float = 1.0
                ) -> list[Profile]:
        return fedscale_devices(self, num_clients, seed, reference_flops)

    def check(self, cfg: RunConfig) -> None:
        check(self.fedscale_semantics in FEDSCALE_SEMANTICS, "fleet.fedscale_semantics",
              self.fedscale_semantics, f"one of {FEDSCALE_SEMANTICS}")
        check(self.local_steps is None or self.exact, "fleet.local_steps", self.local_steps,
              "only fleet=fedscale with fleet.fedscale_semantics=exact charges FedScale's "
              "train.batch_size x local_steps samples a round: leave it null")
        check(self.local_steps is None or self.local_steps >= 1, "fleet.local_steps",
              self.local_steps, "must be >= 1 or null")
        if self.exact:
            check(self.keep_first is None, "fleet.keep_first", self.keep_first,
                  "fleet.fedscale_semantics=exact keeps FedScale's target count of the 1.3x it "
                  "over-selects: leave it null")
            check(not self.partial_work, "fleet.partial_work", self.partial_work,
                  "fleet.fedscale_semantics=exact has FedScale's round rule, which cuts no "
                  "work: leave it false")
            check(self.memory is None, "fleet.memory", self.memory,
                  "fleet.fedscale_semantics=exact simulates what FedScale's simulator does, "
                  "which caps no memory: leave it null")
            check(cfg.federation.round_timeout is None, "federation.round_timeout",
                  cfg.federation.round_timeout,
                  "fleet.fedscale_semantics=exact runs FedScale's round rule, which has no "
                  "deadline: leave it null")
        check(self.capacity is not None, "fleet.capacity", self.capacity,
              f"fleet=fedscale reads each device's speeds from fleet.capacity (FedScale's "
              f"client_device_capacity pickle; {FEDSCALE_TRACES})")
        _existing("fleet.capacity", self.capacity, f" ({FEDSCALE_TRACES})")
        if self.behaviour is not None:
            _existing("fleet.behaviour", self.behaviour, f" ({FEDSCALE_TRACES})")
        check(self.mean_on is None, "fleet.mean_on", self.mean_on,
              "fleet=fedscale takes its availability from fleet.behaviour (null: always "
              "available): leave fleet.mean_on null")
        super().check(cfg)


def fleet_kinds() -> dict[str, type[FleetConfig]]:
    """``{fleet= option: its schema}``: ``none`` is :class:`~fedadapt.config.FleetConfig`
    itself (no devices, no clock)."""
    return dict(_KINDS)


__all__ = ["FEDSCALE_SEMANTICS", "FedScaleFleet", "LognormalFleet", "SimulatedFleet",
           "TiersFleet", "TraceFleet", "fleet_kinds", "register_fleet"]
