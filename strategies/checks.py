"""The refusals of ``strategy=`` and ``dp=``, from their capabilities
(:mod:`fedadapt.strategies.capabilities`), never their names.

:func:`check_strategy` holds what the config alone decides (registered with
:func:`fedadapt.config.validate`, so it runs before any data is loaded);
:func:`check_counts` and :func:`check_every_tensor` what needs the partition's client count and
what each client sends. A strategy class's own refusals of a DP wrapper are its
``check_dp(cfg)`` (HetLoRA's), called after the shared ones; its own refusals of the rest of
the config its ``check_run(cfg)`` (SCAFFOLD's, FedDyn's).
"""

from __future__ import annotations

from typing import Optional

from fedadapt.config import (
    ConfigError,
    DPConfig,
    RunConfig,
    StrategyConfig,
    check,
    register_kind_check,
)
from fedadapt.strategies.capabilities import Capabilities
from fedadapt.strategies.privacy import DPSGD_ACCOUNTANTS
from fedadapt.strategies.registry import (
    CUSTOM,
    STRATEGIES,
    capabilities_of,
    dp_schemas,
    is_custom,
    sample_level,
    strategy_class,
    wraps_strategy,
)


def _where(strategy: StrategyConfig) -> tuple[str, str]:
    """The key and value that name the strategy in a refusal."""
    return ("strategy.target", strategy.target) if is_custom(strategy) else \
        ("strategy", strategy.name)


def check_strategy(cfg: RunConfig) -> None:
    """The strategy and ``dp=`` against the rest of the config (the method, the optimizer, the
    setting, the fleet, secure aggregation), from the config alone; :class:`ConfigError`
    naming the key otherwise."""
    strategy, dp = cfg.strategy, cfg.dp
    if not is_custom(strategy):
        check(strategy.name in STRATEGIES, "strategy", strategy.name,
              f"one of {sorted(STRATEGIES)} or {CUSTOM}")
    check(dp.name in dp_schemas(), "dp", dp.name, f"one of {sorted(dp_schemas())}")
    caps = capabilities_of(strategy)
    if cfg.setting.kind.tiers:
        check_every_tensor(strategy, dp, f"setting={cfg.setting.name}: each tier's clients "
                                         f"send their tier's tensors only")
    if sample_level(dp):
        _check_dpsgd(cfg)
    elif dp.name != "none":
        _check_dp(cfg, caps)
    _check_lora(cfg, caps)
    _check_clock(cfg, caps)
    own = getattr(strategy_class(strategy), "check_run", None)
    if callable(own):  # the strategy's own refusals (its keys, what it cannot compose with)
        own(cfg)
    if cfg.secagg.name != "none":
        check(caps.weighted_sum, *_where(strategy),
              "secagg=secaggplus reveals only the weighted sum of the clients' parameters, "
              "which Flower's SecAggPlusWorkflow hands to its FedAvg: use strategy=fedavg (this "
              "one needs each client's update)")


register_kind_check("strategy", check_strategy)


def _check_dp(cfg: RunConfig, caps: Capabilities) -> None:
    """``dp=`` against the strategy it wraps: the strategies its noise is not calibrated to,
    accounting's FedAvg aggregation, and uniform weights."""
    strategy, dp = cfg.strategy, cfg.dp
    if caps.rank_aware and dp.name.startswith("server_"):
        raise ConfigError(f"dp={dp.name} is invalid with strategy={strategy.name}: the server "
                          f"clips each reply against the global record at the largest LoRA "
                          f"rank, and clients of smaller ranks send smaller tensors; use "
                          f"dp=client_fixed or client_adaptive (each client clips its own "
                          f"rank's update) with strategy={' or '.join(_names('client_dp'))}")
    if caps.no_dp:
        tail = (f"; strategy={' or '.join(_names('client_dp'))} compose with it"
                if caps.rank_aware else "")
        raise ConfigError(f"dp={dp.name} is invalid with strategy={strategy.name}: "
                          f"{caps.no_dp}{tail}")
    own = getattr(strategy_class(strategy), "check_dp", None)
    if callable(own):  # the strategy's own refusals of a DP wrapper
        own(cfg)
    if getattr(dp, "accounting", False):
        _check_accounting(strategy, dp, caps)
    check(cfg.method.weighting == "uniform", "method.weighting", cfg.method.weighting,
          f"dp={dp.name} averages the clipped updates with equal weights (the noise is "
          f"calibrated to clipping_norm / clients per round): set method.weighting=uniform")


