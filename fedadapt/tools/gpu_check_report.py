"""The report of ``fedadapt-gpu-check``: one Markdown file from the step logs it leaves.

    python -m fedadapt.tools.gpu_check_report OUT_DIR     # (re)writes OUT_DIR/report.md
    python -m fedadapt.tools.gpu_check_report --versions  # the device and versions, on stdout

Rewritten after every step, so a check cut short still leaves a report of what ran. Nothing here
measures: the figures are read from the steps' own outputs (fedadapt-bench's JSON, each run's
summary.json and metrics.jsonl, nvidia-smi's samples).
"""

from __future__ import annotations

import csv
import glob
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path


def versions() -> None:
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU visible"
    print(f"device: {gpu} | python {platform.python_version()} | torch {torch.__version__} | "
          f"cuda {torch.version.cuda} | {os.cpu_count()} CPUs")
    names = ("fedadapt", "flwr", "ray", "transformers", "peft", "open_clip_torch", "timm",
             "hydra-core", "datasets")

    def ver(p: str) -> str:
        try:
            return version(p)
        except PackageNotFoundError:
            return "missing"
    print(" | ".join(f"{p} {ver(p)}" for p in names))
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        print(f"nvidia-smi: {smi.stdout.strip()}")
    except (OSError, subprocess.TimeoutExpired):
        pass


def _steps(out: Path) -> dict[str, tuple[int, int, int]]:
    rows = {}
    path = out / "steps.tsv"
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, secs, limit = line.split("\t")
            rows[name] = (int(rc), int(secs), int(limit))
    return rows


def _status(rc: int, secs: int, limit: int) -> str:
    if rc in (124, 137):
        return f"**timed out** after {limit} s"
    return f"ok, {secs} s" if rc == 0 else f"**failed** (exit {rc}), {secs} s"


def _tail(path: Path, n: int) -> str:
    if not path.exists():
        return "(no output)"
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-n:])


def _profiles(folder: Path, out: Path) -> list[str]:
    """Each ``--profile`` file's headline in ``folder`` (its ``## `` lines: wall time and
    device busy), named relative to the report's folder ``out``."""
    lines = []
    for path in sorted(folder.glob("throughput-*.profile.txt")):
        heads = [line[3:] for line in path.read_text().splitlines() if line.startswith("## ")]
        lines.append(f"- `{path.relative_to(out)}`: " + "; ".join(heads))
    return lines


def _throughput(out: Path) -> list[str]:
    rows = ["| method | clients x batch | precision | fedadapt img/s | bare loop img/s (same "
            "total batch) | ratio | data path img/s | GPU busy % |",
            "|---|---|---|---|---|---|---|---|"]
    for path in sorted(out.glob("throughput-*.json")):
        method = path.stem.split("-")[1]
        r = json.loads(path.read_text())
        if "error" in r:
            rows.append(f"| {method} | {r['clients']} x {r['batch_size']} | {r['precision']} | "
                        f"**failed**: {r['error']} | | | | |")
            continue

        def f(v, d=0):
            return "—" if v is None else f"{v:,.{d}f}"
        rows.append(f"| {method} | {r['clients']} x {r['batch_size']} | {r['precision']} | "
                    f"{f(r['fedadapt_images_per_s'])} | {f(r['bare_images_per_s'])} | "
                    f"{f(r['ratio'], 2)} | {f(r['data_images_per_s'])} | "
                    f"{f(r['gpu_utilisation_mean'])} |")
    return rows


def _smi(path: Path, start: float, end: float) -> tuple[float | None, float | None]:
    """Mean GPU utilisation and peak memory (MiB) between two epoch times."""
    if not path.exists():
        return None, None
    util, mem = [], []
    for row in csv.reader(path.read_text().splitlines()):
        try:
            t = datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
        except (ValueError, IndexError):
            continue
        if start <= t <= end:
            util.append(float(row[1]))
            mem.append(float(row[2]))
    return (statistics.mean(util) if util else None), (max(mem) if mem else None)


