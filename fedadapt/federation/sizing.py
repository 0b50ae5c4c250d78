"""How many workers a simulation runs and how many clients each trains side by side
(``federation.workers``, ``federation.clients_per_worker``).

* **Workers** (``auto``): one per GPU; on the CPU one per two cores (of this machine, of
  ``federation.ray_num_*``, or of every live node at ``federation.ray_address``).
  Each is a Ray actor holding the frozen backbone once; a round's sampled clients split evenly
  over them.
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
from fedadapt.federation import cluster
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


def size_simulation(fed: FederationConfig, device: str, sampled: int, batch_size: int,
                    measure=None, *, trains_whole: bool = False) -> Sizing:
    """Workers, K and each worker's Ray resources for a round of ``sampled`` clients;
    ``measure()`` returns ``(per_client, common)`` bytes of a group step on the GPU.
    ``trains_whole``: most of the model trains (full fine-tuning), so a group shares no frozen
    weights; on the CPU its clients then train one after another (K = 1: measured 2x faster
    than K = 3 for the quickstart's fine-tuning)."""
    cpus, gpus = cluster.capacity(fed, device)
    workers = parse_count(fed.workers, "federation.workers")
    if workers is None:
        workers = max(1, gpus) if device == "cuda" else max(1, cpus // 2)
    per_worker = max(1, math.ceil(sampled / workers))
    k = parse_count(fed.clients_per_worker, "federation.clients_per_worker")
    note = ""
    if k is None and device == "cuda" and measure is not None:
        per_client, common = measure()
        free = torch.cuda.mem_get_info()[0] * GPU_MEMORY_FRACTION
        fits = int((free - common) // max(per_client, 1))
        k = max(1, min(per_worker, fits))
        note = (f"federation.clients_per_worker=auto: K={k} ({per_client / 2**20:.0f} MB per "
                f"client, {common / 2**20:.0f} MB in common, {free / 2**30:.1f} GB usable)")
    elif k is None and trains_whole:
        k = 1
        note = ("federation.clients_per_worker=auto: K=1 on the CPU (the model trains whole: "
                "no frozen weights for a group to share)")
    elif k is None:
        k = max(1, min(per_worker, CPU_IMAGES_PER_STEP // max(batch_size, 1)))
        note = f"federation.clients_per_worker=auto: K={k} on the CPU"
    elif k > per_worker:
        note = (f"federation.clients_per_worker={k} is more than the {per_worker} clients a "
                f"worker gets per round: using {per_worker}")
        k = per_worker
    num_cpus = fed.num_cpus if fed.num_cpus is not None else max(1.0, cpus / workers)
    num_gpus = fed.num_gpus if fed.num_gpus is not None else (gpus / workers if gpus else 0.0)
    return Sizing(workers=workers, group_size=k, num_cpus=float(num_cpus),
                  num_gpus=float(num_gpus), note=note)


def measure_group_memory(spec, model) -> tuple[int, int]:
    """Peak GPU bytes of one grouped training step of 1 and of 2 clients (one batch each):
    ``(per_client, common)`` with ``peak(K) = common + K * per_client``."""
    from fedadapt.federation.grouped import ClientJob, train_group
    from fedadapt.federation.worker import client_exits, used_tensors

    dev = torch.device(spec.device)
    base = model.tensors(model.trainable_names())
    donors = [c for c in spec.clients if len(c.train)] or spec.clients
    idx = np.asarray(donors[0].train[:spec.train.batch_size])
    peaks = []
    for k in (1, 2):
        jobs = [ClientJob(cid=i, indices=idx, tensors=base, seed=i, crop_seed=i,
                          exits=client_exits(spec, 0)) for i in range(k)]
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        train_group(model, spec.train_source, jobs, _one_epoch(spec.train), lr=0.0,
                    precision=spec.precision, used=used_tensors(spec, model))
        torch.cuda.synchronize(dev)
        peaks.append(torch.cuda.max_memory_allocated(dev))
    torch.cuda.empty_cache()
    per_client = max(peaks[1] - peaks[0], 1)
    return per_client, max(peaks[0] - per_client, 0)


def _one_epoch(train):
    from dataclasses import replace

    return replace(train, local_epochs=1)


def announce(sizing: Sizing) -> None:
    if sizing.note:
        log(f"[federation] {sizing.note}")
