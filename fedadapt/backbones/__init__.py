"""Frozen backbones behind one interface, built by one factory.

``build_backbone(cfg)`` returns a :class:`Backbone`: an ``nn.Module`` whose ``forward`` maps a
batch of normalised images ``[B, 3, H, W]`` to pooled features ``[B, D]``, frozen
(``requires_grad=False``) and in eval mode. Families register themselves with
:func:`register_backbone_family`; weights come from a hub id or a local path, or are random when
``cfg.weights`` is None (tests, ``fedadapt-inspect``).

Family modules are found, not listed, as methods are (:mod:`fedadapt.discovery`): every module
of this package but ``base`` is imported once, the first time a backbone is built
(:func:`load_backbone_families`). Adding a family is a new file here.
"""

from __future__ import annotations

from fedadapt.backbones.base import BACKBONE_BUILDERS, Backbone, register_backbone_family
from fedadapt.config import BackboneConfig, ConfigError
from fedadapt.discovery import import_plugins, plugin_modules

_LOADED: list[bool] = []


def load_backbone_families() -> dict:
    """Import every family module of this package once (their decorators fill
    :data:`~fedadapt.backbones.base.BACKBONE_BUILDERS`); returns it."""
    if not _LOADED:
        import_plugins(plugin_modules("fedadapt.backbones", skip=("base",)))
        _LOADED.append(True)  # after every import: one that failed fails again next time
    return BACKBONE_BUILDERS


def build_backbone(cfg: BackboneConfig, *, load_weights: bool = True) -> Backbone:
    """Build the frozen backbone ``cfg`` describes.

    Parameters
    ----------
    cfg : BackboneConfig
        Family, weights (hub id, local path or None) and architecture overrides.
    load_weights : bool
        False builds the architecture with random weights (no download), as
        ``fedadapt-inspect`` does.
    """
    load_backbone_families()
    if cfg.family not in BACKBONE_BUILDERS:
        raise ConfigError(
            f"backbone.family={cfg.family!r} is invalid: one of {sorted(BACKBONE_BUILDERS)}"
        )
    import torch

    _check_sealed_weights(cfg, load_weights)
    # Random weights (tests, inspect, weights=null) must be the same in every process: the
    # server's evaluation and every Ray worker build their own copy.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(cfg.arch.get("init_seed", 0)))
        backbone = BACKBONE_BUILDERS[cfg.family](cfg, load_weights)
    if cfg.crop_pct is not None:
        backbone.crop_pct = float(cfg.crop_pct)
    if cfg.interpolation is not None:
        backbone.interpolation = str(cfg.interpolation)
    return backbone.freeze()


__all__ = ["Backbone", "build_backbone", "load_backbone_families",
           "register_backbone_family"]


def _check_sealed_weights(cfg: BackboneConfig, load_weights: bool) -> None:
    """Weights in a folder that fedadapt wrote (``fedadapt-pretrain`` seals its output) are
    checked against their recorded digests once per process; others are loaded as they are."""
    from pathlib import Path

    from fedadapt.data.integrity import SEAL, check_folder

    if not (load_weights and cfg.weights):
        return
    folder = Path(str(cfg.weights)).expanduser()
    if (folder / SEAL).is_file():
        check_folder(folder, f"backbone.weights={cfg.weights!r}: pretrained backbone",
                     fix="rebuild it with fedadapt-pretrain --force")
