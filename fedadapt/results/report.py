"""``fedadapt-report DIR...``: aggregate run directories (a sweep, several seeds) into one table.

Every run directory below the given folders that has a ``summary.json`` (a complete run) becomes
one row; rows whose resolved configs differ only in ``seed`` are grouped and reported as mean
± std over seeds. The columns that identify a group are the config keys that vary across the
runs (e.g. ``method`` and ``partition.alpha`` for a sweep). Writes ``report.md`` and
``report.csv`` (atomically) into ``--out`` (default: the first folder) and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from pathlib import Path

import yaml

from fedadapt.results.store import SUMMARY, atomic_write
from fedadapt.results.tables import fmt_bytes, fmt_count, markdown

IGNORED = ("seed", "output_dir", "cache_dir", "compare", "hydra")
METRICS = [("final global acc", ("final", "global_acc"), 100.0),
           ("best global acc", ("best", "global_acc"), 100.0),
           ("final client-mean acc", ("final", "client_acc"), 100.0),
           ("total bytes", ("total_bytes",), None),
           ("s/round", ("seconds_per_round",), None)]


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if not isinstance(v, list) else tuple(v)
    return out


def find_runs(folders: list[str]) -> list[dict]:
    runs = []
    for folder in folders:
        for summary_path in sorted(Path(folder).rglob(SUMMARY)):
            run_dir = summary_path.parent
            cfg_path = run_dir / "config.yaml"
            if not cfg_path.is_file():
                continue
            summary = yaml.safe_load(summary_path.read_text())
            config = flatten(yaml.safe_load(cfg_path.read_text()) or {})
            config = {k: v for k, v in config.items() if k.split(".")[0] not in IGNORED}
            runs.append({"dir": str(run_dir), "summary": summary, "config": config})
    return runs


def _get(summary: dict, path: tuple):
    for p in path:
        summary = summary.get(p) if isinstance(summary, dict) else None
    return summary


def aggregate(runs: list[dict]) -> tuple[list[str], list[dict]]:
    """Group runs by the config keys that vary (except seed); mean and std of each metric."""
    keys = sorted({k for r in runs for k in r["config"]})
    # A key varies when the runs that have it disagree (method-specific keys are absent in
    # other methods' configs, which alone does not make them vary).
    varying = [k for k in keys
               if len({repr(r["config"][k]) for r in runs if k in r["config"]}) > 1]
    if "method.name" not in varying:
        varying = ["method.name", *varying]
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(repr(r["config"].get(k)) for k in varying), []).append(r)
    rows = []
    for members in groups.values():
        row = {k: members[0]["config"].get(k) for k in varying}
        row["seeds"] = len(members)
        row["trainable"] = members[0]["summary"]["params"]["trainable_params"]
        row["communicated"] = members[0]["summary"]["params"]["communicated_params"]
        for name, path, scale in METRICS:
            vals = [v for v in (_get(m["summary"], path) for m in members) if v is not None]
            vals = [v * scale for v in vals] if scale else vals
            row[name] = (statistics.fmean(vals) if vals else None,
                         statistics.pstdev(vals) if len(vals) > 1 else 0.0 if vals else None)
        rows.append(row)
    rows.sort(key=lambda r: [repr(r[k]) for k in varying])
    return varying, rows


def _cell(name: str, value) -> str:
    mean, std = value
    if mean is None:
        return "—"
    if name == "total bytes":
        return fmt_bytes(mean)
    if name == "s/round":
        return f"{mean:.2f}"
    return f"{mean:.2f} ± {std:.2f}"


def render(varying: list[str], rows: list[dict]) -> tuple[str, str]:
    header = [*varying, "seeds", "trainable", "communicated", *(m[0] for m in METRICS)]
    md_rows = [[str(r[k]) for k in varying] + [str(r["seeds"]), fmt_count(r["trainable"]),
                                               fmt_count(r["communicated"])]
               + [_cell(m[0], r[m[0]]) for m in METRICS] for r in rows]
    buf = io.StringIO()
    writer = csv.writer(buf)
    csv_header = [*varying, "seeds", "trainable", "communicated"]
    for m in METRICS:
        csv_header += [f"{m[0]} mean", f"{m[0]} std"]
    writer.writerow(csv_header)
    for r in rows:
        writer.writerow([r[k] for k in varying] + [r["seeds"], r["trainable"], r["communicated"]]
                        + [x for m in METRICS for x in r[m[0]]])
    return markdown(header, md_rows), buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedadapt-report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", help="run directories or folders containing them")
    parser.add_argument("--out", help="folder for report.md and report.csv (default: first dir)")
    args = parser.parse_args(argv)
    missing = [d for d in args.dirs if not Path(d).is_dir()]
    if missing:
        parser.error(f"no such folder: {', '.join(missing)}")
    runs = find_runs(args.dirs)
    if not runs:
        print(f"fedadapt-report: error: no complete run (summary.json) under {args.dirs}",
              file=sys.stderr)
        sys.exit(2)
    varying, rows = aggregate(runs)
    md, csv_text = render(varying, rows)
    out = Path(args.out or args.dirs[0])
    title = f"# fedadapt report: {len(runs)} runs in {len(rows)} groups (mean ± std over seeds)\n\n"
    atomic_write(out / "report.md", lambda fh: fh.write(title + md))
    atomic_write(out / "report.csv", lambda fh: fh.write(csv_text))
    print(title + md)
    print(f"Wrote {out / 'report.md'} and {out / 'report.csv'}")


if __name__ == "__main__":
    main()
