"""Flower's strategies and differential-privacy wrappers as config groups, built unchanged.

``strategy=NAME`` picks a strategy of ``flwr.serverapp.strategy`` by its Flower name and takes
its constructor parameters as keys (``strategy=fedadam strategy.eta=0.01``); ``dp=NAME`` wraps
it in one of Flower's DP wrappers with the wrapper's parameters as keys (``dp=server_fixed
dp.noise_multiplier=1.0 dp.clipping_norm=0.5``). Each key's type and default are read from the
Flower class's own signature (:func:`strategy_schemas`), so a new Flower parameter shows up by
itself and a removed one fails at start-up.

A few constructor parameters follow from the rest of the config and are never keys of their
own (:data:`DERIVED`): how many clients a round samples (``partition.fraction_fit`` /
``fraction_evaluate``), how replies are weighted (``method.weighting``), the client learning rate
(``train.lr``), the record and metric names of fedadapt's messages, and the DP wrappers' number
of sampled clients.

What fedadapt composes in, without changing the classes (:func:`build_strategy`):

* strategies of FedAvg's family average each tensor over the clients that sent it
  (:func:`fedadapt.strategies.fedavg.per_tensor`), which multi-tier clients need;
* strategies that combine whole replies (Krum, MultiKrum, Bulyan, FedMedian, FedTrimmedAvg,
  QFedAvg) and the DP wrappers (which clip whole updates) need every client to send every
  tensor: they are refused where clients send different tensors (:func:`check_every_tensor`);
* fixed-clipping DP gets Flower's RDP accountant (``dp.accounting=true``, the default):
  epsilon at ``dp.delta`` after every round (default :func:`default_delta`: min(1e-5, N^-1.1),
  well below 1/N).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any, Callable, Optional

from flwr.serverapp import strategy as flwr_strategies

from fedadapt.codec import UNIFORM_KEY
from fedadapt.config import ConfigError, DPConfig, StrategyConfig, check
from fedadapt.strategies import fedbuff, fedex_lora, fednova, fedsa_lora, flexlora, flora, hetlora
from fedadapt.strategies.custom import CUSTOM
from fedadapt.strategies.schema import (  # noqa: F401
    DERIVED,
    DP_DEFAULTS,
    accepted_params,
    params_of,
    schema_of,
)

#: ``strategy=`` name -> Flower class.
STRATEGIES: dict[str, type] = {
    "fedavg": flwr_strategies.FedAvg,
    "fedprox": flwr_strategies.FedProx,
    "fedavgm": flwr_strategies.FedAvgM,
    "fedadam": flwr_strategies.FedAdam,
    "fedyogi": flwr_strategies.FedYogi,
    "fedadagrad": flwr_strategies.FedAdagrad,
    "qfedavg": flwr_strategies.QFedAvg,
    "fedmedian": flwr_strategies.FedMedian,
    "fedtrimmedavg": flwr_strategies.FedTrimmedAvg,
    "krum": flwr_strategies.Krum,
    "multikrum": flwr_strategies.MultiKrum,
    "bulyan": flwr_strategies.Bulyan,
    # LoRA of different ranks across clients (fedadapt's, on Flower's FedAvg)
    "hetlora": hetlora.HetLoRA,
    "flexlora": flexlora.FlexLoRA,
    "fedsa_lora": fedsa_lora.FedSALoRA,
    "flora": flora.FLoRA,
    "fedex_lora": fedex_lora.FedExLoRA,
    # asynchronous, on a simulated fleet's clock (fedadapt's)
    "fedbuff": fedbuff.FedBuff,
    # normalised averaging of clients with different local steps (fedadapt's, on FedAvg)
    "fednova": fednova.FedNova,
}
#: Strategies of fedadapt that average each tensor over its senders in their own way.
NORMALISED = ("fednova",)
#: Strategies that aggregate asynchronously on a fleet's clock (each tensor over its senders).
ASYNC = ("fedbuff",)
#: The strategies that aggregate LoRA of different ranks (each layer over the clients that
#: sent it; they send each client its own rank's slices): they need a LoRA method.
LORA_RANK = ("hetlora", "flexlora", "fedsa_lora", "flora", "fedex_lora")
#: Of those, the ones that fold an update into the clients' frozen weights (``X.base_delta``).
LORA_FOLD = ("flora", "fedex_lora")
#: The ones whose global model holds ``X.base_delta`` (FlexLoRA's for the server's model only:
#: its whole averaged product beyond the global rank's factors).
GLOBAL_FOLD = (*LORA_FOLD, "flexlora")
#: Of those, the ones client-side DP composes with (:func:`lora_dp_refusal`): their new global
#: model is a public function of what was sent plus the plain mean of the clients' updates.
LORA_DP = ("fedsa_lora", "hetlora")
#: Flower strategies that are not offered, and why (the strategy reference says so).
NOT_OFFERED = {
    "fedxgbbagging": "FedXgbBagging aggregates XGBoost trees sent as JSON bytes; fedadapt's "
                     "clients train tensors",
    "fedxgbcyclic": "FedXgbCyclic passes one XGBoost model (JSON bytes) from client to client; "
                    "fedadapt's clients train tensors",
}
#: FedAvg's family: their aggregation is FedAvg's (through ``super().aggregate_train``), which
#: fedadapt replaces by the per-tensor mean.
PER_TENSOR = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")
#: ``dp=`` name -> Flower wrapper.
DP_WRAPPERS: dict[str, type] = {
    "server_fixed": flwr_strategies.DifferentialPrivacyServerSideFixedClipping,
    "client_fixed": flwr_strategies.DifferentialPrivacyClientSideFixedClipping,
    "server_adaptive": flwr_strategies.DifferentialPrivacyServerSideAdaptiveClipping,
    "client_adaptive": flwr_strategies.DifferentialPrivacyClientSideAdaptiveClipping,
}
#: The client mod each client-side wrapper needs (applied per client inside the worker).
DP_MODS = {"client_fixed": "flwr.clientapp.mod:fixedclipping_mod",
           "client_adaptive": "flwr.clientapp.mod:adaptiveclipping_mod"}
#: fedadapt's own keys of the fixed-clipping wrappers: Flower's RDP accountant.
ACCOUNTING_KEYS = {
    "accounting": (bool, True),
    #: epsilon is reported at this delta; None = min(1e-5, N^-1.1) (:func:`default_delta`)
    "delta": (Optional[float], None),
    #: stop before a round whose release would exceed this epsilon (Flower's max_epsilon)
    "max_epsilon": (Optional[float], None),
}
#: Strategies that need at least this many clients per round for ``num_malicious_nodes`` = f:
#: Krum's score sums the n - f - 2 nearest updates (Blanchard et al., 2017: n > 2f + 2);
#: Bulyan selects n - 2f with Multi-Krum, then trims 2f more (El Mhamdi et al., 2018:
#: n >= 4f + 3).
ROBUST_MINIMUM = {"krum": (2, 3), "multikrum": (2, 3), "bulyan": (4, 3)}


def _make_schemas() -> tuple[dict[str, type], dict[str, type]]:
    strategies = {name: schema_of("Strategy", name, StrategyConfig, params_of(cls), __name__)
                  for name, cls in STRATEGIES.items()}
    dps: dict[str, type] = {"none": DPConfig}
    for name, cls in DP_WRAPPERS.items():
        params = params_of(cls)
        if "accountant" in inspect.signature(cls.__init__).parameters:
            params += [(k, t, d) for k, (t, d) in ACCOUNTING_KEYS.items()]
        dps[name] = schema_of("DP", name, DPConfig, params, __name__)
    return strategies, dps


#: The schemas, made once at import and bound to this module's names (``StrategyFedadamConfig``,
#: ...), so a config that holds them pickles (a spawned process finds them here).
_STRATEGY_SCHEMAS, _DP_SCHEMAS = _make_schemas()
globals().update({cls.__name__: cls for cls in [*_STRATEGY_SCHEMAS.values(),
                                                *_DP_SCHEMAS.values()] if cls is not DPConfig})


def strategy_schemas() -> dict[str, type]:
    """``{name: config dataclass}`` of every ``strategy=`` option, read from Flower."""
    return dict(_STRATEGY_SCHEMAS)


def dp_schemas() -> dict[str, type]:
    """``{name: config dataclass}`` of every ``dp=`` option (``none`` included)."""
    return dict(_DP_SCHEMAS)


def keys_of(cfg) -> dict[str, Any]:
    """A strategy or DP config's constructor keys (``name`` and fedadapt's own left out)."""
    if getattr(cfg, "name", None) == CUSTOM and hasattr(cfg, "target"):
        return dict(cfg.kwargs)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
            if f.name != "name" and f.name not in ACCOUNTING_KEYS}


# -- checks ----------------------------------------------------------------------------------

def check_strategy(strategy: StrategyConfig, dp: DPConfig, *, weighting: str,
                   setting: str) -> None:
    """What can be checked of ``strategy=`` and ``dp=`` from the config alone (before any data
    is loaded); :class:`ConfigError` naming the key otherwise."""
    name = strategy.name
    if name != CUSTOM:
        check(name in STRATEGIES, "strategy", name, f"one of {sorted(STRATEGIES)} or custom")
    check(dp.name in dp_schemas(), "dp", dp.name, f"one of {sorted(dp_schemas())}")
    if setting in ("multitier", "personalization"):
        check_every_tensor(strategy, dp, f"setting={setting}: each tier's clients send their "
                                         f"tier's tensors only")
    if dp.name != "none":
        _check_dp(strategy, dp, weighting)


def _check_dp(strategy: StrategyConfig, dp: DPConfig, weighting: str) -> None:
    """``dp=`` against the strategy it wraps: the strategies its noise is not calibrated to,
    accounting's FedAvg aggregation, and uniform weights."""
    name = strategy.name
    if name in NORMALISED:
        raise ConfigError(f"dp={dp.name} is invalid with strategy={name}: its noise is "
                          f"calibrated to FedAvg's mean of the clipped updates, and FedNova "
                          f"rescales each update by its client's steps")
    if name in LORA_RANK:
        refusal = lora_dp_refusal(strategy, dp)
        if refusal:
            raise ConfigError(refusal)
    if getattr(dp, "accounting", False):
        _check_accounting(strategy, dp)
    check(weighting == "uniform", "method.weighting", weighting,
          f"dp={dp.name} averages the clipped updates with equal weights (the noise is "
          f"calibrated to clipping_norm / clients per round): set method.weighting=uniform")


