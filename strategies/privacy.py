"""Privacy accounting: of Flower's fixed-clipping DP wrappers (the default delta, Flower's RDP
accountant, the noise that spends a given epsilon, what a run has spent), and of ``dp=dpsgd``
(sample-level DP-SGD on each client: Opacus's accountants, each client's noise and the mod that
reports its epsilon)."""

from __future__ import annotations

import math
from dataclasses import dataclass
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


# -- dp=dpsgd: sample-level DP-SGD on each client (Opacus) -----------------------------------

#: ``dp.accountant`` of ``dp=dpsgd``: Opacus's Renyi-DP accountant, or its privacy-loss random
#: variable accountant (tighter).
DPSGD_ACCOUNTANTS = ("rdp", "prv")
#: The reply metrics a DP-SGD client reports of its round (read by :class:`DPSGDAccounting`).
DPSGD_ROUND = ("dpsgd_noise", "dpsgd_sample_rate", "dpsgd_steps", "dpsgd_delta")


def opacus_accountants():
    """``opacus.accountants``, or one line naming the extra that installs it."""
    try:
        from opacus import accountants
    except ImportError as err:
        raise ConfigError(f"dp=dpsgd needs Opacus: pip install 'fedadapt[dpsgd]' ({err})"
                          ) from err
    return accountants


def dpsgd_schedule(examples: int, batch_size: int, local_epochs: int) -> tuple[float, int]:
    """A DP-SGD client's sample rate and steps in a round: each step takes each of its
    ``examples`` with probability q = 1 / ceil(examples / batch_size) (Poisson sampling, as
    Opacus's ``DPDataLoader``), ceil(examples / batch_size) steps an epoch."""
    per_epoch = max(1, math.ceil(examples / batch_size))
    return 1.0 / per_epoch, per_epoch * local_epochs


def dpsgd_epsilon(history: list[tuple[float, float, int]], delta: float, accountant: str
                  ) -> float:
    """Epsilon at ``delta`` by Opacus's ``accountant`` after the DP-SGD steps of ``history``
    (``(noise multiplier, sample rate, steps)`` each; the steps of equal noise and rate summed,
    as Opacus's own accountants compose them)."""
    steps: dict[tuple[float, float], int] = {}  # rounds of the same noise and rate: one entry
    for z, q, n in history:
        steps[(float(z), float(q))] = steps.get((float(z), float(q)), 0) + int(n)
    acc = opacus_accountants().create_accountant(accountant)
    acc.history = [(z, q, n) for (z, q), n in steps.items()]
    return float(acc.get_epsilon(delta))


@dataclass(frozen=True)
class DPSGDPlan:
    """``dp=dpsgd`` as the clients run it: each client's noise multiplier and delta, the
    per-sample clipping norm, the accountant."""

    noise: tuple[float, ...]
    delta: tuple[float, ...]
    max_grad_norm: float
    accountant: str


def dpsgd_plan(dp: DPConfig, sizes: list[int], *, batch_size: int, local_epochs: int,
               rounds: int) -> DPSGDPlan:
    """Each client's noise (``dp.noise_multiplier``, or with ``dp.target_epsilon`` Opacus's
    smallest noise that spends at most it in ``rounds`` rounds of its steps at its sample rate)
    and delta (``dp.delta``, or :func:`default_delta` of its training examples); a target no
    noise reaches is refused in one line."""
    accountants = opacus_accountants()
    deltas = tuple(dp.delta if dp.delta is not None else default_delta(max(n, 1))
                   for n in sizes)
    if dp.target_epsilon is None:
        return DPSGDPlan((float(dp.noise_multiplier),) * len(sizes), deltas,
                         float(dp.max_grad_norm), dp.accountant)
    noise = []
    for cid, (n, delta) in enumerate(zip(sizes, deltas)):
        q, steps = dpsgd_schedule(n, batch_size, local_epochs)
        try:
            noise.append(float(accountants.utils.get_noise_multiplier(
                target_epsilon=dp.target_epsilon, target_delta=delta, sample_rate=q,
                steps=steps * rounds, accountant=dp.accountant)))
        except ValueError as err:
            raise ConfigError(f"dp.target_epsilon={dp.target_epsilon} is invalid: no noise "
                              f"reaches it for client {cid} ({n} examples, {rounds} rounds of "
                              f"{steps} steps at sample rate {q:.3g}, delta {delta:.3g}): "
                              f"{err}") from err
    return DPSGDPlan(tuple(noise), deltas, float(dp.max_grad_norm), dp.accountant)


class DPSGDAccounting:
    """``dp=dpsgd``'s train mod: after a client's round it adds the round's DP-SGD steps (the
    ``dpsgd_*`` metrics of its reply) to the history in its ``Context`` (checkpointed with it)
    and reports ``dpsgd_epsilon``, what the client has spent so far at its delta by Opacus's
    accountant (in place of the ``dpsgd_*`` round metrics).
    ``metrics.jsonl`` gets its mean, client mean and max over the round's clients."""

    def __init__(self, accountant: str = "rdp") -> None:
        if accountant not in DPSGD_ACCOUNTANTS:
            raise ValueError(f"accountant={accountant!r}: one of {DPSGD_ACCOUNTANTS}")
        self.accountant = accountant

    def __call__(self, msg, context, call_next):
        from flwr.app import ConfigRecord, MetricRecord

        reply = call_next(msg, context)
        if reply.has_error() or "metrics" not in reply.content.metric_records:
            return reply
        metrics = reply.content.metric_records["metrics"]
        if any(key not in metrics for key in DPSGD_ROUND):
            return reply
        z, q, steps, delta = (metrics[key] for key in DPSGD_ROUND)
        state = context.state.config_records.get("dpsgd")
        past = {k: list(state[k]) for k in ("noise", "rate", "steps")} if state is not None \
            else {"noise": [], "rate": [], "steps": []}
        past["noise"].append(float(z))
        past["rate"].append(float(q))
        past["steps"].append(int(steps))
        context.state["dpsgd"] = ConfigRecord(past)
        spent = dpsgd_epsilon(list(zip(past["noise"], past["rate"], past["steps"])),
                              float(delta), self.accountant)
        kept = {k: v for k, v in metrics.items() if k not in DPSGD_ROUND}
        reply.content["metrics"] = MetricRecord({**kept, "dpsgd_epsilon": spent})
        return reply
