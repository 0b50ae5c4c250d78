"""The mutation scores of scripts/mutation.sh's runs, one row per module, kept as a record
(``benchmarks/records/NAME.json``) and the docs re-rendered.

Each ``OUT`` is a folder scripts/mutation.sh wrote (``results.txt``: every mutant's status,
``commit.txt``). ``--later NAME ...`` lists survivors killed afterwards by tests committed after
the run, each checked against the new tests in mutmut's mutated tree
(``MUTANT_UNDER_TEST=NAME pytest TESTS``); docs/reliability.md says, under the table, which
of the rest are argued equivalent and which are not yet killed.

    python scripts/mutation_table.py /tmp/mut-ckpt2 /tmp/mut-part --record mutation-core \\
        --later fedadapt.federation.server.checkpoint.x_save_client_context__mutmut_4 ...
    python scripts/mutation_table.py /tmp/mut-fleet /tmp/mut-fleet-rerun --update ...

A module in several OUTs (a rerun of one function's mutants with ``MUTANTS=``): the later run's
status of each mutant it checked replaces the earlier's.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from fedadapt.results import records

#: ``module.x_function__mutmut_N`` or, for a method, ``module.xǁClassǁmethod__mutmut_N``
MUTANT = re.compile(r"\s*(\S+?)\.x(?:_|ǁ)\S+__mutmut_\d+: (\w[\w ]*)$")


def rows_of(outs: list[Path], later: set[str]) -> list[list[str]]:
    """One row per module of the runs in ``outs``. A module in several runs (a rerun of one
    function's mutants after it changed, ``MUTANTS=``): each mutant's status is the last run's
    that checked it ("not checked" keeps the earlier one's), and the row names every run's
    commit that checked some."""
    status: dict[str, dict[str, str]] = collections.defaultdict(dict)
    commits: dict[str, list[str]] = collections.defaultdict(list)
    for out in outs:
        commit = (out / "commit.txt").read_text().split()[-1][:7]
        for line in (out / "results.txt").read_text().splitlines():
            m = MUTANT.match(line)
            if not m:
                continue
            name, module, state = line.strip().split(":")[0], m.group(1), m.group(2).strip()
            if state == "not checked" and name in status[module]:
                continue
            status[module][name] = state
            if state != "not checked" and commit not in commits[module]:
                commits[module].append(commit)
    rows = []
    for module, states in status.items():  # in the order the runs first name them
        n = collections.Counter("killed" if s == "timeout" else s for s in states.values())
        n["later"] = sum(1 for name, s in states.items()
                         if name in later and s not in ("killed", "timeout"))
        total = len(states)
        left = total - n["killed"]
        after = n["killed"] + n["later"]
        path = module.removeprefix("fedadapt.").replace(".", "/") + ".py"
        rows.append([f"`{path}`", " + ".join(f"`{c}`" for c in commits[module]), str(total),
                     str(n["killed"]), f"{100 * n['killed'] / total:.1f}%", str(n["later"]),
                     str(left - n["later"]), f"{100 * after / total:.1f}%"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outs", nargs="+", type=Path, help="folders scripts/mutation.sh wrote")
    parser.add_argument("--record", required=True)
    parser.add_argument("--later", nargs="*", default=[], metavar="MUTANT")
    parser.add_argument("--command", required=True)
    parser.add_argument("--footer", default="")
    parser.add_argument("--update", action="store_true",
                        help="keep the record's rows of the modules the OUTs do not hold (a "
                             "rerun of one module needs only its own folders)")
    args = parser.parse_args()
    rows = rows_of(args.outs, set(args.later))
    if args.update:
        new = {row[0]: row for row in rows}
        old = records.load(records.path_of(args.record)).rows
        rows = [new.pop(row[0], row) for row in old] + list(new.values())
    record = records.measured(
        args.record, source="scripts/mutation_table.py", rows=rows, command=args.command,
        footer=args.footer,
        columns=["module", "commit", "mutants", "killed in the run", "score of the run",
                 "killed by later tests", "left (see below)", "score"])
    records.keep(record, "mutation_table")


if __name__ == "__main__":
    main()