def _check_accounting(strategy: StrategyConfig, dp: DPConfig) -> None:
    """``dp.accounting=true``: a noise multiplier, and FedAvg's own aggregation (Flower's
    accountant accepts only FedAvg.aggregate_train) or one with the same sensitivity."""
    name = strategy.name
    check(dp.noise_multiplier > 0, "dp.noise_multiplier", dp.noise_multiplier,
          "privacy accounting (dp.accounting=true) needs a noise multiplier > 0; "
          "dp.accounting=false runs the mechanism without a privacy guarantee")
    own = ""
    if name == CUSTOM:
        cls = strategy_class(strategy)
        own = (f" ({cls.__name__} does not subclass FedAvg)" if not per_tensor_family(strategy)
               else f" ({cls.__name__} overrides aggregate_train)"
               if not _fedavg_aggregation(cls) else "")
    check(name in ("fedavg", "fedprox", *LORA_DP) or (name == CUSTOM and not own),
          *(("strategy", name) if name != CUSTOM else ("strategy.target", strategy.target)),
          f"dp={dp.name} with accounting needs FedAvg's own aggregation (Flower's accountant "
          f"accepts only FedAvg.aggregate_train){own} or one with the same sensitivity: "
          f"strategy=fedavg, fedprox, {' or '.join(LORA_DP)}, or dp.accounting=false")


