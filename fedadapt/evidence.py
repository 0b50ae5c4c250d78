"""``fedadapt-evidence``: an evidence table's runs, from its description, and its records.

    fedadapt-evidence NAME [OUT] [OVERRIDE ...]       run what is not done yet, then the records
    fedadapt-evidence NAME [OUT] --dry-run            the commands it would run, run nothing
    fedadapt-evidence NAME [OUT] --records-only       the records from the runs already in OUT
    fedadapt-evidence --list                          the descriptions it knows

NAME is a description in ``scripts/tables/NAME.yaml`` (or the path of one); OUT defaults to its
``out``; each OVERRIDE goes to every run (e.g. ``federation.backend=inprocess``). A description
holds, in order of use (``like: NAME``: NAME's, with the keys given replaced):

* ``small_vit: true``: pretrain the offline presets' small ViT first (once per cache);
* ``commands``: ``{run: ARGV, creates: PATH}``, each run once, until ``PATH`` exists;
* ``common``, ``runs`` and ``sweeps``: ``NAME: OVERRIDES``, one ``fedadapt COMMON OVERRIDES
  OVERRIDE...`` into ``OUT/NAME`` per run (``output_dir``), one ``fedadapt -m ...`` per sweep
  (``hydra.sweep.dir``); one that finished (its ``.done``) is not run again, so a stopped
  evidence goes on where it stopped;
* ``reports``: ``fedadapt-report ARGS`` for each entry;
* ``records``: ``NAME: TABLE``, each kept as ``benchmarks/records/NAME.json`` and the docs that
  show it re-rendered. A table has a ``kind`` (:mod:`fedadapt.results.evidence_cells`):
  ``columns`` (``rows``, ``columns``, ``first``, ``target``, ``bold``), ``layout`` (``layout``,
  ``dirs``, ``rows``, ``columns``, ``first``, ``bold``), ``lora_ranks``, ``report`` (the table of
  ``fedadapt-report OUT`` and its ``report`` arguments) or ``job`` (the job's own table), both
  with the runs' provenance under them, or ``command`` (``run``: a command that keeps the record
  itself); ``note`` follows the record's command after ``#``.

In every string ``{out}`` is OUT, ``{root}`` the repository, ``{run:NAME}`` the first run
directory under ``OUT/NAME``, ``{command}`` the command that reproduces the records.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from fedadapt.ending import console
from fedadapt.results import evidence_cells, records, report
from fedadapt.results.report import find_runs, provenance

TABLES = records.ROOT / "scripts" / "tables"
KINDS = ("columns", "layout", "lora_ranks", "report", "job", "command")


def describe(name: str) -> tuple[str, dict]:
    """The description NAME (``scripts/tables/NAME.yaml``, or a path) and its short name."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else TABLES / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in TABLES.glob("*.yaml"))
        raise SystemExit(f"fedadapt-evidence: error: no description {path}; known: {known}")
    spec = yaml.safe_load(path.read_text()) or {}
    if spec.get("like"):  # another description's, with these keys replaced
        spec = {**describe(spec["like"])[1], **spec}
    for record, table in (spec.get("records") or {}).items():
        if table.get("kind", "columns") not in KINDS:
            raise SystemExit(f"fedadapt-evidence: error: {path}: records.{record}.kind is "
                             f"{table['kind']!r}, not one of {list(KINDS)}")
        for column in table.get("columns", []) if table.get("kind", "columns") == "columns" else []:
            evidence_cells.column(column)  # an unknown column: one line, before any run
    return path.stem, spec


