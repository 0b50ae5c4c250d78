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

``--throughput [overrides]`` measures images per second of one client's local training on the
run's device and precision, three ways (default base: the Accumulator on ``small_vit``,
Fashion-MNIST, batch 10, the paper's crop augmentation):

* ``fedadapt_images_per_s``: fedadapt's ``train_local`` through its own data path (decoded store,
  device transforms, the next batch prepared while the current one trains);
* ``bare_images_per_s``: a bare PyTorch loop on the same model, optimiser, precision and batch
  size, the batch already on the device (the ceiling);
* ``data_images_per_s``: the data path alone (batches gathered, copied, cropped, resized and
  normalised on the device, no model);

and ``ratio`` = fedadapt / bare, medians over ``--repeats``; ``--data-only`` skips the two
training loops. On CUDA the GPU's mean utilisation during fedadapt's loop is reported too.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fedadapt import progress
from fedadapt.results.records import machine

BASE = ["experiment=quickstart", "method=linear_head", "federation.eval_every=1000"]
#: ``--exits``: the Accumulator + PA in multi-tier FL on digits through the 12-block small ViT
#: (weights do not change the time; random ones need no pretraining), every client at one exit.
EXITS_BASE = ["experiment=custom", "dataset=digits", "backbone=small_vit", "method=accumulator_pa",
              "setting=multitier", "partition=iid", "partition.num_clients=4",
              "partition.fraction_fit=1.0", "federation.eval_every=1000", "train.batch_size=10",
              "train.lr=0.005"]


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


def iciia_latency(overrides: list[str], repeats: int) -> dict:
    """ICIIA Table 2: recognising ONE image with the backbone alone, and with the backbone plus
    the module attending 15 cached features (ICIIA-B and -T): median latency over ``repeats``
    (after 5 warm-up runs) and peak memory of live tensors (parameters included; CPU: the
    dispatcher tracker of ``fedadapt.budget``; GPU: ``max_memory_allocated``)."""
    from fedadapt.adapters import build_model
    from fedadapt.backbones import build_backbone
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.federation.client.training import device
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


#: ``--scale`` and ``--per-round``: a linear head on EfficientNet-Lite0's cached features of
#: Fashion-MNIST (60,000 training images), IID clients, no client evaluation until the end.
SCALE_BASE = ["experiment=custom", "dataset=fashion_mnist", "backbone=efficientnet_lite0",
              "backbone.image_size=64", "method=linear_head", "partition=iid",
              "partition.min_partition_size=1", "train.batch_size=32", "train.lr=0.01",
              "federation.eval_every=1000", "federation.checkpoint_every=0"]
THROUGHPUT_BASE = ["experiment=custom", "dataset=fashion_mnist", "backbone=small_vit",
                   "method=accumulator", "partition=iid", "partition.num_clients=10",
                   "train.batch_size=10", "train.lr=0.005", "train.momentum=0.0",
                   "train.crop_scale=[0.05,1.0]"]


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _rate(fn, images: int, dev: torch.device) -> float:
    """Images per second of one call of ``fn`` that processes ``images`` images."""
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return images / (time.perf_counter() - t0)


class _Utilisation:
    """Mean GPU utilisation (``torch.cuda.utilization``, NVML) sampled every 0.1 s."""

    def __init__(self, dev: torch.device) -> None:
        import threading

        self.dev, self.samples, self.stop = dev, [], threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self.stop.wait(0.1):
            try:
                self.samples.append(float(torch.cuda.utilization(self.dev)))
            except Exception:  # no NVML: utilisation unknown
                return

    def __enter__(self) -> "_Utilisation":
        if self.dev.type == "cuda":
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()

    @property
    def mean(self) -> float | None:
        return statistics.mean(self.samples) if self.samples else None


