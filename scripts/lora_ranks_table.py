"""The table of docs/peft.md's "LoRA of different ranks" evidence, from the runs
scripts/lora_ranks_evidence.sh writes: per aggregator (and the two homogeneous baselines) and
Dirichlet alpha, the final global accuracy and the clients' mean accuracy on their own test
splits (mean ± std over seeds), the bytes a run sends, and each row's difference to homogeneous
rank-8 LoRA and to every client at rank 2 (both at the ranks runs' scale alpha / r = 2), paired by
seed (the same seed: the same partition,
the same sampled clients). FedSA-LoRA's global model has no B (each client keeps its own): its
row is compared on the clients' accuracy.

    python scripts/lora_ranks_table.py OUT [--out FILE] [--record NAME --command '...']
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml


def _runs(root: Path) -> list[dict]:
    out = []
    for summary in sorted(root.rglob("summary.json")):
        cfg = yaml.safe_load((summary.parent / "config.yaml").read_text())
        s = json.loads(summary.read_text())
        ranks = cfg["method"].get("ranks")
        out.append({
            "dir": summary.parent,
            "row": (cfg["strategy"]["name"], tuple(ranks) if ranks else (cfg["method"]["rank"],),
                    cfg["method"]["alpha"]),
            "alpha": cfg["partition"]["alpha"], "seed": s["seed"],
            "global": 100 * s["final"]["global_acc"], "client": 100 * s["final"]["client_acc"],
            "bytes": s["total_bytes"]})
    return out


def _describe(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _label(row: tuple) -> str:
    strategy, ranks, alpha = row
    scale = alpha / max(ranks)
    if len(ranks) == 1:
        return (f"LoRA r = {ranks[0]}, every client, scale {scale:g} (alpha {alpha:g}; "
                f"`strategy={strategy}`)")
    return f"ranks {'/'.join(map(str, ranks))}, scale {scale:g} (`strategy={strategy}`)"


def table(runs: list[dict]) -> str:
    alphas = sorted({r["alpha"] for r in runs})
    by = {(r["row"], r["alpha"], r["seed"]): r for r in runs}
    order = sorted({r["row"] for r in runs}, key=lambda row: (len(row[1]) > 1, -row[1][0],
                                                              row[2], row[0]))
    # the baselines at the ranks runs' scale, 2: rank 8 at alpha 16, rank 2 at alpha 4
    bases = {"r = 8": ("fedavg", (8,), 16.0), "r = 2": ("fedavg", (2,), 4.0)}
    head = ["rows", "seeds", "MB sent"]
    for a in alphas:
        head += [f"global, α {a:g}", f"clients, α {a:g}", f"Δ vs r = 8, α {a:g}",
                 f"Δ vs r = 2, α {a:g}"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in order:
        mine = [r for r in runs if r["row"] == row]
        cells = [_label(row), str(len({r["seed"] for r in mine})),
                 f"{statistics.mean(r['bytes'] for r in mine) / 1e6:.1f}"]
        metric = "client" if row[0] == "fedsa_lora" else "global"
        for a in alphas:
            at = [r for r in mine if r["alpha"] == a]
            cells += [_describe([r["global"] for r in at]), _describe([r["client"] for r in at])]
            for base in bases.values():
                pairs = [r[metric] - by[(base, a, r["seed"])][metric] for r in at
                         if (base, a, r["seed"]) in by]
                cells.append("—" if row == base else _describe(pairs))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--record", help="keep the table as the record NAME as well "
                                         "(benchmarks/records/NAME.json) and re-render the docs")
    parser.add_argument("--command", default="", help="--record: the command that made it")
    args = parser.parse_args(argv)
    runs = _runs(args.root)
    if not runs:
        print(f"lora_ranks_table: error: no run (summary.json) under {args.root}",
              file=sys.stderr)
        return 2
    text = table(runs)
    out = args.out or args.root / "table.md"
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    if not args.record:
        print(text)
    else:  # records.keep prints it
        from fedadapt.results import records

        head, body = records.parse_table(text)
        record = records.measured(args.record, columns=head, rows=body, command=args.command,
                                  source="scripts/lora_ranks_table.py",
                                  **records.of_runs(r["dir"] for r in runs))
        records.keep(record, "lora_ranks_table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
