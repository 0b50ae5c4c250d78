"""Trainable methods, one module each, registered by name with a typed config (PEFT's pattern).

A method turns a frozen :class:`~fedadapt.backbones.Backbone` into an :class:`AdaptedModel` and
says which of its tensors train, which travel to the server and which stay on the client.
Adding a method is a new module here (plus its ``conf/method/<name>.yaml`` and a row in the test
matrix); nothing else branches on method names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fedadapt.adapters.model import AdaptedModel
from fedadapt.config import ConfigError, MethodConfig


@dataclass(frozen=True)
class MethodSpec:
    name: str
    config_cls: type
    #: ``build(cfg, backbone, num_classes, with_backbone) -> AdaptedModel``
    build: Callable[..., AdaptedModel]


METHODS: dict[str, MethodSpec] = {}


def register_method(name: str, config_cls: type):
    """Decorator registering a builder under ``method=name`` with schema ``config_cls``."""

    def deco(fn):
        METHODS[name] = MethodSpec(name=name, config_cls=config_cls, build=fn)
        return fn

    return deco


def build_model(cfg: MethodConfig, backbone, num_classes: int, *, with_backbone: bool | None = None
                ) -> AdaptedModel:
    """Build ``cfg.name``'s model on ``backbone``.

    ``with_backbone=False`` leaves the backbone out of the module (training from cached
    features needs only its ``embed_dim``); the default follows ``cfg.use_cache``.
    """
    if cfg.name not in METHODS:
        raise ConfigError(f"method={cfg.name!r} is invalid: one of {sorted(METHODS)}")
    if with_backbone is None:
        with_backbone = not cfg.use_cache
    return METHODS[cfg.name].build(cfg, backbone, num_classes, with_backbone)


from fedadapt.adapters import exits, heads  # noqa: E402,F401  (registers the methods)

__all__ = ["AdaptedModel", "METHODS", "MethodSpec", "build_model", "register_method"]
