"""``fedadapt-bench``: timings of fedadapt, one module per benchmark, chosen by a flag:

* (no flag), ``--exits``, ``--methods``, ``--per-round``: seconds per round against a plain loop,
  per exit, per method, per clients per round (:mod:`fedadapt.bench.rounds`);
* ``--throughput``: images per second of local training against a bare loop and the data path
  alone (:mod:`fedadapt.bench.throughput`);
* ``--scale``: seconds per round and memory at 100 to 10,000 clients (:mod:`fedadapt.bench.scale`);
* ``--iciia``: ICIIA's latency and memory of recognising one image (:mod:`fedadapt.bench.iciia`).
"""

from __future__ import annotations

import argparse

from fedadapt.bench.throughput import parse_rows, row_name
from fedadapt.ending import console

__all__ = ["main", "parse_rows", "row_name"]


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedadapt-bench",
                                     description=__doc__.split("\n")[0].rstrip(":"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="outputs/bench",
                        help="folder for the JSON (--throughput: a file name ending in .json "
                             "is written as is)")
    parser.add_argument("--exits", help="multi-tier mode, e.g. 3,11: the same run with every "
                                            "client at one exit, per exit (compute saved?)")
    parser.add_argument("--methods", help="methods mode, e.g. fedclip,fedavg_clip: seconds per "
                                              "round of each (base: experiment=fedclip_cost)")
    parser.add_argument("--iciia", action="store_true",
                        help="ICIIA Table 2: latency and memory of recognising one image with "
                             "15 cached features, against the backbone alone")
    parser.add_argument("--throughput", action="store_true",
                        help="images/s of one client's local training: fedadapt, a bare loop, "
                             "the data path alone (base: Accumulator on small_vit)")
    parser.add_argument("--steps", type=int, default=40, help="--throughput: steps per repeat")
    parser.add_argument("--scale", action="store_true",
                        help="s/round and peak memory at 100, 1,000 and 10,000 clients with the "
                             "same number sampled (--sampled)")
    parser.add_argument("--sampled", type=int, default=10, help="--scale: clients per round")
    parser.add_argument("--per-round", help="overhead mode, e.g. 10,100: Flower against the "
                                                "plain loop with that many clients per round "
                                                "(Fashion-MNIST, 100 clients)")
    parser.add_argument("--data-only", action="store_true",
                        help="--throughput: only the data path")
    parser.add_argument("--rows", help="--throughput: several rows in one process, "
                                       "clients:batch:precision:method comma-separated (e.g. "
                                       "1:10:bf16:accumulator_pa,10:10:bf16:lora); --out is "
                                       "their folder, one JSON per row")
    parser.add_argument("--profile", action="store_true",
                        help="--throughput --rows: each row's loops once more under "
                             "torch.profiler, tables beside its JSON (.profile.txt)")
    parser.add_argument("--clients", type=int, default=1,
                        help="--throughput: clients trained side by side (the bare loop steps "
                             "at the same total batch)")
    parser.add_argument("--record", help="keep the table as benchmarks/records/NAME.json and "
                                          "re-render the docs tables that show NAME")
    parser.add_argument("--record-dir", default="benchmarks/records",
                        help="--record: the records' folder (default: benchmarks/records)")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    return parser


def main(argv: list[str] | None = None) -> None:
    from fedadapt.bench import iciia, rounds, scale, throughput
    from fedadapt.entry import run_cli

    def run(argv: list[str]) -> int:
        args = parser().parse_args(argv)
        args.argv = list(argv)
        mode = (throughput if args.throughput else scale if args.scale
                else iciia if args.iciia else rounds)
        mode.run(args)
        return 0

    run_cli(run, argv)


#: The console command: :func:`main`, then the process ends without the interpreter's
#: teardown (:mod:`fedadapt.ending`).
command = console(main)
