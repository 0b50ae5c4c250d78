"""The main job's fine-tuning row on a machine that does other work: alone, two runs started side
by side, and beside a one-thread busy loop; fedadapt's default (threads sized to the free cores,
the wait policy chosen at start-up: fedadapt.cores) against the sizing before it (two threads per
worker whatever the load, OpenMP spinning: ``federation.num_cpus=2 GOMP_SPINCOUNT=300000``).

    python benchmarks/investigations/busy_core_check.py [--repeats 2] \\
        [--backends inprocess,simulation]
        [--rounds 2] [--out runs.json] [--record busy-core] [--from runs.json]

Each run is ``fedadapt method=finetune rounds=2`` in its own process (a warm feature and image
cache: one run first warms it). The scenarios' repeats are interleaved (repeat 1 of every
scenario and sizing, then repeat 2, ...). Reported per scenario and sizing: the median of the
row's ``wall s`` (the run's own wall clock, as the table prints it) and of the whole process's,
and each as a ratio to the same sizing alone. ``--record busy-core`` keeps the table as the
record docs/scaling.md shows. Run it with nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZINGS = {
    "default": ([], {}),
    "before (2 threads, spinning)": (["federation.num_cpus=2"], {"GOMP_SPINCOUNT": "300000"}),
}
SCENARIOS = ("alone", "two side by side", "beside a busy loop")


def start(out: Path, backend: str, rounds: int, sizing: str) -> subprocess.Popen:
    args, env = SIZINGS[sizing]
    cmd = ["fedadapt", "method=finetune", f"rounds={rounds}", f"output_dir={out}",
           f"federation.backend={backend}", *args]
    return subprocess.Popen(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, out: Path, t0: float) -> dict:
    text, _ = proc.communicate()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"busy_core_check: a run failed ({proc.args}):\n{text[-2000:]}")
    summary = json.loads(next(out.glob("quickstart/*/finetune/summary.json")).read_text())
    layout = summary["layout"]
    return {"row_s": summary["wall_s"], "process_s": wall, "threads": layout.get("threads"),
            "omp_wait": layout.get("omp_wait"),
            "final_acc": summary["final"].get("global_acc")}


def scenario(name: str, backend: str, rounds: int, sizing: str, tmp: Path) -> list[dict]:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
        if name == "beside a busy loop" else None
    try:
        if busy is not None:
            time.sleep(0.5)
        outs = [Path(tempfile.mkdtemp(dir=tmp)) for _ in range(2 if name.startswith("two")
                                                                 else 1)]
        t0 = time.monotonic()
        procs = [start(o, backend, rounds, sizing) for o in outs]
        return [finish(p, o, t0) for p, o in zip(procs, outs)]
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


COLUMNS = ["backend", "sizing", "scenario", "runs", "row s (median)", "x alone", "process s",
           "x alone (process)", "threads"]


def table(got: dict) -> list[dict]:
    """Per backend, sizing and scenario: the medians and their ratios to the same sizing
    alone."""
    out = []
    for backend, scenarios in got.items():
        for sizing in SIZINGS:
            alone = statistics.median(r["row_s"] for r in scenarios["alone"][sizing])
            alone_p = statistics.median(r["process_s"] for r in scenarios["alone"][sizing])
            for name in SCENARIOS:
                runs = scenarios[name][sizing]
                row = statistics.median(r["row_s"] for r in runs)
                proc = statistics.median(r["process_s"] for r in runs)
                out.append({"backend": backend, "sizing": sizing, "scenario": name,
                            "runs": len(runs), "row_s": row, "row_x_alone": row / alone,
                            "process_s": proc, "process_x_alone": proc / alone_p,
                            "threads": sorted({r["threads"] for r in runs})})
    return out


def cells(t: dict) -> list[str]:
    return [t["backend"], t["sizing"], t["scenario"], str(t["runs"]), f"{t['row_s']:.1f}",
            f"**{t['row_x_alone']:.2f}**", f"{t['process_s']:.1f}",
            f"{t['process_x_alone']:.2f}", ", ".join(map(str, t["threads"]))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backends", default="inprocess,simulation")
    parser.add_argument("--out", type=Path, default=None,
                        help="every run's numbers, as JSON (written atomically)")
    parser.add_argument("--record", default=None,
                        help="keep the table as benchmarks/records/NAME.json (docs/scaling.md "
                             "shows busy-core)")
    parser.add_argument("--from", dest="from_json", type=Path, default=None,
                        help="no runs: the table of a JSON an earlier --out wrote")
    args = parser.parse_args()
    command = "python benchmarks/investigations/busy_core_check.py " + " ".join(
        a for a in sys.argv[1:] if not a.startswith("--from"))
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        got, command = saved["runs"], saved["command"]
    else:
        got = measure([b for b in args.backends.split(",") if b], args.repeats, args.rounds)
    rows = table(got)
    if args.out is not None:
        from fedadapt.results.store import write_json

        write_json(args.out, {"command": command, "rows": rows, "runs": got})
    from fedadapt.results import records

    records.show(
        args.record, COLUMNS, [cells(t) for t in rows], command=command,
        source="benchmarks/investigations/busy_core_check.py", writer="busy_core_check",
        extra={"runs": got},
        footer="*x alone*: the median against the same sizing's run alone on the idle "
               "machine; *row s*: the run's own wall clock (the table's `wall s`); "
               "*process s*: the whole `fedadapt` process, start-up included.")


def measure(backends: list[str], repeats: int, rounds: int) -> dict:
    got: dict = {b: {s: {z: [] for z in SIZINGS} for s in SCENARIOS} for b in backends}
    with tempfile.TemporaryDirectory(prefix="busy-core-") as tmp:
        print("warming the caches with one run ...", flush=True)
        scenario("alone", backends[0], 1, "default", Path(tmp))
        for repeat in range(repeats):
            for backend in backends:
                for name in SCENARIOS:
                    for sizing in SIZINGS:
                        runs = scenario(name, backend, rounds, sizing, Path(tmp))
                        got[backend][name][sizing] += runs
                        print(f"repeat {repeat + 1}/{repeats} {backend} | {name} | {sizing}: "
                              + "; ".join(f"row {r['row_s']:.1f} s, process {r['process_s']:.1f}"
                                          f" s, {r['threads']} thread(s), {r['omp_wait']}"
                                          for r in runs), flush=True)
    return got


if __name__ == "__main__":
    main()