def lora_dp_refusal(strategy: StrategyConfig, dp: DPConfig) -> Optional[str]:
    """Why ``dp=`` cannot wrap a LoRA-rank strategy (one line), or None where the maths allows.

    Flower's client-side wrappers add Gaussian noise of std ``noise_multiplier *
    clipping_norm / n`` to the aggregate of ``n`` clients whose updates (reply minus what the
    client was sent, at its own rank) were clipped to ``clipping_norm`` by the client's mod.
    That is the Gaussian mechanism only where one client moves the aggregate by at most
    ``clipping_norm / n``: the aggregate is a public function of what was sent plus the plain
    mean of the updates. FedSA-LoRA's zero-padded mean of A, and HetLoRA's zero-padded mean
    without its sparsity weights, are (a pad of a truncation of the global factors is public;
    the ranks are the config's). FlexLoRA (an SVD of the mean of ``B_k A_k``), FLoRA and
    FedEx-LoRA (the mean of ``B_k A_k`` folded into the frozen weights) are quadratic in a
    client's update, so its clipped norm does not bound what it moves. The server-side wrappers
    clip each reply against the global record at the largest rank, which a client of a
    smaller rank does not send."""
    name = strategy.name
    if dp.name.startswith("server_"):
        return (f"dp={dp.name} is invalid with strategy={name}: the server clips each reply "
                f"against the global record at the largest LoRA rank, and clients of smaller "
                f"ranks send smaller tensors; use dp=client_fixed or client_adaptive (each "
                f"client clips its own rank's update) with strategy={' or '.join(LORA_DP)}")
    if name == "flexlora":
        return (f"dp={dp.name} is invalid with strategy=flexlora: its aggregate is the SVD of "
                f"the mean of the products B_k A_k, quadratic in a client's update, so "
                f"clipping the update does not bound what one client moves (the noise's "
                f"calibration); strategy={' or '.join(LORA_DP)} compose with it")
    if name in LORA_FOLD:
        return (f"dp={dp.name} is invalid with strategy={name}: it folds the mean of the "
                f"products B_k A_k into the frozen weights, quadratic in a client's update, so "
                f"clipping the update does not bound what one client moves (the noise's "
                f"calibration); strategy={' or '.join(LORA_DP)} compose with it")
    if name == "hetlora" and getattr(strategy, "sparsity_weighted", True):
        return (f"strategy.sparsity_weighted=true is invalid with dp={dp.name}: HetLoRA's "
                f"weights ||B_k A_k|| depend on the clients' updates, so one client moves the "
                f"aggregate by more than clipping_norm / clients (the noise's calibration); "
                f"set strategy.sparsity_weighted=false (the plain zero-padded mean)")
    if name == "hetlora" and getattr(strategy, "prune_gamma", 0.0) > 0:
        return (f"strategy.prune_gamma={strategy.prune_gamma} is invalid with dp={dp.name}: a "
                f"client that prunes replies at a smaller rank than it was sent, and the "
                f"clipping mod measures the update against what was sent; set "
                f"strategy.prune_gamma=0")
    return None


