"""fedadapt side by side with Apple's pfl-research (PyPI ``pfl`` 0.6.0) on this machine.

    python benchmarks/investigations/peer_pfl.py [--rounds 20] [--repeats 2]
                               [--workloads W1,W2,W3] [--backends simulation,inprocess]
                               [--out outputs/peer_pfl] [--clients 1000]
                               [--max-samples N] [--w3-image-size 64] [--prepare-only]

Run it with fedadapt's venv active. Both sides run the same federated training: Fashion-MNIST,
fedadapt's own Dirichlet(0.5) partition over ``--clients`` clients, FedAvg weighted by examples,
10 clients a round, plain SGD (lr 0.05, no momentum), batch 32, one local epoch:

* **W1**: a small CNN trained whole on the images (fedadapt ``backbone=small_cnn
  method=finetune``; on pfl the same layers rebuilt in plain torch from fedadapt's module, with
  fedadapt's initial weights loaded strictly);
* **W2**: a linear head on frozen EfficientNet-Lite0 run at every step (fedadapt
  ``backbone=efficientnet_lite0 method=linear_head method.use_cache=false``: W3's model without
  the feature cache, at the same ``--w3-image-size``). pfl's side runs the same function in plain
  torch (its venv has no timm nor the EfficientNet package): the export saves fedadapt's frozen
  backbone (images to the pooled 1,280-d feature, in eval mode, as fedadapt's forward runs it)
  with ``torch.export.export`` (a dynamic batch dimension; it exports EfficientNet-Lite0 in torch
  2.13, so no ``torch.jit.trace`` fallback is needed) and ``torch.export.save``
  (``W2-backbone.pt2``); pfl loads it with ``torch.export.load(...).module()``, its parameters
  frozen and run under ``torch.no_grad()``, under an ``nn.Linear`` head holding fedadapt's initial
  head weights. The export checks that the exported backbone's output equals fedadapt's backbone
  on 64 training images, and fedadapt's model output equals head(exported backbone) on them (max
  |diff| at most 1e-4, else it stops: fedadapt runs it channels-last, batch norms folded, on
  the CPU). fedadapt's in-process runs count the rows its backbone runs on (at least the
  training and test rows: no cache);
* **W3**: a linear head on frozen EfficientNet-Lite0 features computed once (fedadapt
  ``backbone=efficientnet_lite0 method=linear_head``, whose feature cache pfl reads too). The
  features are taken at ``--w3-image-size`` px (64, as ``fedadapt-bench --scale``: the time per
  round does not depend on it, the one-off extraction does: 224 px takes hours on 2 cores).

What the pfl side gets from fedadapt (an ``.npz`` per workload under ``<out>/export/``): the
images as fedadapt's preprocessing feeds them to the model (W1, W2: checked against fedadapt's
data path; grey images stored with one channel), or the cached features (W3); the labels; the
partition's training indices; the initial weights (W2: the head's; its backbone is the ``.pt2``);
and the clients each round trains with each client's batch order, both drawn by fedadapt's own
seeded samplers. The two runs therefore train the same clients on the same batches from the same
weights (the fedadapt run checks that its sampled clients match).

pfl runs in its own venv (``<out>/pfl-venv``, made once): fedadapt's torch version, ``pfl
--no-deps`` and only what pfl's PyTorch path imports (numpy, scipy, multiprocess, packaging,
dp-accounting, prv-accountant); no other torch and no CUDA package. Its side uses pfl's
simulation API: ``FederatedDataset``, ``PyTorchModel``, ``FederatedAveraging``,
``SimulatedBackend`` with ``WeightByDatapoints``, and a ``CentralEvaluationCallback`` after the
last round.

fedadapt runs with each of ``--backends`` (``federation.backend``): ``simulation``, Flower's
simulation engine on Ray, and ``inprocess``, the same server, ClientApp and worker in one process.

Each run is its own process, the repeats interleaved (fedadapt, pfl, fedadapt, pfl, ...).
fedadapt's process ends as the ``fedadapt`` command does (:mod:`fedadapt.ending`: its work
done, no interpreter teardown); pfl's as Python's do.
Measured per run: seconds per round (median of the rounds after round 1, from the times each
round ended), seconds from the process's start to the end of round 1, seconds from the end of
the last round (which includes the final evaluation, both sides) to the process's end (the
summary, the tables, the exit; as the parent sees the process end), the peak memory of the
process tree (PSS from /proc/<pid>/smaps_rollup, summed over the process and its descendants,
sampled every 0.25 s) and the final accuracy on Fashion-MNIST's 10,000 test images. Writes
``peer_pfl.md`` and ``peer_pfl.json`` to ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

PFL_VERSION = "0.6.0"
#: What pfl 0.6.0's PyTorch path imports besides torch, found by importing ``pfl``,
#: ``pfl.model.pytorch``, ``pfl.algorithm``, ``pfl.aggregate.simulate``, ``pfl.callback`` and
#: ``pfl.data`` in a venv holding only torch and ``pfl --no-deps`` and adding what failed (in
#: this order: numpy, packaging, multiprocess, scipy, dp_accounting, prv_accountant: the
#: callbacks import ``pfl.privacy``, whose accountants import both), at pfl's own pins. Not
#: needed there: wheel, and the extras (tf, mlx, trees).
PFL_DEPS = ["numpy>=1.21,<3", "packaging>=24.0,<26", "multiprocess>=0.70.15,<0.71",
            "scipy>=1.7.3", "dp-accounting>=0.4,<0.6", "prv-accountant>=0.2.0,<0.3.0"]
FMNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte")
WORKLOADS = {
    "W1": "small CNN trained whole on the images (fedadapt: backbone=small_cnn method=finetune)",
    "W2": "linear head on frozen EfficientNet-Lite0 run at every step (fedadapt: "
          "backbone=efficientnet_lite0 method=linear_head method.use_cache=false; pfl: "
          "fedadapt's backbone exported with torch.export)",
    "W3": "linear head on frozen EfficientNet-Lite0 features computed once (fedadapt: "
          "backbone=efficientnet_lite0 method=linear_head, cached features)",
}
PER_ROUND = 10  # clients a round
LR, BATCH, EPOCHS, EVAL_BATCH = 0.05, 32, 1, 256
PSS_INTERVAL_S = 0.25
PROG = "peer_pfl"


class SetupError(RuntimeError):
    """Bad input or a missing piece: reported as one line."""


# -- shared helpers (stdlib only: this file also runs in pfl's venv) ---------------------------

def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def partition_hash(train_indices) -> str:
    """SHA-256 of the clients' training indices, in client order (both fedadapt processes)."""
    import hashlib

    import numpy as np

    h = hashlib.sha256()
    for idx in train_indices:
        arr = np.asarray(idx, dtype=np.int64)
        h.update(np.int64(len(arr)).tobytes())
        h.update(arr.tobytes())
    return h.hexdigest()[:16]