def training_loops(prep, cfg, *, clients: int, steps: int) -> dict:
    """The loops :func:`throughput` times, on a prepared run (``prep``): ``data`` (the
    data path alone), ``fedadapt`` (``train_local``, or ``train_group`` of ``clients`` side by
    side, each ``steps`` batches) and ``bare`` (a bare PyTorch loop of ``steps`` steps at the
    total batch, K x ``train.batch_size``, on one batch already on the device). With
    ``federation.compile`` on, fedadapt's grouped step is captured and so is a second bare
    loop, ``bare_captured`` (its forward and loss through ``torch.compile``, the same mode),
    so that the ratio is against the faster bare loop."""
    from dataclasses import replace

    from fedadapt.config import ConfigError
    from fedadapt.experiment import resolve_compile
    from fedadapt.federation.client.grouped import ClientJob, UsedTensors, train_group
    from fedadapt.federation.client.training import batches_of, make_optimizer, train_local

    spec, model, src = prep.spec, prep.model, prep.spec.train_source
    bs, dev = cfg.train.batch_size, torch.device(spec.device)
    pool = np.concatenate([c.train for c in spec.clients])
    if len(pool) < clients * steps * bs:
        raise ConfigError(f"--steps={steps} x --clients={clients} x batch {bs} images is more "
                          f"than the {len(pool)} training images")
    idx = [pool[k * steps * bs:(k + 1) * steps * bs] for k in range(clients)]
    train = replace(cfg.train, local_epochs=1)
    scale = tuple(cfg.train.crop_scale) if cfg.train.crop_scale and src.kind == "images" \
        else None
    batches = batches_of(np.concatenate(idx), bs * clients, 1, torch.Generator().manual_seed(0))
    crops = None if scale is None else [(scale, np.full(len(b), 7, np.uint64)) for b in batches]
    start = model.tensors(model.trainable_names())
    jobs = [ClientJob(cid=k, indices=idx[k], tensors=start, seed=k,
                      crop_seed=None if scale is None else 7) for k in range(clients)]
    # which tensors each exit trains: found once per run in a worker, as here
    used = UsedTensors(model, src, int(idx[0][0]), precision=spec.precision)

    def data() -> None:
        for _ in src.stream(batches, dev, crops):
            pass

    compile = resolve_compile(cfg.federation.compile, spec.device)

    def ours() -> None:
        if clients > 1:
            train_group(model, src, jobs, train, lr=train.lr, precision=spec.precision,
                        used=used, compile=compile)
        else:
            train_local(model, src, idx[0], train, lr=train.lr, seed=0,
                        precision=spec.precision, crop_seed=jobs[0].crop_seed)

    batch = src.get(batches[0], dev, None if crops is None else crops[0])
    opt = make_optimizer([p for p in model.parameters() if p.requires_grad], train, train.lr)
    loops = {"data": data, "fedadapt": ours,
             "bare": _bare_loop(model, batch, opt, steps, dev, spec.precision)}
    if compile:
        loops["bare_captured"] = _bare_loop(model, batch, opt, steps, dev, spec.precision,
                                            compile=True)
    return loops


def throughput(cfg, *, steps: int, repeats: int, data_only: bool = False,
               clients: int = 1, profile: Path | None = None) -> dict:
    """Images/s of local training three ways (see the module docstring); with ``clients`` K > 1
    fedadapt trains K clients side by side (each ``steps`` batches) and the bare loop steps
    at the same total batch, K x ``train.batch_size``. ``profile``: after the timed repeats,
    one more call of fedadapt's loop and of the bare loop under ``torch.profiler``, their
    operator tables written to that file (:func:`write_profile`)."""
    prep = prepare_run_quiet(cfg)
    spec, bs = prep.spec, cfg.train.batch_size
    dev = torch.device(spec.device)
    every = training_loops(prep, cfg, clients=clients, steps=steps)
    loops = {"data": every["data"]} if data_only else every
    rates: dict[str, list[float]] = {name: [] for name in loops}
    samples: list[float] = []
    with progress.task(f"[fedadapt-bench] {clients} x {steps} steps, {len(loops)} loops",
                       total=(repeats + 1) * len(loops), unit="loop", interval=0) as bar:
        for name, fn in loops.items():
            fn()  # warm-up: kernels, allocator, the store's pages
            bar.advance(info=f"{name} warmed up")
        for r in range(repeats):  # the sides interleaved: load on the machine hits them alike
            for name, fn in loops.items():
                with _Utilisation(dev) as u:
                    rates[name].append(_rate(fn, clients * steps * bs, dev))
                if name == "fedadapt":
                    samples += u.samples
                bar.advance(info=f"repeat {r + 1}/{repeats} {name}: "
                                 f"{rates[name][-1]:.0f} images/s")
    util = statistics.mean(samples) if samples else None
    med = {k: statistics.median(v) for k, v in rates.items()}
    if profile is not None and not data_only:
        write_profile(profile, {n: every[n] for n in ("fedadapt", "bare")}, dev,
                      clients * steps * bs)
    best_bare = max((med[k] for k in ("bare", "bare_captured") if k in med), default=None)
    return {"fedadapt_images_per_s": med.get("fedadapt"), "bare_images_per_s": best_bare,
            "bare_eager_images_per_s": med.get("bare"),
            "bare_captured_images_per_s": med.get("bare_captured"),
            "compiled": "bare_captured" in med, "data_images_per_s": med["data"],
            "ratio": med["fedadapt"] / best_bare if best_bare else None,
            "device": spec.device, "precision": spec.precision, "batch_size": bs,
            "clients": clients, "image_size": cfg.backbone.image_size, "steps": steps,
            "repeats": repeats, "gpu_utilisation_mean": util, "runs": rates,
            "machine": machine()}


