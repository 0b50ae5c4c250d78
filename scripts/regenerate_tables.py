"""Rebuild an evidence table of the docs from its commands (docs/tables.yaml), with the
provenance footer of `fedadapt-report --provenance`: every run's directory, fedadapt commit and
config hash, so each row can be traced to the run that made it and rerun.

    python scripts/regenerate_tables.py NAME [NAME ...]        rerun the commands (offline)
    python scripts/regenerate_tables.py NAME --from DIR        from run directories kept in DIR
    python scripts/regenerate_tables.py --list                 the tables it knows

The runs go to outputs/tables/NAME/<time>/ (kept: the footer names them); the table's numbers go
to its record, benchmarks/records/NAME.json, and every doc that shows it (between
`<!-- table: NAME -->` and `<!-- /table: NAME -->`) is re-rendered from the record."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from fedadapt.results import records
from fedadapt.results.report import find_runs, provenance

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "docs" / "tables.yaml"


def run_commands(name: str, entry: dict, out: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for i, overrides in enumerate(entry["runs"]):
        cmd = ["fedadapt", *overrides, f"output_dir={out / str(i)}"]
        print(f"[tables] {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)


def table_of(entry: dict, folder: Path) -> str:
    """The table's markdown (without the footer) from the runs under ``folder``."""
    if entry.get("table", "report") == "job":
        (job,) = {p.parent for p in folder.rglob("table.md") if (p.parent / "job.json").is_file()}
        return "\n".join(ln for ln in (job / "table.md").read_text().splitlines()
                         if ln.startswith("|")) + "\n"
    done = subprocess.run([sys.executable, "-m", "fedadapt.results.report", str(folder),
                           "--out", str(folder), *entry.get("report", [])],
                          capture_output=True, text=True, check=True)
    md = (folder / "report.md").read_text()
    return md[md.index("\n|"):].lstrip("\n") if "\n|" in md else done.stdout


def write_record(name: str, entry: dict, folder: Path, runs: list[dict]) -> Path:
    """The table's record from the runs under ``folder``: its cells, the commands, the runs'
    provenance."""
    columns, rows = records.parse_table(table_of(entry, folder))
    commits = {r["summary"].get("git_commit") for r in runs} - {None}
    record = records.measured(
        name, columns, rows, "\n".join(" ".join(["fedadapt", *ov]) for ov in entry["runs"]),
        "scripts/regenerate_tables.py", commit=commits.pop() if len(commits) == 1 else None,
        footer=provenance(runs))
    return records.save(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--from", dest="source", help="run directories already made")
    parser.add_argument("--list", action="store_true")
    args = parser.parse_args()
    registry = yaml.safe_load(REGISTRY.read_text())
    if args.list or not args.names:
        for name, entry in registry.items():
            print(f"{name}: {entry['doc']} ({len(entry['runs'])} command(s))")
        return
    unknown = [n for n in args.names if n not in registry]
    if unknown:
        raise SystemExit(f"regenerate_tables: unknown table(s) {unknown}; known: "
                         f"{sorted(registry)}")
    folders = {}
    for name in args.names:  # every command first: the docs change only after (the runs'
        entry = registry[name]  # commit is then the clean checkout's, not "+dirty")
        if args.source:
            folders[name] = Path(args.source)
        else:
            folders[name] = ROOT / "outputs" / "tables" / name / time.strftime("%Y-%m-%d_%H-%M-%S")
            run_commands(name, entry, folders[name])
    for name, folder in folders.items():
        entry = registry[name]
        runs = find_runs([str(folder)])
        if len(runs) < len(entry["runs"]):
            raise SystemExit(f"regenerate_tables: {folder} holds {len(runs)} complete run(s), "
                             f"{name} needs {len(entry['runs'])}")
        path = write_record(name, entry, folder, runs)
        changed = records.render_docs(only={name})
        print(f"[tables] {name}: {path.relative_to(ROOT)} written from {folder}; re-rendered "
              f"{', '.join(str(d.relative_to(ROOT)) for d in changed) or 'no doc (unchanged)'}",
              file=sys.stderr)

if __name__ == "__main__":
    main()
