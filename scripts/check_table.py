"""Compare a job's ``table.md`` with a table in the README, row by row, to the digit.

    python scripts/check_table.py README.md OUTPUTS/quickstart/<time>/table.md \\
        [--block quickstart] [--skip finetune] [--ignore "wall s"]

The README's table is the first Markdown table inside ``<!-- table: BLOCK -->`` ...
``<!-- /table: BLOCK -->``; the job's is the first table of its file. Rows are matched by their
first column (the method). Every README row not skipped must be in the job's table with the same
text in every column but the ignored ones (wall-clock seconds by default), and the job's table
must hold no other row. Exit 0 when they agree; else 1, one line per difference. Standard
library only: ``.ci/run`` calls it from the installed wheel's venv.

``.ci/run`` skips ``finetune``: training 3.4M parameters for 12 rounds, its last bits follow
the CPU's kernels (docs/reliability.md); the rows on cached features agree to the digit.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path


def cells(line: str) -> list[str]:
    """The cells of one Markdown table row, stripped."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def first_table(lines: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """``(header, {first cell: row})`` of the first Markdown table among ``lines``."""
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("|")), None)
    if start is None:
        raise ValueError("no table")
    header = cells(lines[start])
    rows: dict[str, list[str]] = {}
    for line in lines[start + 1:]:
        if not line.lstrip().startswith("|"):
            break
        row = cells(line)
        if all(re.fullmatch(r":?-+:?", c) for c in row):  # the separator
            continue
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under a header of {len(header)}: {line!r}")
        if row[0] in rows:
            raise ValueError(f"row {row[0]!r} twice")
        rows[row[0]] = row
    return header, rows


def readme_table(text: str, block: str) -> tuple[list[str], dict[str, list[str]]]:
    """The first table in the README's ``<!-- table: block -->`` section."""
    begin, end = f"<!-- table: {block} -->", f"<!-- /table: {block} -->"
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} section")
    return first_table(text.split(begin, 1)[1].split(end, 1)[0].splitlines())


def compare(expected: tuple[list[str], dict[str, list[str]]],
            got: tuple[list[str], dict[str, list[str]]], *, skip: set[str],
            ignore: set[str]) -> list[str]:
    """One line per difference between the expected table and the one a job wrote."""
    (want_header, want), (got_header, rows) = expected, got
    if want_header != got_header:
        return [f"the columns differ: expected {want_header}, got {got_header}"]
    out = []
    for method, row in want.items():
        if method in skip:
            continue
        if method not in rows:
            out.append(f"{method}: no such row in the job's table")
            continue
        for name, a, b in zip(want_header, row, rows[method]):
            if name not in ignore and a != b:
                out.append(f"{method}: {name} is {b}, the README says {a}")
    out += [f"{m}: a row the README's table does not have" for m in rows
            if m not in want and m not in skip]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("readme", type=Path)
    parser.add_argument("table", type=Path, help="the job's table.md")
    parser.add_argument("--block", default="quickstart")
    parser.add_argument("--skip", action="append", default=[], help="a row not compared")
    parser.add_argument("--ignore", action="append", default=None,
                        help='a column not compared (default: "wall s")')
    args = parser.parse_args(argv)
    try:
        expected = readme_table(args.readme.read_text(), args.block)
        got = first_table(args.table.read_text().splitlines())
    except (OSError, ValueError) as err:
        print(f"check_table: {err}", file=sys.stderr)
        return 2
    problems = compare(expected, got, skip=set(args.skip),
                       ignore=set(args.ignore if args.ignore is not None else ["wall s"]))
    for line in problems:
        print(f"check_table: {args.table}: {line}", file=sys.stderr)
    if not problems:
        compared = [m for m in expected[1] if m not in args.skip]
        print(f"check_table: {len(compared)} row(s) as in {args.readme} "
              f"({', '.join(compared)})")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