def _check_dpsgd(cfg: RunConfig) -> None:
    """``dp=dpsgd``'s keys, one line each naming the key. It wraps no strategy (each client's
    released update is already DP for its examples; the server's aggregation is post-processing),
    so it composes with every strategy; a fleet's cut work would change a client's sample
    rate."""
    dp = cfg.dp
    check(dp.noise_multiplier >= 0, "dp.noise_multiplier", dp.noise_multiplier, "must be >= 0")
    check(dp.max_grad_norm > 0, "dp.max_grad_norm", dp.max_grad_norm, "must be > 0")
    check(dp.delta is None or 0 < dp.delta < 1, "dp.delta", dp.delta, "in (0, 1) or null")
    check(dp.target_epsilon is None or dp.target_epsilon > 0, "dp.target_epsilon",
          dp.target_epsilon, "must be > 0 or null (dp.noise_multiplier as given)")
    check(dp.accountant in DPSGD_ACCOUNTANTS, "dp.accountant", dp.accountant,
          f"one of {DPSGD_ACCOUNTANTS} (Opacus's accountants)")
    check(cfg.train.clip_grad_norm is None, "train.clip_grad_norm", cfg.train.clip_grad_norm,
          "dp=dpsgd clips each example's gradient (dp.max_grad_norm): set "
          "train.clip_grad_norm=null")
    partial = getattr(cfg.fleet, "partial_work", False)  # a key of the simulated fleets
    check(not partial, "fleet.partial_work", partial,
          "dp=dpsgd samples each step from all of a client's examples (its sample rate is "
          "accounted); set fleet.partial_work=false")


def _names(what: str) -> list[str]:
    """The registered strategies of one kind: ``client_dp`` (rank-aware ones at FedAvg's
    sensitivity), ``fedavg_sensitivity``, ``rank_aware``, ``each_tensor``."""
    from fedadapt.strategies.registry import CAPABILITIES

    def fits(c: Capabilities) -> bool:
        if what == "client_dp":
            return c.rank_aware and c.fedavg_sensitivity
        return bool(getattr(c, what))

    return [name for name, c in CAPABILITIES.items() if fits(c)]


def _check_accounting(strategy: StrategyConfig, dp: DPConfig, caps: Capabilities) -> None:
    """``dp.accounting=true``: a noise multiplier, and FedAvg's own aggregation (Flower's
    accountant accepts only FedAvg.aggregate_train) or one with the same sensitivity."""
    check(dp.noise_multiplier > 0, "dp.noise_multiplier", dp.noise_multiplier,
          "privacy accounting (dp.accounting=true) needs a noise multiplier > 0; "
          "dp.accounting=false runs the mechanism without a privacy guarantee")
    own = ""
    if is_custom(strategy) and not caps.fedavg_sensitivity:
        cls = strategy_class(strategy)
        own = (f" ({cls.__name__} does not subclass FedAvg)" if not caps.per_tensor
               else f" ({cls.__name__} overrides aggregate_train)")
    check(caps.fedavg_sensitivity, *_where(strategy),
          f"dp={dp.name} with accounting needs FedAvg's own aggregation (Flower's accountant "
          f"accepts only FedAvg.aggregate_train){own} or one with the same sensitivity: "
          f"strategy={', '.join(_names('fedavg_sensitivity'))}, or dp.accounting=false")


def _check_lora(cfg: RunConfig, caps: Capabilities) -> None:
    """What a LoRA strategy aggregates against the method's LoRA: a method with LoRA ranks,
    FFA-LoRA's frozen A, the folding strategies' plain LoRA, mixed ranks' rank-aware
    strategies."""
    name, method = cfg.strategy.name, cfg.method
    ranks = getattr(method, "ranks", None)
    if caps.rank_aware and not hasattr(method, "ranks"):
        raise ConfigError(f"strategy={name} is invalid for method={method.name}: it "
                          f"aggregates LoRA factors (method=lora, with method.ranks for "
                          f"clients of different ranks)")
    if caps.rank_aware and getattr(method, "ffa", False):
        raise ConfigError(f"method.ffa=true is invalid with strategy={name}: it aggregates A "
                          f"and B (FFA-LoRA's A is frozen and never sent)")
    if caps.folds_into_base and not getattr(method, "plain_lora", False):
        raise ConfigError(f"strategy={name} is invalid for method={method.name}: it folds "
                          f"an update into the frozen weights of plain LoRA (method=lora)")
    if ranks and len(set(ranks)) > 1 and not caps.rank_aware:
        raise ConfigError(f"method.ranks={list(ranks)} needs a strategy that aggregates LoRA of "
                          f"different ranks: strategy={' | '.join(_names('rank_aware'))} (not "
                          f"{name})")


