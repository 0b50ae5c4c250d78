"""One run: prepare data and features, then hand the run to its method's family.

:func:`prepare_run` does everything before Flower starts (and fails fast on bad input, before
anything is written); :func:`run_experiment` hands the prepared run to the family of its method
(:mod:`fedadapt.methods`), which trains, serves and writes the run directory with the helpers
below (the run directory's partition, tracker, summary head and tail, the simulation's nodes).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fedadapt.adapters import AdaptedModel, method_spec
from fedadapt.config import ConfigError, RunConfig
from fedadapt.data.partition import Partition
from fedadapt.federation.training import RunSpec
from fedadapt.log import log
from fedadapt.methods import family_of


@dataclass
class PreparedRun:
    spec: RunSpec
    partition: Partition
    model: AdaptedModel  # server-side copy with the seeded initial weights
    counts: dict
    #: How a simulation's clients were laid out (:func:`node_layout`): workers, clients side by
    #: side per worker and why; recorded in the summary.
    layout: Optional[dict] = None
    #: Simulated devices (``fleet=``; :class:`fedadapt.federation.fleet.Fleet`), None without.
    fleet: Optional[object] = None
    #: The frozen backbone's identity, a hash of its weights
    #: (:func:`fedadapt.data.cache.backbone_fingerprint`): two runs that name the same weights
    #: folder but read different files (a backbone pretrained again) tell apart in the summary.
    backbone_weights: Optional[str] = None


def prepare_run(cfg: RunConfig, *, quiet: bool = False) -> PreparedRun:
    """Load and partition the data, build the backbone and (if used) the feature cache."""
    from fedadapt.backbones import build_backbone
    from fedadapt.data.cache import backbone_fingerprint, cached_features
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.partition import cached_partition, format_stats
    from fedadapt.data.sources import DataSource, input_source
    from fedadapt.devices import resolve_precision, run_device, setup
    from fedadapt.federation.training import build_run_model
    from fedadapt.progress import quiet_libraries
    from fedadapt.tracking import check_available

    check_available(cfg.tracking)
    quiet_libraries()
    dev = run_device(cfg.federation.num_gpus)
    precision = resolve_precision(cfg.train.precision, dev)
    setup(dev, cfg.train.deterministic)  # before any work on the device (features, phases)
    card = load_card(cfg.dataset.name)
    _check_method_settings(cfg, card)
    prepared = prepare_dataset(cfg.dataset, cfg.cache_dir, cfg.seed)
    partition = cached_partition(prepared, cfg.partition, card, cfg.seed, cfg.cache_dir)
    if not quiet:
        log(f"[data] {card.name}: {prepared.num_train} train / {prepared.num_test} test samples, "
            f"{prepared.num_classes} classes | {format_stats(partition.stats)}")
    backbone = build_backbone(cfg.backbone)
    class_text = _class_text(cfg, backbone, prepared.class_names)
    family = family_of(cfg.method)

    def images(split: str) -> DataSource:  # decoded once into the store, transformed on device
        return input_source(card, backbone, prepared, split, cfg.cache_dir,
                            backbone_name=cfg.backbone.name)

    def source(split: str) -> DataSource:
        if cfg.method.use_cache:
            path = cached_features(backbone, images(split), cfg.cache_dir, device=dev,
                                   precision=precision, weights=weights)
            return DataSource(prepared, split, features_path=path)
        return images(split)

    original = None
    if cfg.original.train_backbone:  # the papers' original model: a server-side phase first
        original = _original_phase(cfg, backbone, images("train"), partition, prepared, dev)
        backbone = build_backbone(original.backbone)  # the trained one: its features are cached
    weights = backbone_fingerprint(backbone)  # hashed once: the summary and the feature keys
    spec = RunSpec(run_id=uuid.uuid4().hex, method=cfg.method,
                   backbone=original.backbone if original else cfg.backbone,
                   train=cfg.train, seed=cfg.seed, rounds=cfg.rounds,
                   num_classes=prepared.num_classes, embed_dim=backbone.embed_dim,
                   train_source=source("train"),
                   # server-trained methods serve the clients' own test splits only
                   test_source=source("test") if family.clients_train else None,
                   clients=partition.clients, faults=cfg.faults, setting=cfg.setting,
                   class_text=class_text,
                   evaluate_val=cfg.federation.select == "best_val" or cfg.objective is not None,
                   device=dev, precision=precision,
                   compile=resolve_compile(cfg.federation.compile, dev),
                   client_threads=max(1, int(cfg.federation.num_cpus or 1)))
    model = build_run_model(spec, backbone)
    counts = {
        "backbone_params": backbone.num_params(),
        "trainable_params": model.count(model.trainable_names()),
        "communicated_params": model.count(model.communicated_names()),
    }
    prep = PreparedRun(spec=spec, partition=partition, model=model, counts=counts,
                       backbone_weights=weights)
    family.prepare(cfg, prep, backbone=backbone, images=images, original=original)
    return prep


def _class_text(cfg: RunConfig, backbone, class_names):
    """The class prompts through a CLIP backbone's frozen text tower, for methods registered
    with ``uses_text``; None for the others."""
    from fedadapt.backbones.clip import class_text

    if not method_spec(cfg.method).uses_text:
        return None
    return class_text(backbone, class_names, cfg.method.prompt)


def _check_method_settings(cfg: RunConfig, card) -> None:
    """Settings that hold only for some methods (before anything is loaded)."""
    from fedadapt.strategies.zoo import check_strategy

    # also checked where the config is composed (fedadapt.entry.to_run_config); here for runs
    # built in Python
    check_strategy(cfg.strategy, cfg.dp, weighting=cfg.method.weighting,
                   setting=cfg.setting.name)
    if card.personalize_only and not (cfg.setting.name == "personalization"
                                      and cfg.setting.init_from):
        raise ConfigError(f"dataset={card.name} holds personalization clients only: it needs "
                          f"setting=personalization with setting.init_from=<a multi-tier run "
                          f"directory> (the model is federated on another data set, e.g. "
                          f"experiment=acc_speech_multitier)")
    family = family_of(cfg.method)
    family.check(cfg, card)
    if cfg.partition.test_clients > 0 and family.clients_train:
        raise ConfigError(f"partition.test_clients={cfg.partition.test_clients} is invalid for "
                          f"method={cfg.method.name}: unseen test clients have no training "
                          f"data, only server-trained methods (iciia_b, duet, cdc_mmpg, ...) can "
                          f"serve them")
    if cfg.partition.val_clients > 0 and family.clients_train:
        raise ConfigError(f"partition.val_clients={cfg.partition.val_clients} is invalid for "
                          f"method={cfg.method.name}: validation clients have no training data, "
                          f"only server-trained methods (iciia_b, duet, cdc_mmpg, ...) use them")
    if card.test_split_clients and family.clients_train:
        raise ConfigError(f"dataset={card.name} is invalid for method={cfg.method.name}: its "
                          f"test split is held-out users (unseen clients without training "
                          f"data), which only server-trained methods (iciia_b, duet, cdc_mmpg, "
                          f"...) can serve")
    if cfg.objective is not None and not family.clients_train:
        raise ConfigError(f"objective={cfg.objective} is invalid for method={cfg.method.name}: "
                          f"a validation objective is measured on the clients' validation "
                          f"splits during the rounds; this method is trained on the server")
    if cfg.federation.select == "best_val" and cfg.partition.val_fraction == 0:
        raise ConfigError("federation.select=best_val picks the round by the clients' "
                          "validation accuracy: it needs partition.val_fraction > 0")


def _original_phase(cfg: RunConfig, backbone, images, partition: Partition, prepared, device):
    """``original.train_backbone``: the backbone and its classifier trained on the training
    clients' pooled images (:mod:`fedadapt.federation.original`), once per data and settings."""
    from fedadapt.federation.original import original_model

    if family_of(cfg.method).clients_train:
        raise ConfigError(f"original.train_backbone=true is invalid for method="
                          f"{cfg.method.name}: it trains the original model of the "
                          f"server-trained methods (iciia_b, iciia_t, duet, cdc_mmpg, ...)")
    return original_model(backbone, cfg.backbone, images, partition.clients, cfg.original,
                          num_classes=prepared.num_classes, seed=cfg.seed,
                          cache_dir=cfg.cache_dir, device=device)


