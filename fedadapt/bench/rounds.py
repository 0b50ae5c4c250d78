"""``fedadapt-bench`` (no mode flag, ``--exits``, ``--methods``, ``--per-round``): seconds per
round of a fixed configuration, medians over repeats.

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

import statistics
import time
from pathlib import Path

import torch

from fedadapt import progress
from fedadapt.bench.common import table, write
from fedadapt.results.records import machine

BASE = ["experiment=quickstart", "method=linear_head", "federation.eval_every=1000"]
#: ``--exits``: the Accumulator + PA in multi-tier FL on digits through the 12-block small ViT
#: (weights do not change the time; random ones need no pretraining), every client at one exit.
EXITS_BASE = ["experiment=custom", "dataset=digits", "backbone=small_vit", "method=accumulator_pa",
              "setting=multitier", "partition=iid", "partition.num_clients=4",
              "partition.fraction_fit=1.0", "federation.eval_every=1000", "train.batch_size=10",
              "train.lr=0.005"]

#: ``--scale`` and ``--per-round``: a linear head on EfficientNet-Lite0's cached features of
#: Fashion-MNIST (60,000 training images), IID clients, no client evaluation until the end.
SCALE_BASE = ["experiment=custom", "dataset=fashion_mnist", "backbone=efficientnet_lite0",
              "backbone.image_size=64", "method=linear_head", "partition=iid",
              "partition.min_partition_size=1", "train.batch_size=32", "train.lr=0.01",
              "federation.eval_every=1000", "federation.checkpoint_every=0"]


def plain_loop(prep, cfg) -> list[float]:
    """FedAvg over the same clients in one process: seconds per round.

    Clients are drawn by the strategy's own seeded sampler, so both variants train exactly the
    same clients each round, one after another (as a researcher's own loop would).
    """
    from fedadapt import cores
    from fedadapt.strategies.build import sample_size
    from fedadapt.strategies.state import SeededStreams

    model = prep.model
    global_t = model.tensors(model.communicated_names())
    sampler = SeededStreams(cfg.seed)
    times = []
    # the threads a run's one worker would get now (fedadapt.cores): the two sides compared at
    # the same threads, on a busy machine too
    threads, before = cores.threads_for(min(2, cores.usable_cores()), 1)[0], torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with progress.task("[bench] plain loop", total=cfg.rounds, unit="round") as bar:
            for rnd in range(1, cfg.rounds + 1):
                t0 = time.perf_counter()
                global_t = _plain_round(prep, cfg, sampler, rnd, global_t, sample_size(
                    prep.spec.num_clients, cfg.partition.fraction_fit))
                times.append(time.perf_counter() - t0)
                bar.advance()
    finally:
        torch.set_num_threads(before)
    return times


def _plain_round(prep, cfg, sampler, rnd: int, global_t: dict, k_train: int) -> dict:
    """One round of :func:`plain_loop` (evaluation after the last); the new global tensors."""
    from fedadapt.federation.client.training import derive_seed, evaluate, lr_at, train_local

    spec, model = prep.spec, prep.model
    names, n = model.communicated_names(), spec.num_clients
    results = []
    for cid in sampler.sample("train", n, k_train):
        model.load_tensors(global_t)
        train_local(model, spec.train_source, spec.clients[cid].train, spec.train,
                    lr=lr_at(spec.train, rnd, cfg.rounds), seed=derive_seed(cfg.seed, rnd, cid),
                    precision=spec.precision)
        results.append((model.tensors(names), len(spec.clients[cid].train)))
    total = sum(w for _, w in results)
    global_t = {nm: sum(t[nm] * (w / total) for t, w in results) for nm in names}
    if rnd == cfg.rounds:
        model.load_tensors(global_t)
        evaluate(model, spec.test_source, precision=spec.precision)
        for cid in sampler.sample("evaluate", n, int(n * cfg.partition.fraction_evaluate)):
            evaluate(model, spec.train_source, spec.clients[cid].test,
                     precision=spec.precision)  # those Flower's run evaluates
    return global_t


def flower_run(cfg, tmp: Path, label: str | None = None) -> list[float]:
    from fedadapt.experiment import run_experiment

    summary_dir = tmp / f"run-{time.time_ns()}"
    run_experiment(cfg, summary_dir, config_yaml="bench\n", label=label)
    from fedadapt.results.store import read_jsonl

    return [r["round_s"] for r in read_jsonl(summary_dir / "metrics.jsonl")]


def _flower_child(cfg, tmp: Path, label, queue) -> None:
    import resource

    import fedadapt  # noqa: F401  (torchvision shim in the fresh process)

    times = flower_run(cfg, tmp, label)
    queue.put((times, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


def isolated_flower_run(cfg, tmp: Path, label: str | None = None,
                        with_memory: bool = False) -> list[float]:
    """:func:`flower_run` in a fresh process: a repeat of a large model (the whole CLIP) starts
    with the memory of the machine, not what the previous repeat's Ray session left behind.
    ``with_memory``: also the driver process's peak resident memory in bytes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_flower_child, args=(cfg, tmp, label, queue))
    proc.start()
    from queue import Empty

    while True:  # the result before join (a big one would block the child's exit)
        try:
            times, peak = queue.get(timeout=1.0)
            break
        except Empty:
            if not proc.is_alive():
                raise RuntimeError(f"benchmark run of {label} failed (exit code "
                                   f"{proc.exitcode})") from None
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"benchmark run of {label} failed (exit code {proc.exitcode})")
    return (times, peak) if with_memory else times

