"""The method registry: each method module registers its builder and typed config here.

Kept apart from :mod:`fedadapt.adapters` (which imports every method module) so that a method
module imports only this registry, never its own package: no import circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from fedadapt.adapters.model import AdaptedModel
from fedadapt.config import ConfigError, MethodConfig


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_cls: type
    #: ``build(cfg, backbone, num_classes, with_backbone[, class_text]) -> AdaptedModel``
    build: Callable[..., AdaptedModel]
    #: The builder also receives the class prompts' text features (``class_text=``; CLIP).
    uses_text: bool = False
    #: ``clients`` (federated training), ``server`` (a plug-in trained once on the server
    #: and delivered to the clients for inference: :mod:`fedadapt.federation.plugin`) or
    #: ``sessions`` (a generator trained once on the server that answers every session of
    #: every client with generated parameters: :mod:`fedadapt.federation.sessions`).
    trainer: str = "clients"
    #: ``counts(cfg, embed_dim, num_classes) -> dict``: extra figures for ``fedadapt-inspect``
    #: (e.g. ICIIA's Table 1 parameters and FLOPs), under the method's name.
    counts: Optional[Callable[..., dict]] = None


METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, config_cls: type, *, uses_text: bool = False,
                    trainer: str = "clients", counts: Optional[Callable[..., dict]] = None):
    """Decorator registering a builder under ``method=name`` with schema ``config_cls``."""

    def deco(fn):
        METHODS[name] = MethodSpec(name=name, config_cls=config_cls, build=fn,
                                   uses_text=uses_text, trainer=trainer, counts=counts)
        return fn

    return deco


def method_spec(cfg: MethodConfig) -> MethodSpec:
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