def fedadapt_overrides(workload: str, a) -> list[str]:
    """The fedadapt config of a workload (also what the export composes)."""
    n = a.clients
    out = ["experiment=custom", "dataset=fashion_mnist", "partition=dirichlet",
           f"partition.num_clients={n}", "partition.alpha=0.5",
           # Flower samples int(n * fraction) clients: + 0.5 keeps 10 exact for any n
           f"partition.fraction_fit={(PER_ROUND + 0.5) / n!r}", "partition.fraction_evaluate=0.0",
           "strategy=fedavg", "train.optimizer=sgd", f"train.lr={LR}", "train.momentum=0.0",
           "train.weight_decay=0.0", f"train.batch_size={BATCH}", f"train.local_epochs={EPOCHS}",
           f"rounds={a.rounds}", f"federation.eval_every={a.rounds}",
           "federation.checkpoint_every=0"]
    if a.max_samples:
        out.append(f"dataset.max_samples={a.max_samples}")
    if workload == "W1":
        return out + ["backbone=small_cnn", "method=finetune"]
    out += ["backbone=efficientnet_lite0", f"backbone.image_size={a.w3_image_size}",
            "method=linear_head"]
    return out + ["method.use_cache=false"] if workload == "W2" else out


def fail_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}" if not isinstance(
        err, SetupError) else (text[0] if text else "error")


# -- child: export (fedadapt's venv) -----------------------------------------------------------

def _layers_of(features) -> list[dict]:
    """fedadapt's ``SmallCNN.features`` as a plain description pfl's side rebuilds."""
    from torch import nn

    out = []
    for m in features:
        if isinstance(m, nn.Conv2d):
            out.append({"type": "conv", "in": m.in_channels, "out": m.out_channels,
                        "kernel": list(m.kernel_size), "stride": list(m.stride),
                        "padding": list(m.padding)})
        elif isinstance(m, nn.ReLU):
            out.append({"type": "relu"})
        elif isinstance(m, nn.MaxPool2d):
            out.append({"type": "maxpool", "kernel": m.kernel_size, "stride": m.stride})
        elif isinstance(m, nn.AdaptiveAvgPool2d):
            out.append({"type": "avgpool", "size": m.output_size})
        elif isinstance(m, nn.Flatten):
            out.append({"type": "flatten"})
        else:
            raise SetupError(f"the small CNN has a layer this script cannot rebuild: {m}")
    return out


def _model_inputs_u8(source, pre, rows: int, chunk: int = 4096):
    """``uint8 [N, C, S, S]``: fedadapt's model input (``Preprocess.apply``) before the
    normalisation, which it rounds to bytes (C = 1 for grey images: normalising makes them RGB)."""
    import numpy as np
    import torch

    std = torch.tensor(pre.std).view(1, 3, 1, 1)
    mean = torch.tensor(pre.mean).view(1, 3, 1, 1)
    parts = []
    for s in range(0, rows, chunk):
        x = pre.apply(torch.from_numpy(np.asarray(source.images(np.arange(s, min(rows,
                                                                               s + chunk))))))
        u = ((x * std + mean) * 255.0).round().clamp(0, 255).to(torch.uint8)
        if bool((u == u[:, :1]).all()):
            u = u[:, :1]
        parts.append(u.numpy())
    channels = {p.shape[1] for p in parts}
    if len(channels) != 1:
        parts = [np.repeat(p, 3, axis=1) if p.shape[1] == 1 else p for p in parts]
    return np.concatenate(parts)


def _normalised(u8, pre):
    """pfl's side of the same normalisation (the formula of ``Preprocess.normalize``)."""
    import torch

    scale = 1.0 / torch.tensor(pre.std, dtype=torch.float32).view(1, 3, 1, 1)
    shift = -torch.tensor(pre.mean, dtype=torch.float32).view(1, 3, 1, 1) * scale
    return torch.addcmul(shift, torch.from_numpy(u8).float().div_(255.0), scale)


