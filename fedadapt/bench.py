"""``fedadapt-bench``: seconds per round of a fixed configuration, medians over repeats.

Three ways to run the same federated training (same data, partition, seeded client sampling,
local training code and FedAvg weighting):

* ``flower+cache``: Flower simulation (Ray backend), the head trains on cached features;
* ``flower-nocache``: Flower simulation, every batch goes through the frozen backbone;
* ``plain+cache``: a plain in-process PyTorch loop over the same clients, no Flower, no Ray.

``--exits 3,11`` instead times a multi-tier run whose clients all sit at one exit, per exit:
compute saved by an early tier shows as fewer seconds per round.

``--methods fedclip,fedavg_clip`` times whole methods against each other on the same data and
clients (default base: ``experiment=fedclip_cost``), and the one-off preparation of each from an
empty cache (FedCLIP's image features are extracted once, there).

``flower+cache / plain+cache`` is the framework's overhead per round. Round 1 (Ray actors
starting, workers importing torch) is reported separately as start-up. Results go to
``outputs/bench/bench-<time>.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

BASE = ["experiment=quickstart", "method=linear_head", "federation.eval_every=1000"]
#: ``--exits``: the Accumulator + PA in multi-tier FL on digits through the 12-block small ViT
#: (weights do not change the time; random ones need no pretraining), every client at one exit.
EXITS_BASE = ["experiment=custom", "dataset=digits", "backbone=small_vit", "method=accumulator_pa",
              "setting=multitier", "partition=iid", "partition.num_clients=4",
              "partition.fraction_fit=1.0", "federation.eval_every=1000", "train.batch_size=10",
              "train.lr=0.005"]


def plain_loop(prep, cfg) -> list[float]:
    """FedAvg over the same clients in one process: seconds per round.

    Clients are drawn by the strategy's own seeded sampler (node id = partition id here), so
    both variants train exactly the same clients each round.
    """
    from fedadapt.federation.training import derive_seed, evaluate, lr_at, train_local
    from fedadapt.strategies.fedavg import build_strategy

    spec, model = prep.spec, prep.model
    names = model.communicated_names()
    global_t = model.tensors(names)
    n = spec.num_clients
    sampler = build_strategy(cfg.method.strategy, federated=True, num_clients=n,
                             fraction_train=cfg.partition.fraction_fit,
                             fraction_evaluate=cfg.partition.fraction_evaluate, seed=cfg.seed)
    sampler.set_nodes({pid: pid for pid in range(n)})
    times = []
    for rnd in range(1, cfg.rounds + 1):
        t0 = time.perf_counter()
        results = []
        for cid in sampler.sample(sampler.fraction_train, sampler.min_train_nodes):
            model.load_tensors(global_t)
            train_local(model, spec.train_source, spec.clients[cid].train, spec.train,
                        lr=lr_at(spec.train, rnd, cfg.rounds), seed=derive_seed(cfg.seed, rnd, cid))
            results.append((model.tensors(names), len(spec.clients[cid].train)))
        total = sum(w for _, w in results)
        global_t = {nm: sum(t[nm] * (w / total) for t, w in results) for nm in names}
        if rnd == cfg.rounds:
            model.load_tensors(global_t)
            evaluate(model, spec.test_source)
            for c in spec.clients:
                evaluate(model, spec.train_source, c.test)
        times.append(time.perf_counter() - t0)
    return times


def flower_run(cfg, tmp: Path, label: str | None = None) -> list[float]:
    from fedadapt.experiment import run_experiment

    summary_dir = tmp / f"run-{time.time_ns()}"
    run_experiment(cfg, summary_dir, config_yaml="bench\n", label=label)
    from fedadapt.results.store import read_jsonl

    return [r["round_s"] for r in read_jsonl(summary_dir / "metrics.jsonl")]


def _flower_child(cfg, tmp: Path, label, queue) -> None:
    import fedadapt  # noqa: F401  (torchvision shim in the fresh process)

    queue.put(flower_run(cfg, tmp, label))


def isolated_flower_run(cfg, tmp: Path, label: str | None = None) -> list[float]:
    """:func:`flower_run` in a fresh process: a repeat of a large model (the whole CLIP) starts
    with the memory of the machine, not what the previous repeat's Ray session left behind."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_flower_child, args=(cfg, tmp, label, queue))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"benchmark run of {label} failed (exit code {proc.exitcode})")
    return queue.get()


