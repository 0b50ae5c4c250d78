"""How long a stop takes: `fedadapt` is started in its own session, sent SIGINT or SIGTERM (to the
process, or to its whole process group as Ctrl-C and `timeout` do) at two stages, and timed from
the signal to its exit; the exit code, the stop line and the lock are checked each time.

    python benchmarks/investigations/stop_times.py [--repeats 3] [OVERRIDES...]

Stages: ``start-up`` (1 s after the job folder's job.json appears: data, Ray starting) and
``rounds`` (once round 3 is in metrics.jsonl). Prints a markdown table: median and range of the
seconds from the signal to the exit (docs/reliability.md, "Clean stops")."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [("SIGINT", "group"), ("SIGTERM", "process"), ("SIGTERM", "group")]
RUN = ["method=linear_head", "rounds=30", "partition.fraction_fit=1.0"]


def wait_for(folder: Path, stage: str, proc, limit: float = 300.0) -> None:
    deadline = time.time() + limit
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fedadapt ended before the {stage} stage")
        if stage == "start-up" and list(folder.rglob("job.json")):
            time.sleep(1.0)
            return
        rows = list(folder.rglob("metrics.jsonl"))
        if stage == "rounds" and rows and len(rows[0].read_text().splitlines()) >= 3:
            return
        time.sleep(0.02)
    raise RuntimeError(f"no {stage} stage within {limit} s")


def one(sig: str, target: str, stage: str, overrides: list[str]) -> tuple[float, str]:
    folder = Path(tempfile.mkdtemp(prefix="fedadapt-stop-"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(["fedadapt", *RUN, *overrides, f"output_dir={folder}"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    wait_for(folder, stage, proc)
    signum = getattr(signal, sig)
    t0 = time.monotonic()
    (os.killpg if target == "group" else os.kill)(proc.pid, signum)
    try:
        rc = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return float("inf"), "hung (killed after 60 s)"
    took = time.monotonic() - t0
    err = proc.stderr.read()
    problems = []
    if rc != 128 + signum:
        problems.append(f"exit {rc}")
    if f"fedadapt: stopped by {sig}" not in err:
        problems.append("no stop line")
    if list(folder.rglob(".fedadapt.lock")):
        problems.append("lock left")
    if "Traceback" in err:
        problems.append("traceback")
    return took, ", ".join(problems) or "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", help="one case: SIGNAL,process|group,start-up|rounds")
    args, overrides = parser.parse_known_args()
    print("| signal | to | stage | seconds to exit: median (range) | checks |")
    print("|---|---|---|---|---|")
    only = tuple(args.only.split(",")) if args.only else None
    for stage in ("start-up", "rounds"):
        for sig, target in CASES:
            if only and only != (sig, target, stage):
                continue
            results = [one(sig, target, stage, overrides) for _ in range(args.repeats)]
            times = [t for t, _ in results]
            checks = sorted({c for _, c in results})
            print(f"| {sig} | the {'process group' if target == 'group' else 'process'} | "
                  f"{stage} | {statistics.median(times):.2f} ({min(times):.2f}-{max(times):.2f})"
                  f" | {'; '.join(checks)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