class Evidence:
    """One description's steps over one OUT folder."""

    def __init__(self, name: str, spec: dict, out: Path, extra: list[str], dry_run: bool):
        self.name, self.spec, self.out, self.extra, self.dry_run = name, spec, out, extra, dry_run
        self.command = " ".join([f"fedadapt-evidence {name} OUT", *extra])

    def fill(self, text: str) -> str:
        """``{out}``, ``{root}``, ``{run:NAME}`` and ``{command}`` of ``text`` filled in."""
        while "{run:" in text:
            start = text.index("{run:")
            end = text.index("}", start)
            folder = self.out / text[start + 5:end]
            found = sorted(folder.rglob("summary.json")) if folder.is_dir() else []
            where = str(found[0].parent) if found else f"<a run of {folder}>"
            text = text[:start] + where + text[end + 1:]
        return (text.replace("{out}", str(self.out)).replace("{root}", str(records.ROOT))
                .replace("{command}", self.command))

    def call(self, argv: list[str]) -> None:
        argv = [sys.executable if a == "python" else self.fill(a) for a in argv]
        argv = [hit for a in argv for hit in ((sorted(glob.glob(a)) or [a]) if "*" in a else [a])]
        print(shlex.join(argv), flush=True)
        if not self.dry_run:
            path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
            subprocess.run(argv, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                  "PATH": path})  # this environment's tools

    def run(self) -> None:
        """Every step that is not done yet, in order."""
        cache = Path(os.environ.get("FEDADAPT_CACHE", "~/.cache/fedadapt")).expanduser()
        if self.spec.get("small_vit") and not (
                cache / "pretrained" / "small_vit-fashion_mnist-s0").is_dir():
            self.call(["fedadapt-pretrain", "--epochs", "3", "dataset=fashion_mnist",
                       "backbone=small_vit"])
        for step in self.spec.get("commands") or []:
            if Path(self.fill(step["creates"])).exists():
                print(f"# done ({self.fill(step['creates'])}): {shlex.join(step['run'])}")
            else:
                self.call(step["run"])
        for key, into in (("runs", "output_dir"), ("sweeps", "hydra.sweep.dir")):
            for name, overrides in (self.spec.get(key) or {}).items():
                done = self.out / name / ".done"
                if done.exists():
                    print(f"# done: {name} ({done})")
                    continue
                self.call(["fedadapt", *(["-m"] if key == "sweeps" else []),
                           *self.spec.get("common", []), *overrides, *self.extra,
                           f"{into}={self.out / name}"])
                if not self.dry_run:
                    done.touch()
        for args in self.spec.get("reports") or []:
            self.call(["fedadapt-report", *args])

    def report_table(self, kind: str, table: dict) -> str:
        """``job``: the job's own ``table.md`` (one job under OUT); ``report``: the table of
        ``fedadapt-report OUT ARGS``."""
        if kind == "job":
            (job,) = {p.parent for p in self.out.rglob("table.md")
                      if (p.parent / "job.json").is_file()}
            return (job / "table.md").read_text()
        report.main([str(self.out), "--out", str(self.out), *table.get("report", [])])
        return (self.out / "report.md").read_text()

    def records(self, folder: Path) -> None:
        """Each record of the description, from the runs under OUT."""
        for name, table in (self.spec.get("records") or {}).items():
            kind = table.get("kind", "columns")
            if kind == "command":
                self.call(table["run"])
                continue
            if self.dry_run:
                print(f"# keep the record {name} ({kind}) from {self.out}")
                continue
            command = self.command + (f"   # {table['note']}" if table.get("note") else "")
            if kind == "columns":
                columns, rows, runs = evidence_cells.columns_table(
                    self.out, table["rows"], table["columns"], table.get("first", "row"),
                    float(table.get("target", 0.8)), table.get("bold", False))
            else:
                dirs = [hit for d in table.get("dirs", ["."])
                        for hit in sorted(glob.glob(str(self.out / d)))]
                runs = find_runs(dirs)
                if not runs:
                    raise SystemExit(f"fedadapt-evidence: error: no complete run under {dirs}")
                if kind == "lora_ranks":
                    columns, rows = evidence_cells.lora_ranks_table(runs)
                elif kind in ("report", "job"):
                    columns, rows = records.parse_table(self.report_table(kind, table))
                    table = {"footer": provenance(runs), **table}
                else:
                    columns, rows = evidence_cells.layout_table(
                        runs, table["layout"], table.get("rows") or {},
                        table.get("columns") or {}, table.get("bold", False))
                    columns[0] = table.get("first", columns[0])
            record = records.measured(
                name, columns, rows, command, f"fedadapt-evidence ({self.name})",
                footer=table.get("footer", ""), **records.of_runs(r["dir"] for r in runs))
            records.keep(record, "fedadapt-evidence", folder)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="fedadapt-evidence", description=__doc__.split("\n")[0],
                                     epilog="The descriptions: scripts/tables/*.yaml.")
    parser.add_argument("name", nargs="?", help="scripts/tables/NAME.yaml, or a description's path")
    parser.add_argument("out", nargs="?", help="the evidence folder (default: the description's)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--records-only", action="store_true",
                        help="only the records, from the runs already under OUT")
    parser.add_argument("--list", action="store_true", help="the descriptions, one a line")
    parser.add_argument("--folder", default=str(records.RECORDS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.list or not args.name:
        for path in sorted(TABLES.glob("*.yaml")):
            print(f"{path.stem}: {path.read_text().splitlines()[0].lstrip('# ')}")
        return
    if args.out and "=" in args.out:  # an override, not a folder
        args.overrides, args.out = [args.out, *args.overrides], None
    name, spec = describe(args.name)
    out = Path(args.out or spec.get("out") or f"outputs/{name}")
    evidence = Evidence(name, spec, out, args.overrides, args.dry_run)
    if not args.records_only:
        evidence.run()
    evidence.records(Path(args.folder))


#: The console command: :func:`main`, then the process ends without the interpreter's
#: teardown (:mod:`fedadapt.ending`).
command = console(main)


if __name__ == "__main__":
    command()
