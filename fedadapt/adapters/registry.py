"""The method registry: each method module registers its builder and typed config here.

Method modules are found, not listed (:mod:`fedadapt.discovery`): every module of
:mod:`fedadapt.adapters` (the client-trained methods) and every family package of
:mod:`fedadapt.methods` (with the methods it trains) is imported once, the first time the
registry is read (:func:`load_methods`). A
method module imports only this registry, never its own package: no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from fedadapt.adapters.model import AdaptedModel
from fedadapt.config import ConfigError, MethodConfig
from fedadapt.discovery import import_plugins, plugin_modules, plugin_registry


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_cls: type
    #: ``build(cfg, backbone, num_classes, with_backbone[, class_text]) -> AdaptedModel``
    build: Callable[..., AdaptedModel]
    #: The builder also receives the class prompts' text features (``class_text=``; CLIP).
    uses_text: bool = False
    #: The method's family (:mod:`fedadapt.methods`): ``rounds`` (federated training on the
    #: clients), ``plugin`` (a module trained once on the server and delivered to the clients
    #: for inference) or ``sessions`` (a generator trained once on the server that answers
    #: every session of every client with generated parameters).
    family: str = "rounds"
    #: ``counts(cfg, embed_dim, num_classes) -> dict``: extra figures for ``fedadapt-inspect``
    #: (e.g. ICIIA's Table 1 parameters and FLOPs), under the method's name.
    counts: Optional[Callable[..., dict]] = None


METHODS: dict[str, MethodSpec] = plugin_registry()


def register_method(name: str, config_cls: type, *, uses_text: bool = False,
                    family: str = "rounds", counts: Optional[Callable[..., dict]] = None):
    """Decorator registering a builder under ``method=name`` with schema ``config_cls``."""

    def deco(fn):
        METHODS[name] = MethodSpec(name=name, config_cls=config_cls, build=fn,
                                   uses_text=uses_text, family=family, counts=counts)
        return fn

    return deco


_LOADED: list[bool] = []


def load_methods() -> dict[str, MethodSpec]:
    """Import every method module once (their decorators fill :data:`METHODS`); returns it."""
    if not _LOADED:
        # the family packages only (a module beside them, such as server_trained, is their code)
        import_plugins(plugin_modules("fedadapt.adapters", skip=("model", "registry"))
                       + plugin_modules("fedadapt.methods", packages_only=True))
        _LOADED.append(True)  # after every import: one that failed fails again next time
    return METHODS


def method_spec(cfg: MethodConfig) -> MethodSpec:
    load_methods()
    if cfg.name not in METHODS:
        raise ConfigError(f"method={cfg.name!r} is invalid: one of {sorted(METHODS)}")
    return METHODS[cfg.name]


def build_model(cfg: MethodConfig, backbone, num_classes: int, *, with_backbone: bool | None = None,
                class_text=None) -> AdaptedModel:
    """Build ``cfg.name``'s model on ``backbone``.

    ``with_backbone=False`` leaves the backbone out of the module (training from cached
    features needs only its ``embed_dim``); the default follows ``cfg.use_cache``.
    ``class_text`` (:class:`~fedadapt.backbones.clip.ClassText`) goes to methods registered
    with ``uses_text``.
    """
    spec = method_spec(cfg)
    if with_backbone is None:
        with_backbone = not cfg.use_cache
    extra = {"class_text": class_text} if spec.uses_text else {}
    return spec.build(cfg, backbone, num_classes, with_backbone, **extra)
