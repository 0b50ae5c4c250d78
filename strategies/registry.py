"""The ``strategy=`` and ``dp=`` options: Flower's strategies and differential-privacy wrappers
as config groups, built unchanged, and fedadapt's own strategies beside them.

``strategy=NAME`` picks a registered strategy (:func:`register_strategy`) and takes its
constructor parameters as keys (``strategy=fedadam strategy.eta=0.01``); ``dp=NAME`` wraps it in
one of Flower's DP wrappers with the wrapper's parameters as keys (``dp=server_fixed
dp.noise_multiplier=1.0 dp.clipping_norm=0.5``). Each key's type and default are read from the
class's own signature (:func:`strategy_schemas`), so a new Flower parameter shows up by itself
and a removed one fails at start-up. A few constructor parameters follow from the rest of the
config and are never keys of their own (:data:`~fedadapt.strategies.schema.DERIVED`).

Each option is registered with its :class:`~fedadapt.strategies.capabilities.Capabilities`,
which the checks (:mod:`fedadapt.strategies.checks`), the building
(:mod:`fedadapt.strategies.build`) and the rounds read; the schema of each option carries them
as its class attribute ``capabilities`` (``cfg.strategy.capabilities``).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

from flwr.serverapp import strategy as flwr_strategies

from fedadapt.config import DPConfig, StrategyConfig
from fedadapt.strategies import (
    fedbuff,
    feddyn,
    fedex_lora,
    fednova,
    fedsa_lora,
    flexlora,
    flora,
    hetlora,
    moon,
    scaffold,
)
from fedadapt.strategies.capabilities import FEDAVG_FAMILY, Capabilities, fedavg_aggregation
from fedadapt.strategies.custom import CUSTOM
from fedadapt.strategies.schema import params_of, schema_of

#: ``strategy=`` name -> its class.
STRATEGIES: dict[str, type] = {}
#: ``strategy=`` name -> its capabilities.
CAPABILITIES: dict[str, Capabilities] = {}


def register_strategy(name: str, cls: type, capabilities: Optional[Capabilities] = None) -> None:
    """Offer ``cls`` as ``strategy=name`` with ``capabilities`` (default: the class's own
    ``capabilities`` attribute)."""
    STRATEGIES[name] = cls
    CAPABILITIES[name] = capabilities or cls.capabilities


_FEDAVG = dataclasses.replace(FEDAVG_FAMILY, fedavg_sensitivity=True)
for _name, _cls, _caps in (
        ("fedavg", flwr_strategies.FedAvg, dataclasses.replace(_FEDAVG, weighted_sum=True)),
        ("fedprox", flwr_strategies.FedProx, _FEDAVG),
        ("fedavgm", flwr_strategies.FedAvgM, FEDAVG_FAMILY),
        ("fedadam", flwr_strategies.FedAdam, FEDAVG_FAMILY),
        ("fedyogi", flwr_strategies.FedYogi, FEDAVG_FAMILY),
        ("fedadagrad", flwr_strategies.FedAdagrad, FEDAVG_FAMILY),
        ("qfedavg", flwr_strategies.QFedAvg, Capabilities()),
        ("fedmedian", flwr_strategies.FedMedian, Capabilities()),
        ("fedtrimmedavg", flwr_strategies.FedTrimmedAvg, Capabilities()),
        # Krum's score sums the n - f - 2 nearest updates (Blanchard et al., 2017: n > 2f + 2);
        # Bulyan selects n - 2f with Multi-Krum, then trims 2f more (El Mhamdi et al., 2018:
        # n >= 4f + 3)
        ("krum", flwr_strategies.Krum, Capabilities(min_clients=(2, 3))),
        ("multikrum", flwr_strategies.MultiKrum, Capabilities(min_clients=(2, 3))),
        ("bulyan", flwr_strategies.Bulyan, Capabilities(min_clients=(4, 3))),
        # LoRA of different ranks across clients (fedadapt's, on Flower's FedAvg)
        ("hetlora", hetlora.HetLoRA, None),
        ("flexlora", flexlora.FlexLoRA, None),
        ("fedsa_lora", fedsa_lora.FedSALoRA, None),
        ("flora", flora.FLoRA, None),
        ("fedex_lora", fedex_lora.FedExLoRA, None),
        # asynchronous, on a simulated fleet's clock (fedadapt's)
        ("fedbuff", fedbuff.FedBuff, None),
        # normalised averaging of clients with different local steps (fedadapt's, on FedAvg)
        ("fednova", fednova.FedNova, None),
        # FedAvg's server; clients add MOON's model-contrastive term (fedadapt.pfl.moon)
        ("moon", moon.Moon, None),
        # drift correction with a client side (fedadapt's, on FedAvg: fedadapt.pfl.drift)
        ("scaffold", scaffold.Scaffold, None),
        ("feddyn", feddyn.FedDyn, None)):
    register_strategy(_name, _cls, _caps)

#: Flower strategies that are not offered, and why (the strategy reference says so).
NOT_OFFERED = {
    "fedxgbbagging": "FedXgbBagging aggregates XGBoost trees sent as JSON bytes; fedadapt's "
                     "clients train tensors",
    "fedxgbcyclic": "FedXgbCyclic passes one XGBoost model (JSON bytes) from client to client; "
                    "fedadapt's clients train tensors",
}
#: ``dp=`` name -> Flower wrapper.
DP_WRAPPERS: dict[str, type] = {
    "server_fixed": flwr_strategies.DifferentialPrivacyServerSideFixedClipping,
    "client_fixed": flwr_strategies.DifferentialPrivacyClientSideFixedClipping,
    "server_adaptive": flwr_strategies.DifferentialPrivacyServerSideAdaptiveClipping,
    "client_adaptive": flwr_strategies.DifferentialPrivacyClientSideAdaptiveClipping,
}
#: ``dp=`` options that wrap no strategy: each client trains by DP-SGD (per-sample clipping and
#: Gaussian noise on its trained tensors, by Opacus), so they compose with any strategy.
#: name -> its keys ``(type, default)``.
SAMPLE_DP: dict[str, dict[str, tuple]] = {"dpsgd": {
    #: the Gaussian noise's std over the clipping norm (ignored with target_epsilon)
    "noise_multiplier": (float, 1.0),
    #: each example's gradient (over the trained tensors) is clipped to this L2 norm
    "max_grad_norm": (float, 1.0),
    #: epsilon is reported at this delta; None = min(1e-5, n^-1.1) for a client of n examples
    "delta": (Optional[float], None),
    #: set each client's noise so that the run's rounds of its steps spend at most this epsilon
    "target_epsilon": (Optional[float], None),
    #: Opacus's accountant: rdp (Renyi DP) or prv (privacy loss random variable)
    "accountant": (str, "rdp"),
}}
#: The client mod each client-side option needs (applied per client inside the worker).
DP_MODS = {"client_fixed": "flwr.clientapp.mod:fixedclipping_mod",
           "client_adaptive": "flwr.clientapp.mod:adaptiveclipping_mod",
           "dpsgd": "fedadapt.strategies.privacy:DPSGDAccounting"}
#: fedadapt's own keys of the fixed-clipping wrappers: Flower's RDP accountant.
ACCOUNTING_KEYS = {
    "accounting": (bool, True),
    #: epsilon is reported at this delta; None = min(1e-5, N^-1.1)
    #: (:func:`fedadapt.strategies.privacy.default_delta`)
    "delta": (Optional[float], None),
    #: stop before a round whose release would exceed this epsilon (Flower's max_epsilon)
    "max_epsilon": (Optional[float], None),
}


def _make_schemas() -> tuple[dict[str, type], dict[str, type]]:
    strategies = {}
    for name, cls in STRATEGIES.items():
        schema = schema_of("Strategy", name, StrategyConfig, params_of(cls), __name__)
        schema.capabilities = CAPABILITIES[name]
        strategies[name] = schema
    dps: dict[str, type] = {"none": DPConfig}
    for name, cls in DP_WRAPPERS.items():
        params = params_of(cls)
        if "accountant" in inspect.signature(cls.__init__).parameters:
            params += [(k, t, d) for k, (t, d) in ACCOUNTING_KEYS.items()]
        dps[name] = schema_of("DP", name, DPConfig, params, __name__)
    for name, keys in SAMPLE_DP.items():
        dps[name] = schema_of("DP", name, DPConfig, [(k, t, d) for k, (t, d) in keys.items()],
                              __name__)
    return strategies, dps


#: The schemas, made once at import and bound to this module's names (``StrategyFedadamConfig``,
#: ...), so a config that holds them pickles (a spawned process finds them here).
_STRATEGY_SCHEMAS, _DP_SCHEMAS = _make_schemas()
globals().update({cls.__name__: cls for cls in [*_STRATEGY_SCHEMAS.values(),
                                                *_DP_SCHEMAS.values()] if cls is not DPConfig})


def strategy_schemas() -> dict[str, type]:
    """``{name: config dataclass}`` of every ``strategy=`` option."""
    return dict(_STRATEGY_SCHEMAS)


def dp_schemas() -> dict[str, type]:
    """``{name: config dataclass}`` of every ``dp=`` option (``none`` included)."""
    return dict(_DP_SCHEMAS)


def wraps_strategy(dp: DPConfig) -> bool:
    """Whether ``dp=`` is one of Flower's wrappers around the strategy (not ``none``, not
    DP-SGD on the clients)."""
    return dp.name in DP_WRAPPERS


def sample_level(dp: DPConfig) -> bool:
    """Whether ``dp=`` trains each client by DP-SGD (``dp=dpsgd``)."""
    return dp.name in SAMPLE_DP


def dp_mod(dp: DPConfig):
    """The client mod ``dp=`` needs (``module:function``, or ``{_target_: Class, ...}``), or
    None."""
    if sample_level(dp):
        return {"_target_": DP_MODS[dp.name], "accountant": dp.accountant}
    return DP_MODS.get(dp.name)


def is_custom(strategy: StrategyConfig) -> bool:
    """Whether ``strategy=`` is the researcher's own class (``strategy.target``)."""
    return strategy.name == CUSTOM


