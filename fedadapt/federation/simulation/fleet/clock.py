"""The simulated clock: a :class:`Fleet` holds the run's devices, each client's work and its
availability, and says a client's time in a round and how a round ends on the clock (see the
package's docstring)."""

from __future__ import annotations

import math
import random
from dataclasses import asdict
from typing import Optional

import numpy as np

from fedadapt.config import ConfigError
from fedadapt.federation.simulation.fleet.kinds import SimulatedFleet
from fedadapt.federation.simulation.fleet.profiles import (
    FEDSCALE_AUGMENTATION,
    FEDSCALE_MISSING_SPEEDS,
    profiles,
)
from fedadapt.federation.simulation.fleet.traces import (
    FedScaleTrace,
    behaviour_lists,
    read_behaviour,
    read_capacity,
    read_trace,
)

#: The seed stream of each client's availability.
AVAILABILITY_STREAM = 0xA7A1
#: ``fleet.fedscale_semantics=exact``: FedScale's aggregator over-selects this many times the
#: round's target count (its ``--overcommitment`` default).
FEDSCALE_OVERCOMMITMENT = 1.3


class Fleet:
    """The run's devices and their availability; :meth:`seconds` is a client's time in a
    round. ``work[cid]``: the FLOPs of the client's local training in one round."""

    def __init__(self, cfg: SimulatedFleet, num_clients: int, seed: int, work: list[float],
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
        self.exact = cfg.exact
        if self.exact:
            if target is None or target < 1 or samples is None or len(samples) != num_clients:
                raise ValueError("fleet.fedscale_semantics=exact needs the round's target count "
                                 "and each client's charged samples")
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
        self._trace = read_trace(cfg.trace, num_clients) if cfg.availability_csv else None
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
        elif cfg.fedscale_traces and cfg.behaviour is not None:
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
        if not self.cfg.fedscale_traces:
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
                **({"reference_flops": self.reference_flops} if self.cfg.fedscale_traces
                   else {}),
                **({"target": self.target, "overcommitment": FEDSCALE_OVERCOMMITMENT}
                   if self.exact else {}),
                "notes": self.notes(), "clients": clients}


