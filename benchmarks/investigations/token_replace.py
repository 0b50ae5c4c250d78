"""Why does the Accumulator with token replace collapse on the offline evidence? Measure it.

A plain FedAvg loop (the strategy's own seeded sampler, ``train_local``'s batches and seeds) over
the offline preset's clients (``experiment=acc_offline``: the pretrained small ViT, digits, 10
clients, 3 per round), with, every local step of every client: the loss, the gradient norm of
the trainable tensors, whether every tensor is finite; and every round, on a fixed batch of 64
test images: the global test accuracy, and the relative change token replace makes to the CLS
token entering each block, ``||z_replaced - c_k|| / ||c_k||``, averaged over blocks and images.

Each variant is a list of overrides; the default compares the Accumulator's initialisation
(``method.zero_init``) with token replace on and off::

    HF_HUB_OFFLINE=1 python benchmarks/investigations/token_replace.py --rounds 30 \\
        --out docs/token_replace
    python benchmarks/investigations/token_replace.py \\
        --variant "lr1e-3=method.zero_init=false train.lr=0.001"

writes ``<out>.json`` (every curve) and ``<out>.png`` (loss, gradient norm, token change and
accuracy per round, one line per variant).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

BASE = ["experiment=acc_offline", "setting=conventional", "partition.alpha=0.1",
        "method=accumulator"]
VARIANTS = {
    "random init (PyTorch's default)": ["method.zero_init=false"],
    "zero-initialised residual branches": ["method.zero_init=true"],
    "no token replace": ["method.token_replace=false", "method.zero_init=false"],
}


def token_change(model, images: torch.Tensor) -> float:
    """Mean over blocks and images of ``||replaced - c_k|| / ||c_k||`` (0 without replace)."""
    acc = model.head
    ratios: list[float] = []
    history: list[torch.Tensor] = []

    def hook(k: int, hidden: torch.Tensor) -> torch.Tensor:
        history.append(hidden[:, 0])
        h = acc.accumulate(history)
        if not acc.token_replace:
            return hidden
        new = h[:, k + 1]
        ratios.append(float(((new - hidden[:, 0]).norm(dim=-1)
                             / hidden[:, 0].norm(dim=-1).clamp_min(1e-12)).mean()))
        return torch.cat([new.unsqueeze(1), hidden[:, 1:]], dim=1)

    with torch.no_grad():
        model.backbone.forward_exits(images, cls_hook=hook)
    return float(np.mean(ratios)) if ratios else 0.0


def local_steps(model, spec, indices, lr: float, seed: int) -> list[dict]:
    """``train_local``'s loop (same batches, optimiser and clipping), recording every step."""
    from fedadapt.federation.client.training import batches_of, make_optimizer

    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, spec.train, lr)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model.train()
    batches = batches_of(indices, spec.train.batch_size, spec.train.local_epochs, gen)
    crops = None
    if spec.train.crop_scale is not None:
        scale = tuple(float(s) for s in spec.train.crop_scale)
        crops = [(scale, np.full(len(b), seed, dtype=np.uint64)) for b in batches]
    steps = []
    for x, y in spec.train_source.stream(batches, torch.device("cpu"), crops):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = float(torch.norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
        if spec.train.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, spec.train.clip_grad_norm)
        opt.step()
        steps.append({"loss": float(loss.detach()), "grad_norm": grad,
                      "finite": all(bool(torch.isfinite(p).all()) for p in params)})
    return steps


