"""Measurements shared by the tools and the library: call timing, peak memory of a call (CUDA's
allocator peak, or live tensor storages on the CPU), per-exit parameter and FLOP counts.

``fedadapt-budget``'s docstring says exactly what the CPU tracker counts and what it misses.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveMemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages and their peak, observed through the dispatcher.

    Storages passed to :meth:`register` (before entering) form the baseline; inside the ``with``
    block every storage an operator returns that is not yet known is added. Each known storage is
    removed when PyTorch frees it (a weak-reference callback). ``peak_bytes`` is the maximum of
    ``live_bytes`` seen after any operator (or registration).

    Parameters
    ----------
    tensors : iterable of torch.Tensor, optional
        Registered as the baseline (e.g. parameters, optimizer state, the batch).
    """

    def __init__(self, tensors: Iterable[Optional[torch.Tensor]] = ()) -> None:
        super().__init__()
        self._lock = threading.RLock()  # frees may be reported from autograd's threads
        self._live: dict[int, tuple[int, weakref.ref]] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.register(tensors)
        self.baseline_bytes = self.live_bytes

    def register(self, tensors: Iterable[Optional[torch.Tensor]]) -> None:
        """Count the storages of ``tensors`` (``None`` entries are skipped), each once."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._track(t)

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (e.g. sparse, subclasses)
            return
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            known = self._live.get(key)
            if known is not None:
                if known[0] != nbytes:  # resized in place
                    self.live_bytes += nbytes - known[0]
                    self._live[key] = (nbytes, known[1])
            else:
                ref = weakref.ref(storage, lambda _ref, key=key: self._release(key))
                self._live[key] = (nbytes, ref)
                self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.live_bytes -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def time_calls(fn, repeats: int, device: torch.device) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` (synchronised around each on CUDA)."""
    cuda = device.type == "cuda"
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def peak_bytes(fn, device: torch.device, baseline) -> int:
    """Peak memory of one call of ``fn``: ``max_memory_allocated`` on CUDA; on CPU the live
    tensors' peak, counting ``baseline()`` (the tensors alive before the call) from the start."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with LiveMemoryTracker(baseline()) as tracker:
        fn()
    return tracker.peak_bytes


def count_cpu_attention() -> None:
    """Give ``torch.utils.flop_counter`` the attention kernel ``scaled_dot_product_attention``
    runs on the CPU (its formulas cover the CUDA kernels only, so a ViT's attention matmuls
    counted 0 here): the same formulas as CUDA's flash attention, forward and backward.
    Idempotent."""
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    for name, formula in (("_scaled_dot_product_flash_attention_for_cpu", fc.sdpa_flop),
                          ("_scaled_dot_product_flash_attention_for_cpu_backward",
                           fc.sdpa_backward_flop)):
        op = getattr(aten, name, None)
        if op is not None and op not in fc.flop_registry:
            fc.register_flop_formula(op, get_raw=True)(formula)  # already shape-wrapped


def per_exit_counts(backbone) -> list[dict]:
    from torch.utils.flop_counter import FlopCounterMode

    count_cpu_attention()

    blocks = backbone.blocks
    base = backbone.num_params() - sum(p.numel() for b in blocks for p in b.parameters())
    final_norm = sum(p.numel() for p in backbone.model.layernorm.parameters())
    base -= final_norm  # the final LayerNorm belongs to the last exit only
    x = backbone.example_input(1)
    out, cumulative = [], base
    for i, block in enumerate(blocks):
        cumulative += sum(p.numel() for p in block.parameters())
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            backbone.forward_exits(x, last_exit=i)
        out.append({"exit": i, "params": cumulative + (final_norm if i == len(blocks) - 1 else 0),
                    "flops": int(counter.get_total_flops())})
    return out
