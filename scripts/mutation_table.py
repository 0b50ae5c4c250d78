"""The mutation scores of scripts/mutation.sh's runs, one row per module, kept as a record
(``benchmarks/records/NAME.json``) and the docs re-rendered.

Each ``OUT`` is a folder scripts/mutation.sh wrote (``results.txt``: every mutant's status,
``commit.txt``). ``--later NAME ...`` lists survivors killed afterwards by tests committed after
the run, each checked against the new tests in mutmut's mutated tree
(``MUTANT_UNDER_TEST=NAME pytest TESTS``); docs/reliability.md says, under the table, which
of the rest are argued equivalent and which are not yet killed.

    python scripts/mutation_table.py /tmp/mut-ckpt2 /tmp/mut-part --record mutation-core \\
        --later fedadapt.federation.server.checkpoint.x_save_client_context__mutmut_4 ...
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

from fedadapt.results import records

#: ``module.x_function__mutmut_N`` or, for a method, ``module.xǁClassǁmethod__mutmut_N``
MUTANT = re.compile(r"\s*(\S+?)\.x(?:_|ǁ)\S+__mutmut_\d+: (\w[\w ]*)$")


def rows_of(out: Path, later: set[str]) -> list[list[str]]:
    commit = (out / "commit.txt").read_text().split()[-1][:7]
    by_module = collections.defaultdict(collections.Counter)
    for line in (out / "results.txt").read_text().splitlines():
        m = MUTANT.match(line)
        if not m:
            continue
        name = line.strip().split(":")[0]
        status = m.group(2).strip()
        by_module[m.group(1)]["killed" if status == "timeout" else status] += 1
        if name in later and status not in ("killed", "timeout"):
            by_module[m.group(1)]["later"] += 1
    rows = []
    for module, n in sorted(by_module.items()):
        total = sum(v for k, v in n.items() if k != "later")
        left = total - n["killed"]
        after = n["killed"] + n["later"]
        path = module.removeprefix("fedadapt.").replace(".", "/") + ".py"
        rows.append([f"`{path}`", f"`{commit}`", str(total), str(n["killed"]),
                     f"{100 * n['killed'] / total:.1f}%", str(n["later"]),
                     str(left - n["later"]), f"{100 * after / total:.1f}%"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outs", nargs="+", type=Path, help="folders scripts/mutation.sh wrote")
    parser.add_argument("--record", required=True)
    parser.add_argument("--later", nargs="*", default=[], metavar="MUTANT")
    parser.add_argument("--command", required=True)
    parser.add_argument("--footer", default="")
    args = parser.parse_args()
    rows = [row for out in args.outs for row in rows_of(out, set(args.later))]
    record = records.measured(
        args.record, source="scripts/mutation_table.py", rows=rows, command=args.command,
        footer=args.footer,
        columns=["module", "commit", "mutants", "killed in the run", "score of the run",
                 "killed by later tests", "left (see below)", "score"])
    records.keep(record, "mutation_table")


if __name__ == "__main__":
    main()
