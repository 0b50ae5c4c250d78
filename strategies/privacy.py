"""Privacy accounting of Flower's fixed-clipping DP wrappers: the default delta, Flower's RDP
accountant, the noise that spends a given epsilon, and what a run has spent."""

from __future__ import annotations

from typing import Optional

from fedadapt.config import ConfigError, DPConfig


def default_delta(num_clients: int) -> float:
    """``dp.delta`` when none is given: min(1e-5, N^-1.1) for N clients.

    (epsilon, delta)-DP allows the mechanism to fail outright with probability delta; at
    delta >= 1/N a mechanism that publishes one client's data in the clear meets it. delta must
    be well below 1/N: McMahan et al. (ICLR 2018, user-level DP for federated learning) take
    N^-1.1, and 1e-5 is the customary ceiling (Abadi et al., CCS 2016)."""
    return min(1e-5, float(num_clients) ** -1.1)


def accountant_for(dp: DPConfig, num_clients: int):
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
        accountant = accountant_for(cfg, num_clients)
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