def run_variant(overrides: list[str], rounds: int) -> dict:
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.client.training import derive_seed, evaluate, lr_at
    from fedadapt.strategies.build import sample_size
    from fedadapt.strategies.state import SeededStreams

    cfg = to_run_config(compose_config(BASE + overrides + [f"rounds={rounds}"]))
    prep = prepare_run(cfg, quiet=True)
    spec, model = prep.spec, prep.model
    names = model.communicated_names()
    global_t = model.tensors(names)
    sampler = SeededStreams(cfg.seed)  # the clients fedadapt's FedAvg samples
    k = sample_size(spec.num_clients, cfg.partition.fraction_fit)
    probe, _ = next(spec.test_source.stream([np.arange(64)], torch.device("cpu")))
    print(f"  round   0 | token change at initialisation {token_change(model, probe):.3f}")
    curve = []
    for rnd in range(1, rounds + 1):
        results, steps = [], []
        for cid in sampler.sample("train", spec.num_clients, k):
            model.load_tensors(global_t)
            steps += local_steps(model, spec, spec.clients[cid].train,
                                 lr_at(spec.train, rnd, rounds), derive_seed(cfg.seed, rnd, cid))
            results.append((model.tensors(names), len(spec.clients[cid].train)))
        total = sum(w for _, w in results)
        global_t = {n: sum(t[n] * (w / total) for t, w in results) for n in names}
        model.load_tensors(global_t)
        _, acc, _ = evaluate(model, spec.test_source, precision=spec.precision)
        finite = [s["grad_norm"] for s in steps if math.isfinite(s["grad_norm"])]
        curve.append({
            "round": rnd, "accuracy": acc,
            "loss": float(np.mean([s["loss"] for s in steps])),
            "grad_norm_median": float(np.median(finite)) if finite else float("nan"),
            "grad_norm_max": float(max(finite)) if finite else float("nan"),
            "non_finite_steps": sum(not s["finite"] for s in steps),
            "token_change": token_change(model, probe)})
        c = curve[-1]
        print(f"  round {rnd:3d} | acc {100 * acc:5.1f}% | loss {c['loss']:.3f} | grad median "
              f"{c['grad_norm_median']:.3g} max {c['grad_norm_max']:.3g} | non-finite steps "
              f"{c['non_finite_steps']} | token change {c['token_change']:.3f}", flush=True)
    from fedadapt.results.records import pretrained
    from fedadapt.results.store import git_commit

    return {"overrides": BASE + overrides, "curve": curve, "git_commit": git_commit(),
            "backbone": pretrained(cfg.backbone.weights)}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("loss", "mean local loss"), ("grad_norm_median", "median gradient norm"),
            ("token_change", "||replaced - CLS|| / ||CLS||"), ("accuracy", "global test acc")]
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for ax, (key, title) in zip(axes, keys):
        for name, res in results.items():
            xs = [c["round"] for c in res["curve"]]
            ax.plot(xs, [c[key] for c in res["curve"]], label=name)
        ax.set_title(title)
        ax.set_xlabel("round")
        if key == "grad_norm_median":
            ax.set_yscale("log")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=override [override ...] (repeatable); default: the three above")
    p.add_argument("--base", nargs="*", default=None, help="replace the base overrides")
    p.add_argument("--out", default="outputs/token_replace")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="plot and tabulate the variants of earlier runs' JSON files instead")
    p.add_argument("--record", metavar="NAME",
                   help="keep the table as the record benchmarks/records/NAME.json (with "
                        "--command) and re-render the docs that show it")
    p.add_argument("--command", help="the record's commands (with --record)")
    args = p.parse_args()
    if args.record and not args.command:
        p.error("--record needs --command (the commands that made the runs)")
    if args.merge:
        results = {}
        for path in args.merge:
            results.update(json.loads(Path(path).read_text()))
        finish(results, Path(args.out), args.record, args.command)
        return
    if args.base is not None:
        BASE[:] = args.base
    variants = VARIANTS
    if args.variant:
        variants = {}
        for v in args.variant:
            name, _, rest = v.partition("=")
            variants[name] = rest.split()
    results = {}
    for name, overrides in variants.items():
        print(f"[token_replace] {name}: {' '.join(BASE + overrides)}", flush=True)
        results[name] = run_variant(overrides, args.rounds)
    finish(results, Path(args.out), args.record, args.command)


def backbone_of(overrides: list[str]) -> str | None:
    """The pretrained backbone a variant's overrides name (for results written without it)."""
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.results.records import pretrained

    return pretrained(to_run_config(compose_config(overrides)).backbone.weights)


COLUMNS = ["variant", "rounds", "final acc", "best acc", "token change, last round",
           "median gradient norm, last round", "non-finite steps"]


def rows_of(results: dict) -> list[list[str]]:
    """The table's rows: each variant's last round; the best final accuracy in bold."""
    from fedadapt.results.records import bold_best

    rows = []
    for name, res in results.items():
        c = res["curve"]
        rows.append([name, str(len(c)), f"{100 * c[-1]['accuracy']:.1f}",
                     f"{100 * max(r['accuracy'] for r in c):.1f}",
                     f"{c[-1]['token_change']:.2f}", f"{c[-1]['grad_norm_median']:.3g}",
                     str(sum(r["non_finite_steps"] for r in c))])
    return bold_best(rows, [2])


def finish(results: dict, out: Path, record: str | None = None, command: str | None = None
           ) -> None:
    """``<out>.json``, ``<out>.png`` and a Markdown table of the last round on stdout (kept
    as the record ``record`` when given)."""
    from fedadapt.files import atomic_write
    from fedadapt.results import records

    atomic_write(out.with_suffix(".json"), lambda fh: json.dump(results, fh, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"[token_replace] wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    commits = sorted({res.get("git_commit") or "unknown" for res in results.values()})
    backbones = sorted({res.get("backbone") or backbone_of(res["overrides"]) or "unknown"
                        for res in results.values()})
    records.show(record, COLUMNS, rows_of(results), command,
                 "benchmarks/investigations/token_replace.py", "token_replace.py",
                 commit=", ".join(commits), backbone=" | ".join(backbones))


if __name__ == "__main__":
    main()