def run_experiment(cfg: RunConfig, run_dir: Path, *, config_yaml: str,
                   prepared: Optional[PreparedRun] = None, label: Optional[str] = None,
                   execute: Optional[Callable] = None, resume: bool = False) -> dict:
    """Run ``cfg`` with its method's family (:mod:`fedadapt.methods`) and write its run
    directory; return the summary.

    ``execute(plan, client_app) -> ServerState`` runs the federation; the default is Flower's
    simulation engine (:func:`fedadapt.federation.launch.run_simulation`) with workers as nodes.
    The deployment engine passes one that executes the plan on its own grid, one node per
    client. With ``resume``, a run in rounds continues from the run directory's last checkpoint
    (or starts over when it has none).
    """
    label = label or cfg.method.name
    t0 = time.time()
    prep = prepared or prepare_run(cfg)
    return family_of(cfg.method).run(cfg, run_dir, prep, config_yaml=config_yaml, label=label,
                                     execute=execute, resume=resume, t0=t0)


def write_partition(run_dir: Path, cfg: RunConfig, prep: PreparedRun, *, stats: bool = True,
                    plot: bool = True) -> None:
    """``partition.json`` (statistics) and ``partition.png`` (classes per client)."""
    from fedadapt.results.store import write_json

    if stats:
        write_json(run_dir / "partition.json", prep.partition.stats)
    if not plot:
        return
    from fedadapt.results.plots import write_partition_plot

    source = prep.spec.train_source
    write_partition_plot(cfg, prep.partition, source.labels(), run_dir / "partition.png",
                         class_names=list(source.prepared.class_names))


