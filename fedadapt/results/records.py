"""Benchmark and evidence results kept as data: one JSON record per table in
``benchmarks/records/NAME.json``, and the docs' tables rendered from them.

A record holds the table's columns and rows (cells as printed), the command that made it, the
machine, the date, the commit, and the text printed under the table (a provenance footer, a
note). A doc shows it between ``<!-- table: NAME -->`` and ``<!-- /table: NAME -->``; the same
record may be shown on several pages. ``fedadapt-bench --record NAME`` and
``fedadapt-evidence NAME`` write records and re-render the docs;
``tests/test_records.py`` checks that every docs table equals what its record renders.

    python -m fedadapt.results.records            re-render every docs table from its record
    python -m fedadapt.results.records --check    exit 1 naming each table that differs
    python -m fedadapt.results.records --write NAME --table report.md --command "..."
                                                  keep the first table of a file (a report)
                                                  as the record NAME, then re-render
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fedadapt.files import atomic_write

ROOT = Path(__file__).resolve().parents[2]
RECORDS = ROOT / "benchmarks" / "records"
DOC_GLOBS = ("README.md", "docs/*.md", "docs/papers/*.md")
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)"
                   r"(<!-- /table: (?P=name) -->)", re.S)
NAME = re.compile(r"^[a-z0-9][\w.-]*$")


@dataclass
class Record:
    """One table's numbers and where they came from."""

    name: str
    columns: list[str]
    rows: list[list[str]]
    command: str  # what reproduces it (a shell line, or several separated by newlines)
    machine: str
    date: str  # YYYY-MM-DD of the measurement
    commit: str | None = None  # fedadapt's commit that measured it, where known
    backbone: str | None = None  # e.g. "small ViT sha256:..." for the small-ViT evidence
    footer: str = ""  # markdown printed under the table (provenance, a note)
    source: str = ""  # what wrote the record
    extra: dict = field(default_factory=dict)  # raw numbers a writer keeps beside the cells

    def __post_init__(self) -> None:
        if not NAME.match(self.name):
            raise ValueError(f"record name {self.name!r}: lower-case letters, digits, '_', '-', "
                             f"'.' only")
        width = len(self.columns)
        for i, row in enumerate(self.rows):
            if len(row) != width:
                raise ValueError(f"record {self.name}: row {i} has {len(row)} cells, the "
                                 f"table {width} columns")


def _row(cells: list) -> str:
    text = [str(c).replace("|", "\\|").replace("\n", " ") for c in cells]
    return "|" + "|".join(f" {c} " if c else " " for c in text) + "|"


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def parse_table(markdown: str) -> tuple[list[str], list[list[str]]]:
    """The columns and rows of the first markdown table in ``markdown`` (a report's table)."""
    lines: list[str] = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            lines.append(line)
        elif lines:
            break
    if len(lines) < 2:
        raise ValueError("no markdown table (a header and a rule) in the text")
    return _cells(lines[0]), [_cells(ln) for ln in lines[2:]]


def bold_best(rows: list[list[str]], columns) -> list[list[str]]:
    """``rows`` with the highest leading number of each of ``columns`` (indices) in bold, every
    tied cell: a cell's mean ± std, not its bracketed interval; empty cells left alone."""
    rows = [list(r) for r in rows]
    for j in columns:
        means = [float(m[1]) if (m := re.match(r"\s*(-?\d+(?:\.\d+)?)", r[j])) else None
                 for r in rows]
        best = max((m for m in means if m is not None), default=None)
        for r, m in zip(rows, means):
            if m is not None and m == best:
                head, sep, tail = r[j].partition(" [")
                r[j] = f"**{head}**" + (f" [{tail}" if sep else "")
    return rows


def render(record: Record) -> str:
    """The table's markdown (header, rule, rows) and the footer, as the docs show it."""
    lines = [_row(record.columns), "|" + "---|" * len(record.columns)]
    lines += [_row(row) for row in record.rows]
    text = "\n".join(lines) + "\n"
    return text + (f"\n{record.footer.strip()}\n" if record.footer.strip() else "")


