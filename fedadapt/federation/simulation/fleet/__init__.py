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

The package's modules, one job each: :mod:`.kinds` (the ``fleet=`` kinds: schemas, capabilities,
checks), :mod:`.profiles` (device profiles), :mod:`.traces` (trace files: the availability CSV
and FedScale's pickles), :mod:`.clock` (the :class:`Fleet` and its simulated clock) and
:mod:`.costs` (FLOP and memory costs, and :func:`build_fleet`).
"""

from fedadapt.federation.simulation.fleet.clock import FEDSCALE_OVERCOMMITMENT, Fleet
from fedadapt.federation.simulation.fleet.costs import (
    build_fleet,
    charged_samples,
    optimizer_states,
    tiers_from_fleet,
    train_flops_per_example,
    train_memory_bytes,
)
from fedadapt.federation.simulation.fleet.kinds import (
    FedScaleFleet,
    LognormalFleet,
    SimulatedFleet,
    TiersFleet,
    TraceFleet,
    fleet_kinds,
    register_fleet,
)
from fedadapt.federation.simulation.fleet.profiles import (
    FEDSCALE_MISSING_SPEEDS,
    PROFILE_STREAM,
    Profile,
    assign_memory,
    draw_entries,
    fedscale_entry,
    profiles,
)
from fedadapt.federation.simulation.fleet.traces import (
    FEDSCALE_TRACES,
    FedScaleTrace,
    TraceUnpickler,
    behaviour_lists,
    merged_intervals,
    read_behaviour,
    read_capacity,
    read_trace,
)

__all__ = ["FEDSCALE_MISSING_SPEEDS", "FEDSCALE_OVERCOMMITMENT", "FEDSCALE_TRACES",
           "PROFILE_STREAM", "FedScaleFleet", "FedScaleTrace", "Fleet", "LognormalFleet",
           "Profile", "SimulatedFleet", "TiersFleet", "TraceFleet", "TraceUnpickler",
           "assign_memory", "behaviour_lists", "build_fleet", "charged_samples", "draw_entries",
           "fedscale_entry", "fleet_kinds", "merged_intervals", "optimizer_states", "profiles",
           "read_behaviour", "read_capacity", "read_trace", "register_fleet", "tiers_from_fleet",
           "train_flops_per_example", "train_memory_bytes"]