def check_counts(strategy: StrategyConfig, dp: DPConfig, *, num_clients: int,
                 sampled: int) -> None:
    """What depends on the number of clients (known once the data is partitioned)."""
    name = strategy.name
    if name in ROBUST_MINIMUM:
        per, plus = ROBUST_MINIMUM[name]
        f, need = strategy.num_malicious_nodes, per * strategy.num_malicious_nodes + plus
        check(sampled >= need, "strategy.num_malicious_nodes", f,
              f"strategy={name} needs at least {per}f+{plus} = {need} clients per round to "
              f"tolerate f={f} malicious ones; partition.fraction_fit samples {sampled} of "
              f"{num_clients}")
    if name == "multikrum":
        check(1 <= strategy.num_nodes_to_select <= sampled, "strategy.num_nodes_to_select",
              strategy.num_nodes_to_select, f"in 1..{sampled} (the clients a round samples)")
    if getattr(dp, "accounting", False):
        check(dp.delta is None or 0 < dp.delta < 1, "dp.delta", dp.delta, "in (0, 1)")


def strategy_class(strategy: StrategyConfig) -> type:
    """The Flower class ``strategy=`` names (``custom``: ``strategy.target``)."""
    if strategy.name == CUSTOM:
        from fedadapt.strategies.custom import target_class

        return target_class(strategy.target)
    return STRATEGIES[strategy.name]


def per_tensor_family(strategy: StrategyConfig) -> bool:
    """Whether the strategy aggregates through FedAvg, so each tensor is averaged over the
    clients that sent it (FedAvg's family, and a custom subclass of FedAvg)."""
    if strategy.name == CUSTOM:
        from fedadapt.strategies.custom import is_fedavg_family

        return is_fedavg_family(strategy_class(strategy))
    return strategy.name in PER_TENSOR


def _fedavg_aggregation(cls: type) -> bool:
    """Whether ``cls`` aggregates with FedAvg's own ``aggregate_train`` (what Flower's
    fixed-clipping accountant requires)."""
    return cls.aggregate_train is flwr_strategies.FedAvg.aggregate_train


def check_every_tensor(strategy: StrategyConfig, dp: DPConfig, why: str) -> None:
    """Refuse a strategy or DP wrapper that needs every client to send every tensor."""
    if not per_tensor_family(strategy) and strategy.name not in (*LORA_RANK, *ASYNC,
                                                                  *NORMALISED):
        raise ConfigError(f"strategy={strategy.name} is invalid here: it combines whole "
                          f"updates, and {why} (strategies that average each tensor over its "
                          f"senders: {', '.join(PER_TENSOR)})")
    if dp.name != "none":
        raise ConfigError(f"dp={dp.name} is invalid here: it clips each client's whole update, "
                          f"and {why}")


