"""``fedadapt-budget``: compute and memory budget of one training step per early exit.

The Accumulator paper's Table 7 lists, for each exit ``l`` of DeiT-S, the FLOPs, the cumulative
parameters and the peak training memory with the whole model trainable ("Mem. Peak") and with the
base model frozen ("Mem. Peak frozen"). This measures the same on the method's model built from the
architecture alone (random weights, no download, no data; the number of classes comes from the
dataset card).

What a row is
-------------
For exit ``l`` the model is the one a client of tier ``l`` holds: the backbone's embeddings and
blocks ``0..l`` (later blocks are removed; so are the layer-wise heads of later exits), plus the
method's own modules (e.g. the whole Accumulator and its head). One training step is

``zero_grad(set_to_none=True)``; ``logits = model.exit_logits(x, last_exit=l)[-1]``;
cross-entropy on random labels; ``backward()``; ``optimizer.step()``

on a random batch ``[batch_size, 3, S, S]`` at the backbone's ``image_size`` (an audio
backbone: spectrograms ``[batch_size, T, F]``, its ``example_input``), with the run's
optimizer (``train.optimizer``, ``train.lr``, ``train.momentum``, ``train.weight_decay``; by
default SGD with momentum 0.9, whose momentum buffers are part of the memory) over the trainable
parameters, in two modes:

* ``frozen``: the method's own trainable set (the backbone frozen, adapters trainable);
* ``full``: every parameter requires grad (the backbone trains too, in train mode).

Columns
-------
* ``params``: the backbone's cumulative parameters up to exit ``l`` (embeddings + blocks
  ``0..l``; the final LayerNorm counts at the last exit), from
  :func:`fedadapt.measure.per_exit_counts`.
* ``flops``: FLOPs of the backbone's forward up to exit ``l`` on one image, counted by
  ``torch.utils.flop_counter`` (2 per multiply-accumulate; matmuls, convolutions, attention;
  elementwise ops not counted), as ``fedadapt-inspect``.
* ``model_params``, ``trainable_params_frozen``: parameters held by the tier-``l`` model, and
  those that train in ``frozen`` mode (in ``full`` mode all of them train).
* ``peak_mb_frozen``, ``peak_mb_full``: peak memory of the step in MB (2**20 bytes), see below.
* ``step_ms_frozen``, ``step_ms_full``: wall time of the step (``zero_grad`` to
  ``optimizer.step``), median over ``repeats`` steps after one warm-up step (not timed) and the
  memory step (not timed either: on CPU it runs under the tracker, which slows it down).

Peak memory
-----------
The peak is the whole memory the step needs, model weights included, never a difference.

* **CUDA**: ``torch.cuda.max_memory_allocated()`` over the step after
  ``torch.cuda.reset_peak_memory_stats()``: every byte the caching allocator handed out and that
  was live at the peak (weights, buffers, optimizer state, the batch, activations, gradients,
  kernel workspaces such as cuBLAS's), rounded up to the allocator's 512-byte blocks; memory
  reserved but unused by the cache, and the CUDA context, are not counted.
* **CPU** (no allocator peak counter): :class:`LiveMemoryTracker` counts live tensor storages.
  At step start it registers the storages of the model's parameters and buffers, of their
  gradients (none: they were set to None), of the optimizer's state and of the batch and labels.
  During the step it is a ``TorchDispatchMode``: every ATen operator call (forward, backward,
  which autograd runs through the same dispatcher, and the optimizer step) passes through it, and
  each tensor the operator returns is looked up by its ``untyped_storage()``; a storage not yet
  registered is a new allocation of ``storage.nbytes()`` bytes. A storage shared by several
  tensors (views, in-place results, a gradient autograd stole from its producer) is counted
  once. Every registered storage carries a weak reference whose callback fires when PyTorch
  releases the storage (the Python storage object lives exactly as long as the C++ storage), so
  frees are observed when they happen; the peak is the maximum over the step of the live total,
  taken after every operator. Not counted: scratch memory an operator allocates and frees
  inside its own kernel (e.g. oneDNN/BLAS workspaces, the internals of the fused attention
  kernel), pre-existing tensors that were not registered and that no operator returns during the
  step, allocator overhead and fragmentation, and the Python / library memory of the process.
  ``tests/test_budget.py`` checks the tracker on a known allocation pattern (4 MB, freed, then
  2 MB: peak 4 MB) and against the CPU allocator's own accounting of the same training step
  (``torch.profiler`` memory events): the peaks of new bytes agree to within 10% (on DeiT-S,
  batch 2, exits 0 and 3, both modes, they were equal to the byte).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import gc
import statistics
import sys
from typing import Optional

import torch
import torch.nn.functional as F

from fedadapt.measure import peak_bytes, time_calls

MB = 2**20

CPU_METHOD = ("live tensor storages (TorchDispatchMode): weights, buffers, optimizer state, batch, "
              "activations and gradients; kernel-internal scratch not counted")
CUDA_METHOD = "torch.cuda.max_memory_allocated: the whole allocated peak, weights included"


# -- the model a client of tier l holds ------------------------------------------------------

def _check_exits(exits: Optional[list[int]], num_layers: int) -> list[int]:
    from fedadapt.config import ConfigError

    if exits is None:
        return list(range(num_layers))
    if not exits:
        raise ConfigError("--exits is empty: name at least one exit")
    bad = [e for e in exits if not 0 <= e < num_layers]
    if bad:
        raise ConfigError(f"--exits={','.join(map(str, exits))} is invalid: exit(s) {bad} outside "
                          f"0..{num_layers - 1} (the backbone has {num_layers} blocks)")
    return list(exits)


def _tier_model(base, last_exit: int, full: bool):
    """A copy of ``base`` truncated after block ``last_exit``; ``full``: everything trains."""
    from fedadapt.adapters.exits import LayerwiseHeads

    model = copy.deepcopy(base)
    del model.backbone.blocks[last_exit + 1:]
    if isinstance(model.head, LayerwiseHeads):
        del model.head.heads[last_exit + 1:]
    if full:
        model.train_backbone = True
        model.requires_grad_(True)
    return model.train()


def _baseline_tensors(model, optimizer, batch: tuple[torch.Tensor, ...]) -> list:
    tensors = [*model.parameters(), *model.buffers(), *batch]
    tensors += [p.grad for p in model.parameters()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _step(model, optimizer, x: torch.Tensor, y: torch.Tensor, last_exit: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    logits = model.exit_logits(x, last_exit=last_exit)[-1]
    F.cross_entropy(logits, y).backward()
    optimizer.step()


def _measure_mode(base, run, last_exit: int, *, full: bool, batch_size: int, repeats: int,
                  num_classes: int, input_shape: tuple, device: torch.device) -> dict:
    from fedadapt.federation.client.training import make_optimizer

    model = _tier_model(base, last_exit, full).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, run.train, run.train.lr)
    x = torch.randn(batch_size, *input_shape, device=device)
    y = torch.randint(0, num_classes, (batch_size,), device=device)
    cuda = device.type == "cuda"

    step = functools.partial(_step, model, optimizer, x, y, last_exit)
    step()  # warm-up: optimizer state, kernels, caches
    optimizer.zero_grad(set_to_none=True)
    peak = peak_bytes(step, device,
                      baseline=functools.partial(_baseline_tensors, model, optimizer, (x, y)))
    times = time_calls(step, repeats, device)
    out = {"peak_mb": peak / MB, "step_ms": 1000 * statistics.median(times),
           "model_params": sum(p.numel() for p in model.parameters()),
           "trainable_params": sum(p.numel() for p in params)}
    del step, model, optimizer, params, x, y
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def measure_exit_budget(run, *, batch_size: int = 1, repeats: int = 5,
                        exits: Optional[list[int]] = None, device: str = "cpu",
                        progress: bool = False) -> list[dict]:
    """Per-exit FLOPs, parameters, peak training memory and step time (see the module doc).

    Parameters
    ----------
    run : fedadapt.config.RunConfig
        Method, backbone (with exits: ``family=vit`` or ``deit``), dataset (for the number of
        classes) and ``train`` (the optimizer).
    batch_size, repeats : int
        Images per step; timed steps per exit and mode (their median is reported).
    exits : list of int, optional
        Exits to measure (0-based blocks); all by default.
    device : str
        ``cpu`` or ``cuda`` (``cuda:N``).
    progress : bool
        One line per exit on stderr.

    Returns
    -------
    list of dict
        One row per exit: ``exit``, ``params``, ``flops``, ``model_params``,
        ``trainable_params_frozen``, ``peak_mb_frozen``, ``peak_mb_full``, ``step_ms_frozen``,
        ``step_ms_full``.

    Raises
    ------
    fedadapt.config.ConfigError
        An exit outside ``0..L-1``, a backbone or method without exits, CUDA asked but absent,
        ``batch_size`` or ``repeats`` below 1.
    """
    from fedadapt.adapters import build_model
    from fedadapt.backbones import build_backbone
    from fedadapt.config import ConfigError
    from fedadapt.data.catalogue import load_card
    from fedadapt.measure import per_exit_counts

    if batch_size < 1:
        raise ConfigError(f"--batch-size={batch_size} is invalid: must be >= 1")
    if repeats < 1:
        raise ConfigError(f"--repeats={repeats} is invalid: must be >= 1")
    dev = _device(device)
    card = load_card(run.dataset.name)
    torch.manual_seed(run.seed)
    backbone = build_backbone(run.backbone, load_weights=False)
    if not backbone.has_exits:
        raise ConfigError(f"backbone={run.backbone.name} has no early exits: fedadapt-budget "
                          f"needs backbone.family=vit, deit or ast")
    exits = _check_exits(exits, backbone.num_layers)
    counts = per_exit_counts(backbone)
    base = build_model(run.method, backbone, card.num_classes, with_backbone=True)
    if not base.has_exits:
        raise ConfigError(f"method={run.method.name} has no early exits: use lw_linear, lw_mlp "
                          f"or accumulator")
    if dataclasses.is_dataclass(run.method) and getattr(run.method, "train_backbone", False):
        print("fedadapt-budget: method.train_backbone=true: the frozen and full modes train the "
              "same parameters", file=sys.stderr)
    kw = dict(batch_size=batch_size, repeats=repeats, num_classes=card.num_classes,
              input_shape=tuple(backbone.example_input(1).shape[1:]), device=dev)
    rows = []
    for e in exits:
        frozen = _measure_mode(base, run, e, full=False, **kw)
        full = _measure_mode(base, run, e, full=True, **kw)
        row = {"exit": e, "params": counts[e]["params"], "flops": counts[e]["flops"],
               "model_params": frozen["model_params"],
               "trainable_params_frozen": frozen["trainable_params"],
               "peak_mb_frozen": frozen["peak_mb"], "peak_mb_full": full["peak_mb"],
               "step_ms_frozen": frozen["step_ms"], "step_ms_full": full["step_ms"]}
        rows.append(row)
        if progress:
            print(f"[budget] exit {e}/{backbone.num_layers - 1}: peak {full['peak_mb']:.1f} MB "
                  f"full, {frozen['peak_mb']:.1f} MB frozen; step {full['step_ms']:.1f} ms full, "
                  f"{frozen['step_ms']:.1f} ms frozen", file=sys.stderr, flush=True)
    return rows


def _device(device: str) -> torch.device:
    from fedadapt.config import ConfigError

    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ConfigError(f"--device={device!r} is invalid: cpu or cuda") from err
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device={device!r} is invalid: cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device={device} is invalid: CUDA is not available "
                          f"(torch {torch.__version__})")
    return dev


# -- command line -----------------------------------------------------------------------------

def budget_table(rows: list[dict], *, title: str = "") -> str:
    """Markdown table, one row per exit (Table 7's quantities)."""
    lines = [title, ""] if title else []
    lines += ["| exit | FLOPs (G) | params (M) | peak MB full | peak MB frozen | step ms full "
              "| step ms frozen |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['exit']} | {r['flops'] / 1e9:.2f} | {r['params'] / 1e6:.2f} "
                     f"| {r['peak_mb_full']:.1f} | {r['peak_mb_frozen']:.1f} "
                     f"| {r['step_ms_full']:.1f} | {r['step_ms_frozen']:.1f} |")
    return "\n".join(lines) + "\n"


def _parse_exits(text: Optional[str]) -> Optional[list[int]]:
    from fedadapt.config import ConfigError

    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise ConfigError(f"--exits={text!r} is invalid: comma-separated exit numbers, "
                          f"e.g. 0,3,11") from err


def _main(argv: list[str]) -> int:
    from fedadapt.config import ConfigError
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.results.store import write_json

    parser = argparse.ArgumentParser(
        prog="fedadapt-budget",
        description="Per-exit FLOPs, parameters, peak training memory (full / frozen backbone) "
                    "and step time of a method's model with random weights (the Accumulator "
                    "paper's Table 7).")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per exit and mode")
    parser.add_argument("--exits", help="comma-separated exits, e.g. 0,3,11 (default: all)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int,
                        help="torch CPU threads (default: torch's own choice)")
    parser.add_argument("--out", help="also write the rows as JSON to this file")
    parser.add_argument("overrides", nargs="*",
                        help="Hydra overrides, e.g. method=accumulator backbone=deit_small "
                             "dataset=cifar100")
    args = parser.parse_args(argv)
    exits = _parse_exits(args.exits)
    run = to_run_config(compose_config(args.overrides))
    dev = _device(args.device)
    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError(f"--threads={args.threads} is invalid: must be >= 1")
        torch.set_num_threads(args.threads)
    rows = measure_exit_budget(run, batch_size=args.batch_size, repeats=args.repeats,
                               exits=exits, device=str(dev), progress=True)
    measure = CUDA_METHOD if dev.type == "cuda" else CPU_METHOD
    title = (f"## {run.method.name} on {run.backbone.name} ({run.dataset.name}), batch "
             f"{args.batch_size}, {dev.type} ({torch.get_num_threads()} threads), median of "
             f"{args.repeats} steps")
    print(budget_table(rows, title=title) + f"\nPeak memory: {measure}; MB = 2**20 bytes. "
          f"FLOPs: backbone forward at batch 1 (torch.utils.flop_counter).")
    if args.out:
        write_json(args.out, {"method": run.method.name, "backbone": run.backbone.name,
                              "dataset": run.dataset.name, "device": str(dev),
                              "batch_size": args.batch_size, "repeats": args.repeats,
                              "threads": torch.get_num_threads(),
                              "optimizer": dataclasses.asdict(run.train),
                              "peak_memory": measure, "torch": torch.__version__,
                              "rows": rows})
    return 0


def main() -> None:
    from fedadapt.entry import run_cli

    run_cli(_main)


if __name__ == "__main__":
    main()