def _variants(args) -> tuple[list[str], dict[str, list[str]]]:
    """The base overrides and the variants of the round-timing modes."""
    if args.methods:
        overrides = ["experiment=fedclip_cost", f"rounds={args.rounds}", *args.overrides]
        return overrides, {m: overrides + [f"method={m}"] for m in args.methods.split(",")}
    if args.exits:
        overrides = EXITS_BASE + [f"rounds={args.rounds}", *args.overrides]
        return overrides, {f"multi-tier, exit {e}": overrides + [f"setting.tiers=[{e}]"]
                           for e in args.exits.split(",")}
    if args.per_round:
        overrides = SCALE_BASE + ["partition.num_clients=100", f"rounds={args.rounds}",
                                  *args.overrides]
        out = {}
        for n in args.per_round.split(","):
            ov = overrides + [f"partition.fraction_fit={int(n) / 100}",
                              f"partition.fraction_evaluate={int(n) / 100}"]
            out[f"flower+cache, {n} per round"] = ov
            out[f"plain+cache, {n} per round"] = ov
        return overrides, out
    overrides = BASE + [f"rounds={args.rounds}", *args.overrides]
    return overrides, {"flower+cache": overrides,
                       "flower-nocache": overrides + ["method.use_cache=false"],
                       "plain+cache": overrides}


def _prepare_cost(name: str, cfg) -> dict:
    """``--methods``: the one-off cost of a method (data, backbone and, for cached methods,
    feature extraction) from an empty cache."""
    import dataclasses
    import tempfile

    from fedadapt.experiment import prepare_run

    with tempfile.TemporaryDirectory() as fresh:
        t0 = time.perf_counter()
        prepare_run(dataclasses.replace(cfg, cache_dir=fresh), quiet=True)
        cost = time.perf_counter() - t0
    print(f"[bench] {name} (prepare from an empty cache: {cost:.1f} s)", flush=True)
    return {"prepare_empty_cache_s": cost}


def _one_repeat(name: str, cfg, args, tmp: Path) -> list[float]:
    """Seconds of each round of one run of variant ``name``."""
    from fedadapt.experiment import prepare_run

    if name.startswith("plain"):
        return plain_loop(prepare_run(cfg, quiet=True), cfg)
    return isolated_flower_run(cfg, tmp, label=name) if args.methods else flower_run(cfg, tmp)


def run(args) -> None:
    """Each variant's median seconds per round (rounds 2..R) and of round 1 over
    ``args.repeats`` runs; the variants' repeats interleaved (repeat 1 of each, then repeat 2
    of each, ...), so that load on the machine hits them alike."""
    from fedadapt.entry import compose_config, to_run_config

    overrides, variants = _variants(args)
    configs = {name: to_run_config(compose_config(ov)) for name, ov in variants.items()}
    extra = {name: _prepare_cost(name, cfg) if args.methods else {}
             for name, cfg in configs.items()}
    times: dict[str, list[list[float]]] = {name: [] for name in configs}
    started, total, done = time.monotonic(), args.repeats * len(configs), 0
    for rep in range(args.repeats):
        for name, cfg in configs.items():
            left = ("" if not done else " | ~" + progress.fmt_seconds(
                (time.monotonic() - started) / done * (total - done)) + " left")
            print(f"[bench] {name}: repeat {rep + 1}/{args.repeats} | run {done + 1}/{total}"
                  f"{left}", flush=True)
            times[name].append(_one_repeat(name, cfg, args, Path(args.out) / "runs"))
            done += 1
    results = {name: {"median_s_per_round": statistics.median(
                          [t for run in runs for t in run[1:]]),
                      "median_round1_s": statistics.median(run[0] for run in runs),
                      "rounds_measured": sum(len(run) - 1 for run in runs), **extra[name]}
               for name, runs in times.items()}
    meta = {"machine": machine(), "config": overrides, "repeats": args.repeats,
            "results": results}
    names = list(results)
    per_round = {n: results[n]["median_s_per_round"] for n in names}
    if args.methods:
        meta["ratio_to_last"] = {m: per_round[m] / per_round[names[-1]] for m in names}
    elif args.per_round:
        meta["overhead_ratio"] = {n: per_round[f"flower+cache, {n} per round"]
                                  / per_round[f"plain+cache, {n} per round"]
                                  for n in args.per_round.split(",")}
    elif not args.exits:
        meta["overhead_ratio"] = per_round["flower+cache"] / per_round["plain+cache"]
        meta["cache_speedup"] = per_round["flower-nocache"] / per_round["flower+cache"]
    write(args.out, "bench", meta)
    table(args, ["variant", f"median s/round (rounds 2..{args.rounds})", "median round 1 s"],
           [[name, f"{r['median_s_per_round']:.3f}", f"{r['median_round1_s']:.2f}"]
            for name, r in results.items()], meta)
    if args.methods:
        for m in names:
            ratio = meta["ratio_to_last"][m]
            print(f"{m}: prepare from an empty cache {results[m]['prepare_empty_cache_s']:.1f} "
                  f"s; seconds per round {per_round[m]:.3f} = {ratio:.4f} x {names[-1]} "
                  f"({1 / ratio:.0f}x faster)")
    elif args.exits:
        print(f"\n{names[0]} / {names[-1]} seconds per round: "
              f"{per_round[names[0]] / per_round[names[-1]]:.2f}")
    elif args.per_round:
        for n, ratio in meta["overhead_ratio"].items():
            print(f"{n} clients per round: Flower overhead (flower+cache / plain+cache) "
                  f"{ratio:.2f}x")
    else:
        print(f"\nFlower overhead (flower+cache / plain+cache): {meta['overhead_ratio']:.1f}x; "
              f"feature cache speed-up (nocache / cache): {meta['cache_speedup']:.1f}x")
    print(f"machine: {meta['machine']}")

