"""Reproducible and resumable Flower strategies: their randomness and their state.

**Randomness.** Flower's strategies sample nodes with Python's global ``random`` module and the
DP wrappers draw noise from numpy's global generator. :class:`SeededStreams` gives each run its
own seeded states for them, swapped in only while a strategy hook runs
(``with streams.use("train"): strategy.configure_train(...)``) and saved back afterwards, so
nothing else in the process moves them and they go into every checkpoint. Sampling for
training and for evaluation are separate Python streams (how often clients are evaluated never
changes which clients train); both share one numpy stream.

**State.** :func:`strategy_state` writes a strategy's instance attributes (FedAdam's ``m_t`` /
``v_t``, FedAvgM's momentum, the adaptive clipping norm, the accountant's ledger, ... of the
strategy and of every strategy it wraps) as JSON plus named numpy arrays, with no pickle;
:func:`load_strategy_state` puts them back. What it writes: plain values (numbers, strings,
None, and lists and string-keyed dicts of them), numpy arrays and Flower ArrayRecords, lists and
dicts mixing these, numpy's ``Generator`` and ``RandomState``, ``torch.Generator``, Python's
``random.Random``, and any object with ``state_dict()`` / ``load_state_dict()``. A strategy
class that defines ``state_dict()`` / ``load_state_dict()`` itself (a researcher's own) is saved
through them instead of its attributes. Callables (aggregation functions) are configuration,
not state, and are left out; an attribute of a type it cannot write stops the run with one line
naming it (:class:`StrategyStateError`) rather than resuming inexactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import Strategy

from fedadapt.config import FedadaptError

__all__ = ["SeededStreams", "StrategyStateError", "load_strategy_state", "strategy_state"]


class StrategyStateError(FedadaptError, TypeError):
    """A strategy attribute that cannot be checkpointed exactly; the message names it."""


class SeededStreams:
    """The run's own states of ``random`` (per stream) and of ``numpy.random``."""

    STREAMS = ("train", "evaluate")

    def __init__(self, seed: int) -> None:
        self.python = {s: random.Random(f"{s}-{seed}").getstate() for s in self.STREAMS}
        entropy = np.random.SeedSequence([int(seed), 0xD9]).generate_state(1)[0]
        self.numpy = np.random.RandomState(int(entropy)).get_state()
        self._numpy_held = False

    @contextmanager
    def use(self, stream: str) -> Iterator[None]:
        """Python's ``random`` on ``stream`` and numpy's global generator on the run's own
        state while the block runs; both saved back after it, the outer states restored (inside
        :meth:`held`, numpy's once, when it ends)."""
        outer_py = random.getstate()
        outer_np = None if self._numpy_held else np.random.get_state()
        random.setstate(self.python[stream])
        np.random.set_state(self.numpy)
        try:
            yield
        finally:
            self.python[stream] = random.getstate()
            self.numpy = np.random.get_state()
            random.setstate(outer_py)
            if outer_np is not None:
                np.random.set_state(outer_np)

    @contextmanager
    def held(self) -> Iterator[None]:
        """While the block runs (a run's rounds), :meth:`use` leaves numpy's global generator
        where the hook left it (a copy of the run's state: the run's own is set again at the
        next hook, so nothing drawn in between moves it) and the process's state is put back
        once, at the end. Reading or setting numpy's state costs 35 us (its 624 words are
        copied one by one): 140 us a round saved."""
        if self._numpy_held:
            yield
            return
        outer = np.random.get_state()
        self._numpy_held = True
        try:
            yield
        finally:
            self._numpy_held = False
            np.random.set_state(outer)

    def sample(self, stream: str, num_clients: int, k: int) -> list[int]:
        """The partition ids that Flower's ``sample_nodes`` draws (``random.sample`` of the
        grid's node list, which is in partition order) from ``stream``, sorted: for loops that
        train the same clients without Flower (``fedadapt-bench``'s plain loop)."""
        with self.use(stream):
            return sorted(random.sample(range(num_clients), k))

    def state_dict(self) -> dict:
        """JSON-able."""
        name, keys, pos, has_gauss, cached = self.numpy
        return {"python": {s: [v, list(internal), g] for s, (v, internal, g)
                           in self.python.items()},
                "numpy": [name, np.asarray(keys).tolist(), int(pos), int(has_gauss),
                          float(cached)]}

    def load_state_dict(self, state: dict) -> None:
        self.python = {s: (v, tuple(internal), g) for s, (v, internal, g)
                       in state["python"].items()}
        name, keys, pos, has_gauss, cached = state["numpy"]
        self.numpy = (name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)


