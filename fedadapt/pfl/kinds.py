"""The personalization kinds (``pfl=`` options), each a schema over
:class:`~fedadapt.config.PflConfig` (whose own kind is ``none``) and a
:class:`~fedadapt.pfl.rule.ClientRule`: its keys, what it keeps on the client (``keeps``, a class
attribute), its client round (``train_round``), what a client is evaluated with
(``evaluated``) and its refusals (``check``, called by :func:`fedadapt.config.validate` before any
data is read). :func:`register_pfl` registers a kind (a researcher's too); :func:`pfl_kinds` is
the registry :func:`fedadapt.entry.register_configs` stores as ``schema/pfl/<name>``."""

from __future__ import annotations

from typing import Optional

from fedadapt.config import PflConfig, RunConfig
from fedadapt.pfl.rule import PFL_KINDS, STRATEGY_RULES, ClientRule


def pfl_kinds() -> dict[str, type[PflConfig]]:
    """Every registered kind by name (the shipped ones imported first)."""
    from fedadapt.pfl import fedper, fedrep  # noqa: F401 - they register

    return dict(PFL_KINDS)


def client_rule(cfg: RunConfig) -> Optional[ClientRule]:
    """The rule the run's clients follow: its ``pfl`` kind's, or its strategy's client side
    (``Capabilities.client_rule``); None: FedAvg's local training."""
    from fedadapt.strategies.registry import capabilities_of

    if isinstance(cfg.pfl, ClientRule):
        return cfg.pfl
    name = capabilities_of(cfg.strategy).client_rule
    if name is None:
        return None
    return STRATEGY_RULES[name](cfg.strategy)
