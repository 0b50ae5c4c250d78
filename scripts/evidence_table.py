"""An evidence script's table, one row per sweep folder (or part of one), kept as a record
(``benchmarks/records/NAME.json``) and the docs re-rendered: the evidence scripts end with it.

Each row is ``FOLDER[?KEY=VALUE...]:LABEL``: the complete runs under ``OUT/FOLDER`` whose
config has each ``KEY`` (a dotted key of ``config.yaml``) at ``VALUE``. Each column is one of
:data:`COLUMNS`; cells over seeds are mean ± sample std, or each seed's value in seed order
(the same seed: the same partition, devices and sampling, so the rows are paired by seed).

    python scripts/evidence_table.py OUT --record fleet-tiers --command "bash ..." \\
        --columns global sim-minutes dropped to-target --target 0.8 \\
        --rows lora:"LoRA r = 8, FedAvg" "fedbuff:LoRA r = 8, FedBuff"
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fedadapt.results import records
from fedadapt.results.report import find_runs, first_reaching, history_of


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _each(values: list) -> str:
    return ", ".join(values)


def _final(key: str):
    return lambda runs, _: _spread([100 * r["summary"]["final"][key] for r in runs])


def _sim_minutes(runs, _) -> str:
    return _each([f"{history_of(r)[-1]['sim_time_s'] / 60:.2f}" for r in runs])


def _dropped(runs, _) -> str:
    return _each([str(sum(h.get("sim_late", 0) + h.get("sim_offline", 0)
                          for h in history_of(r))) for r in runs])


def _to_target(runs, target) -> str:
    hits = [first_reaching(history_of(r), target) for r in runs]
    return _each(["—" if h is None else f"{h['sim_time_s'] / 60:.2f}" for h in hits])


def _config(key: str, missing: str = "—"):
    def cell(runs, _) -> str:
        values = {str(r["config"].get(key)) for r in runs}
        return missing if values == {"None"} else ", ".join(sorted(values))
    return cell


def _epsilon(runs, _) -> str:
    values = {f"{h['epsilon']:.1f}" for r in runs for h in history_of(r)[-1:]
              if h.get("epsilon") is not None}
    return ", ".join(sorted(values)) or "—"


#: name -> (its heading, given the seeds and the target; its cell, given the row's runs)
COLUMNS = {
    "global": (lambda s, t: "final global accuracy", _final("global_acc")),
    "clients": (lambda s, t: "final client-mean accuracy", _final("client_acc")),
    "sim-minutes": (lambda s, t: f"simulated minutes ({s})", _sim_minutes),
    "dropped": (lambda s, t: f"clients dropped, late or offline ({s})", _dropped),
    "to-target": (lambda s, t: f"simulated minutes to {100 * t:g}% ({s}; —: not reached)",
                  _to_target),
    "noise": (lambda s, t: "noise multiplier", _config("dp.noise_multiplier")),
    "epsilon": (lambda s, t: "epsilon at delta 1e-5", _epsilon),
}


def select(out: Path, spec: str) -> tuple[str, list[dict]]:
    """``FOLDER[?KEY=VALUE...]:LABEL`` -> (label, its runs by seed)."""
    where, _, label = spec.partition(":")
    folder, *conditions = where.split("?")
    wanted = dict(c.split("=", 1) for c in conditions)
    runs = [r for r in find_runs([str(out / folder)])
            if all(str(r["config"].get(k)) == v for k, v in wanted.items())]
    if not runs:
        raise SystemExit(f"evidence_table: no complete run under {out / folder} "
                         f"with {wanted or 'any config'}")
    return label or folder, sorted(runs, key=lambda r: r["summary"]["seed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the evidence folder: one sweep folder per row")
    parser.add_argument("--rows", nargs="+", required=True, metavar="FOLDER[?K=V]:LABEL")
    parser.add_argument("--columns", nargs="+", required=True, choices=sorted(COLUMNS))
    parser.add_argument("--target", type=float, default=0.8, help="to-target's accuracy")
    parser.add_argument("--record", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--footer", default="")
    args = parser.parse_args()
    selected = [select(args.out, spec) for spec in args.rows]
    every = [r for _, runs in selected for r in runs]
    seeds = "seeds " + ", ".join(map(str, sorted({r["summary"]["seed"] for r in every})))
    rows = [[label] + [COLUMNS[c][1](runs, args.target) for c in args.columns]
            for label, runs in selected]
    record = records.measured(
        args.record, source="scripts/evidence_table.py", rows=rows, command=args.command,
        footer=args.footer, **records.of_runs(r["dir"] for r in every),
        columns=["row"] + [COLUMNS[c][0](seeds, args.target) for c in args.columns])
    records.keep(record, "evidence_table")


if __name__ == "__main__":
    main()
