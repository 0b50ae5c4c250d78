"""A client's round beyond FedAvg's local training: the one extension point of personalized FL
(``pfl=``) and of the drift-correcting strategies' client side (SCAFFOLD, FedDyn, MOON).

A :class:`ClientRule` gets a :class:`RoundWork`: the clients a worker trains this round, each
as a :class:`~fedadapt.federation.client.grouped.ClientJob` starting from the global tensors and
its personal ones, the state the rule keeps for each client between rounds (tensors by name,
saved in the run directory beside the client's personal tensors, or in a deployment client's
``context.state``: both survive a resume), and the arrays the server sent the rule (SCAFFOLD's
control variate, named ``rule/...``). It trains them with :meth:`RoundWork.train` (side by side,
only the tensors it names, for the epochs and towards the anchors and linear terms it gives:
any number of phases) and returns each client's final tensors; what it puts in
:attr:`RoundWork.send` travels back beside them. :meth:`ClientRule.evaluated` says which
tensors a client is evaluated with (Ditto's personal copy, APFL's mixture).

The default rule is FedAvg's: one training from the received tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, ClassVar, Optional

import torch

from fedadapt.codec import RULE_PREFIX  # rule/<what>/<tensor>: the rule's arrays both ways
from fedadapt.config import PflConfig, RunConfig, check
from fedadapt.discovery import plugin_registry
from fedadapt.federation.client.grouped import ClientJob, ClientResult
from fedadapt.log import log
from fedadapt.settings import only_training


def split_received(received: dict[str, torch.Tensor]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(the model's tensors, the rule's arrays)`` of what a client received."""
    if not any(n.startswith(RULE_PREFIX) for n in received):
        return received, {}
    return ({n: t for n, t in received.items() if not n.startswith(RULE_PREFIX)},
            {n: t for n, t in received.items() if n.startswith(RULE_PREFIX)})


@dataclass
class RoundWork:
    """The clients one worker trains in a round, for a :class:`ClientRule`."""

    #: The run's :class:`~fedadapt.federation.client.training.RunSpec` (its data source
    #: ``train_source``, ``precision``, ``seed``: what a rule with its own step reads).
    spec: object
    model: object
    jobs: list[ClientJob]
    #: Each client's state kept by the rule (``{cid: {name: tensor}}``, empty on its first
    #: round); changed in place by the rule, saved after the round.
    state: dict[int, dict[str, torch.Tensor]]
    #: The rule's arrays the server sent each client (names without :data:`RULE_PREFIX`).
    received: dict[int, dict[str, torch.Tensor]]
    #: Each client's learning rate and proximal mu this round.
    rates: dict[int, tuple[float, float]]
    #: The run's local training (``train.*``).
    train_config: object
    #: The number of classes (the model's head).
    num_classes: int
    #: ``_train(jobs, train, rates) -> {cid: ClientResult | reason}``: the worker's grouped
    #: training (:func:`fedadapt.federation.client.worker.train_groups`).
    _train: Callable
    #: What each client sends back beside its trained tensors (names without the prefix).
    send: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    #: How many clients ``_train`` trains side by side (1: one at a time).
    group_size: int = 1

    def train(self, jobs: Optional[list[ClientJob]] = None, *, names: Optional[list[str]] = None,
              epochs: Optional[int] = None, lr: Optional[float] = None,
              mu: Optional[float] = None) -> dict[int, ClientResult | str]:
        """Train ``jobs`` (default: every client's) side by side: only the tensors ``names``
        (default: everything the model trains), for ``epochs`` local epochs (default
        ``train.local_epochs``), at ``lr`` and proximal ``mu`` (default: the round's). Each
        result holds the job's every tensor, the untrained ones as they came."""
        jobs = self.jobs if jobs is None else jobs
        train = self.train_config if epochs is None else \
            replace(self.train_config, local_epochs=int(epochs))
        rates = {j.cid: (self.rates[j.cid][0] if lr is None else float(lr),
                         self.rates[j.cid][1] if mu is None else float(mu)) for j in jobs}
        if names is None:
            out = self._train(jobs, train, rates)
        else:
            with only_training(self.model, names):
                if min(len(jobs), self.group_size) > 1 and _fixed_differ(jobs, names):
                    out = {}  # side by side they would share the model's one value of them
                    for job in jobs:
                        out.update(self._train([job], train, {job.cid: rates[job.cid]}))
                else:
                    if len(jobs) > 1:  # side by side the fixed tensors are the model's: the
                        # clients' one value of them (FedRep's body while the heads train;
                        # the model held what it was last left with, a resumed run's other)
                        chosen = set(names)
                        self.model.load_tensors({n: t for n, t in jobs[0].tensors.items()
                                                 if n not in chosen})
                    out = self._train(jobs, train, rates)
        for job in jobs:
            res = out.get(job.cid)
            if isinstance(res, ClientResult):
                res.tensors = {**job.tensors, **res.tensors}
        return out


