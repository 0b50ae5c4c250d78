"""Failing clients: screening replies on the server, and seeded fault injection on the client.

A reply is dropped from the round's aggregation when the client raised (an error reply), did not
answer within ``federation.round_timeout``, or sent tensors that are not exactly the expected
ones: other names, other shapes, or NaN/Inf values. The round goes on with the rest while at least
``federation.min_reply_fraction`` of the sampled clients gave usable replies; below that the run
stops with a message saying why.

Fault injection (``faults.fraction``, ``faults.kinds``) makes a seeded random subset of the
clients misbehave in each round, to exercise all of this.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np
from flwr.app import ArrayRecord, MetricRecord, RecordDict

from fedadapt.codec import RULE_PREFIX, as_numpy, record
from fedadapt.config import FAULT_KINDS, FedadaptError
from fedadapt.federation.wire import records

__all__ = ["FAULT_KINDS", "TENSOR_FAULTS", "RoundFailed", "Screened", "corrupt", "error_cause",
           "injected_fault", "require_enough", "screen_clients"]
#: The kinds that :func:`corrupt` applies to a reply's tensors.
TENSOR_FAULTS = ("nan", "wrong_keys", "wrong_shape")


class RoundFailed(FedadaptError, RuntimeError):
    """Too few usable replies in a round; the run cannot go on."""


@dataclass
class Screened:
    """The usable replies of a round and what happened to the others."""

    #: ``(partition id, content)`` of every usable reply, in partition order.
    good: list = field(default_factory=list)
    #: ``(partition id, kind, detail)`` of every dropped client.
    dropped: list[tuple[int, str, str]] = field(default_factory=list)

    def describe(self, limit: int = 6) -> str:
        shown = "; ".join(f"client {who}: {kind} ({msg})" for who, kind, msg in
                          self.dropped[:limit])
        more = len(self.dropped) - limit
        return shown + (f"; and {more} more (metrics.jsonl counts them by kind)"
                        if more > 0 else "")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, kind, _ in self.dropped:
            out[kind] = out.get(kind, 0) + 1
        return out


def screen_clients(sent: Sequence[int], replies: dict[int, RecordDict | str],
                   expected: Optional[Callable[[int], dict[str, tuple]]]) -> Screened:
    """Split the per-client replies of a round into usable ones (``good``: ``(client,
    content)`` in client order) and dropped ones.

    ``replies`` maps a client to its records, or to the reason it (or its whole message)
    failed; a client of ``sent`` with no entry did not answer in time. ``expected(client)``
    gives the tensor names and shapes a training reply must hold (None for evaluation replies,
    which carry no tensors).
    """
    out = Screened()
    for cid in sorted(sent):
        content = replies.get(cid)
        if content is None:
            out.dropped.append((cid, "timeout", "no reply within federation.round_timeout"))
            continue
        reason = (error_cause(content) if isinstance(content, str)
                  else records.error_of(content))
        if reason is not None:
            out.dropped.append((cid, "error", reason))
            continue
        if expected is not None:
            problem = _check_arrays(content, expected(cid))
            if problem is not None:
                out.dropped.append((cid, *problem))
                continue
        out.good.append((cid, content))
    return out


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: ``Type: message`` as a traceback ends, the type possibly dotted (``ray.exceptions.X``).
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:\([\w.]+\))?): ?(.*)$")
#: Wrappers around a client's own exception (Ray's, Flower's) that say nothing about it.
_WRAPPERS = ("RayTaskError", "ClientAppException", "RayActorError")


def error_cause(reason: str, limit: int = 300) -> str:
    """The cause in a failed client's error reply, as ``Type: message``.

    Flower's simulation engine sends ``<class ...>:<'...'>`` with Ray's whole remote traceback
    inside, the client's own exception in the middle of it; this returns that exception's
    line (the root of the chain), not the wrappers around it, or the reason's last line."""
    text = _ANSI.sub("", reason)
    lines = [ln.rstrip() for ln in text.splitlines()]
    for ln in lines:  # tracebacks print the root cause of a chain first
        m = _EXC_LINE.match(ln)
        if m and not ln.startswith((" ", "\t")) and not any(w in m.group(1) for w in _WRAPPERS) \
                and (m.group(1).endswith(("Error", "Exception", "Interrupt", "Exit", "Warning"))
                     or "." in m.group(1)):
            return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"[:limit]
    marker = "occurred. Message: "
    if marker in text:
        return text.split(marker, 1)[1].strip().splitlines()[0][:limit]
    tail = [ln.strip() for ln in lines if ln.strip()]
    return (tail[-1] if tail else "no reason given")[:limit]