def _export_backbone(model, x, path: Path) -> dict:
    """Save ``model.backbone`` (images to the pooled feature, in eval mode: what fedadapt's
    forward runs under the head) with ``torch.export`` (dynamic batch dimension) to ``path``;
    load it back as pfl's side does and check it on the images ``x``: its output against
    fedadapt's backbone, and head(exported backbone(x)) against fedadapt's whole model."""
    import torch
    from torch import nn

    model.eval()
    backbone = model.backbone
    start = time.time()
    with torch.no_grad():
        program = torch.export.export(
            backbone, (x,), dynamic_shapes=({0: torch.export.Dim("batch", min=1)},))
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")  # torch wants the .pt2 suffix
    torch.export.save(program, tmp)
    os.replace(tmp, path)
    seconds = time.time() - start
    exported = torch.export.load(path).module()
    head = nn.Linear(model.head.in_features, model.head.out_features)
    head.load_state_dict(model.head.state_dict(), strict=True)
    with torch.no_grad():
        ours, theirs = exported(x), backbone(x)
        feature_diff = float((ours - theirs).abs().max())
        output_diff = float((head(ours) - model(x)).abs().max())
        # the smallest batch, against fedadapt's at that batch (a convolution's last bits
        # depend on the batch size: 2.4e-5 between a batch of 64 and one of 1 here)
        one_diff = float((exported(x[:1]) - backbone(x[:1])).abs().max())
    print(f"[export] W2's backbone: torch.export in {seconds:.1f} s "
          f"({path.stat().st_size / 1e6:.1f} MB); on {len(x)} images max |diff| "
          f"{feature_diff:.1e} (features, exported vs fedadapt's), {output_diff:.1e} (head("
          f"exported) vs fedadapt's model), {one_diff:.1e} (a batch of 1)", flush=True)
    worst = max(feature_diff, output_diff, one_diff)
    # fedadapt's whole model runs its frozen backbone on the CPU channels-last, its batch norms
    # folded (2.4e-5 and 3e-5 from NCHW at 64 px: benchmarks/investigations/frozen_cpu_chunks.py)
    if worst > 1e-4:
        raise SetupError(f"the exported backbone differs from fedadapt's by {worst:.1e} "
                         f"(features {feature_diff:.1e}, outputs {output_diff:.1e}, a batch of "
                         f"1 {one_diff:.1e})")
    return {"backbone_export": "torch.export", "backbone_export_s": seconds,
            "backbone_file_bytes": path.stat().st_size, "backbone_check_images": len(x),
            "backbone_check_max_abs_diff": feature_diff, "output_check_max_abs_diff": output_diff,
            "backbone_check_batch1_max_abs_diff": one_diff}


def child_export(a) -> int:
    """Build the workload with fedadapt (its partition, features, initial weights) and write
    what pfl's side reads."""
    import numpy as np

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.client.training import derive_seed, local_schedule
    from fedadapt.strategies.build import sample_size
    from fedadapt.strategies.state import SeededStreams

    out_dir = Path(a.export_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = fedadapt_overrides(a.workload, a)
    run = to_run_config(compose_config(overrides))
    prep = prepare_run(run)
    spec, model = prep.spec, prep.model
    n = spec.num_clients
    k = sample_size(n, run.partition.fraction_fit)
    if k != PER_ROUND:
        raise SetupError(f"fedadapt samples {k} clients a round, not {PER_ROUND}")
    if model.communicated_names() != model.trainable_names():
        raise SetupError("the model has personal tensors: not a plain FedAvg model")
    # the clients of each round as fedadapt's strategy draws them, and each one's batch order
    streams = SeededStreams(run.seed)
    cids, orders = [], []
    for rnd in range(1, run.rounds + 1):
        for cid in streams.sample("train", n, k):
            batches, _ = local_schedule(spec.clients[cid].train, spec.train,
                                        derive_seed(run.seed, rnd, cid), None)
            cids.append(cid)
            orders.append(np.concatenate(batches).astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum([len(o) for o in orders])]).astype(np.int64)
    train, test = spec.train_source, spec.test_source
    arrays = {"train_y": np.asarray(train.labels(), dtype=np.int64),
              "test_y": np.asarray(test.labels(), dtype=np.int64),
              "sched_cid": np.asarray(cids, dtype=np.int64),
              "sched_order": np.concatenate(orders), "sched_offsets": offsets}
    arch = {"workload": a.workload, "num_classes": spec.num_classes, "in_dim": spec.embed_dim,
            "rounds": run.rounds, "per_round": k, "seed": run.seed}
    check, backbone_checks = None, {}
    weights = model.state_dict()
    if a.workload in ("W1", "W2"):
        pre = train.preprocess
        arch.update(layers=_layers_of(model.backbone.features) if a.workload == "W1" else [],
                    mean=list(pre.mean), std=list(pre.std), images=True)
        arrays["train_x"] = _model_inputs_u8(train, pre, len(arrays["train_y"]))
        arrays["test_x"] = _model_inputs_u8(test, pre, len(arrays["test_y"]))
        # pfl's input from these bytes against fedadapt's own data path
        idx = np.random.default_rng(0).choice(len(arrays["train_y"]), 256, replace=False)
        theirs, _ = train.get(np.sort(idx))
        ours = _normalised(arrays["train_x"][np.sort(idx)], pre)
        check = float((theirs - ours).abs().max())
        if check > 1e-6:
            raise SetupError(f"the exported images differ from fedadapt's inputs by {check}")
        if a.workload == "W2":
            if model.input_kind != "images" or model.train_backbone:
                raise SetupError("W2's fedadapt model does not run a frozen backbone on images "
                                 "(is method.use_cache=false applied?)")
            arch["backbone_file"] = f"{a.workload}-backbone.pt2"
            backbone_checks = _export_backbone(model, theirs[:64], out_dir / arch["backbone_file"])
            weights = model.head.state_dict(prefix="head.")  # the backbone travels in the .pt2
    else:
        arch.update(layers=[], images=False)
        for split, src in (("train", train), ("test", test)):
            target = out_dir / f"{a.workload}-{split}-features.npy"
            target.unlink(missing_ok=True)
            try:  # the sealed cache file itself (a hard link), else a copy
                os.link(src.features_path, target)
            except OSError:
                import shutil

                shutil.copyfile(src.features_path, target)
            arch[f"features_{split}"] = target.name
    weights = {f"w:{name}": t.detach().cpu().numpy() for name, t in weights.items()}
    path = out_dir / f"{a.workload}.npz"
    tmp = out_dir / f".{a.workload}.tmp-{os.getpid()}.npz"
    np.savez(tmp, arch=np.asarray(json.dumps(arch)), **arrays, **weights)
    os.replace(tmp, path)
    meta = {"overrides": overrides, "npz": str(path), "partition_hash":
            partition_hash(c.train for c in spec.clients), "num_clients": n,
            "train_samples": int(sum(len(c.train) for c in spec.clients)),
            "schedule": [cids[i:i + k] for i in range(0, len(cids), k)],
            "input_check_max_abs_diff": check, **backbone_checks, "counts": prep.counts,
            # without a cache the backbone runs on every trained row and every test row
            "backbone_rows_needed": int(len(arrays["sched_order"]) + len(arrays["test_y"])),
            "seed": run.seed, "features_path": getattr(train, "features_path", None)}
    write_atomic(Path(a.result), json.dumps(meta))
    return 0


