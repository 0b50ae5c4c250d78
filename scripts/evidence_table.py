"""An evidence script's table, one row per sweep folder (or part of one), kept as a record
(``benchmarks/records/NAME.json``) and the docs re-rendered: the evidence scripts end with it.

Each row is ``FOLDER[+FOLDER...][?KEY=VALUE...]:LABEL``: the complete runs under those
``OUT/FOLDER``s whose config has each ``KEY`` (a dotted key of ``config.yaml``) at ``VALUE``.
Each column is ``NAME[?KEY=VALUE...][:HEADING]``, NAME one of :data:`COLUMNS`, its cell over
the row's runs that have each ``KEY`` at ``VALUE`` (empty where none); cells over seeds are
mean ± sample std, or each seed's value in seed order (the same seed: the same partition,
devices and sampling, so the rows are paired by seed). ``--bold`` sets each accuracy column's
best mean in bold.

    python scripts/evidence_table.py OUT --record fleet-tiers --command "bash ..." \\
        --columns global sim-minutes dropped to-target --target 0.8 \\
        --rows lora:"LoRA r = 8, FedAvg" "fedbuff:LoRA r = 8, FedBuff"
    python scripts/evidence_table.py OUT --record peft-small-vit --command "bash ..." \\
        --columns lr trainable bytes "global?partition.alpha=0.1:alpha 0.1" \\
        --rows "vit_lr+vit_tuned?method.name=lora?train.lr=0.2:LoRA r = 8"
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


def _trainable(runs, _) -> str:
    from fedadapt.results.report import fmt_count

    return fmt_count(runs[0]["summary"]["params"]["communicated_params"])


def _bytes(runs, _) -> str:
    from fedadapt.results.report import fmt_bytes

    return fmt_bytes(statistics.median(r["summary"]["total_bytes"] for r in runs))


def _pair(runs, _) -> str:
    """Final global accuracy at alpha 0.1 / alpha 1000 (one run each), "" for one missing."""
    by_alpha = {float(r["config"].get("partition.alpha")): 100 * r["summary"]["final"]["global_acc"]
                for r in runs}
    return " / ".join("" if a not in by_alpha else f"{by_alpha[a]:.2f}" for a in (0.1, 1000.0))


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
    "lr": (lambda s, t: "lr", _config("train.lr")),
    "trainable": (lambda s, t: "trainable", _trainable),
    "bytes": (lambda s, t: "bytes", _bytes),
    "pair": (lambda s, t: "alpha 0.1 / alpha 1000", _pair),
}


def _where(conditions: list[str]) -> dict[str, str]:
    return dict(c.split("=", 1) for c in conditions)


def _matching(runs: list[dict], wanted: dict[str, str]) -> list[dict]:
    return [r for r in runs if all(str(r["config"].get(k)) == v for k, v in wanted.items())]


def column(spec: str) -> tuple[str, dict[str, str], str | None]:
    """``NAME[?KEY=VALUE...][:HEADING]`` -> (name, its conditions, its heading or None)."""
    where, _, heading = spec.partition(":")
    name, *conditions = where.split("?")
    if name not in COLUMNS:
        raise SystemExit(f"evidence_table: error: column {name!r} is not one of "
                         f"{sorted(COLUMNS)}")
    return name, _where(conditions), heading or None


def select(out: Path, spec: str) -> tuple[str, list[dict]]:
    """``FOLDER[?KEY=VALUE...]:LABEL`` -> (label, its runs by seed)."""
    where, _, label = spec.partition(":")
    folders, *conditions = where.split("?")
    wanted = _where(conditions)
    paths = [str(out / f) for f in folders.split("+")]
    runs = _matching(find_runs(paths), wanted)
    if not runs:
        raise SystemExit(f"evidence_table: no complete run under {' '.join(paths)} "
                         f"with {wanted or 'any config'}")
    return label or folders, sorted(runs, key=lambda r: r["summary"]["seed"])


def table(selected: list[tuple[str, list[dict]]], columns, target: float) -> list[list[str]]:
    """Each row's label and its cells (a column's cell over the row's runs that match the
    column's conditions; empty where none do)."""
    def cell(runs, name, wanted):
        runs = _matching(runs, wanted)
        return COLUMNS[name][1](runs, target) if runs else ""
    return [[label] + [cell(runs, name, wanted) for name, wanted, _ in columns]
            for label, runs in selected]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the evidence folder: one sweep folder per row")
    parser.add_argument("--rows", nargs="+", required=True, metavar="FOLDER[+F][?K=V]:LABEL")
    parser.add_argument("--columns", nargs="+", required=True,
                        metavar="NAME[?K=V][:HEADING]", help=f"NAME: one of {sorted(COLUMNS)}")
    parser.add_argument("--first", default="row", help="the first column's heading")
    parser.add_argument("--bold", action="store_true",
                        help="each accuracy column's best mean in bold")
    parser.add_argument("--target", type=float, default=0.8, help="to-target's accuracy")
    parser.add_argument("--record", required=True)
    parser.add_argument("--command", required=True)
    parser.add_argument("--footer", default="")
    parser.add_argument("--folder", default=str(records.RECORDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    columns = [column(spec) for spec in args.columns]
    selected = [select(args.out, spec) for spec in args.rows]
    every = [r for _, runs in selected for r in runs]
    seeds = "seeds " + ", ".join(map(str, sorted({r["summary"]["seed"] for r in every})))
    rows = table(selected, columns, args.target)
    if args.bold:
        rows = records.bold_best(rows, [j + 1 for j, (name, _, _) in enumerate(columns)
                           if name in ("global", "clients")])
    record = records.measured(
        args.record, source="scripts/evidence_table.py", rows=rows, command=args.command,
        footer=args.footer, **records.of_runs(r["dir"] for r in every),
        columns=[args.first] + [heading or COLUMNS[name][0](seeds, args.target)
                                for name, _, heading in columns])
    records.keep(record, "evidence_table", Path(args.folder))


if __name__ == "__main__":
    main()
