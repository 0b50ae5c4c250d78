"""A `fedadapt-report` layout's table kept as a record (``benchmarks/records/NAME.json``) in the
docs' words, and the docs re-rendered: the Accumulator's offline tables end with it.

The table is the layout's own (the same cells as ``fedadapt-report DIRS --layout LAYOUT``);
``--rows`` picks and orders its rows and names them (``METHOD:LABEL``, METHOD as the report's
first column says it), ``--columns`` names its columns (``REPORT COLUMN:LABEL``, in order),
``--bold`` sets each column's best mean in bold. The record's commit, day and backbone are the
runs' own (``records.of_runs``).

    python scripts/report_record.py acc-offline --layout paper --command "..." \\
        --rows "lw_finetune:fine-tuning (\\`lw_finetune\\`)" ... \\
        --columns "partition.alpha=0.1, setting.name=multitier:multi-tier, alpha 0.1" ... \\
        --bold OUT/acc_offline
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedadapt.results import records, report

LAYOUTS = {"paper": report.paper_table, "personalization": report.personalization_layout,
           "communication": lambda runs: report.communication_table(runs, "lw_linear")}


def _pairs(specs: list[str], what: str) -> dict[str, str]:
    pairs = {}
    for spec in specs:
        name, sep, label = spec.partition(":")
        if not sep or not name:
            sys.exit(f"report_record.py: error: {what} {spec!r} is not NAME:LABEL")
        pairs[name] = label
    return pairs


def table(runs: list[dict], layout: str, rows: dict[str, str], columns: dict[str, str],
          bold: bool) -> tuple[list[str], list[list[str]]]:
    """The layout's table with the rows and columns picked, ordered and named."""
    heads, body = records.parse_table(LAYOUTS[layout](runs))
    by_name = {r[0]: r for r in body}
    missing = [m for m in rows if m not in by_name] + [c for c in columns if c not in heads]
    if missing:
        raise SystemExit(f"report_record.py: error: the report has no {missing}; its rows are "
                         f"{list(by_name)}, its columns {heads}")
    picked = list(columns) or heads[1:]
    index = [heads.index(c) for c in picked]
    out = [[label] + [by_name[m][i] for i in index] for m, label in
           (rows or {r[0]: r[0] for r in body}).items()]
    return ([heads[0]] + [columns.get(c, c) for c in picked],
            records.bold_best(out, range(1, len(picked) + 1)) if bold else out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("record", help="the record's name (benchmarks/records/NAME.json)")
    p.add_argument("dirs", nargs="+", help="run directories or folders containing them")
    p.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    p.add_argument("--command", required=True, help="the commands that made the runs")
    p.add_argument("--rows", nargs="*", default=[], metavar="METHOD:LABEL")
    p.add_argument("--columns", nargs="*", default=[], metavar="COLUMN:LABEL")
    p.add_argument("--first", default=None, help="the first column's heading")
    p.add_argument("--bold", action="store_true", help="each column's best mean in bold")
    p.add_argument("--folder", default=str(records.RECORDS), help=argparse.SUPPRESS)
    args = p.parse_args()
    runs = report.find_runs(args.dirs)
    if not runs:
        sys.exit(f"report_record.py: error: no complete run under {args.dirs}")
    columns, rows = table(runs, args.layout, _pairs(args.rows, "--rows"),
                          _pairs(args.columns, "--columns"), args.bold)
    if args.first:
        columns[0] = args.first
    record = records.measured(args.record, columns, rows, args.command,
                              "scripts/report_record.py",
                              **records.of_runs([r["dir"] for r in runs]))
    records.keep(record, "report_record.py", Path(args.folder))


if __name__ == "__main__":
    main()
