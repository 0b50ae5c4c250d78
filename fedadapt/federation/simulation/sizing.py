"""How many workers a simulation runs and how many clients each trains side by side
(``federation.workers``, ``federation.clients_per_worker``).

* **Workers** (``auto``): one per GPU; on the CPU one per two cores. Planned per node (this
  machine, ``federation.ray_num_*``, or each live node at ``federation.ray_address``): every
  worker asks for the same CPUs and GPUs (Flower gives all its actors one request), the most
  that lets each node host its share, so a worker never asks for more than one node has (2
  nodes x 1 CPU: 2 workers of 1 CPU, one on each). Each worker is a Ray actor holding the frozen
  backbone once; a round's sampled clients split evenly over them. An explicit
  ``federation.num_cpus`` / ``num_gpus`` that no node has is refused before Ray starts.
* **Clients per worker** ``K`` (``auto``): on a GPU, from the measured memory of one client's
  training step: a group of one and of two clients are each stepped once on the device and
  their peak allocations give the memory a group needs per client and in common; K is what fits
  in 80% of the device's free memory (at most the clients a worker gets per round). On the CPU,
  where memory rarely binds, as many as keep a group's step under 1,024 images, except when
  the model trains whole (full fine-tuning: no frozen weights for a group to share), where
  K = 1. ``K = 1`` trains a worker's clients one after another, exactly as before grouping.

A larger K fills the device with fewer, larger steps (a paper-shaped round of 10 clients x batch
10 becomes one step of 100 images), at the cost of memory that grows with K; more workers only
help when one worker cannot use the device (or on CPUs with many cores).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fedadapt.config import ConfigError, FederationConfig
from fedadapt.federation.simulation import cluster
from fedadapt.log import log

#: A CPU group's step holds at most this many images (``K x batch``).
CPU_IMAGES_PER_STEP = 1024
GPU_MEMORY_FRACTION = 0.8


@dataclass(frozen=True)
class Sizing:
    workers: int
    group_size: int
    num_cpus: float
    num_gpus: float
    #: How K was chosen (printed once, recorded in the summary).
    note: str = ""


def parse_count(value: str, key: str) -> Optional[int]:
    """``auto`` -> None, a positive integer -> it; anything else names the key."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"{key}={value!r} is invalid: 'auto' or an integer >= 1")
    return n


def _count(amount: float, share: float) -> int:
    """How many shares of ``share`` an ``amount`` of a resource holds (as Flower counts, with
    room for float error: 1.0 / (1/3) is 3)."""
    return int(amount / share + 1e-9)


def actors_that_fit(nodes: list[tuple[float, float]], cpus: float, gpus: float) -> int:
    """How many workers asking ``(cpus, gpus)`` each fit on ``nodes`` at once, counted per node
    as Flower's actor pool counts them (``pool_size_from_resources``)."""
    return sum(min(_count(c, cpus), _count(g, gpus)) if gpus > 0 else _count(c, cpus)
               for c, g in nodes)


def _largest_share(amounts: list[float], n: int) -> float:
    """The largest per-worker share of a resource that still lets ``n`` workers fit on nodes
    holding ``amounts`` of it."""
    shares = sorted({a / k for a in amounts if a > 0 for k in range(1, n + 1)}, reverse=True)
    for share in shares:
        if sum(_count(a, share) for a in amounts) >= n:
            return share
    return 0.0


def _per_node(nodes, cpus: float, gpus: float) -> list[int]:
    return [actors_that_fit([node], cpus, gpus) for node in nodes]


def _show(nodes) -> str:
    return ", ".join(f"{c:g} CPUs" + (f" {g:g} GPUs" if g else "") for c, g in nodes)


def plan_workers(fed: FederationConfig, device: str, nodes: list[tuple[float, float]]
                 ) -> tuple[int, float, float, str]:
    """``(workers, num_cpus, num_gpus, note)`` for ``nodes`` (``(cpus, gpus)`` each): see the
    module docstring. Raises :class:`ConfigError` when no node can host one worker."""
    workers = parse_count(fed.workers, "federation.workers")
    cuda = device == "cuda"
    if cuda and not any(g >= 1 or (fed.num_gpus and g >= fed.num_gpus) for _, g in nodes):
        raise ConfigError(f"federation.ray_address: this machine trains on its GPU, but no node "
                          f"of the cluster has one (nodes: {_show(nodes)})")
    if fed.num_gpus is not None:
        gpus = float(fed.num_gpus)
    elif cuda:
        gpus = 1.0 if workers is None else _largest_share([g for _, g in nodes], workers)
    else:
        gpus = 0.0
    if fed.num_cpus is not None:
        cpus = float(fed.num_cpus)
    elif cuda:  # the CPUs of each GPU's node, shared by the workers it hosts
        slots = [_count(g, gpus) if gpus > 0 else 0 for _, g in nodes]
        cpus = min((c / n for (c, _), n in zip(nodes, slots) if n and c > 0), default=1.0)
    elif workers is None:
        cpus = min(2.0, min((c for c, _ in nodes if c > 0), default=1.0))
    else:
        cpus = _largest_share([c for c, _ in nodes], workers)
    fit = actors_that_fit(nodes, cpus, gpus) if cpus > 0 else 0
    if fit == 0:
        key = "federation.num_gpus" if gpus and fed.num_gpus is not None else \
            "federation.num_cpus" if fed.num_cpus is not None else "federation.workers"
        raise ConfigError(f"{key}: a worker asking for {cpus:g} CPUs and {gpus:g} GPUs fits on "
                          f"no node (nodes: {_show(nodes)}); lower federation.num_cpus / "
                          f"num_gpus")
    if workers is None:
        workers = fit
    if fed.num_cpus is None and not cuda:  # each node's CPUs shared by the workers it hosts
        per = _per_node(nodes, cpus, gpus)
        cpus = min(c / n for (c, _), n in zip(nodes, per) if n)
    note = ""
    if workers > fit:
        note = (f"federation.workers={workers}: {fit} fit on the nodes at once ({_show(nodes)}); "
                f"the others' messages wait for a free one")
    return workers, cpus, gpus, note


