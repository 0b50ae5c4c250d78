"""Method families: how a method is trained and served, one package each.

A method (:mod:`fedadapt.adapters`' registry) names its family; the family holds everything that
differs between the ways of training:

- ``rounds`` (:mod:`fedadapt.methods.rounds`): federated rounds driven by a Flower strategy,
  the clients train (linear and MLP heads, FedCLIP's AttAI, the Accumulator, ...);
- ``plugin`` (:mod:`fedadapt.methods.plugin`): a module trained once on the server and
  delivered to every client for inference (ICIIA);
- ``sessions`` (:mod:`fedadapt.methods.sessions`): a generator trained once on the server that
  answers every session of every client with generated parameters (DUET, CDC-MMPG).

A family is a :class:`Family` registered with :func:`register_family` in its package's
``__init__``; its package also holds its methods, its server and client code. The core
(:mod:`fedadapt.experiment`, :mod:`fedadapt.cli`, :mod:`fedadapt.clients.app`) dispatches on
the family in one place each and never branches on a family's name. Packages here are found,
not listed (:func:`fedadapt.adapters.registry.load_methods`, :mod:`fedadapt.discovery`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from fedadapt.discovery import plugin_registry

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    from fedadapt.config import RunConfig

#: A client-side handler: ``handler(spec, msg, context) -> RecordDict`` (the reply's content).
Handler = Callable[..., object]


class Family:
    """A family of methods: its checks, its run-spec fields, its run, its client handlers."""

    #: The name methods give (``register_method(..., family=name)``).
    name: str = ""
    #: The clients train (federated rounds). Settings that need trained clients (a validation
    #: objective, the global test split) or clients without training data (unseen test clients)
    #: are decided on this capability.
    clients_train: bool = False

    def check(self, cfg: "RunConfig", card) -> None:
        """Refuse settings this family cannot run (before anything is loaded)."""

    def check_code(self, cfg: "RunConfig") -> None:
        """Build and check the user's code the config names (their strategy, mods,
        evaluation) from the config alone, before any data is loaded: a job checks every run
        with it before its first, a sweep every point before its first."""

    def prepare(self, cfg: "RunConfig", prep, *, backbone, images: Callable,
                original) -> None:
        """Fill the family's fields of the prepared run (``prep.spec``, ``prep.model``: a
        :class:`fedadapt.methods.run.PreparedRun`) once the model exists (``images(split)``: the
        split's raw images; ``original``: the original-model phase's result or None)."""

    def units(self, cfg: "RunConfig") -> int:
        """Progress units of one run (rounds; 1 for a run trained on the server)."""
        return 1

    def run(self, cfg: "RunConfig", run_dir: "Path", prep, *, config_yaml: str, label: str,
            client_app, execute: Optional[Callable], resume: bool, t0: float) -> dict:
        """Train and serve, write the run directory (``summary.json`` last); the summary.
        ``client_app`` is the run's ClientApp (:func:`fedadapt.clients.app.make_client_app`),
        which ``execute(plan, client_app)`` runs on the nodes."""
        raise NotImplementedError

    def warm_up(self, spec, model) -> None:
        """A node's warm-up before its first message (beyond building the model)."""

    #: ``{(message type, phase): handler}`` of the ClientApp (message type ``train``,
    #: ``evaluate`` or ``query``; phase ``config["phase"]``, None for the rounds).
    handlers: dict[tuple[str, Optional[str]], Handler] = {}


#: ``Family.name`` -> the registered family.
METHOD_FAMILIES: dict[str, Family] = plugin_registry()


def register_family(family: Family) -> Family:
    """Register ``family`` under its name (in its package's ``__init__``)."""
    if family.name in METHOD_FAMILIES:
        raise ValueError(f"method family {family.name!r} is registered twice")
    METHOD_FAMILIES[family.name] = family
    return family


def family_of(method_cfg) -> Family:
    """The family of ``method=`` (a ``MethodConfig``)."""
    from fedadapt.adapters.registry import method_spec

    return METHOD_FAMILIES[method_spec(method_cfg).family]


def client_handler(kind: str, phase: Optional[str]) -> Handler:
    """The ClientApp's handler of a ``kind`` message in ``phase``."""
    from fedadapt.adapters.registry import load_methods

    load_methods()
    for family in METHOD_FAMILIES.values():
        if (kind, phase) in family.handlers:
            return family.handlers[(kind, phase)]
    raise ValueError(f"no method family handles a {kind} message of phase {phase!r}")
