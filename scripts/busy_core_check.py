"""Rounds through Ray with one core kept busy by another process: the default worker against a
one-CPU worker (docs/scaling.md, "A core taken by another job").

    python scripts/busy_core_check.py [--repeats 2]

The run: 10 linear heads on cached digits features (600 images, 4 rounds of 10 local epochs;
the 20%-faulty test's clean run), through Flower's simulation engine. Each repeat runs the two
sizings one after the other, with a busy loop on one core throughout; prints each run's round
seconds and the median round of each sizing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SIZINGS = {"default": {}, "ray_num_cpus=1": {"ray_num_cpus": 1}}


def rounds(cache: str, federation: dict) -> list[float]:
    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.config import (
        BackboneConfig,
        DatasetConfig,
        FederationConfig,
        PartitionConfig,
        RunConfig,
        TrainConfig,
    )
    from fedadapt.experiment import run_experiment
    from fedadapt.results.store import read_jsonl

    cfg = RunConfig(
        dataset=DatasetConfig(name="digits", max_samples=600),
        backbone=BackboneConfig(name="small_cnn", family="small_cnn", image_size=16,
                                arch={"width": 8, "pool": 2, "init": "kaiming"}),
        method=LinearHeadConfig(), rounds=4, seed=7, cache_dir=cache,
        partition=PartitionConfig(kind="iid", num_clients=10, fraction_fit=1.0),
        train=TrainConfig(lr=0.2, batch_size=16, local_epochs=10, precision="fp32"),
        federation=FederationConfig(eval_every=4, backend="simulation", **federation))
    with tempfile.TemporaryDirectory() as out:
        run_experiment(cfg, Path(out), config_yaml="busy_core_check\n")
        return [row["round_s"] for row in read_jsonl(Path(out) / "metrics.jsonl")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cache = os.environ.get("FEDADAPT_CACHE") or tempfile.mkdtemp(prefix="busy-core-")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    got: dict[str, list[float]] = {name: [] for name in SIZINGS}
    try:
        for repeat in range(args.repeats):
            for name, federation in SIZINGS.items():
                secs = rounds(cache, federation)
                got[name] += secs
                print(f"repeat {repeat + 1} {name}: rounds "
                      f"{', '.join(f'{s:.2f}' for s in secs)} s", flush=True)
    finally:
        busy.kill()
    for name, secs in got.items():
        print(f"{name}: median round {statistics.median(secs):.2f} s ({len(secs)} rounds)")


if __name__ == "__main__":
    main()