def iciia_latency(overrides: list[str], repeats: int) -> dict:
    """ICIIA Table 2: recognising ONE image with the backbone alone, and with the backbone plus
    the module attending 15 cached features (ICIIA-B and -T): median latency over ``repeats``
    (after 5 warm-up runs) and peak memory of live tensors (parameters included; CPU: the
    dispatcher tracker of ``fedadapt.budget``; GPU: ``max_memory_allocated``)."""
    from fedadapt.adapters import build_model
    from fedadapt.backbones import build_backbone
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.federation.training import device
    from fedadapt.measure import peak_bytes, time_calls

    dev = torch.device(device())
    results = {}
    for preset in ("iciia_b", "iciia_t"):
        run = to_run_config(compose_config(["experiment=iciia_offline", f"method={preset}",
                                            *overrides]))
        backbone = build_backbone(run.backbone).to(dev)
        module = build_model(run.method, backbone, 10, with_backbone=False).head.module
        module = module.to(dev).eval()
        size = run.backbone.image_size
        image = torch.randn(1, 3, size, size, device=dev)
        history = torch.randn(run.method.images - 1, backbone.embed_dim, device=dev)
        variants = {"backbone alone": lambda b=backbone, x=image: b(x),
                    f"backbone + {preset} (15 cached)":
                        lambda b=backbone, m=module, x=image, h=history:
                            m.predict_one(h, b(x)[0])}
        for name, fn in variants.items():
            if name in results:
                continue
            with torch.no_grad():
                for _ in range(5):
                    fn()
                times = time_calls(fn, repeats, dev)
                peak = peak_bytes(fn, dev, baseline=lambda n=name, b=backbone, h=history,
                                  m=module: [*b.parameters(), h,
                                             *([] if n == "backbone alone" else m.parameters())])
            results[name] = {"median_ms": 1e3 * statistics.median(times), "peak_mb": peak / 1e6,
                             "module_params": 0 if name == "backbone alone" else
                             sum(p.numel() for p in module.parameters())}
    return results


