"""What every family's run shares: the prepared run (:class:`PreparedRun`, made by
:func:`fedadapt.experiment.prepare_run`), its run directory's partition, tracker, summary head
and tail, and the simulation that executes it (its backend and its nodes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from fedadapt import cores
from fedadapt.adapters import AdaptedModel
from fedadapt.config import RunConfig
from fedadapt.data.partition import Partition
from fedadapt.federation.client.training import RunSpec
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
    #: Simulated devices (``fleet=``; :class:`fedadapt.federation.simulation.fleet.Fleet`), None
    #: without.
    fleet: Optional[object] = None
    #: The frozen backbone's identity, a hash of its weights
    #: (:func:`fedadapt.data.cache.backbone_fingerprint`): two runs that name the same weights
    #: folder but read different files (a backbone pretrained again) tell apart in the summary.
    backbone_weights: Optional[str] = None
    #: The method's family (:class:`fedadapt.methods.Family`), looked up once by
    #: :func:`fedadapt.experiment.prepare_run`: it checks, prepares and runs the run.
    method_family: Optional[object] = None


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
    runs ``fn()`` once more in the caller's thread, whose error is the run's. As a context
    manager it is joined on the way out, an error's way too (without running ``fn`` again, the
    error in flight is the run's): a thread still drawing while the process exits on that error
    can abort it (``terminate called without an active exception``, exit code 134 instead of
    the error's 2, seen under load when round 2 raised)."""

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

    def __enter__(self) -> "Background":
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if kind is None:
            self.join()
        else:
            self.thread.join()


def run_tracker(cfg: RunConfig, run_dir: Path, config_yaml: str, label: str,
                resume_round: int = 0):
    """The run's :class:`fedadapt.tracking.Tracker` (no-op unless ``tracking.*`` is on)."""
    from fedadapt.results.store import git_commit
    from fedadapt.tracking import open_tracker

    if not (cfg.tracking.tensorboard or cfg.tracking.mlflow or cfg.tracking.wandb):
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
    from fedadapt.federation.simulation import cluster
    from fedadapt.federation.simulation.sizing import parse_count, plan_workers

    if fed.ray_address is not None:
        return "simulation", "a Ray cluster (federation.ray_address)"
    if device == "cuda":
        return "simulation", "a GPU"
    workers = parse_count(fed.workers, "federation.workers")
    if workers is None:
        workers = plan_workers(fed, device, cluster.node_resources(fed, device))[0]
    if workers > 1:
        return "simulation", f"{workers} workers"
    return "inprocess", "this machine's CPU"


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
        from fedadapt.federation.simulation.inprocess import in_process

        return in_process(nodes="workers")
    from fedadapt.federation.simulation.launch import run_simulation

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
            "reproducibility": reproducibility(prep.spec, prep.layout)}


def side_by_side(model, compile: bool) -> dict:
    """How a worker's clients train side by side, said once and recorded in the layout:
    through the grouped forms (one batch of every client's rows; captured by torch.compile
    with ``federation.compile``), or through vmap and why."""
    from fedadapt.federation.client.grouped import engine_of

    engine, why = engine_of(model)
    if engine == "forms":
        how = "grouped forms: one batch of every client's rows, each client's trained " \
              "modules as batched products" + (", captured by torch.compile" if compile else "")
    else:
        how = f"vmap over each client's step ({why})"
    log(f"[federation] clients side by side through {how}")
    return {"side_by_side": engine, "side_by_side_why": why,
            "compiled": bool(compile and engine == "forms")}


def reproducibility(spec, layout: Optional[dict] = None) -> dict:
    """What, besides the config and seed, decides a run's numbers to the last bit: the CPU
    kernels torch dispatches to (its instruction set), torch's thread counts (the server's
    evaluation; each client's, pinned to ``federation.num_cpus``), the GPU and whether its
    kernels were deterministic (``train.deterministic``: cuDNN convolutions and some backward
    passes are not by default), and the precision. Two runs whose metrics differ can be
    compared here; dropped clients are in ``metrics.jsonl`` (``failures``)."""
    import os

    import torch

    out = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "torch_threads_server": (layout or {}).get("server_threads")
           or torch.get_num_threads(),
           "torch_threads_client": spec.client_threads,
           "omp_num_threads_env": os.environ.get("OMP_NUM_THREADS"),
           "device": spec.device, "precision": spec.precision,
           "deterministic": bool(spec.train.deterministic)}
    if spec.device == "cuda":
        out.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    return out