def _run(out: Path, name: str, total_rounds: int) -> list[str]:
    summaries = glob.glob(str(out / "runs" / name / "**" / "summary.json"), recursive=True)
    if not summaries:
        return ["(no finished run: see its log below)"]
    if not (Path(summaries[0]).parent / "metrics.jsonl").exists():  # trained once, on the server
        summary = json.loads(Path(summaries[0]).read_text())
        return [f"- run directory: `{Path(summaries[0]).parent.relative_to(out)}`; wall "
                f"{summary.get('wall_s', '—')} s; final: {summary.get('final')}"]
    run_dir = Path(summaries[0]).parent
    summary = json.loads(Path(summaries[0]).read_text())
    rounds = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    secs = [r["round_s"] for r in rounds]
    evaluated = [r["round"] for r in rounds if r.get("global_acc") is not None]
    plain = [s for r, s in zip(rounds, secs) if r["round"] not in evaluated][1:] or secs
    end = (run_dir / "metrics.jsonl").stat().st_mtime
    util, peak = _smi(out / f"run-{name}.smi.csv", end - sum(secs), end)
    layout = summary.get("layout") or {}
    med = statistics.median(plain)
    eval_s = (secs[[r["round"] for r in rounds].index(evaluated[-1])] - med) if evaluated else None
    lines = [f"- run directory: `{run_dir.relative_to(out)}`; device {summary.get('device')}, "
             f"precision {summary.get('precision')}",
             f"- clients side by side: K = {layout.get('clients_per_worker')} on "
             f"{layout.get('workers')} worker(s) ({layout.get('note') or 'explicit'}); "
             f"through {layout.get('side_by_side', '—')}"
             f"{', captured' if layout.get('compiled') else ''}; backend "
             f"{layout.get('backend', '—')}",
             f"- seconds per round: {', '.join(f'{s:.2f}' for s in secs)} (round "
             f"{', '.join(map(str, evaluated)) or '—'} with the global evaluation); median "
             f"without round 1 and evaluation: {med:.2f} s",
             *([f"- the global evaluation (round {evaluated[-1]}): about {eval_s:.2f} s (that "
                f"round's seconds less the median)"] if evaluated else []),
             f"- {total_rounds} rounds at that median: {med * total_rounds / 60:.1f} min, plus "
             f"the evaluations",
             "- GPU busy over the rounds: " + ("—" if util is None else f"{util:.0f}%") +
             "; peak GPU memory (nvidia-smi, the whole device): " +
             ("—" if peak is None else f"{peak / 1024:.1f} GiB"),
             f"- final global accuracy (synthetic data: a check that it learns, not a result): "
             f"{summary['final'].get('global_acc')}"]
    return lines


#: The runs of ``fedadapt-gpu-check``: name, what it is, the rounds of its paper's row (for the
#: projected time; 1 for the server-trained methods, which train once).
RUNS = (("conventional", "experiment=acc_conventional (Table 1's shape), defaults", 500),
        ("conventional-eager", "the same, federation.compile=false", 500),
        ("anytime", "experiment=acc_anytime", 1500),
        ("multitier", "experiment=acc_multitier", 500),
        ("lora", "experiment=acc_conventional method=lora", 500),
        ("fedclip", "experiment=fedclip_pacs (CLIP ViT-B/32, PACS-shaped data)", 200),
        ("iciia", "experiment=iciia_cifar100 method=iciia_b", 1),
        ("duet", "experiment=sessions_cifar100 method=duet", 1),
        ("cdc_mmpg", "experiment=sessions_cifar100 method=cdc_mmpg", 1))


def report(out: Path) -> str:
    steps = _steps(out)
    parts = [f"# fedadapt GPU check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "",
             "Made by `fedadapt-gpu-check` (the data are synthetic, CIFAR-100-shaped: "
             "figures of speed, not of accuracy).", "", "```", _tail(out / "versions.log", 5),
             "```", "", "## Steps", "", "| step | result |", "|---|---|"]
    parts += [f"| {n} | {_status(*v)} |" for n, v in steps.items()]
    if (out / "attention.md").exists():
        parts += ["", "## Attention under vmap (`benchmarks/investigations/vmap_attention.py`)", "",
                  (out / "attention.md").read_text()]
    if "tests" in steps:
        log = out / "tests.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = text.splitlines()
        failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
        slow = next((i for i, line in enumerate(lines) if "slowest" in line and "durations"
                     in line), None)
        slowest = lines[slow:slow + 16] if slow is not None else []
        parts += ["", "## Tests", "", "```", _tail(log, 1), *failed[:40], *slowest, "```"]
    rows = _throughput(out)
    if len(rows) > 2:
        parts += ["", "## Throughput of local training (`fedadapt-bench --throughput`)", "",
                  "K clients side by side, each its own batches; the bare loop is a plain "
                  "PyTorch step of the same model at the total batch K x B on one batch "
                  "already on the device (the ceiling). Median of 3 repeats.", "", *rows]
    profiles = _profiles(out / "profile", out)
    if profiles:
        parts += ["", "## Where the time goes (`--profile`: one more call of each loop under "
                  "torch.profiler; tables in the `.profile.txt` file)", "", *profiles]
    captured = _throughput(out / "captured")
    if len(captured) > 2:
        parts += ["", "## The same rows captured (`federation.compile=true`)", "",
                  "fedadapt's grouped step through torch.compile (CUDA graphs on a GPU), against "
                  "the faster of the bare step eager and the bare step captured the same way "
                  "(a row's JSON has both). The first call of each shape compiles; the repeats "
                  "after the warm-up are timed.", "", *captured]
    for name, title, total in RUNS:
        if f"run-{name}" in steps:
            parts += ["", f"## `{title}`", "", *_run(out, name, total)]
    bad = [n for n, (rc, _, _) in steps.items() if rc != 0]
    for name in bad:
        parts += ["", f"## Log of the step that failed: {name}", "", "```",
                  _tail(out / f"{name}.log", 25), "```"]
    return "\n".join(parts) + "\n"


def main() -> None:
    if sys.argv[1:] == ["--versions"]:
        versions()
        return
    out = Path(sys.argv[1])
    text = report(out)
    tmp = out / "report.md.tmp"
    tmp.write_text(text)
    os.replace(tmp, out / "report.md")
    print(text)


if __name__ == "__main__":
    main()
