"""The fleet evidence's table, one row per sweep folder: the final global accuracy (mean ± std
over seeds), the simulated minutes the rounds took, the clients the fleet dropped (late or
offline) per seed, and each seed's simulated minutes to a target accuracy, paired by seed (the
same seed: the same partition, devices and sampling), then kept as a record
(``benchmarks/records/NAME.json``) and the docs re-rendered.

    python scripts/fleet_table.py OUT --rows fedavg_drops:"FedAvg ..." ... --target 0.6 \\
        --record fleet-fedscale --command "bash scripts/fedscale_evidence.sh"
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedadapt.results import records
from fedadapt.results.report import find_runs, first_reaching, history_of


def _minutes_to(history: list[dict], target: float) -> float | None:
    hit = first_reaching(history, target)
    return None if hit is None else hit["sim_time_s"] / 60


def _dropped(history: list[dict]) -> int:
    return sum(r.get("sim_late", 0) + r.get("sim_offline", 0) for r in history)


def row_of(label: str, runs: list[dict], target: float) -> list[str]:
    runs = sorted(runs, key=lambda r: r["summary"]["seed"])
    finals = [100 * r["summary"]["final"]["global_acc"] for r in runs]
    histories = [history_of(r) for r in runs]
    spread = f" ± {statistics.stdev(finals):.2f}" if len(finals) > 1 else ""
    minutes = [h[-1]["sim_time_s"] / 60 for h in histories]
    to = [_minutes_to(h, target) for h in histories]
    return [label, f"{statistics.mean(finals):.2f}{spread}",
            ", ".join(f"{m:.2f}" for m in minutes), ", ".join(str(_dropped(h)) for h in histories),
            ", ".join("—" if t is None else f"{t:.2f}" for t in to)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="the evidence folder: one sweep folder per row")
    parser.add_argument("--rows", nargs="+", required=True, metavar="FOLDER:LABEL")
    parser.add_argument("--target", type=float, default=0.6)
    parser.add_argument("--record", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--footer", default="")
    args = parser.parse_args()
    rows, dirs, found = [], [], []
    for spec in args.rows:
        folder, _, label = spec.partition(":")
        runs = find_runs([str(Path(args.out) / folder)])
        if not runs:
            raise SystemExit(f"fleet_table: no complete run under {Path(args.out) / folder}")
        dirs += [r["dir"] for r in runs]
        found += runs
        rows.append(row_of(label or folder, runs, args.target))
    seeds = "seeds " + ", ".join(map(str, sorted({r["summary"]["seed"] for r in found})))
    rounds = "/".join(map(str, sorted({int(r["config"]["rounds"]) for r in found})))
    record = records.measured(
        args.record, source="scripts/fleet_table.py", rows=rows, command=args.command,
        footer=args.footer,
        columns=["row", "final global accuracy", f"simulated minutes, {rounds} rounds ({seeds})",
                 f"clients dropped, late or offline ({seeds})",
                 f"simulated minutes to {100 * args.target:g}% ({seeds}; —: not reached)"],
        backbone=records.backbone_of(dirs))
    print(f"fleet_table: wrote {records.save(record)}")
    print(records.render(record))
    for doc in records.render_docs(only={args.record}):
        print(f"fleet_table: {doc} re-rendered")


if __name__ == "__main__":
    main()