class Background:
    """``fn()`` in a thread from now, for work a run needs at its end but not before (a plot of
    its partition): it overlaps the rounds, whose time is mostly the workers' (other processes
    on Ray; torch's native kernels in process). :meth:`join` waits; if ``fn`` raised there
    (an import beside the rounds' own can meet Python's import-lock deadlock detection), it
    runs ``fn()`` once more in the caller's thread, whose error is the run's."""

    def __init__(self, fn: Callable[[], None]) -> None:
        import threading

        self.fn, self.error = fn, None

        def run() -> None:
            try:
                fn()
            except BaseException as err:  # noqa: BLE001 - raised again in join()
                self.error = err

        self.thread = threading.Thread(target=run, name="fedadapt-background", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            self.fn()


def open_tracker(cfg: RunConfig, run_dir: Path, config_yaml: str, label: str,
                  resume_round: int = 0):
    """The run's :class:`fedadapt.tracking.Tracker` (no-op unless ``tracking.*`` is on)."""
    from fedadapt.results.store import git_commit
    from fedadapt.tracking import open_tracker

    if not (cfg.tracking.tensorboard or cfg.tracking.mlflow):
        return open_tracker(cfg.tracking, run_dir=run_dir, config_yaml=config_yaml, name=label,
                            experiment=cfg.experiment, output_dir=cfg.output_dir)
    tags = {"fedadapt.method": label, "fedadapt.dataset": cfg.dataset.name,
            "fedadapt.backbone": cfg.backbone.name, "fedadapt.seed": str(cfg.seed),
            "fedadapt.git_commit": git_commit() or "none"}
    return open_tracker(cfg.tracking, run_dir=run_dir, config_yaml=config_yaml,
                        name=f"{label} seed={cfg.seed}", experiment=cfg.experiment,
                        output_dir=cfg.output_dir, tags=tags, resume_round=resume_round)


def resolve_backend(fed, device: str) -> tuple[str, str]:
    """``federation.backend``, ``auto`` resolved: ``(inprocess | simulation, why)``. In process
    when one worker on the CPU serves the run (Ray would add its start-up, its workers' memory
    and its end for nothing: docs/speed.md, beside pfl-research); Flower's simulation engine
    for several workers, a GPU or a Ray cluster."""
    if fed.backend != "auto":
        return fed.backend, f"federation.backend={fed.backend}"
    from fedadapt.federation import cluster
    from fedadapt.federation.sizing import parse_count, plan_workers

    if fed.ray_address is not None:
        return "simulation", "a Ray cluster (federation.ray_address)"
    if device == "cuda":
        return "simulation", "a GPU"
    workers = parse_count(fed.workers, "federation.workers")
    if workers is None:
        workers = plan_workers(fed, device, cluster.node_resources(fed, device))[0]
    if workers > 1:
        return "simulation", f"{workers} workers"
    return "inprocess", "one worker on the CPU"


def simulation(cfg: RunConfig) -> Callable:
    """The default ``execute``: Flower's simulation engine with ``cfg.federation``, or the
    workers in this process (``federation.backend``, ``auto`` resolved by
    :func:`resolve_backend`), said in one line."""
    from fedadapt.devices import run_device

    backend, why = resolve_backend(cfg.federation, run_device(cfg.federation.num_gpus))
    if cfg.federation.backend == "auto":
        log(f"[federation] federation.backend=auto: "
            f"{'in process' if backend == 'inprocess' else 'Flower simulation engine (Ray)'} "
            f"({why})")
    if backend == "inprocess":
        from fedadapt.federation.inprocess import in_process

        return in_process(nodes="workers")
    from fedadapt.federation.launch import run_simulation

    return lambda plan, client_app: run_simulation(plan, client_app, cfg.federation)


def summary_head(cfg: RunConfig, label: str, prep: PreparedRun, *, rounds: int,
                  setting: str) -> dict:
    """The fields that say which run a summary is (first in every ``summary.json``)."""
    p = cfg.partition
    return {"method": label, "experiment": cfg.experiment, "dataset": cfg.dataset.name,
            "backbone": cfg.backbone.name, "backbone_weights": prep.backbone_weights,
            "partition": {"kind": p.kind, "num_clients": prep.spec.num_clients,
                          "alpha": p.alpha, "fraction_fit": p.fraction_fit},
            "seed": cfg.seed, "rounds": rounds, "setting": setting}


def summary_tail(prep: PreparedRun) -> dict:
    """The partition's statistics and where the run ran (last in every ``summary.json``)."""
    from fedadapt.results.store import git_commit, versions

    return {"partition_stats": {k: prep.partition.stats[k] for k in
                                ("num_clients", "samples_per_client", "classes_per_client")},
            "versions": versions(), "git_commit": git_commit(), "device": prep.spec.device,
            "precision": prep.spec.precision, "layout": prep.layout,
            "reproducibility": reproducibility(prep.spec)}


def side_by_side(model, compile: bool) -> dict:
    """How a worker's clients train side by side, said once and recorded in the layout:
    through the grouped forms (one batch of every client's rows; captured by torch.compile
    with ``federation.compile``), or through vmap and why."""
    from fedadapt.federation.grouped import engine_of

    engine, why = engine_of(model)
    if engine == "forms":
        how = "grouped forms: one batch of every client's rows, each client's trained " \
              "modules as batched products" + (", captured by torch.compile" if compile else "")
    else:
        how = f"vmap over each client's step ({why})"
    log(f"[federation] clients side by side through {how}")
    return {"side_by_side": engine, "side_by_side_why": why,
            "compiled": bool(compile and engine == "forms")}


def resolve_compile(value: str, device: str) -> bool:
    """``federation.compile``: ``auto`` captures the grouped step on a GPU only."""
    text = str(value).strip().lower()
    return device == "cuda" if text == "auto" else text == "true"


def reproducibility(spec) -> dict:
    """What, besides the config and seed, decides a run's numbers to the last bit: the CPU
    kernels torch dispatches to (its instruction set), torch's thread counts (the server's
    evaluation; each client's, pinned to ``federation.num_cpus``), the GPU and whether its
    kernels were deterministic (``train.deterministic``: cuDNN convolutions and some backward
    passes are not by default), and the precision. Two runs whose metrics differ can be
    compared here; dropped clients are in ``metrics.jsonl`` (``failures``)."""
    import os

    import torch

    out = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "torch_threads_server": torch.get_num_threads(),
           "torch_threads_client": spec.client_threads,
           "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
           "device": spec.device, "precision": spec.precision,
           "deterministic": bool(spec.train.deterministic)}
    if spec.device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return out


