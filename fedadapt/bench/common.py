"""What every ``fedadapt-bench`` mode ends with: its JSON and its table (kept as a record with
``--record``)."""

from __future__ import annotations

import time
from pathlib import Path


def table(args, columns: list[str], rows: list[list[str]], raw: dict) -> None:
    """Print the result's table; with ``--record NAME``, keep it as the record
    ``benchmarks/records/NAME.json`` and re-render the docs tables that show it."""
    from fedadapt.results import records

    record = records.measured(args.record or "bench", columns, rows,
                              " ".join(["fedadapt-bench", *args.argv]), "fedadapt-bench",
                              extra=raw)
    print("\n" + records.render(record), end="")
    if not args.record:
        return
    folder = Path(args.record_dir)
    path = records.save(record, folder)
    print(f"record: {path}")
    if (Path.cwd() / "docs").is_dir() and folder.resolve() == records.RECORDS.resolve():
        for doc in records.render_docs(only={args.record}):
            print(f"record: {doc} re-rendered")


def write(out: str, name: str, obj: dict) -> Path:
    from fedadapt.results.store import write_json

    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(path, obj)
    return path
