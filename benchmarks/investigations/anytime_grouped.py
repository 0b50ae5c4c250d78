"""What an anytime client costs when it trains side by side: K clients of the Accumulator + PA
on the 12-block small ViT trained as one group, each step at an exit drawn from all 12 (anytime),
against the same group with every client at the deepest exit (what a group cost when it ran to
its deepest drawn exit). Medians over the repeats, the two sides interleaved.

    python benchmarks/investigations/anytime_grouped.py [--clients 10] [--steps 10] [--repeats 5] \\
        [overrides]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fedadapt.bench.throughput import prepare_run_quiet
from fedadapt.entry import compose_config, to_run_config
from fedadapt.federation.client.grouped import ClientJob, UsedTensors, train_group


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = to_run_config(compose_config([
        "dataset=fashion_mnist", "backbone=small_vit", "setting=anytime", "method=accumulator_pa",
        "train.batch_size=10", *args.overrides]))
    prep = prepare_run_quiet(cfg)
    model, src, train = prep.model, prep.spec.train_source, prep.spec.train
    bs, k = train.batch_size, args.clients
    pool = np.concatenate([c.train for c in prep.spec.clients])[:k * args.steps * bs]
    start = model.tensors(model.trainable_names())
    exits = list(range(model.num_exits))
    used = UsedTensors(model, src, int(pool[0]), precision=prep.spec.precision)

    def jobs(draw: list[int]) -> list[ClientJob]:
        return [ClientJob(cid=i, indices=pool[i * args.steps * bs:(i + 1) * args.steps * bs],
                          tensors=start, seed=i, exits=draw) for i in range(k)]

    sides = {"anytime (exits 0-11)": jobs(exits), "every client at exit 11": jobs(exits[-1:])}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for rep in range(args.repeats + 1):
        for name, group in sides.items():
            t0 = time.perf_counter()
            train_group(model, src, group, train, lr=train.lr, used=used,
                        precision=prep.spec.precision)
            if rep:  # the first pass warms up
                times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"| {k} clients x {args.steps} steps x batch {bs}, {torch.get_num_threads()} threads "
          f"| median s | vs every client at exit 11 |\n|---|---|---|")
    for name, s in med.items():
        print(f"| {name} | {s:.3f} | {s / med['every client at exit 11']:.2f} |")


if __name__ == "__main__":
    main()