# -- child: fedadapt (its venv) ----------------------------------------------------------------

def child_fedadapt(a) -> int:
    """One fedadapt run in this process, as ``fedadapt`` itself runs it (on ``--backend``);
    records when each round ended and which clients trained."""
    meta = json.loads(Path(a.meta).read_text())
    from omegaconf import OmegaConf

    import fedadapt.federation.server.loop as server
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run, run_experiment
    from fedadapt.results.store import read_jsonl

    ends: list[float] = []
    trained: dict[int, list[int]] = {}
    close_round, exchange = server._close_round, server.exchange

    def timed_close(state, plan, row, t0, **kw):
        close_round(state, plan, row, t0, **kw)
        if row.get("round", 0) > 0:
            ends.append(time.time())

    def recorded_exchange(grid, messages, timeout, expected, what, server_round):
        out = exchange(grid, messages, timeout, expected, what, server_round)
        if what == "training":
            trained[server_round] = sorted(int(c) for c in out[0])
        return out

    server._close_round, server.exchange = timed_close, recorded_exchange
    seen = {"calls": 0, "rows": 0}
    if a.workload == "W2":  # the rows the backbone runs on in this process (in process: all)
        from fedadapt.backbones.efficientnet import EfficientNetLiteBackbone

        backbone_forward = EfficientNetLiteBackbone.forward
        backbone_frozen_cpu = EfficientNetLiteBackbone.frozen_cpu

        def counted(run):
            def call(images):
                seen["calls"] += 1
                seen["rows"] += len(images)
                return run(images)
            return call

        def counted_forward(self, images):
            return counted(lambda x: backbone_forward(self, x))(images)

        # its own forward, and the folded form a frozen forward runs on the CPU
        EfficientNetLiteBackbone.forward = counted_forward
        EfficientNetLiteBackbone.frozen_cpu = lambda self: counted(backbone_frozen_cpu(self))
    composed = compose_config(meta["overrides"] + [f"federation.backend={a.backend}"])
    run = to_run_config(composed)
    prep = prepare_run(run)
    same_partition = partition_hash(c.train for c in prep.spec.clients) == meta["partition_hash"]
    run_dir = Path(a.run_dir)
    run_experiment(run, run_dir, config_yaml=OmegaConf.to_yaml(composed), prepared=prep,
                   label=f"peer_pfl-{a.workload}")
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("round", 0) > 0]
    evaluated = [r for r in rows if r.get("global_acc") is not None]
    schedule = [trained.get(r) for r in range(1, len(rows) + 1)]
    result = {"ends": ends, "accuracy": evaluated[-1]["global_acc"] if evaluated else None,
              "loss": evaluated[-1]["global_loss"] if evaluated else None,
              "own_round_s": [r["round_s"] for r in rows], "same_partition": same_partition,
              "same_clients": schedule == meta["schedule"], "layout": prep.layout,
              "run_dir": str(run_dir)}
    if a.workload == "W2":
        result.update(backbone_calls=seen["calls"], backbone_rows=seen["rows"],
                      backbone_rows_needed=meta["backbone_rows_needed"])
    write_atomic(Path(a.result), json.dumps(result))
    return 0


# -- child: pfl (its venv) ---------------------------------------------------------------------

