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
None, and lists and dicts of them), numpy arrays, Flower ArrayRecords and torch tensors (any
dtype and device: their bytes, dtype, shape, device and ``requires_grad``), lists and dicts
mixing these (int keys too), numpy's ``Generator`` and ``RandomState``, ``torch.Generator``,
Python's ``random.Random``, and any object with ``state_dict()`` / ``load_state_dict()`` (a
torch module or optimizer, a researcher's schedule). A strategy class that defines
``state_dict()`` / ``load_state_dict()`` itself is saved through them instead of its
attributes. Functions, classes and callables that hold no state are configuration, rebuilt from
the config on resume, and left out (:func:`_configuration`); anything else it cannot write (a
callable object holding state without ``state_dict()``, a function that rebinds a variable of
its closure, an object of another type) stops the run with one line naming the attribute
(:class:`StrategyStateError`) rather than resuming inexactly. :func:`check_checkpointable` does
a checkpoint's save and load of a strategy (the run's check before round 1).
"""

from __future__ import annotations

import functools
import json
import random
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import Strategy

from fedadapt.config import FedadaptError

__all__ = ["SeededStreams", "StrategyStateError", "check_checkpointable", "load_strategy_state",
           "pack_arrays", "strategy_state", "unpack_arrays"]


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


def _key_scalar(value: Any) -> bool:
    """A dict key a checkpoint can write (a plain value, or a tuple of them)."""
    if isinstance(value, tuple):
        return all(_key_scalar(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _own_state(strategy: Strategy) -> bool:
    """Whether the strategy's class saves itself (``state_dict()`` / ``load_state_dict()``)."""
    return callable(getattr(strategy, "state_dict", None)) and callable(
        getattr(strategy, "load_state_dict", None))


def _has_state_dict(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None))


def _rebinds_closure(fn: types.FunctionType) -> Optional[str]:
    """The variable of its closure that ``fn`` assigns (``nonlocal n; n += 1``: state that
    lives in the function), or None."""
    free = set(fn.__code__.co_freevars)
    if not free:
        return None
    import dis

    for ins in dis.get_instructions(fn):
        if ins.opname == "STORE_DEREF" and ins.argval in free:
            return str(ins.argval)
    return None


def _configuration(value: Any, owner: Strategy) -> bool:
    """Whether an attribute is configuration, rebuilt from the config on resume rather than
    saved: a function (one that keeps no state in its closure), a class, a module, a builtin, a
    method of the strategy itself, a ``functools.partial`` of these with plain arguments, and
    a callable object that holds no state of its own."""
    if isinstance(value, types.FunctionType):
        return _rebinds_closure(value) is None
    if isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)):
        return True
    if isinstance(value, types.MethodType):
        return value.__self__ is owner or isinstance(value.__self__, (type, types.ModuleType))
    if isinstance(value, functools.partial):
        return _configuration(value.func, owner) and _scalar(list(value.args)) and _scalar(
            dict(value.keywords))
    if callable(value) and not _has_state_dict(value) and not isinstance(
            value, (torch.Tensor, np.ndarray)):
        return not getattr(value, "__dict__", None) and not any(
            hasattr(value, s) for c in type(value).__mro__ for s in getattr(c, "__slots__", ()))
    return False


def _refuse(key: str, value: Any, why: str) -> StrategyStateError:
    return StrategyStateError(
        f"cannot checkpoint strategy attribute {key} ({type(value).__name__}): {why} "
        f"(docs/federation.md, 'Your own strategy')")


def _encode_tensor(value: torch.Tensor, key: str, tensors: dict[str, np.ndarray]) -> dict:
    """A torch tensor of any dtype and device: its bytes (as uint8), dtype, shape, device."""
    if value.layout != torch.strided or value.is_quantized:
        raise _refuse(key, value, f"a {value.layout} tensor; keep it dense (.to_dense())")
    cpu = value.detach().to("cpu").contiguous()
    tensors[key] = cpu.reshape(-1).view(torch.uint8).numpy()
    return {"torch": key, "dtype": str(cpu.dtype).removeprefix("torch."),
            "shape": list(cpu.shape), "device": str(value.device),
            "requires_grad": bool(value.requires_grad),
            "parameter": isinstance(value, torch.nn.Parameter)}


