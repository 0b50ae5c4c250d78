"""Where models run and in which precision (``federation.num_gpus``, ``train.precision``,
``train.deterministic``).

* **Device.** ``federation.num_gpus=0`` runs everything on the CPU and never initialises CUDA:
  Ray hides the GPUs from workers that ask for none (its default, which fedadapt keeps), and the
  driver's evaluation uses the CPU too. Otherwise a GPU is used when one is visible.
* **Precision.** ``auto`` is bf16 autocast on CUDA and fp32 on the CPU; ``bf16`` on a CPU needs
  native bf16 (AVX512-BF16 / AMX), else the run refuses to start. Under bf16 the matmuls,
  convolutions and attention run in bf16 while trainable tensors, optimiser state, everything
  communicated and every reported number stay fp32; the frozen backbone's weights may be held in
  bf16 (:func:`hold_frozen`). TF32 matmuls are on for fp32 work on CUDA, unless the environment
  sets ``FEDADAPT_TF32=0`` (the test suite does, so that fp32 compares exactly on a GPU too).
* **Determinism.** ``train.deterministic=true`` turns on torch's deterministic algorithms and sets
  cuBLAS's workspace (``CUBLAS_WORKSPACE_CONFIG=:4096:8``) for bit-exact reruns on a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import time
from typing import Optional

import torch
from torch import nn

from fedadapt.config import PRECISIONS, ConfigError


def run_device(num_gpus: Optional[float]) -> str:
    """``cpu`` when ``federation.num_gpus`` is 0 (CUDA is not touched), else ``cuda`` when a GPU
    is visible."""
    if num_gpus is not None and num_gpus == 0:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def cpu_supports_bf16() -> bool:
    """True when the CPU computes bf16 natively (oneDNN's check: AVX512-BF16 or AMX)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(precision: str, device: str) -> str:
    """``fp32`` or ``bf16`` for ``train.precision`` on ``device``; ConfigError when impossible."""
    if precision not in PRECISIONS:
        raise ConfigError(f"train.precision={precision!r} is invalid: one of {PRECISIONS}")
    if precision == "auto":
        return "bf16" if device == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision == "bf16" and device == "cpu" and not cpu_supports_bf16():
        raise ConfigError("train.precision=bf16 is invalid here: this CPU has no native bf16 "
                          "(AVX512-BF16 or AMX); use train.precision=fp32 (or auto)")
    if precision == "bf16" and device == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.precision=bf16 is invalid here: this GPU does not support bf16; "
                          "use train.precision=fp32 (or auto)")
    return precision


def tf32_enabled() -> bool:
    """Whether fp32 matmuls and convolutions on CUDA run in TF32 (unless ``FEDADAPT_TF32=0``)."""
    return os.environ.get("FEDADAPT_TF32", "1") != "0"


def compute_precision(device: str, precision: str) -> str:
    """What a run's matmuls really compute in: ``bf16``, ``fp32``, or ``tf32`` for fp32 on
    CUDA with TF32 on. Features cached under one are not those of another."""
    if precision == "fp32" and device == "cuda" and tf32_enabled():
        return "tf32"
    return precision


def setup(device: str, deterministic: bool = False) -> None:
    """Per process, before the first CUDA call: TF32 matmuls, and deterministic algorithms
    (with cuBLAS's workspace setting) when asked."""
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = tf32_enabled()
        torch.backends.cudnn.allow_tf32 = tf32_enabled()


def autocast(device: str, precision: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on ``device`` when ``precision`` is ``bf16``; a no-op for fp32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)


def hold_frozen(module: nn.Module, precision: str) -> None:
    """Under bf16, keep the frozen weights of ``module``'s linear and convolution layers (the
    bulk of a backbone) in bf16: half the memory and no cast per step. Trainable tensors
    (adapters inside a backbone), normalisation layers and loose parameters (tokens, position
    embeddings) stay fp32. Use the module under :func:`autocast`, which runs these layers in
    bf16 anyway."""
    if precision != "bf16":
        return
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            for p in sub.parameters(recurse=False):
                if not p.requires_grad and p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)


def seed_torch(seed: int, device: torch.device) -> None:
    """What ``torch.manual_seed(seed)`` does for a process computing on ``device``: the CPU
    generator, and on CUDA every GPU's. Called per client and round: ``torch.manual_seed`` also
    queues seeds for CUDA, XPU and MTIA while they are not initialised, each queued call
    recording a formatted stack trace (about 0.6 ms each under fedadapt's stack, 17 ms in a
    round of 10 clients training linear heads)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)


#: :func:`return_freed_memory` trims only when the heap holds at least this much free memory.
TRIM_ABOVE_BYTES = 64 << 20
#: ... and reads how much is free at most once in this many seconds (``mallinfo2`` walks every
#: free block of every arena: 275 us a call in a small CNN's process, twice a 80 ms round).
CHECK_EVERY_S = 1.0
_LAST_CHECK = [-math.inf]


def heap_free_bytes() -> Optional[int]:
    """The free bytes glibc's heaps keep (``mallinfo2().fordblks``, every arena); None where
    that cannot be read (another C library, glibc before 2.33)."""
    libc = _libc()
    info = getattr(libc, "mallinfo2", None) if libc is not None else None
    if info is None:
        return None
    if info.restype is not _MallInfo2:
        info.restype = _MallInfo2
    return int(info().fordblks)


def return_freed_memory(min_free: int = TRIM_ABOVE_BYTES,
                        check_every_s: float = CHECK_EVERY_S) -> bool:
    """Hand the memory Python and torch have freed back to the operating system (glibc's
    ``malloc_trim``; a no-op elsewhere); whether it trimmed. glibc keeps freed blocks below its
    mmap threshold (which grows to 32 MB as large blocks are freed) in the process heap, so a
    process that decodes, trains and encodes a whole CLIP (605 MB) per client grows round after
    round without it. Called once per message on a worker and once per round on the server.
    It trims only when the heaps hold ``min_free`` bytes or more (:data:`TRIM_ABOVE_BYTES`):
    a trim releases the pages and the next round faults them in again, 1.3 ms a call on a
    small CNN's round under cProfile, for a few MB (the peer_pfl investigation's W1). A call
    within ``check_every_s`` of the last one that read the heaps does nothing: a round that
    frees a large model's worth takes longer than that anyway."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    now = time.monotonic()
    if now - _LAST_CHECK[0] < check_every_s:
        return False
    _LAST_CHECK[0] = now
    free = heap_free_bytes()
    if free is not None and free < min_free:
        return False
    libc.malloc_trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    """This process's C library (ctypes), or None."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None
