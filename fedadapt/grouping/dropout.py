"""Dropout whose masks are the client's own, alone or side by side with other clients.

torch's dropout draws from the one global generator, so among clients trained side by side a
client's masks would depend on which clients share its group. Here a mask is a counter-based
hash of (the client's key for this step, the dropout call's place in the forward, the element's
index within the client's batch): a client draws the same masks in
:func:`~fedadapt.federation.client.training.train_local` and in any group. The key is one integer
(one client), one per client slot of a grouped batch (:mod:`fedadapt.grouping.forms`: slot
``s`` owns rows ``s*B .. s*B+B-1``), or a batched tensor inside ``vmap``.

:func:`install` points every ``nn.Dropout`` of a model (the MLP heads', peft's ``lora_dropout``)
at :func:`_forward`; inside :func:`keyed` they use the key, elsewhere (evaluation, server-side
training) they are torch's dropout.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

_M31 = (1 << 31) - 1
#: The seed stream of a client's dropout keys (one of the streams shared by
#: :func:`~fedadapt.federation.client.training.train_local` and grouped training).
DROPOUT_STREAM = 0xD209


class _Keyed(threading.local):
    """The key of the forward running on this thread and the dropout calls it made so far
    (a thread's own: workers in one process train at once, each on a thread)."""

    key = None
    calls = 0


_STATE = _Keyed()


def step_key(seed: int, step: int) -> int:
    """A client's key at one local step: from its training seed and the step's index."""
    seq = np.random.SeedSequence([int(seed), int(step), DROPOUT_STREAM])
    return int(seq.generate_state(1)[0]) & _M31


@contextmanager
def keyed(key: torch.Tensor):
    """Dropout in this forward draws from ``key``: an int64 scalar (batched under ``vmap``), or
    ``[S]`` keys, one per client slot of a grouped batch."""
    _STATE.key, _STATE.calls = key, 0
    try:
        yield
    finally:
        _STATE.key, _STATE.calls = None, 0


@contextmanager
def branch():
    """A part of a forward that only some slots take (the clients leaving at an exit): the calls
    it makes are not counted for what follows, so every client's n-th dropout call is its n-th
    alone, whatever branches other clients took in between."""
    calls = _STATE.calls
    try:
        yield
    finally:
        _STATE.calls = calls


def uniform(key: torch.Tensor, call: int, shape: torch.Size, device) -> torch.Tensor:
    """``shape`` floats in [0, 1): a 31-bit integer hash of (key, call, element index); every
    product stays below 2^62, so int64 never overflows."""
    idx = torch.arange(shape.numel(), dtype=torch.int64, device=device).view(shape)
    return _hash(idx + key * 0x2545F491 + call * 0x61C88647)


def uniform_slots(keys: torch.Tensor, call: int, shape: torch.Size, device) -> torch.Tensor:
    """:func:`uniform` for a grouped batch of ``len(keys)`` equal slots: slot ``s`` draws what
    ``uniform(keys[s], call, its own rows' shape)`` draws (the element index counts from the
    slot's first row), so a client's mask is its mask alone."""
    n = len(keys)
    per = shape.numel() // n
    idx = torch.arange(per, dtype=torch.int64, device=device).view(1, per)
    return _hash(idx + keys.view(n, 1) * 0x2545F491 + call * 0x61C88647).view(shape)


def _hash(h: torch.Tensor) -> torch.Tensor:
    h = h & _M31
    for _ in range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & _M31
    h = (h >> 16) ^ h
    return h.to(torch.float32) * (1.0 / (1 << 31))


def _forward(module: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    key = _STATE.key
    if key is None or not module.training or module.p == 0:
        return F.dropout(x, module.p, module.training, module.inplace)
    call = _STATE.calls
    _STATE.calls = call + 1
    if key.dim() == 1:  # one key per client slot (fedadapt.grouping.forms)
        from fedadapt.grouping.forms import active

        slots = active()
        n = x.shape[0] // slots.rows
        keys = key[slots.lo:slots.lo + n]
        u = uniform_slots(keys, call, x.shape, x.device)
    else:
        u = uniform(key, call, x.shape, x.device)
    keep = u >= module.p
    return x * keep.to(x.dtype) * (1.0 / (1.0 - module.p))


def install(model: nn.Module) -> bool:
    """Every ``nn.Dropout`` of ``model`` draws from the key of :func:`keyed` (idempotent);
    whether it has any (without, a step needs no key)."""
    found = False
    for m in model.modules():
        if type(m) is nn.Dropout:
            found = True
            if not isinstance(m.__dict__.get("forward"), partial):
                m.forward = partial(_forward, m)
    return found