def _check_clock(cfg: RunConfig, caps: Capabilities) -> None:
    """FedNova counts SGD steps; an asynchronous strategy needs a fleet's clock and has no
    rounds to time out nor FedScale's synchronous round rule; ``dp=``'s noise needs a fixed
    number of clients per round, which a fleet does not keep."""
    name, fleet = cfg.strategy.name, cfg.fleet
    simulated = fleet.simulated
    if caps.counts_sgd_steps and cfg.train.optimizer != "sgd":
        raise ConfigError(f"train.optimizer={cfg.train.optimizer} is invalid with "
                          f"strategy={name}: its normalisation counts SGD steps (with or "
                          f"without momentum)")
    if caps.asynchronous and not simulated:
        raise ConfigError(f"strategy={name} is invalid without a fleet: its clients arrive on "
                          f"a simulated clock (fleet=tiers|lognormal|trace|fedscale)")
    if caps.asynchronous and cfg.federation.round_timeout is not None:
        raise ConfigError(f"federation.round_timeout={cfg.federation.round_timeout} is invalid "
                          f"with strategy={name}: it has no rounds to time out (the server "
                          f"applies each buffer as it fills)")
    check(not (caps.asynchronous and fleet.exact), "fleet.fedscale_semantics",
          getattr(fleet, "fedscale_semantics", None),
          f"'exact' runs FedScale's synchronous round rule; strategy={name} is asynchronous")
    if simulated and wraps_strategy(cfg.dp):
        raise ConfigError(f"dp={cfg.dp.name} is invalid with fleet={fleet.name}: its noise "
                          f"is calibrated to a fixed number of clients per round, and a fleet's "
                          f"rounds sample among the clients available and drop late ones")


def check_every_tensor(strategy: StrategyConfig, dp: DPConfig, why: str) -> None:
    """Refuse a strategy or DP wrapper that needs every client to send every tensor."""
    if not capabilities_of(strategy).each_tensor:
        key, value = _where(strategy)
        raise ConfigError(f"{key}={value} is invalid here: it combines whole "
                          f"updates, and {why} (strategies that average each tensor over its "
                          f"senders: {', '.join(_names('per_tensor'))})")
    if wraps_strategy(dp):
        raise ConfigError(f"dp={dp.name} is invalid here: it clips each client's whole update, "
                          f"and {why}")


def check_counts(strategy: StrategyConfig, dp: DPConfig, *, num_clients: int,
                 sampled: int) -> None:
    """What depends on the number of clients (known once the data is partitioned)."""
    name, minimum = strategy.name, capabilities_of(strategy).min_clients
    if minimum is not None:
        per, plus = minimum
        f, need = strategy.num_malicious_nodes, per * strategy.num_malicious_nodes + plus
        check(sampled >= need, "strategy.num_malicious_nodes", f,
              f"strategy={name} needs at least {per}f+{plus} = {need} clients per round to "
              f"tolerate f={f} malicious ones; partition.fraction_fit samples {sampled} of "
              f"{num_clients}")
    if hasattr(strategy, "num_nodes_to_select"):
        check(1 <= strategy.num_nodes_to_select <= sampled, "strategy.num_nodes_to_select",
              strategy.num_nodes_to_select, f"in 1..{sampled} (the clients a round samples)")
    if getattr(dp, "accounting", False):
        check(dp.delta is None or 0 < dp.delta < 1, "dp.delta", dp.delta, "in (0, 1)")


def dp_refusal(cfg: RunConfig) -> Optional[str]:
    """Why ``dp=`` cannot wrap the run's strategy (one line), or None where the maths allows."""
    try:
        if wraps_strategy(cfg.dp):
            _check_dp(cfg, capabilities_of(cfg.strategy))
    except ConfigError as err:
        return str(err)
    return None