def path_of(name: str, folder: Path = RECORDS) -> Path:
    return folder / f"{name}.json"


def save(record: Record, folder: Path = RECORDS) -> Path:
    path = path_of(record.name, folder)
    text = json.dumps(asdict(record), indent=1, ensure_ascii=False) + "\n"
    atomic_write(path, lambda fh: fh.write(text))
    return path


def keep(record: Record, writer: str, folder: Path = RECORDS) -> Path:
    """What a table's writer does last: save ``record``, print it and where it went, and
    re-render the docs tables that show it (for the project's own records folder)."""
    path = save(record, folder)
    print(f"{writer}: wrote {path}")
    print(render(record))
    if Path(folder).resolve() == RECORDS.resolve():
        for doc in render_docs(only={record.name}):
            print(f"{writer}: {doc} re-rendered")
    return path


def measured(name: str, columns: list[str], rows: list[list[str]], command: str, source: str,
             **more) -> Record:
    """A record of what was measured now: this machine, today, this checkout's commit
    (``more`` sets the other fields, or overrides those)."""
    from fedadapt.results.store import git_commit

    return Record(**{"name": name, "columns": columns, "rows": rows, "command": command,
                     "source": source, "machine": machine(), "date": today(),
                     "commit": git_commit(), **more})


def show(name: str | None, columns: list[str], rows: list[list[str]], command: str,
         source: str, writer: str, **more) -> None:
    """A measurement's table: kept as the record ``name`` (:func:`keep` prints it), or, with no
    name, only printed (``more`` as for :func:`measured`)."""
    record = measured(name or writer, columns, rows, command, source, **more)
    if name:
        keep(record, writer)
    else:
        print(render(record))


def load(path: str | Path) -> Record:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        record = Record(**data)
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"record {path}: {err}") from None
    if record.name != path.stem:
        raise ValueError(f"record {path}: its name is {record.name!r}, the file {path.stem!r}")
    return record


def load_all(folder: Path = RECORDS) -> dict[str, Record]:
    return {p.stem: load(p) for p in sorted(folder.glob("*.json"))}


def today() -> str:
    return time.strftime("%Y-%m-%d")


def machine() -> str:
    """The host, its accelerator or CPU model, cores and torch threads."""
    import os
    import platform

    import torch

    if torch.cuda.is_available():
        dev = torch.cuda.get_device_name()
    else:
        try:
            dev = next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                       if ln.startswith("model name"))
        except (OSError, StopIteration):
            dev = platform.processor() or platform.machine()
    return (f"{platform.node()} | {dev} | {os.cpu_count()} cores | "
            f"{torch.get_num_threads()} torch threads")


def pretrained(weights) -> str | None:
    """A folder made by ``fedadapt-pretrain`` in a record's words: its architecture, data set,
    epochs, day, test accuracy and the SHA-256 of its ``model.safetensors``; None for weights
    that are not such a folder."""
    import hashlib

    info = Path(str(weights)) / "pretrain.json" if weights else None
    if info is None or not info.is_file():
        return None
    made = json.loads(info.read_text())
    model = info.with_name("model.safetensors")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()[:16] if model.is_file() \
        else "its file missing"
    made_on = time.strftime("%Y-%m-%d", time.localtime(info.stat().st_mtime))
    return (f"{made['backbone']} made by fedadapt-pretrain on {made['dataset']}, "
            f"{made['epochs']} epochs, on {made_on} ({100 * made['final_test_acc']:.2f}% "
            f"on its test set; model.safetensors SHA-256 {digest}…)")


def backbone_of(run_dirs) -> str | None:
    """Which backbone the runs in ``run_dirs`` ran on, in a record's words: for a folder made by
    ``fedadapt-pretrain`` (``backbone.weights``), :func:`pretrained`'s words; and the weights'
    fingerprint the runs' summaries recorded (several backbones: each, joined by " | "). None
    where no run names either."""
    import yaml

    found, made_by = [], {}  # each weights folder described (its file hashed) once
    for run_dir in map(Path, run_dirs):
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
        summary = json.loads((run_dir / "summary.json").read_text())
        fingerprint = summary.get("backbone_weights")
        text = f"weights fingerprint {fingerprint}" if fingerprint else ""
        weights = (config.get("backbone") or {}).get("weights")
        if weights not in made_by:
            made_by[weights] = pretrained(weights)
        made = made_by[weights]
        if made:
            text = made + (f"; {text}" if text else "")
        if text and text not in found:
            found.append(text)
    return " | ".join(found) or None