def _decode_tensor(spec: dict, key: str, tensors: dict) -> torch.Tensor:
    raw = np.array(tensors[spec["torch"]], dtype=np.uint8)  # its own memory, writable
    dtype = getattr(torch, spec["dtype"])
    out = (torch.from_numpy(raw).view(dtype).reshape(spec["shape"]) if raw.size
           else torch.empty(spec["shape"], dtype=dtype))
    if spec["device"] != "cpu":
        try:
            out = out.to(spec["device"])
        except (RuntimeError, AssertionError) as err:
            raise StrategyStateError(
                f"strategy attribute {key} was saved on {spec['device']}, which this machine "
                f"does not have ({str(err).splitlines()[0]})") from err
    if spec.get("parameter"):
        return torch.nn.Parameter(out, requires_grad=spec["requires_grad"])
    return out.requires_grad_(True) if spec["requires_grad"] else out


def _encode(value: Any, key: str, tensors: dict[str, np.ndarray], shared: dict[int, str]):
    """One attribute as JSON; its arrays go into ``tensors`` under ``key``-prefixed names.
    ``shared``: ``id(object) -> tag`` of objects saved elsewhere (the global arrays)."""
    if id(value) in shared:
        return {"same_as": shared[id(value)]}
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, torch.Tensor):
        return _encode_tensor(value, key, tensors)
    if isinstance(value, np.ndarray):
        if value.dtype.hasobject:
            raise _refuse(key, value, "a numpy array of Python objects; keep numbers in it")
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
    if _is_arrays(value, dict) and all(isinstance(k, str) for k in value):
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
    if isinstance(value, dict) and all(_key_scalar(k) for k in value):  # int keys (a torch
        # optimizer's state_dict, a dict by client id)
        return {"kmap": [[_encode(k, f"{key}/{i}#key", tensors, shared),
                          _encode(v, f"{key}/{i}", tensors, shared)]
                         for i, (k, v) in enumerate(value.items())]}
    if isinstance(value, (list, tuple)):
        return {"seq": [_encode(v, f"{key}/{i}", tensors, shared) for i, v in enumerate(value)],
                "tuple": isinstance(value, tuple)}
    if _has_state_dict(value):  # Flower's accountant, a torch module or optimizer, yours
        state = value.state_dict()
        if _scalar(state):  # JSON as it is (Flower's accountant: its own ledger)
            return {"state": state}
        return {"state_of": _encode(state, f"{key}#state", tensors, shared)}
    if isinstance(value, types.FunctionType) and _rebinds_closure(value):
        raise _refuse(key, value, f"{value.__qualname__} keeps state in its closure "
                                  f"(nonlocal {_rebinds_closure(value)}), which no checkpoint "
                                  f"holds: keep it in an attribute, or in an object with "
                                  f"state_dict() / load_state_dict()")
    if callable(value) and not isinstance(value, (
            types.FunctionType, types.MethodType, types.BuiltinFunctionType, type,
            functools.partial)):
        held = sorted(getattr(value, "__dict__", {}))[:4]
        raise _refuse(key, value, f"a callable object that holds state ({', '.join(held)}) "
                                  f"and has no state_dict() / load_state_dict() to save it "
                                  f"through: give its class the two methods")
    if callable(value):
        raise _refuse(key, value, "a function or method inside a container, or a method of "
                                  "another object: keep functions as attributes of their own "
                                  "(configuration, rebuilt from the config) and state in "
                                  "objects with state_dict() / load_state_dict()")
    raise _refuse(key, value, "keep it as arrays, torch tensors, plain values or a numpy / "
                              "torch generator, or give its class (or the strategy's) "
                              "state_dict() / load_state_dict()")


def _attributes(strategy: Strategy, prefix: str, tensors: dict, shared: dict) -> dict:
    skip = set(getattr(strategy, "_transient", ()))
    out = {}
    for name, value in vars(strategy).items():
        if name in skip or _configuration(value, strategy):
            continue
        out[name] = _encode(value, f"{prefix}.{name}", tensors, shared)
    return out


def strategy_state(strategy: Strategy, global_arrays: ArrayRecord | None = None
                   ) -> tuple[dict, dict[str, np.ndarray]]:
    """``(json, arrays)`` of every attribute of ``strategy`` and of the strategies it wraps.
    An attribute that is the global arrays themselves (FedAvgM's ``current_arrays`` after a
    round) is stored as a reference, not a copy. An attribute it cannot write exactly raises
    :class:`StrategyStateError` naming it."""
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
    if "torch" in spec:
        return _decode_tensor(spec, key, tensors)
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
    if "kmap" in spec:
        out = {}
        for i, (k, v) in enumerate(spec["kmap"]):
            name = _decode(k, f"{key}/{i}#key", tensors, None, global_arrays)
            out[tuple(name) if isinstance(name, list) else name] = _decode(
                v, f"{key}/{i}", tensors, None, global_arrays)
        return out
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
        elif "state" in spec or "state_of" in spec:
            if not _has_state_dict(current):
                raise StrategyStateError(
                    f"strategy attribute {key} was saved through its state_dict(), but the "
                    f"strategy built now holds {type(current).__name__} there, with no "
                    f"load_state_dict(): build it in the constructor")
            current.load_state_dict(spec["state"] if "state" in spec else _decode(
                spec["state_of"], f"{key}#state", tensors, None, global_arrays))
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