def _fixed_differ(jobs: list[ClientJob], names: list[str]) -> bool:
    """Whether the tensors a phase holds fixed differ between its clients (FedRep's heads in
    its body phase). Clients side by side train only what trains per client and share the
    model's value of the rest, so such a phase trains its clients one at a time (said once)."""
    chosen = set(names)
    fixed = [n for n in jobs[0].tensors if n not in chosen]
    differ = [n for n in fixed if any(not torch.equal(j.tensors[n], jobs[0].tensors[n])
                                      for j in jobs[1:])]
    if differ and not _SAID_ALONE:
        _SAID_ALONE.append(True)
        log(f"[federation] a phase holding each client's own {differ[0]} (and "
            f"{len(differ) - 1} more) fixed trains its clients one at a time, not side by side "
            f"(side by side they would share one value of it)")
    return bool(differ)


_SAID_ALONE: list[bool] = []


class ClientRule:
    """FedAvg's client round (see the module docstring); a kind overrides what it changes."""

    #: Why its clients train one at a time, not side by side (said in the run's layout line);
    #: "" where they train side by side.
    alone_because: ClassVar[str] = ""

    @property
    def label(self) -> str:
        """How the run's layout line names it (a kind: ``pfl=<name>``)."""
        return f"pfl={self.name}" if isinstance(self, PflConfig) else type(self).__name__

    def check_model(self, model, num_classes: int) -> None:
        """Refuse a model the rule cannot train (ConfigError, one line), when the run's model
        is built (default: none refused)."""

    def train_round(self, work: RoundWork) -> dict[int, ClientResult | str]:
        """Each client's final tensors (or the reason it failed): by default one training
        from the received tensors."""
        return work.train()

    def evaluated(self, model, tensors: dict[str, torch.Tensor],
                  state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors a client is evaluated with, from the global and personal ones it holds
        and its state (default: those)."""
        return tensors


#: The client rules the strategies name in their capabilities (``client_rule``), by name.
STRATEGY_RULES: dict[str, Callable[[object], ClientRule]] = plugin_registry()


def register_strategy_rule(name: str, make: Callable[[object], ClientRule]) -> None:
    """``make(strategy config) -> ClientRule``: the client side of a strategy that declares
    ``Capabilities(client_rule=name)``."""
    STRATEGY_RULES[name] = make


#: The kinds by ``pfl=`` option; ``none`` is the base itself.
PFL_KINDS: dict[str, type[PflConfig]] = plugin_registry()
PFL_KINDS["none"] = PflConfig


def register_pfl(kind: type[PflConfig]) -> type[PflConfig]:
    """Class decorator: ``kind`` (a dataclass subclass of :class:`PflConfig` and
    :class:`ClientRule`) becomes the ``pfl=`` option named by its ``name`` default (a preset
    ``conf/pfl/<name>.yaml`` extends ``/schema/pfl/<name>@_here_``)."""
    if not issubclass(kind, ClientRule):
        raise TypeError(f"{kind.__name__}: a pfl kind is a PflConfig and a ClientRule")
    PFL_KINDS[kind.name] = kind
    return kind


def check_composes(cfg: RunConfig, kind: PflConfig) -> None:
    """What every kind refuses: a strategy with its own client side beside it (a method the
    clients do not train is refused where the run is prepared:
    :func:`fedadapt.experiment.prepare_run`)."""
    from fedadapt.strategies.registry import capabilities_of

    caps = capabilities_of(cfg.strategy)
    check(caps.client_rule is None, "pfl", kind.name,
          f"strategy={cfg.strategy.name} has its own client side (its client_rule "
          f"{caps.client_rule!r}); a personalized method runs beside FedAvg-like strategies")
