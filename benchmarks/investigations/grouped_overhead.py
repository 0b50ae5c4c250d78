"""How much more work a grouped step dispatches than a bare step, measured on the CPU.

    python benchmarks/investigations/grouped_overhead.py [--clients 10] [--batch 10] [--steps 8] \\
        [--repeats 7]

On a GPU the grouped step is bound by the CPU: launching its operators takes longer than the
device takes to run them (docs/speed.md, "Where a grouped step's time goes"). The number of
operators a step dispatches does not depend on the device, so it can be measured and cut here.
The model has DeiT-S's structure at a width too small to compute much: the 12-block ViT
(``small_vit``) at width 16 with the Accumulator and parallel adapters, 32 px images in 16 px
patches. Reported:

* the top-level aten operators per step (each is at least one kernel launch on a GPU), K
  clients side by side (``train_group``) against a bare PyTorch step at batch K x B;
* their milliseconds per step, medians of ``--repeats``, the two sides interleaved.

Data: a CIFAR-100-shaped synthetic set (``fedadapt/tools/synthetic_cifar100.py``, 5,000 images, made
once under ``$FEDADAPT_CACHE/grouped_overhead``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

TINY_DEIT = ["backbone=small_vit", "backbone.arch.hidden_size=16",
             "backbone.arch.num_attention_heads=2", "backbone.arch.intermediate_size=32",
             "backbone.arch.patch_size=16", "method=accumulator_pa", "train.precision=fp32",
             "train.momentum=0.0", "partition.num_clients=10"]


def top_level_ops(fn) -> int:
    """aten operators ``fn`` dispatches that no other aten operator called."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--batch", type=int, default=10)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

    from fedadapt.bench.throughput import THROUGHPUT_BASE, prepare_run_quiet, training_loops
    from fedadapt.entry import compose_config, to_run_config

    data = Path(os.environ.get("FEDADAPT_CACHE") or Path.home() / ".cache" / "fedadapt") \
        / "grouped_overhead"
    if not (data / "dataset_dict.json").exists():
        subprocess.run([sys.executable, "-m", "fedadapt.tools.synthetic_cifar100",
                        str(data), "--train", "5000", "--test", "500"], check=True)
    cfg = to_run_config(compose_config(THROUGHPUT_BASE + TINY_DEIT + [
        "dataset=cifar100", f"dataset.path={data}", f"train.batch_size={a.batch}"]))
    k, bs, steps = a.clients, a.batch, a.steps
    loops = training_loops(prepare_run_quiet(cfg), cfg, clients=k, steps=steps)
    sides = {"grouped": loops["fedadapt"], "bare": loops["bare"]}
    for fn in sides.values():
        fn()  # warm-up
    ops = {name: top_level_ops(fn) / steps for name, fn in sides.items()}
    ms: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(a.repeats):
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn()
            ms[name].append((time.perf_counter() - t0) / steps * 1e3)
    print(f"| {k} clients x batch {bs} against batch {k * bs} | top-level aten ops per step | "
          f"ms per step (median of {a.repeats}) |\n|---|---|---|")
    for name in sides:
        print(f"| {name} | {ops[name]:,.0f} | {statistics.median(ms[name]):.1f} |")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
