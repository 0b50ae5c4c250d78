"""Write a generated pair of device traces in exactly FedScale's format, for `fleet=fedscale`
where FedScale's own files are not at hand. FedScale keeps its own pair in its git repository
(https://github.com/SymbioticLab/FedScale, `benchmark/dataset/data/device_info/`); this
project's machines reach no network, so they are not used here.

    python scripts/fedscale_traces.py OUT_DIR [--devices 500] [--seed 0] [--to-finish]

writes OUT_DIR/client_device_capacity and OUT_DIR/client_behave_trace, pickles of

    client_device_capacity: {client id: {'computation': ms per sample, 'communication': kbit/s}}
    client_behave_trace:    {client id: {'duration': s, 'inactive': [s], 'finish_time': s,
                                         'active': [s], 'model': str}}

GENERATED, NOT FEDSCALE'S DATA. FedScale shows its traces' spread only as figures (compute
latency of AI Benchmark's phones and MobiPerf's network throughput, each over about two orders of
magnitude). The distributions below are this script's choice, stated so that a table made on
them says what it ran on:

- computation: log-normal, median 30 ms per sample, sigma 0.8 (5% of devices under 8 ms, 5%
  over 110 ms: a fast phone to a slow one, a 14x spread);
- communication: log-normal, median 2,000 kbit/s, sigma 1.0 (5% under 390, 5% over 10,000);
- availability: a cycle of `finish_time` = 600 s (the runs it is made for last minutes of
  simulated time, so a day's cycle would leave a device always on or always off), with one to
  three active intervals covering a share of the cycle drawn uniformly from 40% to 100%, in
  whole seconds. An interval that would reach the cycle's end ends at `finish_time - 1`
  (599 s): FedScale's own simulator (`ClientMetadata.is_active`) never moves past an interval
  that ends at `finish_time`, so an entry with one would stay on it for good
  (`fleet.fedscale_semantics=exact` reads it so; docs/fleet.md). `--to-finish` writes such
  intervals to `finish_time` as this script did before (the same bytes as then);
- models: one of a few phone names, unused by fedadapt (as by FedScale's simulator).

Seeded: the same seed writes the same bytes."""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import numpy as np

from fedadapt.files import atomic_write

CYCLE_S = 600
MODELS = ("SM-G950F", "CPH1801", "Pixel 3", "Redmi Note 8", "iPhone 11")


def capacity(devices: int, rng: np.random.Generator) -> dict:
    ms = rng.lognormal(np.log(30.0), 0.8, devices)
    kbps = rng.lognormal(np.log(2000.0), 1.0, devices)
    return {i + 1: {"computation": float(ms[i]), "communication": float(kbps[i])}
            for i in range(devices)}


def one_behaviour(rng: np.random.Generator, to_finish: bool = False) -> dict:
    intervals = int(rng.integers(1, 4))
    on_share = rng.uniform(0.4, 1.0)
    # the cycle cut at sorted points into 2 x intervals pieces, alternately on and off (the on
    # pieces scaled to on_share of it), then turned by a uniform phase: a device is as likely
    # to be on at any time of the cycle (an interval turned past the end wraps to the start)
    cuts = np.sort(rng.uniform(0, 1, 2 * intervals - 1))
    pieces = np.diff(np.concatenate([[0.0], cuts, [1.0]]))
    on, off = pieces[0::2], pieces[1::2]
    on = on / on.sum() * on_share
    off = off / off.sum() * (1 - on_share) if off.sum() > 0 else off
    phase, t, spans = rng.uniform(0, 1), 0.0, []
    for i in range(intervals):
        start, end = (t + phase) % 1.0, (t + on[i] + phase) % 1.0
        spans += [(start, end)] if start < end else [(start, 1.0), (0.0, end)]
        t += on[i] + (off[i] if i < len(off) else 0.0)
    active, inactive = [], []
    for start, end in sorted(s for s in spans if s[1] > s[0]):
        a = int(round(start * CYCLE_S))
        b = max(a + 1, int(round(end * CYCLE_S)))
        if not to_finish:
            b = min(b, CYCLE_S - 1)  # not at finish_time, where FedScale's cursor sticks
            if b <= a:
                continue  # under a second left before the cycle's end
        active.append(a)
        inactive.append(b)
    duration = int(sum(b - a for a, b in zip(active, inactive)))
    return {"duration": duration, "inactive": inactive, "finish_time": CYCLE_S,
            "active": active, "model": MODELS[int(rng.integers(len(MODELS)))]}


def behaviour(devices: int, rng: np.random.Generator, to_finish: bool = False) -> dict:
    return {i + 1: one_behaviour(rng, to_finish) for i in range(devices)}


def write(out: Path, devices: int, seed: int, to_finish: bool = False) -> tuple[Path, Path]:
    rng = np.random.default_rng(seed)
    files = (out / "client_device_capacity", out / "client_behave_trace")
    for path, data in zip(files, (capacity(devices, rng), behaviour(devices, rng, to_finish))):
        blob = pickle.dumps(data)
        atomic_write(path, lambda fh, blob=blob: fh.write(blob), mode="wb")
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--to-finish", action="store_true",
                        help="let an interval end at finish_time (where FedScale's simulator "
                             "never moves past it), as this script did before")
    args = parser.parse_args()
    if args.devices < 1:
        raise SystemExit("fedscale_traces: --devices must be >= 1")
    for path in write(Path(args.out), args.devices, args.seed, args.to_finish):
        print(f"fedscale_traces: wrote {path} (generated, not FedScale's data)")


if __name__ == "__main__":
    main()