def child_pfl(a) -> int:
    """The same training with pfl's simulation API, from the export."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel
    from torch import nn

    export = Path(a.export)
    data = np.load(export, allow_pickle=False)
    arch = json.loads(str(data["arch"]))
    rounds, k = arch["rounds"], arch["per_round"]
    if a.rounds != rounds:
        raise SetupError(f"the export holds {rounds} rounds, not {a.rounds}")

    def layer(spec: dict) -> nn.Module:
        kind = spec["type"]
        if kind == "conv":
            return nn.Conv2d(spec["in"], spec["out"], tuple(spec["kernel"]),
                             stride=tuple(spec["stride"]), padding=tuple(spec["padding"]))
        if kind == "maxpool":
            return nn.MaxPool2d(spec["kernel"], spec["stride"])
        if kind == "avgpool":
            return nn.AdaptiveAvgPool2d(spec["size"])
        return {"relu": nn.ReLU, "flatten": nn.Flatten}[kind]()

    class Net(nn.Module):
        """fedadapt's model in plain torch (same parameter names), with the two methods
        ``PyTorchModel`` asks for. Images arrive as bytes and are normalised here, as
        fedadapt's data path does (``Preprocess.normalize``). W2: fedadapt's frozen backbone
        as exported (``torch.export``), its parameters frozen, run without autograd."""

        def __init__(self) -> None:
            super().__init__()
            self.images = bool(arch["images"])
            self.frozen = None
            if arch["layers"]:
                self.backbone = nn.Module()
                self.backbone.features = nn.Sequential(*[layer(s) for s in arch["layers"]])
            if arch.get("backbone_file"):
                self.frozen = torch.export.load(export.parent / arch["backbone_file"]).module()
                self.frozen.requires_grad_(False)
            self.head = nn.Linear(arch["in_dim"], arch["num_classes"])
            if self.images:
                scale = 1.0 / torch.tensor(arch["std"], dtype=torch.float32).view(1, 3, 1, 1)
                shift = -torch.tensor(arch["mean"], dtype=torch.float32).view(1, 3, 1, 1) * scale
                self.register_buffer("scale", scale, persistent=False)
                self.register_buffer("shift", shift, persistent=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.images:
                x = torch.addcmul(self.shift, x.float().div_(255.0), self.scale)
            if arch["layers"]:
                x = self.backbone.features(x)
            if self.frozen is not None:
                with torch.no_grad():
                    x = self.frozen(x)
            return self.head(x)

        def train(self, mode: bool = True):
            """As ``nn.Module.train``, but the exported backbone keeps the eval mode it was
            exported in (an exported module refuses ``train()`` and ``eval()``)."""
            self.training = mode
            for child in self.children():
                if child is not self.frozen:
                    child.train(mode)
            return self

        def loss(self, x, y, eval=False):  # noqa: A002  (pfl's keyword)
            self.eval() if eval else self.train()
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x, y, eval=True):  # noqa: A002
            self.eval()
            logits = self(x)
            n = len(y)
            return {"loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), n),
                    "accuracy": Weighted(float((logits.argmax(1) == y).sum()), n)}

    net = Net()
    weights = {name[2:]: torch.from_numpy(data[name]) for name in data.files
               if name.startswith("w:")}
    if net.frozen is None:
        net.load_state_dict(weights, strict=True)  # fedadapt's initial weights, every tensor
    else:  # W2: the head's (the backbone's are the exported ones)
        net.head.load_state_dict({k[len("head."):]: v for k, v in weights.items()}, strict=True)
        if set(weights) != {f"head.{k}" for k in net.head.state_dict()}:
            raise SetupError(f"W2's export holds more than the head: {sorted(weights)}")

    if arch["images"]:
        train_x, test_x = data["train_x"], data["test_x"]
    else:  # fedadapt's feature cache, memory-mapped as fedadapt maps it
        train_x = np.load(export.parent / arch["features_train"], mmap_mode="r")
        test_x = np.load(export.parent / arch["features_test"], mmap_mode="r")
    train_y, test_y = data["train_y"], data["test_y"]
    cids, order, offsets = data["sched_cid"], data["sched_order"], data["sched_offsets"]

    def user_dataset(position: int) -> Dataset:
        """Client ``cids[position]`` in the round of that position, its samples in fedadapt's
        batch order (pfl's ``Dataset`` batches in the order it holds them)."""
        rows = order[offsets[position]:offsets[position + 1]]
        x = torch.from_numpy(np.ascontiguousarray(train_x[rows]))
        y = torch.from_numpy(train_y[rows])
        return Dataset((x, y), user_id=str(int(cids[position])))

    positions = iter(range(len(cids)))  # fedadapt's schedule, round after round
    federated = FederatedDataset(user_dataset, lambda: next(positions))
    central = Dataset((torch.from_numpy(np.array(test_x)), torch.from_numpy(test_y)))

    class FinalCentralEvaluation(CentralEvaluationCallback):
        """pfl's central evaluation after the last central iteration only: fedadapt evaluates
        its global model in the last round (``federation.eval_every=rounds``), not before
        training (pfl's ``on_train_begin`` would) nor between rounds."""

        final = None

        def on_train_begin(self, *, model):
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if central_iteration != rounds - 1:
                return False, Metrics()
            stop, metrics = self._eval(model)
            self.final = metrics
            return stop, metrics

    class RoundClock(TrainingProcessCallback):
        """When each central iteration (round) ended."""

        def __init__(self) -> None:
            super().__init__()
            self.ends: list[float] = []

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.ends.append(time.time())
            return False, Metrics()

    evaluation = FinalCentralEvaluation(central, NNEvalHyperParams(local_batch_size=EVAL_BATCH))
    clock = RoundClock()
    model = PyTorchModel(model=net, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(
                             [p for p in net.parameters() if p.requires_grad], lr=1.0))
    backend = SimulatedBackend(training_data=federated, val_data=federated,
                               postprocessors=[WeightByDatapoints()])
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=rounds,
                                           evaluation_frequency=rounds, train_cohort_size=k,
                                           val_cohort_size=None),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=LR, local_num_epochs=EPOCHS,
                                              local_batch_size=BATCH),
        model_eval_params=NNEvalHyperParams(local_batch_size=EVAL_BATCH),
        callbacks=[evaluation, clock])  # the clock last: a round's time includes its evaluation
    final = {str(name).rsplit("| ", 1)[-1]: float(getattr(value, "overall_value", value))
             for name, value in evaluation.final or []}
    import pfl

    write_atomic(Path(a.result), json.dumps({
        "ends": clock.ends, "accuracy": final.get("accuracy"), "loss": final.get("loss"),
        "torch": torch.__version__,
        "pfl": getattr(pfl, "__version__", PFL_VERSION), "torch_threads": torch.get_num_threads(),
        "users_left": len(cids) - next(positions, len(cids))}))
    return 0


# -- parent: the pfl venv ----------------------------------------------------------------------

def _run_quiet(cmd: list[str], what: str, env=None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr + proc.stdout).splitlines()
                 if ln.strip() and "is ignored: it is neither" not in ln]
        why = next((ln for ln in reversed(lines) if "ERROR" in ln or "Error" in ln),
                   lines[-1] if lines else f"exit code {proc.returncode}")
        raise SetupError(f"{what}: {why.strip()}")
    return proc.stdout


def fedadapt_versions(python: str) -> dict:
    code = ("import json, torch, flwr, fedadapt; print(json.dumps({'torch': torch.__version__, "
            "'flwr': flwr.__version__, 'fedadapt': fedadapt.__version__}))")
    out = _run_quiet([python, "-c", code], f"fedadapt's venv ({python}) cannot import fedadapt "
                     f"(run this script with fedadapt's venv active)")
    return json.loads(out.strip().splitlines()[-1])