def write_profile(path: Path, loops: dict, dev: torch.device, images: int) -> None:
    """One call of each loop under ``torch.profiler`` (CPU, and CUDA where the device is one):
    per loop its wall time, the kernels' busy time on the device, and the operators that take
    the most device time and the most CPU time, to ``path`` (text, written atomically)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from fedadapt.files import atomic_write

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    parts = []
    for name, fn in loops.items():
        _sync(dev)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            wall = time.perf_counter() - t0
        avg = prof.key_averages()
        # the device's own events (kernels, copies), as the table's "Self CUDA time total"
        # counts them: an operator's row repeats its kernels' time
        kernels = sum(e.self_device_time_total for e in avg if e.device_type == DeviceType.CUDA
                      and not e.is_user_annotation) / 1e6
        busy = (f"; device kernels {kernels:.3f} s ({100 * kernels / wall:.0f}% of the wall "
                f"time)" if dev.type == "cuda" else "")
        parts += [f"## {name}: {images} images in {wall:.3f} s under the profiler "
                  f"({images / wall:,.0f} images/s){busy}", ""]
        if dev.type == "cuda":
            parts += ["### by device time", avg.table(sort_by="self_device_time_total",
                                                       row_limit=25, max_name_column_width=60), ""]
        parts += ["### by CPU time", avg.table(sort_by="self_cpu_time_total", row_limit=25,
                                               max_name_column_width=60), ""]
    atomic_write(path, lambda fh: fh.write("\n".join(parts)))


def prepare_run_quiet(cfg):
    from fedadapt.experiment import prepare_run

    return prepare_run(cfg, quiet=True)


def _bare_loop(model, batch, opt, steps: int, dev: torch.device, precision: str,
               compile: bool = False):
    """A bare PyTorch training loop on one batch already on the device (the ceiling); with
    ``compile`` its forward and loss through ``torch.compile`` (``reduce-overhead`` on a GPU,
    as fedadapt's captured step)."""
    from fedadapt.devices import autocast

    x, y = batch
    loss_of = model.training_loss
    if compile:
        loss_of = torch.compile(model.training_loss, dynamic=False,
                                mode="reduce-overhead" if dev.type == "cuda" else None)

    def bare() -> None:
        model.train()
        for _ in range(steps):
            with autocast(dev.type, precision):
                loss = loss_of(x, y)
            opt.zero_grad(set_to_none=True)
            loss.float().backward()
            opt.step()

    return bare


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fedadapt-bench", description=__doc__.split("\n")[0])
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


def _table(args, columns: list[str], rows: list[list[str]], raw: dict) -> None:
    """Print the result's table; with ``--record NAME``, keep it as the record
    ``benchmarks/records/NAME.json`` and re-render the docs tables that show it."""
    from fedadapt.results import records

    record = records.measured(args.record or "bench", columns, rows,
                              " ".join(["fedadapt-bench", *args.argv]), "fedadapt-bench",
                              extra=raw)
    print("\n" + records.render(record), end="")
    if not args.record:
        return
    folder = Path(args.record_dir)
    path = records.save(record, folder)
    print(f"record: {path}")
    if (Path.cwd() / "docs").is_dir() and folder.resolve() == records.RECORDS.resolve():
        for doc in records.render_docs(only={args.record}):
            print(f"record: {doc} re-rendered")


def _write(out: str, name: str, obj: dict) -> Path:
    from fedadapt.results.store import write_json

    path = Path(out)
    if path.suffix != ".json":
        path = path / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    write_json(path, obj)
    return path


def parse_rows(text: str) -> list[tuple[int, int, str, str]]:
    """``--rows``: ``clients:batch:precision:method`` rows, comma-separated."""
    from fedadapt.config import ConfigError

    rows = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        parts = item.split(":")
        if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit() \
                or int(parts[0]) < 1 or int(parts[1]) < 1:
            raise ConfigError(f"--rows: {item!r} is not clients:batch:precision:method (e.g. "
                              f"10:10:bf16:accumulator_pa)")
        rows.append((int(parts[0]), int(parts[1]), parts[2], parts[3]))
    if not rows:
        raise ConfigError("--rows: no row given (e.g. 1:10:bf16:accumulator_pa,10:10:bf16:lora)")
    return rows


def row_name(clients: int, batch: int, precision: str, method: str) -> str:
    """A ``--rows`` row's JSON file name (read back by ``scripts/gpu_check_report.py``)."""
    return f"throughput-{method}-k{clients}-b{batch}-{precision}.json"


def _run_throughput(args) -> None:
    from fedadapt.entry import compose_config, to_run_config

    if args.rows:  # several rows in one process: one start-up (imports, CUDA) for all
        out, failed, table = Path(args.out), [], []
        for k, bs, precision, method in parse_rows(args.rows):
            extra = [f"method={method}", f"train.batch_size={bs}", f"train.precision={precision}"]
            name = row_name(k, bs, precision, method)
            print(f"[fedadapt-bench] {method}, {k} client(s) x batch {bs}, {precision}",
                  flush=True)
            try:  # a row that fails is recorded and the next one runs
                cfg = to_run_config(compose_config(THROUGHPUT_BASE + list(args.overrides) + extra))
                res = throughput(cfg, steps=args.steps, repeats=args.repeats, clients=k,
                                 profile=out / name.replace(".json", ".profile.txt")
                                 if args.profile else None)
            except Exception as err:  # noqa: BLE001 - reported in the row's JSON and on stdout
                import traceback

                traceback.print_exc()
                why = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                print(f"[fedadapt-bench] row failed: {why}", flush=True)
                failed.append(name)
                res = {"error": why, "clients": k, "batch_size": bs, "precision": precision}
            _write(str(out / name), "", {**res, "config": THROUGHPUT_BASE + args.overrides + extra})
            table.append((method, name, res))
            print(f"[fedadapt-bench] JSON: {out / name}", flush=True)
            _free()
        _table(args, ["method", *THROUGHPUT_COLUMNS],
               [[m, *_throughput_row(r)] for m, _, r in table], {n: r for _, n, r in table})
        if failed:
            raise SystemExit(f"fedadapt-bench: {len(failed)} row(s) failed: {', '.join(failed)}")
        return
    if args.profile:
        from fedadapt.config import ConfigError

        raise ConfigError("--profile writes beside each --rows row's JSON: give --rows (e.g. "
                          "--rows 10:10:bf16:accumulator_pa)")
    cfg = to_run_config(compose_config(THROUGHPUT_BASE + list(args.overrides)))
    res = throughput(cfg, steps=args.steps, repeats=args.repeats, data_only=args.data_only,
                     clients=args.clients)
    path = _write(args.out, "bench-throughput", {**res, "config": THROUGHPUT_BASE + args.overrides})
    _table(args, THROUGHPUT_COLUMNS, [_throughput_row(res)], res)
    print(f"medians of {res['repeats']} x {res['steps']} steps on {res['device']}\n"
          f"machine: {res['machine']}\nJSON: {path}")


def _free() -> None:
    """The last row's model and data released before the next row's."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


THROUGHPUT_COLUMNS = ["clients x batch", "precision", "image px", "fedadapt img/s",
                      "bare loop img/s", "data path img/s", "ratio", "GPU busy"]


def _throughput_row(res: dict) -> list[str]:
    def rate(key: str) -> str:
        return "—" if res.get(key) is None else f"{res[key]:,.0f}"

    if "error" in res:
        return [f"{res['clients']} x {res['batch_size']}", res["precision"], "—", "failed",
                "—", "—", res["error"], "—"]
    busy = res.get("gpu_utilisation_mean")
    return [f"{res['clients']} x {res['batch_size']}", res["precision"], str(res["image_size"]),
            rate("fedadapt_images_per_s"), rate("bare_images_per_s"),
            rate("data_images_per_s"), "—" if res["ratio"] is None else f"{res['ratio']:.2f}",
            "—" if busy is None else f"{busy:.0f}%"]


def _run_scale(args) -> None:
    """s/round and the driver's peak memory at 100, 1,000 and 10,000 clients registered, the
    same number sampled each round (``--sampled``), each in a fresh process."""
    from fedadapt.entry import compose_config, to_run_config

    rows = {}
    for total in (100, 1000, 10000):
        frac = args.sampled / total
        ov = SCALE_BASE + [f"partition.num_clients={total}", f"partition.fraction_fit={frac}",
                           f"partition.fraction_evaluate={frac}", f"rounds={args.rounds}",
                           *args.overrides]
        cfg = to_run_config(compose_config(ov))
        per_round, first, peaks = [], [], []
        for rep in range(args.repeats):
            print(f"[bench] {total} clients: repeat {rep + 1}/{args.repeats}", flush=True)
            t0 = time.perf_counter()
            times, peak = isolated_flower_run(cfg, Path(args.out) / "runs", f"{total} clients",
                                              with_memory=True)
            first.append(time.perf_counter() - t0 - sum(times[1:]))
            per_round.extend(times[1:])
            peaks.append(peak)
        rows[total] = {"median_s_per_round": statistics.median(per_round),
                       "median_s_before_round_2": statistics.median(first),
                       "peak_rss_mb": max(peaks) / 2**20}
    base = rows[100]["median_s_per_round"]
    meta = {"machine": machine(), "sampled": args.sampled, "repeats": args.repeats,
            "rounds": args.rounds, "config": SCALE_BASE + list(args.overrides), "results": rows,
            "ratio_10000_to_100": rows[10000]["median_s_per_round"] / base}
    path = _write(args.out, "bench-scale", meta)
    _table(args, [f"clients registered ({args.sampled} sampled per round)",
                  f"median s/round (rounds 2..{args.rounds})", "start-up to round 2 s",
                  "driver peak RSS MB"],
           [[f"{total:,}", f"{r['median_s_per_round']:.3f}", f"{r['median_s_before_round_2']:.1f}",
             f"{r['peak_rss_mb']:.0f}"] for total, r in rows.items()], meta)
    print(f"\n10,000 / 100 clients s/round: {meta['ratio_10000_to_100']:.2f}\n"
          f"machine: {meta['machine']}\nJSON: {path}")


def _run_iciia(args) -> None:
    res = iciia_latency(args.overrides, max(args.repeats, 20))
    meta = {"results": res, "repeats": max(args.repeats, 20), "machine": machine()}
    _table(args, ["recognising one image", "median latency ms", "peak memory MB",
                  "module params"],
           [[name, f"{r['median_ms']:.2f}", f"{r['peak_mb']:.1f}", f"{r['module_params']:,}"]
            for name, r in res.items()], meta)
    _write(args.out, "bench-iciia", meta)


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


def _run_rounds(args) -> None:
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
    _write(args.out, "bench", meta)
    _table(args, ["variant", f"median s/round (rounds 2..{args.rounds})", "median round 1 s"],
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


def main(argv: list[str] | None = None) -> None:
    from fedadapt.entry import run_cli

    def run(argv: list[str]) -> int:
        args = _parser().parse_args(argv)
        args.argv = list(argv)
        if args.throughput:
            _run_throughput(args)
        elif args.scale:
            _run_scale(args)
        elif args.iciia:
            _run_iciia(args)
        else:
            _run_rounds(args)
        return 0

    run_cli(run, argv)


if __name__ == "__main__":
    main()
