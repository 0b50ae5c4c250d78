"""The noise multipliers that spend a target epsilon:

    python benchmarks/investigations/dp_noise.py --epsilon 1 4 8 --rounds 30 --clients 100 \\
        --sampled 100

prints, for each target, the smallest ``dp.noise_multiplier`` (3 significant digits) whose
rounds of ``dp=server_fixed`` spend at most that epsilon at delta = min(1e-5, N^-1.1),
fedadapt's default (or ``--delta``), by Flower's RDP accountant, as a run reports it."""

from __future__ import annotations

import argparse

from fedadapt.strategies.privacy import noise_for_epsilon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilon", type=float, nargs="+", required=True)
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--clients", type=int, required=True, help="partition.num_clients")
    parser.add_argument("--sampled", type=int, required=True, help="clients per round")
    parser.add_argument("--delta", type=float, default=None,
                        help="default: min(1e-5, clients^-1.1)")
    args = parser.parse_args()
    print("| target epsilon | dp.noise_multiplier |\n|---|---|")
    for eps in args.epsilon:
        z = noise_for_epsilon(eps, rounds=args.rounds, num_clients=args.clients,
                              sampled=args.sampled, delta=args.delta)
        print(f"| {eps:g} | {z:g} |")


if __name__ == "__main__":
    main()