def ensure_pfl_venv(venv: Path, torch_version: str) -> dict:
    """``venv`` with torch ``torch_version``, pfl (no deps) and :data:`PFL_DEPS`; made once,
    reused while its record says the same torch and pfl."""
    record = venv / "peer_pfl.json"
    python = venv / "bin" / "python"
    if record.is_file() and python.exists():
        info = json.loads(record.read_text())
        if info.get("torch") == torch_version and info.get("pfl") == PFL_VERSION:
            return info
    print(f"[setup] creating pfl's venv {venv} (torch {torch_version}, pfl {PFL_VERSION})",
          flush=True)
    _run_quiet([sys.executable, "-m", "venv", "--clear", str(venv)], f"cannot create {venv}")
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={torch_version}\n")  # nothing may bring another torch
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
           "-c", str(constraints)]
    _run_quiet(pip + [f"torch=={torch_version}", *PFL_DEPS],
               f"cannot install torch=={torch_version} and pfl's dependencies into {venv}")
    _run_quiet(pip + ["--no-deps", f"pfl=={PFL_VERSION}"],
               f"pfl=={PFL_VERSION} is not installable into {venv}")
    code = ("import json, importlib.metadata as md, torch, pfl, pfl.model.pytorch, "
            "pfl.aggregate.simulate, pfl.aggregate.weighting, pfl.algorithm, pfl.callback, "
            "pfl.data.federated_dataset, pfl.hyperparam, pfl.metrics; "
            "names = sorted(d.metadata['Name'].lower() for d in md.distributions()); "
            "print(json.dumps({'torch': torch.__version__, 'pfl': md.version('pfl'), "
            "'cuda_packages': [n for n in names if n.startswith(('nvidia', 'triton', 'cuda'))],"
            " 'packages': names}))")
    info = json.loads(_run_quiet([str(python), "-c", code], f"pfl does not import in {venv}")
                      .strip().splitlines()[-1])
    if info["torch"] != torch_version:
        raise SetupError(f"pfl's venv got torch {info['torch']}, not fedadapt's {torch_version}")
    if info["cuda_packages"]:
        raise SetupError(f"pfl's venv got CUDA packages: {', '.join(info['cuda_packages'])}")
    write_atomic(record, json.dumps(info, indent=1))
    return info


# -- parent: measured processes ----------------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, session id), from /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        table[int(entry)] = (int(fields[1]), int(fields[3]))
    return table