def node_layout(cfg: RunConfig, prep: PreparedRun, execute: Optional[Callable],
                 sampled: int, resume: Optional[dict] = None) -> dict:
    """The plan's nodes: on the deployment engine (``execute`` given) one per client; in
    simulation the workers, their Ray resources and the clients each trains side by side."""
    from fedadapt.federation.simulation.sizing import announce, probe_group, size_simulation

    spec = prep.spec
    if execute is not None and getattr(execute, "nodes", "clients") == "clients" or \
            cfg.secagg.name != "none":  # SecAgg+'s keys and masks are a node's: one per client
        return {"nodes": "clients", "num_nodes": spec.num_clients, "group_size": 1}
    probe = (lambda: probe_group(spec, prep.model)) if family_of(cfg.method).clients_train \
        else None
    backbone_trained = prep.model.count([n for n in prep.model.trainable_names()
                                         if n.startswith("backbone.")])
    fed = cfg.federation
    backend = resolve_backend(fed, spec.device)[0] if execute is None else \
        getattr(execute, "backend", "inprocess" if getattr(execute, "nodes", "") == "workers"
                else "simulation")
    trains_whole = backbone_trained >= prep.counts["backbone_params"] / 2
    # in process, workers on threads train at once only one client at a time each, through
    # train_local (grouped steps, DP-SGD's and a pfl kind's own loops keep process-wide state)
    auto = str(fed.workers).strip().lower() == "auto"
    at_once = (backend == "inprocess" and auto and spec.device == "cpu" and trains_whole
               and spec.dpsgd is None and spec.rule is None)
    if backend == "inprocess" and auto:
        fed = dataclasses.replace(fed, workers=str(in_process_workers(fed, at_once, resume,
                                                                      sampled)))
    sizing = size_simulation(fed, spec.device, sampled, cfg.train.batch_size,
                             probe, trains_whole=trains_whole)
    at_once = at_once and sizing.workers > 1 and sizing.group_size == 1
    announce(sizing)
    threads, why = worker_threads(fed, sizing, backend, at_once, resume)
    # the server's own evaluation at the process's threads, unless the free cores cap them
    server = threads if threads < max(1, int(sizing.num_cpus)) else None
    prep.layout = {"backend": backend, "workers": sizing.workers,
                   "clients_per_worker": sizing.group_size, "num_cpus": sizing.num_cpus,
                   "num_gpus": sizing.num_gpus, "note": sizing.note, "threads": threads,
                   "threads_why": why, "omp_wait": cores.WAIT_POLICY[0],
                   "server_threads": server, "workers_at_once": at_once}
    log(f"[federation] {threads} torch thread(s) per worker ({why}); OpenMP waits: "
        f"{cores.describe_policy()}")
    if at_once:
        log(f"[federation] in process: the {sizing.workers} workers train at once, each on a "
            f"thread of its own (the model trains whole on the CPU: a core per worker trains "
            f"faster than one worker's threads share both)")
    if sizing.group_size > 1 and spec.dpsgd is not None:  # worker.train_groups(private=True)
        log(f"[federation] dp={cfg.dp.name}: each worker trains its {sizing.group_size} clients "
            f"one at a time, not side by side (Opacus's per-sample gradients are one model's)")
        prep.layout.update(side_by_side="one_at_a_time", side_by_side_why=f"dp={cfg.dp.name}",
                           compiled=False)
    elif sizing.group_size > 1 and spec.rule is not None and spec.rule.alone_because:
        log(f"[federation] {spec.rule.label}: each worker trains its {sizing.group_size} "
            f"clients one at a time, not side by side ({spec.rule.alone_because})")
        prep.layout.update(side_by_side="one_at_a_time", side_by_side_why=spec.rule.label,
                           compiled=False)
    elif sizing.group_size > 1 and probe is not None:
        prep.layout.update(side_by_side(prep.model, spec.compile))
    spec.client_threads = threads  # each worker's torch threads
    return {"nodes": "workers", "num_nodes": sizing.workers, "group_size": sizing.group_size,
            "resources": {"num_cpus": sizing.num_cpus, "num_gpus": sizing.num_gpus},
            "server_threads": server, "workers_at_once": at_once}


def in_process_workers(fed, at_once: bool, resume: Optional[dict], sampled: int) -> int:
    """``federation.workers=auto`` in process: one worker with every free core, or, for workers
    that train at once (``at_once``), a worker per free core (``federation.num_cpus`` sets the
    cores of each) as long as each gets two of the round's ``sampled`` clients or more: with
    fewer, a worker waits for the busiest one (the quickstart's fine-tuning, 3 clients a round
    on 2 cores: 73.8 s at once against 73.0 s for one worker with both). A resumed run keeps
    its first part's layout."""
    if not at_once:
        return 1
    if resume and resume.get("workers"):
        return int(resume["workers"])
    per = max(1, int(fed.num_cpus or 1))
    free = cores.threads_for(cores.usable_cores(), 1)[0]
    return max(1, min(free // per, sampled // 2))


def worker_threads(fed, sizing, backend: str, at_once: bool,
                   resume: Optional[dict]) -> tuple[int, str]:
    """Each worker's torch threads and why (fedadapt.cores): ``federation.num_cpus`` when set;
    a resumed run's first part's (its last bits depend on them); on a remote Ray cluster its
    workers' CPUs; else those CPUs capped by the cores free on this machine."""
    want = max(1, int(sizing.num_cpus))
    if fed.num_cpus is not None:
        return want, f"federation.num_cpus={fed.num_cpus:g}"
    if resume and resume.get("threads"):
        return int(resume["threads"]), "as the run's part before the resume"
    if fed.ray_address is not None:
        return want, "the cluster's CPUs per worker"
    # in process they take turns unless they train at once
    local = sizing.workers if backend != "inprocess" or at_once else 1
    return cores.threads_for(sizing.num_cpus, local)