def _fits(shape: tuple, expected: tuple) -> bool:
    """``shape`` is ``expected``; a dimension expected as ``-n`` may be 1..n (a LoRA rank a
    client may have pruned itself to)."""
    return len(shape) == len(expected) and all(
        d == e if e >= 0 else 1 <= d <= -e for d, e in zip(shape, expected))


def _check_arrays(content: RecordDict, expected: dict[str, tuple]) -> tuple[str, str] | None:
    arrays = record(content, ArrayRecord, "arrays")
    if arrays is None:
        return "wrong_keys", "no 'arrays' record"
    # a client rule's arrays (SCAFFOLD's rule/dc/...) beside the tensors: its strategy reads them
    names = {n for n in arrays.keys() if not n.startswith(RULE_PREFIX)}
    if names != set(expected):
        extra, missing = sorted(names - set(expected)), sorted(set(expected) - names)
        return "wrong_keys", f"unexpected {extra[:3]}, missing {missing[:3]}"
    for name, arr in arrays.items():
        if name not in names:
            continue
        if not _fits(tuple(arr.shape), tuple(expected[name])):
            return "wrong_shape", f"{name}: {tuple(arr.shape)} != {tuple(expected[name])}"
    for name, arr in arrays.items():
        values = as_numpy(arr)
        if np.issubdtype(values.dtype, np.floating) and not np.isfinite(values).all():
            return "nonfinite", f"{name} has NaN/Inf"
    metrics = record(content, MetricRecord, "metrics")
    if metrics is None or "num-examples" not in metrics:
        return "wrong_keys", "no num-examples metric"
    return None


def require_enough(screened: Screened, sampled: int, min_fraction: float,
                   server_round: int) -> None:
    """Stop the run when fewer than ``ceil(min_fraction * n)`` replies are usable, ``n`` the
    sampled clients less those the simulated fleet dropped (late at the deadline, offline,
    discarded by over-selection): the fleet's drops are the system simulated, not clients that
    failed, so a round in which the fleet dropped everyone goes on without an update."""
    simulated = sum(1 for _, kind, _ in screened.dropped if kind.startswith("sim_"))
    expected = sampled - simulated
    need = max(1, math.ceil(min_fraction * expected)) if expected > 0 else 0
    if len(screened.good) < need:
        raise RoundFailed(
            f"round {server_round}: only {len(screened.good)} of {sampled} sampled clients gave "
            f"usable training replies, fewer than federation.min_reply_fraction={min_fraction} "
            f"requires ({need}"
            f"{f' of the {expected} the simulated fleet did not drop' if simulated else ''}); "
            f"{screened.describe(5)}")


def injected_fault(seed: int, server_round: int, client: int, fraction: float,
                   kinds: list[str]) -> str | None:
    """The fault this client injects in this round (seeded), or None."""
    if fraction <= 0 or not kinds:
        return None
    rng = random.Random(f"fault-{seed}-{server_round}-{client}")
    if rng.random() >= fraction:
        return None
    return rng.choice(list(kinds))


def corrupt(tensors: dict, kind: str) -> dict:
    """Apply a tensor-level fault (``nan``, ``wrong_keys``, ``wrong_shape``) to a reply."""
    import torch

    if not tensors:
        return tensors
    name = sorted(tensors)[0]
    out = dict(tensors)
    if kind == "nan":
        t = out[name].clone()
        t.view(-1)[0] = float("nan")
        out[name] = t
    elif kind == "wrong_keys":
        out[name + ".bogus"] = out.pop(name)
    elif kind == "wrong_shape":
        out[name] = torch.cat([out[name].reshape(-1), torch.zeros(1)])
    return out
