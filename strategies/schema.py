"""A Flower class's constructor as a config schema: its parameters become typed keys.

Shared by Flower's strategies and DP wrappers (:mod:`fedadapt.strategies.registry`) and the
researcher's own strategy (:mod:`fedadapt.strategies.custom`).
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from omegaconf import MISSING

#: Constructor parameters set from the rest of the config, and from where.
DERIVED = {
    "fraction_train": "partition.fraction_fit",
    "min_train_nodes": "partition.fraction_fit",
    "fraction_evaluate": "partition.fraction_evaluate",
    "min_evaluate_nodes": "partition.fraction_evaluate",
    "min_available_nodes": "partition.num_clients",
    "weighted_by_key": "method.weighting",
    "eta_l": "train.lr",
    "client_learning_rate": "train.lr",
    "seed": "seed",
    "num_clients": "partition.num_clients",
    "arrayrecord_key": "fedadapt's message layout ('arrays')",
    "configrecord_key": "fedadapt's message layout ('config')",
    "train_loss_key": "fedadapt's train metric ('train_loss')",
    "train_metrics_aggr_fn": "fedadapt's client metrics",
    "evaluate_metrics_aggr_fn": "fedadapt's client metrics",
    "selection_rule": "Bulyan's own default (Multi-Krum)",
    "strategy": "strategy=",
    "num_sampled_clients": "partition.fraction_fit",
    "accountant": "dp.accounting",
    "rank_of": "method.ranks (each client's LoRA rank)",
    "local_momentum": "train.momentum",
    "local_batch_size": "train.batch_size",
    "local_epochs": "train.local_epochs",
    "examples_of": "each client's training examples",
}
#: Defaults for the wrappers' parameters that Flower leaves without one.
DP_DEFAULTS = {"noise_multiplier": 1.0, "clipping_norm": 1.0}


def params_of(cls: type, skip: dict = DERIVED) -> list[tuple[str, Any, Any]]:
    """``(name, type, default)`` of ``cls``'s constructor parameters that are config keys."""
    hints = typing.get_type_hints(cls.__init__)
    out = []
    for p in list(inspect.signature(cls.__init__).parameters.values())[1:]:
        if p.name in skip or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        default = DP_DEFAULTS.get(p.name, MISSING) if p.default is p.empty else p.default
        out.append((p.name, hints.get(p.name, Any), default))
    return out


def schema_of(prefix: str, name: str, base: type, params: list, module: str = __name__
              ) -> type:
    """A dataclass ``<prefix><Name>Config(base)`` with ``name`` and ``params`` as fields, bound
    to ``module`` (which must hold it under that name for a config holding it to pickle)."""
    fields = [(p, t, dataclasses.field(default=d)) for p, t, d in params]
    fields.insert(0, ("name", str, dataclasses.field(default=name)))
    cls = dataclasses.make_dataclass(f"{prefix}{name.title().replace('_', '')}Config", fields,
                                     bases=(base,))
    cls.__module__ = module
    return cls


def accepted_params(cls: type) -> set[str]:
    """The keyword arguments ``cls(...)`` takes: its ``__init__``'s named parameters and, where
    it passes ``**kwargs`` on (``super().__init__(**kwargs)``), those of the next ``__init__``
    up its method order, and so on (a user's ``class Mine(FedAvg)`` with ``**kwargs`` takes
    FedAvg's ``fraction_train``, ``weighted_by_key``, ...)."""
    out: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]
        out |= {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out