# -- building --------------------------------------------------------------------------------

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
    if per_tensor_family(strategy) and dp.name == "none":
        cls = per_tensor(cls)
    quiet = logging.getLogger("flwr")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # FedAvg warns that fraction_evaluate=0 skips evaluation
    try:
        built = cls(**kwargs)
        if dp.name == "none":
            return built
        wrapper = DP_WRAPPERS[dp.name]
        accountant = _accountant(dp, num_clients) if getattr(dp, "accounting", False) else None
        if strategy.name in LORA_DP:
            # Flower's wrapper takes an accountant only on FedAvg.aggregate_train; these
            # aggregate a public part plus the plain mean of the clipped updates, the same
            # sensitivity (lora_dp_refusal), so the same Gaussian releases are accounted
            wrapped = wrapper(built, num_sampled_clients=train_n, **keys_of(dp))
            wrapped.accountant = accountant
            return wrapped
        extra = {"accountant": accountant} if accountant is not None else {}
        return wrapper(built, num_sampled_clients=train_n, **keys_of(dp), **extra)
    except ValueError as err:  # Flower's own check of a value
        which = f"dp={dp.name}" if dp.name != "none" else f"strategy={strategy.name}"
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
    return strategy.target if strategy.name == CUSTOM else f"strategy={strategy.name}"


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


def default_delta(num_clients: int) -> float:
    """``dp.delta`` when none is given: min(1e-5, N^-1.1) for N clients.

    (epsilon, delta)-DP allows the mechanism to fail outright with probability delta; at
    delta >= 1/N a mechanism that publishes one client's data in the clear meets it. delta must
    be well below 1/N: McMahan et al. (ICLR 2018, user-level DP for federated learning) take
    N^-1.1, and 1e-5 is the customary ceiling (Abadi et al., CCS 2016)."""
    return min(1e-5, float(num_clients) ** -1.1)


def _accountant(dp: DPConfig, num_clients: int):
    """Flower's RDP accountant for a fixed-clipping wrapper (no sampling amplification: the
    only model Flower's fixed-clipping accounting supports)."""
    try:
        from flwr.supercore.privacy_accounting import (
            NeighboringRelation,
            PrivacyConfig,
            SamplingMethod,
        )
        from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

        return RdpAccountant(PrivacyConfig(
            target_delta=dp.delta if dp.delta is not None else default_delta(num_clients),
            population_size=num_clients,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION, max_epsilon=dp.max_epsilon))
    except ImportError as err:
        raise ConfigError(f"dp.accounting=true needs Flower's accounting backend: pip install "
                          f"'flwr[dp]' ({err})") from err


def noise_for_epsilon(epsilon: float, *, rounds: int, num_clients: int, sampled: int,
                      delta: Optional[float] = None) -> float:
    """The smallest noise multiplier (to 3 significant digits) whose ``rounds`` releases of
    fixed-clipping DP spend at most ``epsilon`` at ``delta`` (default :func:`default_delta`) by
    Flower's RDP accountant, as a run with ``dp=server_fixed`` accounts them."""
    from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

    cfg = DPConfig(name="server_fixed")
    cfg.delta, cfg.max_epsilon = delta, None

    def spent(z: float) -> float:
        accountant = _accountant(cfg, num_clients)
        accountant.compose(GaussianPrivacyEvent(z, sampled, num_clients), rounds)
        return accountant.get_privacy_spent().epsilon

    lo, hi = 1e-3, 1e4
    while hi / lo > 1.0005:  # bisection in log space: epsilon falls as the noise grows
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if spent(mid) > epsilon else (lo, mid)
    return float(f"{hi:.3g}") if spent(float(f"{hi:.3g}")) <= epsilon else float(f"{hi:.4g}")


def privacy_spent(strategy) -> Optional[dict]:
    """Epsilon and delta spent so far, from the accountant of a DP wrapper; None without one."""
    spent = strategy.privacy_spent() if hasattr(strategy, "privacy_spent") else None
    if spent is None:
        return None
    return {"epsilon": spent.epsilon, "delta": spent.delta, "releases": spent.num_releases,
            "accounting": spent.accounting_method}


