"""Accuracy against epsilon from ``dp_fmnist`` run directories:

    python benchmarks/investigations/plot_dp.py outputs/dp_fmnist --out docs/dp_epsilon.png

One point per noise multiplier (mean and sample std over seeds of the final global accuracy, at
the epsilon Flower's accountant reported); the runs without DP as a line."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    groups: dict = {}
    for folder in args.dirs:
        for path in sorted(Path(folder).rglob("summary.json")):
            s = json.loads(path.read_text())
            eps = (s.get("privacy") or {}).get("epsilon")
            groups.setdefault(eps, []).append(100 * s["final"]["global_acc"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.4))
    points = sorted((e, v) for e, v in groups.items() if e is not None)
    ax.errorbar([e for e, _ in points], [statistics.mean(v) for _, v in points],
                yerr=[statistics.stdev(v) if len(v) > 1 else 0 for _, v in points],
                marker="o", capsize=3, label="server-side fixed clipping")
    for e, v in points:
        ax.annotate(f"{statistics.mean(v):.1f}", (e, statistics.mean(v)),
                    textcoords="offset points", xytext=(4, -12), fontsize=8)
    if None in groups:
        mean = statistics.mean(groups[None])
        ax.axhline(mean, color="gray", ls="--", label=f"no DP ({mean:.1f})")
    ax.set_xlabel("epsilon at delta = 1/N (Flower's RDP accountant)")
    ax.set_ylabel("final global accuracy (%)")
    ax.set_title("Fashion-MNIST, 1,000 clients, 20 rounds", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
