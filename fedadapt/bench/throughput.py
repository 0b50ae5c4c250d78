"""``fedadapt-bench --throughput [overrides]``: images per second of one client's local
training on the run's device and precision, three ways (default base: the Accumulator on
``small_vit``, Fashion-MNIST, batch 10, the paper's crop augmentation):

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

import statistics
import time
from pathlib import Path

import numpy as np
import torch

from fedadapt import progress
from fedadapt.bench.common import table, write
from fedadapt.results.records import machine

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
    """A ``--rows`` row's JSON file name (read back by fedadapt.tools.gpu_check_report)."""
    return f"throughput-{method}-k{clients}-b{batch}-{precision}.json"


def run(args) -> None:
    from fedadapt.entry import compose_config, to_run_config

    if args.rows:  # several rows in one process: one start-up (imports, CUDA) for all
        out, failed, done = Path(args.out), [], []
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
            write(str(out / name), "", {**res, "config": THROUGHPUT_BASE + args.overrides + extra})
            done.append((method, name, res))
            print(f"[fedadapt-bench] JSON: {out / name}", flush=True)
            _free()
        table(args, ["method", *THROUGHPUT_COLUMNS],
               [[m, *_throughput_row(r)] for m, _, r in done], {n: r for _, n, r in done})
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
    path = write(args.out, "bench-throughput", {**res, "config": THROUGHPUT_BASE + args.overrides})
    table(args, THROUGHPUT_COLUMNS, [_throughput_row(res)], res)
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