def main(argv: list[str] | None = None) -> None:
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    parser = argparse.ArgumentParser(prog="fedadapt-bench", description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default="outputs/bench")
    parser.add_argument("--exits", help="multi-tier mode, e.g. 3,11: the same run with every "
                                            "client at one exit, per exit (compute saved?)")
    parser.add_argument("--methods", help="methods mode, e.g. fedclip,fedavg_clip: seconds per "
                                              "round of each (base: experiment=fedclip_cost)")
    parser.add_argument("--iciia", action="store_true",
                        help="ICIIA Table 2: latency and memory of recognising one image with "
                             "15 cached features, against the backbone alone")
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = parser.parse_args(argv)
    if args.iciia:
        res = iciia_latency(args.overrides, max(args.repeats, 20))
        print("\n| recognising one image | median latency ms | peak memory MB | module "
              "params |\n|---|---|---|---|")
        for name, r in res.items():
            print(f"| {name} | {r['median_ms']:.2f} | {r['peak_mb']:.1f} | "
                  f"{r['module_params']:,} |")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from fedadapt.results.store import write_json

        write_json(out / f"bench-iciia-{time.strftime('%Y%m%d-%H%M%S')}.json",
                   {"results": res, "repeats": max(args.repeats, 20),
                    "machine": f"{platform.node()} | {torch.get_num_threads()} torch threads | "
                               f"{'cuda' if torch.cuda.is_available() else 'cpu'}"})
        return
    prepare_s = {}
    if args.methods:
        overrides = ["experiment=fedclip_cost", f"rounds={args.rounds}", *args.overrides]
        methods = args.methods.split(",")
        variants = {m: overrides + [f"method={m}"] for m in methods}
    elif args.exits:
        overrides = EXITS_BASE + [f"rounds={args.rounds}", *args.overrides]
        exits = [int(e) for e in args.exits.split(",")]
        variants = {f"multi-tier, exit {e}": overrides + [f"setting.tiers=[{e}]"]
                    for e in exits}
    else:
        overrides = BASE + [f"rounds={args.rounds}", *args.overrides]
        variants = {
            "flower+cache": overrides,
            "flower-nocache": overrides + ["method.use_cache=false"],
            "plain+cache": overrides,
        }
    tmp = Path(args.out) / "runs"
    results = {}
    for name, ov in variants.items():
        cfg = to_run_config(compose_config(ov))
        if args.methods:  # one-off cost: data, backbone and (cached methods) feature extraction
            import dataclasses
            import tempfile

            with tempfile.TemporaryDirectory() as fresh:
                t0 = time.perf_counter()
                prepare_run(dataclasses.replace(cfg, cache_dir=fresh), quiet=True)
                prepare_s[name] = time.perf_counter() - t0
            print(f"[bench] {name} (prepare from an empty cache: {prepare_s[name]:.1f} s)",
                  flush=True)
        per_round, startup = [], []
        for rep in range(args.repeats):
            print(f"[bench] {name}: repeat {rep + 1}/{args.repeats}", flush=True)
            times = plain_loop(prepare_run(cfg, quiet=True), cfg) if name.startswith("plain") \
                else isolated_flower_run(cfg, tmp, label=name) if args.methods \
                else flower_run(cfg, tmp)
            startup.append(times[0])
            per_round.extend(times[1:])
        results[name] = {"median_s_per_round": statistics.median(per_round),
                         "median_round1_s": statistics.median(startup),
                         "rounds_measured": len(per_round),
                         **({"prepare_empty_cache_s": prepare_s[name]} if name in prepare_s
                            else {})}
    meta = {"machine": f"{platform.node()} | {platform.processor() or platform.machine()} | "
                       f"{torch.get_num_threads()} torch threads | "
                       f"{'cuda' if torch.cuda.is_available() else 'cpu'}",
            "config": overrides, "repeats": args.repeats, "results": results}
    if args.methods:
        base = results[methods[-1]]["median_s_per_round"]
        meta["ratio_to_last"] = {m: results[m]["median_s_per_round"] / base for m in methods}
    elif not args.exits:
        flower, plain = results["flower+cache"], results["plain+cache"]
        meta["overhead_ratio"] = flower["median_s_per_round"] / plain["median_s_per_round"]
        meta["cache_speedup"] = (results["flower-nocache"]["median_s_per_round"]
                                 / flower["median_s_per_round"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from fedadapt.results.store import write_json

    write_json(out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json", meta)
    print("\n| variant | median s/round (rounds 2..R) | median round 1 s |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['median_s_per_round']:.3f} | {r['median_round1_s']:.2f} |")
    if args.methods:
        for m in methods:
            print(f"{m}: prepare from an empty cache {prepare_s[m]:.1f} s; seconds per round "
                  f"{results[m]['median_s_per_round']:.3f} = {meta['ratio_to_last'][m]:.4f} x "
                  f"{methods[-1]} ({1 / meta['ratio_to_last'][m]:.0f}x faster)")
    elif args.exits:
        first, last = (results[f"multi-tier, exit {e}"]["median_s_per_round"]
                       for e in (exits[0], exits[-1]))
        print(f"\nexit {exits[0]} / exit {exits[-1]} seconds per round: {first / last:.2f}")
    else:
        print(f"\nFlower overhead (flower+cache / plain+cache): {meta['overhead_ratio']:.1f}x; "
              f"feature cache speed-up (nocache / cache): {meta['cache_speedup']:.1f}x")
    print(f"machine: {meta['machine']}")


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