def describe(strategy) -> str:
    """``FedAdam`` / ``DifferentialPrivacyServerSideFixedClipping(FedAvg)``: what runs."""
    inner = getattr(strategy, "strategy", None)
    name = type(strategy).__name__.removeprefix("PerTensor")
    return f"{name}({describe(inner)})" if inner is not None else name


# -- the docs' strategy table -----------------------------------------------------------------

def markdown_table() -> str:
    """docs/strategies.md's tables, generated from the schemas (``python -m
    fedadapt.strategies.zoo > docs/strategies.md``; a test checks the file is current)."""
    def keys(schema) -> str:
        fields = [f for f in dataclasses.fields(schema) if f.name != "name"]
        return ", ".join(f"`{f.name}={f.default}`" for f in fields) or "—"

    lines = ["# Strategies and differential privacy", "",
             "Generated by `python -m fedadapt.strategies.zoo > docs/strategies.md` from "
             "Flower's own constructors (flwr " + _flwr_version() + "); "
             "`tests/test_strategy_zoo.py` checks that it is current.", "",
             "`strategy=NAME` picks one of Flower's strategies, unchanged; its keys are the "
             "constructor's parameters (`strategy=fedadam strategy.eta=0.01`).", "",
             "Set from the rest of the config, never typed twice:", "",
             *[f"- `{k}` from {v}" for k, v in DERIVED.items()
               if k not in ("strategy", "accountant")], "",
             "| strategy= | Flower class | keys (defaults) | settings |",
             "|---|---|---|---|"]
    for name, schema in strategy_schemas().items():
        cls = STRATEGIES[name]
        where = ("all (per-tensor mean under its own update)" if name in PER_TENSOR else
                 "a fleet (fleet=tiers|lognormal|trace|fedscale): asynchronous on its clock, each "
                 "tensor over its senders; no dp=, no federation.round_timeout; see fleet.md"
                 if name in ASYNC else
                 "method=lora (plain LoRA for flora and fedex_lora), with or without "
                 "method.ranks; each layer over the clients that sent it (multitier too); "
                 "dp=client_fixed|client_adaptive with fedsa_lora, and with hetlora without "
                 "its sparsity weights and pruning; see peft.md" if name in LORA_RANK else
                 "all (each tensor over its senders), train.optimizer=sgd; clients of "
                 "different local steps (their data, or fleet.partial_work); no dp=; see "
                 "fleet.md" if name in NORMALISED else
                 "where every client sends every tensor; refused in multitier and "
                 "personalization, and for a method whose clients train part of what it sends")
        lines.append(f"| `{name}` | `{cls.__name__}` | {keys(schema)} | {where} |")
    lines.append("| `custom` | yours: `strategy.target=pkg.module.Class` (any subclass of "
                 "Flower's `Strategy`) | its constructor's parameters, checked against its "
                 "signature | a subclass of FedAvg as FedAvg's family (per-tensor, `dp=`); "
                 "another as the strategies that combine whole updates |")
    lines += ["", "Not offered: " + "; ".join(f"`{name}` ({why})"
                                              for name, why in NOT_OFFERED.items()) + "."]
    lines += ["", "`dp=NAME` wraps the strategy in one of Flower's differential-privacy "
              "wrappers; needs `method.weighting=uniform` and clients that send every tensor. "
              "Fixed clipping reports epsilon at `dp.delta` (default min(1e-5, N^-1.1), well "
              "below 1/N) after every round "
              "with Flower's RDP accountant (no sampling amplification, FedAvg's aggregation: "
              "`strategy=fedavg` or `fedprox`; or the same sensitivity with client-side "
              "clipping: `fedsa_lora`, `hetlora` with `strategy.sparsity_weighted=false`).", "",
              "| dp= | Flower wrapper | keys (defaults) | client mod |", "|---|---|---|---|",
              "| `none` | — | — | — |"]
    for name, schema in dp_schemas().items():
        if name == "none":
            continue
        mod = f"`{DP_MODS[name].split(':')[1]}`, per client" if name in DP_MODS else "—"
        lines.append(f"| `{name}` | `{DP_WRAPPERS[name].__name__}` | {keys(schema)} | {mod} |")
    return "\n".join(lines) + "\n"


def _flwr_version() -> str:
    from importlib.metadata import version

    return version("flwr")


if __name__ == "__main__":
    print(markdown_table(), end="")