def of_runs(run_dirs) -> dict:
    """A record's provenance from the runs it tabulates, not from the moment it is written
    (a table may be made later from them): their commits (``summary.json``'s ``git_commit``),
    the day of the newest run and their backbone (:func:`backbone_of`)."""
    run_dirs = [Path(d) for d in run_dirs]
    commits = sorted({json.loads((d / "summary.json").read_text()).get("git_commit")
                      or "unknown" for d in run_dirs})
    newest = max((d / "summary.json").stat().st_mtime for d in run_dirs)
    return {"commit": ", ".join(commits), "backbone": backbone_of(run_dirs),
            "date": time.strftime("%Y-%m-%d", time.localtime(newest))}


def docs(root: Path = ROOT) -> list[Path]:
    return [p for pattern in DOC_GLOBS for p in sorted(root.glob(pattern))]


def blocks(text: str) -> list[tuple[str, str]]:
    """Each ``(name, body)`` of a doc's record blocks."""
    return [(m["name"], m["body"]) for m in BLOCK.finditer(text)]


def stale(root: Path = ROOT, folder: Path = RECORDS) -> list[str]:
    """One line per docs table that its record does not render to (or that has no record)."""
    records, problems = load_all(folder), []
    for doc in docs(root):
        for name, body in blocks(doc.read_text()):
            where = doc.relative_to(root)
            if name not in records:
                problems.append(f"{where}: table {name!r} has no record {path_of(name, folder)}")
            elif body != render(records[name]):
                problems.append(f"{where}: table {name!r} differs from its record "
                                f"(python -m fedadapt.results.records re-renders it)")
    return problems


def render_docs(root: Path = ROOT, folder: Path = RECORDS, only: set[str] | None = None
                ) -> list[Path]:
    """Rewrite every docs table (or those named in ``only``) from its record; the docs that
    changed."""
    records, changed = load_all(folder), []
    for doc in docs(root):
        text = doc.read_text()

        def fill(m: re.Match) -> str:
            name = m["name"]
            if name not in records or (only is not None and name not in only):
                return m.group(0)
            return m.group(1) + render(records[name]) + m.group(4)

        new = BLOCK.sub(fill, text)
        if new != text:
            atomic_write(doc, lambda fh, new=new: fh.write(new))
            changed.append(doc)
    return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m fedadapt.results.records",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="say which tables differ, change "
                                                             "nothing")
    parser.add_argument("--write", metavar="NAME", help="keep a table as the record NAME")
    parser.add_argument("--table", help="--write: the markdown file whose first table it is")
    parser.add_argument("--command", help="--write: the command that made the table")
    parser.add_argument("--backbone", help="--write: the pretrained backbone it ran on")
    parser.add_argument("--footer", default="", help="--write: markdown under the table")
    parser.add_argument("--dir", default=str(RECORDS), help="the records' folder (default: "
                                                            "benchmarks/records)")
    args = parser.parse_args(argv)
    if args.write:
        if not (args.table and args.command):
            parser.error("--write needs --table FILE and --command '...'")
        columns, rows = parse_table(Path(args.table).read_text())
        path = save(measured(args.write, columns, rows, args.command,
                             f"python -m fedadapt.results.records --write ({args.table})",
                             backbone=args.backbone, footer=args.footer), Path(args.dir))
        print(f"records: wrote {path}")
        if Path(args.dir).resolve() != RECORDS.resolve():
            return
    if args.check:
        problems = stale()
        for line in problems:
            print(line, file=sys.stderr)
        raise SystemExit(1 if problems else 0)
    for doc in render_docs():
        print(f"records: {doc.relative_to(ROOT)} re-rendered")


if __name__ == "__main__":
    main()