def keys_of(cfg) -> dict[str, Any]:
    """A strategy or DP config's constructor keys (``name`` and fedadapt's own left out)."""
    if is_custom(cfg):
        return dict(cfg.kwargs)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name != "name" and f.name not in ACCOUNTING_KEYS}


def strategy_class(strategy: StrategyConfig) -> type:
    """The class ``strategy=`` names (``custom``: ``strategy.target``)."""
    if is_custom(strategy):
        from fedadapt.strategies.custom import target_class

        return target_class(strategy.target)
    return STRATEGIES[strategy.name]


def capabilities_of(strategy: StrategyConfig) -> Capabilities:
    """The capabilities of the strategy ``strategy=`` names (a custom class's own, or what its
    class implies)."""
    if is_custom(strategy):
        return custom_capabilities(strategy_class(strategy))
    return CAPABILITIES[strategy.name]


def custom_capabilities(cls: type) -> Capabilities:
    """A researcher's class's capabilities: its own ``capabilities`` attribute, else those of
    the nearest class it extends that declares or registers them (FedAvg's family for a subclass
    of FedAvg, with FedAvg's sensitivity only while it keeps FedAvg's ``aggregate_train``;
    never SecAgg+'s weighted sum, which only Flower's FedAvg hands over); a strategy that
    combines whole updates otherwise."""
    registered = {klass: name for name, klass in STRATEGIES.items()}
    for klass in cls.__mro__:
        own = klass.__dict__.get("capabilities")
        if isinstance(own, Capabilities):
            return own
        if klass in registered:
            caps = CAPABILITIES[registered[klass]]
            return dataclasses.replace(caps, weighted_sum=False, fedavg_sensitivity=(
                caps.fedavg_sensitivity and fedavg_aggregation(cls)))
    return Capabilities()