def tree_pss(root: int) -> tuple[int, int]:
    """(bytes, processes): PSS summed over ``root``, its descendants and whatever else runs in
    its session (a daemon the tree started that re-parented itself)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    tree, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid not in tree:
            tree.add(pid)
            stack.extend(children.get(pid, []))
    tree |= {pid for pid, (_, sid) in table.items() if sid == root}
    total, counted = 0, 0
    for pid in tree:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as fh:
                for line in fh:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        counted += 1
                        break
        except OSError:
            continue
    return total, counted


def run_measured(cmd: list[str], log: Path, env: dict, timeout_s: float | None) -> dict:
    """Run ``cmd`` (its own session) with its PSS sampled; when it started, ended, its peak
    (``timeout_s``: None, no limit)."""
    start = time.time()
    peak, procs = 0, 0
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        try:
            while True:
                pss, n = tree_pss(proc.pid)
                if pss > peak:
                    peak, procs = pss, n
                try:
                    proc.wait(timeout=PSS_INTERVAL_S)
                    break
                except subprocess.TimeoutExpired:
                    if timeout_s is not None and time.time() - start > timeout_s:
                        raise SetupError(f"a run took longer than --timeout {timeout_s:.0f} s "
                                         f"(log: {log})") from None
        except (SetupError, KeyboardInterrupt):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)  # the session this script started
                    proc.wait(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue
            raise
    return {"started": start, "exited": time.time(), "returncode": proc.returncode,
            "peak_pss_bytes": peak, "peak_pss_processes": procs}


def _child_error(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    mine = [ln for ln in lines if ln.startswith(f"{PROG}: error:")]
    if mine:
        return mine[-1][len(f"{PROG}: error:"):].strip()
    return lines[-1] if lines else "no output"


def child_cmd(python: str, a, mode: str, workload: str, **extra) -> list[str]:
    cmd = [python, str(Path(__file__).resolve()), "--child", mode, "--workload", workload,
           "--rounds", str(a.rounds), "--clients", str(a.clients),
           "--w3-image-size", str(a.w3_image_size)]
    if a.max_samples:
        cmd += ["--max-samples", str(a.max_samples)]
    for key, value in extra.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


def child_env(pfl: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLWR_TELEMETRY_ENABLED="0",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    if pfl:  # nothing of fedadapt's environment on pfl's path
        for key in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
            env.pop(key, None)
    return env


def summarise_run(side: str, workload: str, rep: int, measured: dict, result: dict) -> dict:
    ends = result["ends"]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {"side": side, "workload": workload, "repeat": rep,
            "rounds_done": len(ends),
            "s_per_round": statistics.median(gaps) if gaps else None,
            "round_s": gaps,
            "startup_to_round1_s": ends[0] - measured["started"] if ends else None,
            # the end of the last round (its evaluation included) to the process's end
            "tail_s": measured["exited"] - ends[-1] if ends else None,
            "process_s": measured["exited"] - measured["started"],
            "peak_pss_bytes": measured["peak_pss_bytes"],
            "peak_pss_processes": measured["peak_pss_processes"],
            "accuracy": result.get("accuracy"),
            "loss": result.get("loss"),
            **{k: v for k, v in result.items() if k not in ("ends", "accuracy", "loss")}}


# -- parent: report ----------------------------------------------------------------------------

def _cell(values: list, fmt: str) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def machine() -> dict:
    info = {"cpu_count": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0)),
            "platform": platform.platform(), "python": platform.python_version()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu_model"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gb"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return info


def render(report: dict) -> str:
    a, m = report["args"], report["machine"]
    lines = [
        "# fedadapt vs pfl-research: FedAvg simulation on one machine", "",
        f"Command: `{report['command']}`", "",
        f"Machine: {m['cpu_count']} CPUs ({m['cpus_usable']} usable), "
        f"{m.get('cpu_model', 'unknown CPU')}, {m.get('memory_gb', '?')} GB; load average "
        f"{report['load_before']} before, {report['load_after']} after (other jobs share it).",
        "",
        f"Versions: fedadapt {report['fedadapt']['fedadapt']} (flwr {report['fedadapt']['flwr']}"
        f"), pfl {report['pfl']['pfl']}; torch {report['fedadapt']['torch']} in both venvs.", "",
        f"Setting: Fashion-MNIST, fedadapt's Dirichlet(0.5) partition of {a['clients']} clients"
        + (f" (first {a['max_samples']} training images)" if a["max_samples"] else "")
        + f", {PER_ROUND} clients a round, FedAvg weighted by examples, SGD lr {LR} (no "
        f"momentum), batch {BATCH}, {EPOCHS} local epoch; {a['rounds']} rounds, {a['repeats']} "
        "repeat(s) interleaved; the same clients, batches and initial weights on both sides.", "",
        "| workload | framework | s / round | start-up to end of round 1 (s) | "
        "after the last round (s) | peak PSS, process tree (MB) | final test accuracy | "
        "final test loss | runs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for w in a["workloads"]:
        for side in report["sides"]:
            runs = [r for r in report["runs"] if r["workload"] == w and r["side"] == side]
            lines.append(
                f"| {w} | {side} | {_cell([r['s_per_round'] for r in runs], '.3f')} | "
                f"{_cell([r['startup_to_round1_s'] for r in runs], '.1f')} | "
                f"{_cell([r.get('tail_s') for r in runs], '.2f')} | "
                f"{_cell([r['peak_pss_bytes'] / 1e6 for r in runs], '.0f')} | "
                f"{_cell([r['accuracy'] for r in runs], '.4f')} | "
                f"{_cell([r['loss'] for r in runs], '.4f')} | {len(runs)} |")
    lines += ["", "Cells: median over the repeats (min–max when more than one). s / round: "
              "median of the rounds after round 1 (round 1 is in the start-up column; the last "
              "round includes the evaluation on the 10,000 test images, both sides). After the "
              "last round: from the end of the last round to the process's end (the summary, "
              "the tables, the exit), as the parent sees it end (it polls every "
              f"{PSS_INTERVAL_S} s at most, returning as the process exits). Peak PSS: "
              "the process and its descendants (fedadapt on simulation: Ray's too), sampled "
              f"every {PSS_INTERVAL_S} s. pfl's round 1 also evaluates each of its clients before "
              "and after local training (pfl does so in every central iteration where iteration % "
              "evaluation_frequency == 0, which iteration 0 always is)."
              + (f" W2: EfficientNet-Lite0 at {a['w3_image_size']} px run at every step on "
                 "both sides (pfl: fedadapt's backbone saved by torch.export and loaded as a "
                 "module; the export is not timed)." if "W2" in a["workloads"] else "")
              + (f" W3's features: EfficientNet-Lite0 at {a['w3_image_size']} px, computed once "
                 "by the export (not timed)." if "W3" in a["workloads"] else ""), ""]
    for w in a["workloads"]:
        lines.append(f"- {w}: {WORKLOADS[w]}.")
        checks = report["exports"][w]
        runs = [r for r in report["runs"] if r["workload"] == w and r["side"] != "pfl"]
        same = all(r.get("same_clients") and r.get("same_partition") for r in runs)
        counted = [r for r in runs if r.get("backbone_rows")]
        lines.append(f"  Checks: fedadapt's runs trained the exported clients on the exported "
                     f"partition: {'yes' if same else 'NO'}"
                     + ("" if checks.get("input_check_max_abs_diff") is None else
                        f"; pfl's image input vs fedadapt's: max |diff| "
                        f"{checks['input_check_max_abs_diff']:.1e}")
                     + ("" if checks.get("backbone_check_max_abs_diff") is None else
                        f"; the exported backbone vs fedadapt's on "
                        f"{checks['backbone_check_images']} images: max |diff| "
                        f"{checks['backbone_check_max_abs_diff']:.1e} (features), "
                        f"{checks['output_check_max_abs_diff']:.1e} (head(backbone) vs "
                        f"fedadapt's model output); exported in "
                        f"{checks['backbone_export_s']:.1f} s")
                     + ("" if not counted else
                        f"; fedadapt's backbone ran on {counted[0]['backbone_rows']:,} rows in "
                        f"{counted[0]['backbone_calls']:,} calls in its in-process run (the "
                        f"trained and test rows: {counted[0]['backbone_rows_needed']:,})")
                     + ".")
    return "\n".join(lines) + "\n"


def parent(a) -> int:
    workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise SetupError(f"--workloads {a.workloads!r}: choose from {', '.join(WORKLOADS)}")
    if a.rounds < 1 or a.repeats < 1:
        raise SetupError("--rounds and --repeats must be at least 1")
    backends = [b.strip() for b in a.backends.split(",") if b.strip()]
    if not backends or any(b not in ("simulation", "inprocess") for b in backends):
        raise SetupError(f"--backends {a.backends!r}: simulation, inprocess or both")
    sides = [f"fedadapt {b}" for b in backends] + ["pfl"]
    if a.clients < PER_ROUND:
        raise SetupError(f"--clients must be at least {PER_ROUND}")
    missing = [f for f in FMNIST_FILES if not (FMNIST_DIR / f).exists()
               and not (FMNIST_DIR / f"{f}.gz").exists()]
    if missing:
        raise SetupError(f"Fashion-MNIST is missing: {', '.join(missing)} not in {FMNIST_DIR} "
                         f"(Debian package dataset-fashion-mnist)")
    out = Path(a.out).resolve()
    for sub in ("export", "logs", "runs"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *sys.argv])
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    fed = fedadapt_versions(sys.executable)
    pfl_info = ensure_pfl_venv(out / "pfl-venv", fed["torch"])
    pfl_python = str(out / "pfl-venv" / "bin" / "python")
    stamp = time.strftime("%Y%m%d-%H%M%S")

    exports = {}
    for w in workloads:
        print(f"[export] {w}: fedadapt's partition, data and initial weights", flush=True)
        log, meta = out / "logs" / f"{stamp}-export-{w}.log", out / "export" / f"{w}.json"
        measured = run_measured(child_cmd(sys.executable, a, "export", w,
                                          export_dir=out / "export", result=meta),
                                log, child_env(False), None)  # W3's features: once, any time
        if measured["returncode"] != 0:
            raise SetupError(f"export of {w} failed: {_child_error(log)} (log: {log})")
        exports[w] = json.loads(meta.read_text())
        print(f"[export] {w}: {exports[w]['num_clients']} clients, "
              f"{exports[w]['train_samples']} training samples, "
              f"{measured['exited'] - measured['started']:.0f} s", flush=True)

    if a.prepare_only:
        print(f"[export] done (--prepare-only): the measured runs read {out / 'export'}")
        return 0
    runs = []
    for rep in range(1, a.repeats + 1):
        for w in workloads:
            for side in sides:
                tag = f"{stamp}-{w}-{side.replace(' ', '-')}-{rep}"
                log, result = out / "logs" / f"{tag}.log", out / "logs" / f"{tag}.json"
                if side != "pfl":
                    cmd = child_cmd(sys.executable, a, "fedadapt", w, meta=out / "export" /
                                    f"{w}.json", run_dir=out / "runs" / tag, result=result,
                                    backend=side.split()[1])
                else:
                    cmd = child_cmd(pfl_python, a, "pfl", w, export=exports[w]["npz"],
                                    result=result)
                measured = run_measured(cmd, log, child_env(side == "pfl"), a.timeout)
                if measured["returncode"] != 0:
                    raise SetupError(f"{side} run of {w} (repeat {rep}) failed: "
                                     f"{_child_error(log)} (log: {log})")
                row = summarise_run(side, w, rep, measured, json.loads(result.read_text()))
                row["log"] = str(log)
                runs.append(row)
                spr, up, tail = row["s_per_round"], row["startup_to_round1_s"], row["tail_s"]
                print(f"[{w} {side} {rep}/{a.repeats}] "
                      f"{'n/a' if spr is None else f'{spr:.3f}'} s/round, start-up "
                      f"{'n/a' if up is None else f'{up:.1f}'} s, after the last round "
                      f"{'n/a' if tail is None else f'{tail:.2f}'} s, peak PSS "
                      f"{row['peak_pss_bytes'] / 1e6:.0f} MB, accuracy {row['accuracy']}",
                      flush=True)
    report = {"command": command, "machine": machine(), "load_before": load_before,
              "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
              "args": {"rounds": a.rounds, "repeats": a.repeats, "workloads": workloads,
                       "clients": a.clients, "max_samples": a.max_samples,
                       "w3_image_size": a.w3_image_size},
              "sides": sides, "fedadapt": fed,
              "pfl": {k: v for k, v in pfl_info.items() if k != "packages"},
              "pfl_venv_packages": pfl_info.get("packages"), "exports": {
                  w: {k: v for k, v in e.items() if k != "schedule"} for w, e in exports.items()},
              "runs": runs}
    table = render(report)
    write_atomic(out / "peer_pfl.json", json.dumps(report, indent=1))
    write_atomic(out / "peer_pfl.md", table)
    print()
    print(table, end="")
    print(f"\n(written to {out / 'peer_pfl.md'} and {out / 'peer_pfl.json'})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workloads", default="W1,W2,W3", help="comma-separated: W1, W2, W3")
    p.add_argument("--backends", default="simulation,inprocess",
                   help="fedadapt's federation.backend: simulation, inprocess or both")
    p.add_argument("--out", default="outputs/peer_pfl")
    p.add_argument("--clients", type=int, default=1000,
                   help="clients of the partition (fewer: a quick check)")
    p.add_argument("--max-samples", type=int, default=None,
                   help="use only this many training images (fedadapt's dataset.max_samples)")
    p.add_argument("--w3-image-size", type=int, default=64,
                   help="EfficientNet-Lite0's input size (W2's images, W3's features)")
    p.add_argument("--prepare-only", action="store_true",
                   help="make pfl's venv and the exports (W3's features: the long part), then "
                        "stop; a later run measures")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds one measured run may take")
    for name in ("child", "workload", "export-dir", "result", "meta", "run-dir", "export",
                 "backend"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    child = {"export": child_export, "fedadapt": child_fedadapt, "pfl": child_pfl}
    try:
        if a.child == "fedadapt":  # ends as the fedadapt command does (fedadapt.ending)
            from fedadapt.ending import finish

            finish(child_fedadapt(a))
        if a.child:
            return child[a.child](a)
        return parent(a)
    except KeyboardInterrupt:
        print(f"{PROG}: error: interrupted", file=sys.stderr)
        return 130
    except Exception as err:  # one clear line (children: the parent shows it)
        if a.child and not isinstance(err, SetupError):
            import traceback

            traceback.print_exc()
        print(f"{PROG}: error: {fail_line(err)}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