def size_simulation(fed: FederationConfig, device: str, sampled: int, batch_size: int,
                    probe=None, *, trains_whole: bool = False,
                    nodes: Optional[list[tuple[float, float]]] = None) -> Sizing:
    """Workers, K and each worker's Ray resources for a round of ``sampled`` clients.
    ``probe()`` (:func:`probe_group`) steps clients side by side once before K is chosen: on the
    GPU it returns ``(per_client, common)`` bytes of a group step, elsewhere None; when it
    raises, K = 1 (one client at a time) and the note names the cause. ``trains_whole``: most
    of the model trains (full fine-tuning), so a group shares no frozen weights; on the CPU its
    clients then train one after another (K = 1: measured 2x faster than K = 3 for the
    quickstart's fine-tuning). Clients on cached features run no frozen backbone in a step,
    but side by side a step serves K clients' small products at once: ten linear heads on
    EfficientNet-Lite0 features exchange a round in 15.3 ms side by side against 17.7-21.0 ms
    one at a time (2026-11-29, 300 rounds x 3 each, in process; the grouped step was 24 ms
    against 18 ms when it split into buckets by batch size), so they take the general rule.
    ``nodes``: ``(cpus, gpus)`` per node (default:
    :func:`fedadapt.federation.simulation.cluster.node_resources`)."""
    nodes = cluster.node_resources(fed, device) if nodes is None else nodes
    workers, num_cpus, num_gpus, place_note = plan_workers(fed, device, nodes)
    per_worker = max(1, math.ceil(sampled / workers))
    k = parse_count(fed.clients_per_worker, "federation.clients_per_worker")
    cuda = device == "cuda"
    note = ""
    if k is None and trains_whole and not cuda:
        k = 1
        note = ("federation.clients_per_worker=auto: K=1 on the CPU (the model trains whole: "
                "no frozen weights for a group to share)")
    elif k is None:
        fits = per_worker if cuda else CPU_IMAGES_PER_STEP // max(batch_size, 1)
        k = max(1, min(per_worker, fits))
        note = f"federation.clients_per_worker=auto: K={k} on the {'GPU' if cuda else 'CPU'}"
        try:
            measured = probe() if k > 1 and probe is not None else None
        except Exception as err:  # the run goes on, one client at a time
            k, measured = 1, None
            note = (f"federation.clients_per_worker=auto: K=1, one client at a time: clients "
                    f"side by side failed in the sizing probe ({one_line(err)})")
        if measured is not None:
            per_client, common = measured
            free = torch.cuda.mem_get_info()[0] * GPU_MEMORY_FRACTION
            k = max(1, min(per_worker, int((free - common) // max(per_client, 1))))
            note = (f"federation.clients_per_worker=auto: K={k} ({per_client / 2**20:.0f} MB "
                    f"per client, {common / 2**20:.0f} MB in common, {free / 2**30:.1f} GB "
                    f"usable)")
    elif k > per_worker:
        note = (f"federation.clients_per_worker={k} is more than the {per_worker} clients a "
                f"worker gets per round: using {per_worker}")
        k = per_worker
    return Sizing(workers=workers, group_size=k, num_cpus=float(num_cpus),
                  num_gpus=float(num_gpus), note="; ".join(n for n in (place_note, note) if n))


def one_line(err: BaseException) -> str:
    """``Type: the first line of its message``."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


def probe_group(spec, model) -> Optional[tuple[int, int]]:
    """One grouped training step (one batch a client, learning rate 0) of 1 and 2 clients on
    the GPU, of 2 on the CPU, in the run's precision; raises what the grouped step raises.
    On the GPU, the peak allocations give ``(per_client, common)`` bytes with
    ``peak(K) = common + K * per_client``; elsewhere None. The model's tensors and the global
    random state are left as they were."""
    from fedadapt.federation.client.grouped import ClientJob, train_group
    from fedadapt.federation.client.worker import client_exits, used_tensors

    dev = torch.device(spec.device)
    cuda = dev.type == "cuda"
    base = model.tensors(model.trainable_names())
    donors = [c for c in spec.clients if len(c.train)] or spec.clients
    idx = np.asarray(donors[0].train[:spec.train.batch_size])
    peaks = []
    with torch.random.fork_rng(devices=[dev] if cuda else []):
        for k in (1, 2) if cuda else (2,):
            jobs = [ClientJob(cid=i, indices=idx, tensors=base, seed=i, crop_seed=i,
                              exits=client_exits(spec, 0)) for i in range(k)]
            if cuda:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            train_group(model, spec.train_source, jobs, _one_epoch(spec.train), lr=0.0,
                        precision=spec.precision, used=used_tensors(spec, model))
            if cuda:
                torch.cuda.synchronize(dev)
                peaks.append(torch.cuda.max_memory_allocated(dev))
    model.eval()
    if not cuda:
        return None
    torch.cuda.empty_cache()
    per_client = max(peaks[1] - peaks[0], 1)
    return per_client, max(peaks[0] - per_client, 0)


def _one_epoch(train):
    from dataclasses import replace

    return replace(train, local_epochs=1)


def announce(sizing: Sizing) -> None:
    if sizing.note:
        log(f"[federation] {sizing.note}")
