"""``fedadapt-bench --scale``: seconds per round and the driver's peak memory at 100, 1,000 and
10,000 clients registered, the same number sampled each round."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from fedadapt.bench.common import table, write
from fedadapt.bench.rounds import SCALE_BASE, isolated_flower_run
from fedadapt.results.records import machine


def run(args) -> None:
    """s/round and the driver's peak memory at 100, 1,000 and 10,000 clients registered, the
    same number sampled each round (``--sampled``), each in a fresh process."""
    from fedadapt.entry import compose_config, to_run_config

    rows = {}
    for total in (100, 1000, 10000):
        frac = args.sampled / total
        ov = SCALE_BASE + [f"partition.num_clients={total}", f"partition.fraction_fit={frac}",
                           f"partition.fraction_evaluate={frac}", f"rounds={args.rounds}",
                           *args.overrides]
        cfg = to_run_config(compose_config(ov))
        per_round, first, peaks = [], [], []
        for rep in range(args.repeats):
            print(f"[bench] {total} clients: repeat {rep + 1}/{args.repeats}", flush=True)
            t0 = time.perf_counter()
            times, peak = isolated_flower_run(cfg, Path(args.out) / "runs", f"{total} clients",
                                              with_memory=True)
            first.append(time.perf_counter() - t0 - sum(times[1:]))
            per_round.extend(times[1:])
            peaks.append(peak)
        rows[total] = {"median_s_per_round": statistics.median(per_round),
                       "median_s_before_round_2": statistics.median(first),
                       "peak_rss_mb": max(peaks) / 2**20}
    base = rows[100]["median_s_per_round"]
    meta = {"machine": machine(), "sampled": args.sampled, "repeats": args.repeats,
            "rounds": args.rounds, "config": SCALE_BASE + list(args.overrides), "results": rows,
            "ratio_10000_to_100": rows[10000]["median_s_per_round"] / base}
    path = write(args.out, "bench-scale", meta)
    table(args, [f"clients registered ({args.sampled} sampled per round)",
                  f"median s/round (rounds 2..{args.rounds})", "start-up to round 2 s",
                  "driver peak RSS MB"],
           [[f"{total:,}", f"{r['median_s_per_round']:.3f}", f"{r['median_s_before_round_2']:.1f}",
             f"{r['peak_rss_mb']:.0f}"] for total, r in rows.items()], meta)
    print(f"\n10,000 / 100 clients s/round: {meta['ratio_10000_to_100']:.2f}\n"
          f"machine: {meta['machine']}\nJSON: {path}")