def node_layout(cfg: RunConfig, prep: PreparedRun, execute: Optional[Callable],
                 sampled: int) -> dict:
    """The plan's nodes: on the deployment engine (``execute`` given) one per client; in
    simulation the workers, their Ray resources and the clients each trains side by side."""
    from fedadapt.federation.sizing import announce, probe_group, size_simulation

    spec = prep.spec
    if execute is not None and getattr(execute, "nodes", "clients") == "clients":
        return {"nodes": "clients", "num_nodes": spec.num_clients, "group_size": 1}
    probe = (lambda: probe_group(spec, prep.model)) if family_of(cfg.method).clients_train \
        else None
    backbone_trained = prep.model.count([n for n in prep.model.trainable_names()
                                         if n.startswith("backbone.")])
    fed = cfg.federation
    backend = resolve_backend(fed, spec.device)[0] if execute is None else \
        getattr(execute, "backend", "inprocess" if getattr(execute, "nodes", "") == "workers"
                else "simulation")
    if backend == "inprocess" and str(fed.workers).strip().lower() == "auto":
        fed = dataclasses.replace(fed, workers="1")  # its workers take turns: one has every CPU
    sizing = size_simulation(fed, spec.device, sampled, cfg.train.batch_size,
                             probe, trains_whole=backbone_trained
                             >= prep.counts["backbone_params"] / 2,
                             features=spec.train_source.kind == "features")
    announce(sizing)
    prep.layout = {"backend": backend, "workers": sizing.workers,
                   "clients_per_worker": sizing.group_size, "num_cpus": sizing.num_cpus,
                   "num_gpus": sizing.num_gpus, "note": sizing.note}
    if sizing.group_size > 1 and probe is not None:
        prep.layout.update(side_by_side(prep.model, spec.compile))
    spec.client_threads = max(1, int(sizing.num_cpus))  # each worker's torch threads
    return {"nodes": "workers", "num_nodes": sizing.workers, "group_size": sizing.group_size,
            "resources": {"num_cpus": sizing.num_cpus, "num_gpus": sizing.num_gpus}}
