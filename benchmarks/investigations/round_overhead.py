"""Where a Table-1-shaped round's time goes besides the clients' training: the Accumulator + PA
on a random DeiT-S (its real tensor sizes: 144 MB up and 144 MB down for 10 clients), 100
clients, 10 per round, in process under cProfile, on a synthetic CIFAR-100-shaped data set of a
few images per client at 32 px (so that compute is small and what is not compute shows).

    python benchmarks/investigations/round_overhead.py [--rounds 3] [--images 2000] [overrides...]

Prints, per round on average: the round's wall seconds, the clients' training (the worker's
``_run_group``), the aggregation (``average_by_tensor``), the replies' screening, the exchange
besides training (packing, unpacking, records), and the rest. Offline; ~1 min on 2 cores.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
from pathlib import Path

PARTS = {  # label: (file suffix, function)
    "round": ("federation/server/loop.py", "_train_round"),
    "training (_run_group)": ("federation/client/worker.py", "_run_group"),
    "exchange (grid)": ("federation/wire/grid.py", "_exchange"),
    "aggregation (average_by_tensor)": ("strategies/fedavg.py", "average_by_tensor"),
    "screening (screen_clients)": ("federation/server/faults.py", "screen_clients"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--images", type=int, default=2000)
    args, overrides = parser.parse_known_args(argv)
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    tmp = Path(tempfile.mkdtemp(prefix="round_overhead-"))
    subprocess.run([sys.executable, "-m", "fedadapt.tools.synthetic_cifar100", str(tmp / "data"),
                    "--train", str(args.images), "--test", "100"], check=True)
    composed = compose_config([
        "experiment=acc_conventional", "dataset=cifar100", f"dataset.path={tmp / 'data'}",
        "backbone=deit_small", "backbone.weights=null", "backbone.image_size=32",
        "method=accumulator_pa", "partition=iid", "partition.num_clients=100",
        "partition.fraction_fit=0.1", f"rounds={args.rounds}",
        f"federation.eval_every={args.rounds + 1}", "federation.checkpoint_every=0",
        "train.crop_scale=null", f"cache_dir={tmp / 'cache'}", *overrides])
    profile = cProfile.Profile()
    profile.enable()
    run_experiment(to_run_config(composed), tmp / "run", execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed))
    profile.disable()
    stats = pstats.Stats(profile).stats
    seconds = {label: sum(v[3] for (f, _, name), v in stats.items()
                          if f.endswith(suffix) and name == func)
               for label, (suffix, func) in PARTS.items()}
    n = args.rounds
    rows = [("round, wall", seconds["round"])]
    rows += [(label, seconds[label]) for label in list(PARTS)[1:]]
    exchange_only = seconds["exchange (grid)"] - seconds["training (_run_group)"]
    rest = (seconds["round"] - seconds["exchange (grid)"]
            - seconds["aggregation (average_by_tensor)"] - seconds["screening (screen_clients)"])
    rows[2] = ("exchange besides training", exchange_only)
    rows.append(("the rest of the round", rest))
    rows.append(("not training, in all", seconds["round"] - seconds["training (_run_group)"]))
    print("| part of a round | s per round |\n|---|---|")
    for label, total in rows:
        print(f"| {label} | {total / n:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
