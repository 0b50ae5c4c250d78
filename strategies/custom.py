"""``strategy=custom``: the researcher's own Flower strategy, by import path.

``strategy=custom strategy.target=mystrat.HalfStepFedAvg strategy.step=0.5`` builds
``HalfStepFedAvg(step=0.5, ...)``: any subclass of Flower's ``Strategy``, written against
Flower's API alone. Its keys are its constructor's parameters, typed and checked against the
class's signature as the built-in strategies' are (a key it does not take, a value of the wrong
type, a parameter without default left out: one line naming ``strategy.<key>``); the parameters
that follow from the rest of the config (:data:`~fedadapt.strategies.schema.DERIVED`: clients per
round, weighting, metric names, ...) are passed when the class takes them, as for Flower's own.
A subclass of ``FedAvg`` composes with the per-tensor averaging and with ``dp=`` exactly as
FedAvg's family does; a class that combines whole updates is treated like Krum (refused where
clients send different tensors).

Its state is checkpointed with the built-in strategies' (:mod:`fedadapt.strategies.state`):
arrays, torch tensors, plain values, numpy and torch generators, objects with ``state_dict()``,
or the class's own ``state_dict()`` / ``load_state_dict()`` when it defines them; the run saves
and loads it once before round 1
(:func:`fedadapt.methods.rounds.strategy.check_strategy_with_clients`). A key the class passes on
through ``**kwargs`` to a constructor that refuses it is named when the class is built
(:func:`fedadapt.strategies.build.build_strategy`).
"""

from __future__ import annotations

import inspect
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedadapt.config import ConfigError, StrategyCustomConfig

#: ``strategy=`` name of the researcher's own strategy.
CUSTOM = "custom"


def target_class(target: str) -> type:
    """The class ``strategy.target`` names, checked to be a Flower strategy."""
    from flwr.serverapp.strategy import Strategy

    from fedadapt.userimport import load

    cls = load(target, "strategy.target")
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise ConfigError(f"strategy.target={target!r} is invalid: it is not a subclass of "
                          f"flwr.serverapp.strategy.Strategy ({type(cls).__name__})")
    return cls


def is_fedavg_family(cls: type) -> bool:
    """Whether ``cls`` aggregates through FedAvg (per-tensor averaging and DP compose)."""
    from flwr.serverapp.strategy import FedAvg

    return issubclass(cls, FedAvg)


def _check_keys(cls: type, target: str, given: dict) -> dict:
    """``given`` typed by ``cls``'s signature; :class:`ConfigError` naming the key otherwise."""
    from fedadapt.strategies.schema import DERIVED, params_of, schema_of

    params = params_of(cls)
    names = [p for p, _, _ in params]
    takes_any = any(p.kind is p.VAR_KEYWORD
                    for p in inspect.signature(cls.__init__).parameters.values())
    for key in given:
        if key in DERIVED:
            raise ConfigError(f"strategy.{key} is set by fedadapt from {DERIVED[key]}; leave "
                              f"it out")
        if key not in names and not takes_any:
            raise ConfigError(f"strategy.{key} is not a parameter of {target} (its "
                              f"parameters: {', '.join(names) or 'none'})")
    missing = [p for p, _, d in params if d is MISSING and p not in given]
    if missing:
        raise ConfigError(f"strategy.{missing[0]} is required by {target} (a constructor "
                          f"parameter without a default): set strategy.{missing[0]}=VALUE")
    known = {k: v for k, v in given.items() if k in names}
    params = [p for p in params if p[0] in known]  # only what is given is typed and passed
    try:
        try:
            schema = OmegaConf.structured(schema_of("Strategy", CUSTOM, StrategyCustomConfig,
                                                  params))
        except (OmegaConfBaseException, ValueError, TypeError):  # a type OmegaConf cannot hold
            schema = OmegaConf.structured(schema_of("Strategy", CUSTOM, StrategyCustomConfig,
                                                  [(p, Any, d) for p, _, d in params]))
        typed = OmegaConf.merge(schema, {"target": target, **known})
        values = OmegaConf.to_container(typed, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", "") or "?"
        raise ConfigError(f"strategy.{key} is invalid for {target}: "
                          f"{str(err).splitlines()[0]}") from err
    return {k: (values[k] if k in known else v) for k, v in given.items()}


def custom_config(node: DictConfig) -> StrategyCustomConfig:
    """The typed ``strategy=custom`` config of a composed (or reloaded) ``strategy`` node: its
    target loaded and its constructor keys checked."""
    data = OmegaConf.to_container(node, resolve=True)
    target = data.get("target")
    if not target or target == "???":
        raise ConfigError("strategy=custom needs strategy.target=pkg.module.Class (your Flower "
                          "strategy), e.g. strategy.target=mystrat.HalfStepFedAvg")
    given = {k: v for k, v in data.items() if k not in ("name", "target")}
    out = StrategyCustomConfig(name=CUSTOM, target=str(target))
    out.__dict__["_kwargs"] = _check_keys(target_class(str(target)), str(target), given)
    return out
