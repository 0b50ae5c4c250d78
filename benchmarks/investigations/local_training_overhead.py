"""What fedadapt's local training adds to the training itself, on peer_pfl.py's workloads.

    python benchmarks/investigations/local_training_overhead.py [--workload W1|W3] [--repeats 30] \\
        [--clients 10]

Ten clients of the workload's partition (the first ``--clients``) train as a worker trains them
(``train_local``: the schedule, seeding, the data path, the optimiser), against a bare torch loop
over the same model and the same batches held ready as tensors (what pfl's side does). The two are
timed alternately, ``--repeats`` times each; the medians and minima are printed in ms per round of
those clients. Nothing is written. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", choices=("W1", "W3"), default="W3")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--clients", type=int, default=10)
    a = p.parse_args(argv)
    if a.repeats < 1 or a.clients < 1:
        p.error("--repeats and --clients are at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import torch.nn.functional as F
    from peer_pfl import fedadapt_overrides

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.client.training import local_schedule, train_local

    shape = SimpleNamespace(clients=1000, rounds=20, max_samples=None, w3_image_size=64)
    prep = prepare_run(to_run_config(compose_config(fedadapt_overrides(a.workload, shape))),
                       quiet=True)
    model, spec = prep.model, prep.spec
    source, train = spec.train_source, spec.train
    clients = [c.train for c in spec.clients[:a.clients]]
    initial = {n: t.clone() for n, t in model.tensors(model.trainable_names()).items()}
    ready = [list(source.stream(local_schedule(idx, train, i, None)[0], "cpu"))
             for i, idx in enumerate(clients)]
    params = [p for p in model.parameters() if p.requires_grad]

    def fedadapt() -> None:
        for i, idx in enumerate(clients):
            model.load_tensors(initial)
            train_local(model, source, idx, train, lr=train.lr, seed=i, precision="fp32")

    def bare() -> None:
        for batches in ready:
            model.load_tensors(initial)
            model.train()
            opt = torch.optim.SGD(params, lr=train.lr)
            for x, y in batches:
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()

    sides = {"train_local": fedadapt, "bare torch loop, inputs ready": bare}
    for run in sides.values():  # warm-up: first optimiser (torch._dynamo's import), mappings
        run()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(a.repeats):
        for name, run in sides.items():
            t0 = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t0)
    steps = sum(len(b) for b in ready)
    print(f"{a.workload}: {len(clients)} clients, {steps} steps, {torch.get_num_threads()} torch "
          f"threads, {a.repeats} repeats each, alternating")
    for name, ts in times.items():
        print(f"  {name}: {statistics.median(ts) * 1e3:.2f} ms a round (min "
              f"{min(ts) * 1e3:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
