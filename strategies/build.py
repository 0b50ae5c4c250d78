"""The Flower strategy a run's ``strategy=`` and ``dp=`` name, built unchanged.

What fedadapt composes in, without changing the classes (:func:`build_strategy`), by the
strategy's capabilities (:mod:`fedadapt.strategies.capabilities`):

* strategies of FedAvg's family average each tensor over the clients that sent it
  (:func:`fedadapt.strategies.fedavg.per_tensor`), which multi-tier clients need;
* a DP wrapper gets Flower's RDP accountant (``dp.accounting=true``, the default), also around a
  strategy that aggregates its own way at FedAvg's sensitivity (HetLoRA, FedSA-LoRA), which
  Flower's wrapper would refuse to account.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional

from fedadapt.codec import UNIFORM_KEY
from fedadapt.config import ConfigError, DPConfig, StrategyConfig
from fedadapt.strategies.capabilities import fedavg_aggregation
from fedadapt.strategies.privacy import accountant_for
from fedadapt.strategies.registry import (
    DP_WRAPPERS,
    capabilities_of,
    is_custom,
    keys_of,
    strategy_class,
    wraps_strategy,
)
from fedadapt.strategies.schema import DERIVED, accepted_params


def sample_size(num_clients: int, fraction: float) -> int:
    """Clients a round samples at ``fraction`` (Flower: ``max(int(N * fraction), min)``)."""
    return min(num_clients, max(1, int(num_clients * fraction))) if fraction > 0 else 0


def build_strategy(strategy: StrategyConfig, dp: DPConfig, *, num_clients: int,
                   fraction_train: float, fraction_evaluate: float, weighting: str, lr: float,
                   federated: bool = True, mods: Optional[list] = None,
                   rank_of: Optional[Callable[[int], int]] = None, seed: int = 0,
                   sample_available: bool = False, train=None,
                   examples_of: Optional[Callable[[int], int]] = None):
    """The Flower strategy of ``strategy=`` (per-tensor for FedAvg's family), wrapped by
    ``dp=``; :class:`~fedadapt.strategies.fedavg.LocalOnly` for a method that is not
    federated. Flower's own ``ValueError`` on a bad value becomes a :class:`ConfigError`."""
    from fedadapt.strategies.fedavg import LocalOnly, aggregate_client_metrics, per_tensor

    train_n = sample_size(num_clients, fraction_train)
    # a simulated fleet (sample_available): the strategy samples fraction_train of the clients
    # available at the round's start, at least one, however few they are
    common = dict(fraction_train=fraction_train, fraction_evaluate=fraction_evaluate,
                  min_train_nodes=1 if sample_available else train_n,
                  min_evaluate_nodes=int(num_clients * fraction_evaluate),
                  min_available_nodes=1 if sample_available else num_clients,
                  weighted_by_key=UNIFORM_KEY if weighting == "uniform" else "num-examples",
                  train_metrics_aggr_fn=aggregate_client_metrics,
                  evaluate_metrics_aggr_fn=aggregate_client_metrics)
    if not federated:
        return LocalOnly(**common)
    cls = strategy_class(strategy)
    wanted = accepted_params(cls)
    derived = {"eta_l": lr, "client_learning_rate": lr, "rank_of": rank_of, "seed": seed,
               "num_clients": num_clients, "examples_of": examples_of,
               **({"local_momentum": train.momentum, "local_batch_size": train.batch_size,
                   "local_epochs": train.local_epochs} if train is not None else {})}
    kwargs = {**{k: v for k, v in common.items() if k in wanted},
              **{k: v for k, v in derived.items() if k in wanted}, **keys_of(strategy)}
    caps = capabilities_of(strategy)
    if caps.per_tensor and not wraps_strategy(dp):
        cls = per_tensor(cls)
    quiet = logging.getLogger("flwr")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # FedAvg warns that fraction_evaluate=0 skips evaluation
    try:
        built = cls(**kwargs)
        if not wraps_strategy(dp):  # none, or DP-SGD on the clients
            return built
        wrapper = DP_WRAPPERS[dp.name]
        accountant = (accountant_for(dp, num_clients) if getattr(dp, "accounting", False)
                      else None)
        if caps.fedavg_sensitivity and not fedavg_aggregation(cls):
            # Flower's wrapper takes an accountant only on FedAvg.aggregate_train; these
            # aggregate a public part plus the plain mean of the clipped updates, the same
            # sensitivity (fedadapt.strategies.checks), so the same Gaussian releases are accounted
            wrapped = wrapper(built, num_sampled_clients=train_n, **keys_of(dp))
            wrapped.accountant = accountant
            return wrapped
        extra = {"accountant": accountant} if accountant is not None else {}
        return wrapper(built, num_sampled_clients=train_n, **keys_of(dp), **extra)
    except ValueError as err:  # Flower's own check of a value
        which = f"dp={dp.name}" if wraps_strategy(dp) else f"strategy={strategy.name}"
        raise ConfigError(f"{which} is invalid: {err}") from err
    except TypeError as err:  # a key the class passes on (**kwargs) to one that refuses it
        refused = _refused_key(err, keys_of(strategy))
        if refused is None:
            raise
        raise ConfigError(f"strategy.{refused} is not a parameter of {_target(strategy)}: "
                          f"{str(err).splitlines()[0]} (its parameters: "
                          f"{', '.join(_parameters(strategy_class(strategy))) or 'none'})"
                          ) from err
    finally:
        quiet.setLevel(level)


def _refused_key(err: TypeError, given: dict) -> Optional[str]:
    """The key of ``given`` a constructor's ``TypeError`` says it does not take (``got an
    unexpected keyword argument 'stepp'``), or None."""
    import re

    found = re.search(r"unexpected keyword argument '([^']+)'", str(err))
    return found.group(1) if found and found.group(1) in given else None


def _target(strategy: StrategyConfig) -> str:
    return strategy.target if is_custom(strategy) else f"strategy={strategy.name}"


def _parameters(cls: type) -> list[str]:
    """The keyword parameters of ``cls`` and, where it passes ``**kwargs`` on, of its bases
    (as far as they go), fedadapt's derived ones left out."""
    out: list[str] = []
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        out += [p.name for p in params if p.name != "self" and p.kind not in
                (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in DERIVED
                and p.name not in out]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out


def describe(strategy) -> str:
    """``FedAdam`` / ``DifferentialPrivacyServerSideFixedClipping(FedAvg)``: what runs."""
    inner = getattr(strategy, "strategy", None)
    name = type(strategy).__name__.removeprefix("PerTensor")
    return f"{name}({describe(inner)})" if inner is not None else name