# -- as a checkpoint writes it -----------------------------------------------------------------

def pack_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    """The strategy's arrays as a checkpoint's ``strategy.safetensors``; an array safetensors
    cannot hold raises :class:`StrategyStateError` naming its attribute."""
    from safetensors.numpy import save

    ready = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    try:
        return save(ready)
    except Exception as err:  # noqa: BLE001 - find the one array at fault and name it
        for name, array in ready.items():
            try:
                save({name: array})
            except Exception as one:  # noqa: BLE001
                raise StrategyStateError(
                    f"cannot checkpoint strategy attribute {name.split('/')[0]} (a numpy "
                    f"array of {array.dtype}): {str(one).splitlines()[0]}") from one
        raise StrategyStateError(f"cannot checkpoint the strategy's arrays: "
                                 f"{str(err).splitlines()[0]}") from err


def unpack_arrays(data: bytes) -> dict[str, np.ndarray]:
    """What :func:`pack_arrays` wrote."""
    from safetensors.numpy import load

    return load(data)


def _flat(spec: Any, path: str, out: dict) -> dict:
    """``spec`` (a state's JSON) as ``{path: leaf}``, the path led by the attribute's name."""
    if isinstance(spec, dict):
        for k, v in spec.items():
            _flat(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(spec, list):
        for i, v in enumerate(spec):
            _flat(v, f"{path}[{i}]", out)
    else:
        out[path] = spec
    return out


def _attribute_of(path: str) -> str:
    """``strategy.<attribute>`` from a flattened path (spec keys left out)."""
    spec_keys = {"strategy", "own_state", "state", "state_of", "value", "map", "kmap", "seq",
                 "np_generator", "np_randomstate", "torch_generator", "py_random", "tuple",
                 "torch", "dtype", "shape", "device", "requires_grad", "parameter", "array",
                 "arrays", "dict", "list", "same_as"}
    names = []
    for part in path.split("."):
        part = part.split("[")[0]
        if part in spec_keys:
            if part != "strategy":
                break
            continue
        names.append(part)
    return ".".join(["strategy", *names])


def check_checkpointable(strategy: Strategy, rebuild: Optional[Callable[[], Strategy]] = None,
                         global_arrays: ArrayRecord | None = None) -> None:
    """A checkpoint's save and load of ``strategy`` as it is, done now: its state written as a
    checkpoint writes it (JSON and safetensors, :func:`pack_arrays`), read back, loaded into
    ``rebuild()`` (the strategy built anew from the same config, as a resumed run builds it)
    and saved again, which must give the same state. :class:`StrategyStateError` names the
    attribute that cannot be written, or that comes back different."""
    state, arrays = strategy_state(strategy, global_arrays)
    try:
        text = json.dumps(state, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise StrategyStateError(f"cannot checkpoint the strategy's state as JSON: "
                                 f"{err}") from err
    loaded = unpack_arrays(pack_arrays(arrays))
    if rebuild is None:
        return
    fresh = rebuild()
    load_strategy_state(fresh, json.loads(text), loaded, global_arrays)
    again, again_arrays = strategy_state(fresh, global_arrays)
    before, after = _flat(state, "", {}), _flat(json.loads(json.dumps(again)), "", {})
    for path in sorted(set(before) | set(after)):
        if before.get(path, "<absent>") != after.get(path, "<absent>"):
            raise StrategyStateError(
                f"strategy attribute {_attribute_of(path)} does not come back the same from a "
                f"checkpoint (saved and loaded into the strategy built anew, as a resumed run "
                f"builds it): its load_state_dict() or constructor sets it otherwise")
    for name in sorted(set(arrays) | set(again_arrays)):
        a, b = arrays.get(name), again_arrays.get(name)
        if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype or \
                np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
            raise StrategyStateError(
                f"strategy attribute {name.split('/')[0].split('#')[0]} does not come back the "
                f"same from a checkpoint (saved and loaded into the strategy built anew, as a "
                f"resumed run builds it)")