# -- strategy attributes ---------------------------------------------------------------------

def _is_arrays(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and bool(value) and all(
        isinstance(v, np.ndarray) for v in (value.values() if kind is dict else value))


def _scalar(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_scalar(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _scalar(v) for k, v in value.items())
    return value is None or isinstance(value, (bool, int, float, str))


def _own_state(strategy: Strategy) -> bool:
    """Whether the strategy's class saves itself (``state_dict()`` / ``load_state_dict()``)."""
    return callable(getattr(strategy, "state_dict", None)) and callable(
        getattr(strategy, "load_state_dict", None))


def _encode(value: Any, key: str, tensors: dict[str, np.ndarray], shared: dict[int, str]):
    """One attribute as JSON; its arrays go into ``tensors`` under ``key``-prefixed names.
    ``shared``: ``id(object) -> tag`` of objects saved elsewhere (the global arrays)."""
    if id(value) in shared:
        return {"same_as": shared[id(value)]}
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, np.ndarray):
        tensors[key] = value
        return {"array": key}
    if isinstance(value, ArrayRecord):
        for name, array in value.items():
            tensors[f"{key}/{name}"] = array.numpy()
        return {"arrays": list(value.keys())}
    if isinstance(value, Strategy):
        if _own_state(value):
            return {"own_state": _encode(value.state_dict(), f"{key}#state", tensors, shared)}
        return {"strategy": _attributes(value, key, tensors, shared)}
    if _scalar(value):
        return {"value": list(value) if isinstance(value, tuple) else value}
    if _is_arrays(value, dict):
        for name, array in value.items():
            tensors[f"{key}/{name}"] = array
        return {"dict": list(value.keys())}
    if _is_arrays(value, list):
        for i, array in enumerate(value):
            tensors[f"{key}/{i}"] = array
        return {"list": len(value)}
    if isinstance(value, np.random.Generator):
        return {"np_generator": _encode(value.bit_generator.state, f"{key}#bits", tensors,
                                        shared)}
    if isinstance(value, np.random.RandomState):
        return {"np_randomstate": _encode(value.get_state(legacy=False), f"{key}#mt", tensors,
                                          shared)}
    if isinstance(value, torch.Generator):
        tensors[key] = value.get_state().numpy()
        return {"torch_generator": key, "device": str(value.device)}
    if isinstance(value, random.Random):
        version, internal, gauss = value.getstate()
        return {"py_random": [version, list(internal), gauss]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"map": {k: _encode(v, f"{key}/{k}", tensors, shared) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        return {"seq": [_encode(v, f"{key}/{i}", tensors, shared) for i, v in enumerate(value)],
                "tuple": isinstance(value, tuple)}
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return {"state": value.state_dict()}  # Flower's accountant: its own JSON-able ledger
    raise StrategyStateError(
        f"cannot checkpoint strategy attribute {key} ({type(value).__name__}): keep it as "
        f"arrays, plain values or a numpy / torch generator, or give the strategy class "
        f"state_dict() / load_state_dict() (docs/federation.md, 'Your own strategy')")


def _attributes(strategy: Strategy, prefix: str, tensors: dict, shared: dict) -> dict:
    skip = set(getattr(strategy, "_transient", ()))
    out = {}
    for name, value in vars(strategy).items():
        if name in skip or callable(value):
            continue
        out[name] = _encode(value, f"{prefix}.{name}", tensors, shared)
    return out


def strategy_state(strategy: Strategy, global_arrays: ArrayRecord | None = None
                   ) -> tuple[dict, dict[str, np.ndarray]]:
    """``(json, arrays)`` of every attribute of ``strategy`` and of the strategies it wraps.
    An attribute that is the global arrays themselves (FedAvgM's ``current_arrays`` after a
    round) is stored as a reference, not a copy."""
    tensors: dict[str, np.ndarray] = {}
    shared = {id(global_arrays): "global"} if global_arrays is not None else {}
    if _own_state(strategy):
        return {"#own_state": _encode(strategy.state_dict(), "strategy#state", tensors,
                                      shared)}, tensors
    return _attributes(strategy, "strategy", tensors, shared), tensors


def _decode(spec: dict, key: str, tensors: dict, current: Any, global_arrays) -> Any:
    if "same_as" in spec:
        return global_arrays
    if "value" in spec:
        return spec["value"]
    if "array" in spec:
        return tensors[spec["array"]]
    if "arrays" in spec:
        return ArrayRecord({n: Array(tensors[f"{key}/{n}"]) for n in spec["arrays"]})
    if "dict" in spec:
        return {n: tensors[f"{key}/{n}"] for n in spec["dict"]}
    if "list" in spec:
        return [tensors[f"{key}/{i}"] for i in range(spec["list"])]
    if "map" in spec:
        return {k: _decode(v, f"{key}/{k}", tensors, None, global_arrays)
                for k, v in spec["map"].items()}
    if "seq" in spec:
        out = [_decode(v, f"{key}/{i}", tensors, None, global_arrays)
               for i, v in enumerate(spec["seq"])]
        return tuple(out) if spec.get("tuple") else out
    if "np_generator" in spec:
        state = _decode(spec["np_generator"], f"{key}#bits", tensors, None, global_arrays)
        gen = current if isinstance(current, np.random.Generator) else np.random.Generator(
            getattr(np.random, state["bit_generator"])())
        gen.bit_generator.state = state
        return gen
    if "np_randomstate" in spec:
        gen = current if isinstance(current, np.random.RandomState) else np.random.RandomState()
        gen.set_state(_decode(spec["np_randomstate"], f"{key}#mt", tensors, None, global_arrays))
        return gen
    if "torch_generator" in spec:
        gen = current if isinstance(current, torch.Generator) else torch.Generator(
            spec.get("device", "cpu"))
        gen.set_state(torch.from_numpy(np.array(tensors[spec["torch_generator"]])))
        return gen
    if "py_random" in spec:
        version, internal, gauss = spec["py_random"]
        gen = current if isinstance(current, random.Random) else random.Random()
        gen.setstate((version, tuple(internal), gauss))
        return gen
    raise ValueError(f"unknown strategy state entry for {key}: {sorted(spec)}")


def _restore(strategy: Strategy, attrs: dict, prefix: str, tensors: dict, global_arrays) -> None:
    for name, spec in attrs.items():
        key = f"{prefix}.{name}"
        current = getattr(strategy, name, None)
        if "strategy" in spec:
            _restore(current, spec["strategy"], key, tensors, global_arrays)
        elif "own_state" in spec:
            current.load_state_dict(_decode(spec["own_state"], f"{key}#state", tensors, None,
                                            global_arrays))
        elif "state" in spec:
            current.load_state_dict(spec["state"])
        else:
            value = _decode(spec, key, tensors, current, global_arrays)
            if isinstance(current, tuple) and isinstance(value, list):
                value = tuple(value)
            setattr(strategy, name, value)


def load_strategy_state(strategy: Strategy, state: dict, tensors: dict[str, np.ndarray],
                        global_arrays: ArrayRecord | None = None) -> None:
    """Put back what :func:`strategy_state` saved (into a strategy built from the same config)."""
    if "#own_state" in state:
        strategy.load_state_dict(_decode(state["#own_state"], "strategy#state", tensors, None,
                                         global_arrays))
        return
    _restore(strategy, state, "strategy", tensors, global_arrays)
