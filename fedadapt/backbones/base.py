"""The interface every backbone implements."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fedadapt.assets import MissingAssetError
from fedadapt.config import BackboneConfig
from fedadapt.discovery import plugin_registry


class Backbone(nn.Module):
    """A frozen feature extractor.

    Capabilities are declared by the class: ``has_exits`` (per-layer tokens for early exits,
    ``forward_exits``); ``peft_targets`` (the module names the PEFT methods of
    :mod:`fedadapt.adapters.tuners` adapt by default, inside :meth:`tuning_module`).

    Attributes
    ----------
    embed_dim : int
        Size D of the pooled feature.
    num_layers : int
        Number of blocks (exits) for backbones that expose per-layer tokens, else 1.
    image_size : int
        Input resolution ``S`` (the model sees ``S`` x ``S`` images).
    crop_pct : float
        Evaluation preprocessing: the shortest side is resized to ``S / crop_pct``, then an
        ``S`` x ``S`` centre crop is taken (1.0: resize to ``S``, as CLIP; 0.875: 256 then 224,
        as DeiT's image processor).
    interpolation : str
        ``bicubic`` or ``bilinear``: the resize filter of the backbone's own preprocessing.
    mean, std : tuple of float
        Normalisation the backbone was trained with.
    weights_id : str
        Identity of the weights (hub id, path or ``random``), part of the feature-cache key.
    modality : str
        What it takes: ``image`` (``[B, 3, S, S]``) or ``audio`` (spectrograms ``[B, T, F]``
        from its feature extractor's settings; see :mod:`fedadapt.backbones.ast_model`).
    """

    has_exits: bool = False

    embed_dim: int
    num_layers: int = 1
    image_size: int = 224
    crop_pct: float = 1.0
    interpolation: str = "bilinear"
    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    weights_id: str = "random"
    #: Normalisation layers keep their pretrained statistics when the backbone is fine-tuned.
    has_batchnorm: bool = False
    modality: str = "image"
    #: Default target modules of the PEFT tuners, by their last name component: ``lora`` (LoRA
    #: and DoRA), ``ia3`` and ``ia3_feedforward`` ((IA)^3's targets, and those of them whose
    #: input it scales). Empty: the backbone names none (``method.target_modules`` must).
    peft_targets: dict[str, tuple[str, ...]] = {}
    #: On the CPU, a frozen forward (:func:`fedadapt.adapters.model.frozen_features`) runs in
    #: chunks of about this many input pixels (rows x S x S), None: in one call; and with
    #: ``cpu_channels_last`` its input in channels-last layout. Declared by the backbones where
    #: it was measured faster (EfficientNet-Lite0 on the 2-core EPYC, docs/speed.md).
    cpu_chunk_pixels: Optional[int] = None
    cpu_channels_last: bool = False

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,D]
        raise NotImplementedError

    def frozen_cpu(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What computes :meth:`forward` for a frozen forward on the CPU
        (:func:`fedadapt.adapters.model.frozen_features`): the backbone itself, unless a
        backbone has a faster form of the same function (EfficientNet-Lite: its batch norms
        folded into its convolutions)."""
        return self

    def example_input(self, batch_size: int = 1) -> torch.Tensor:
        """Zeros of the input's shape (counting FLOPs, measuring memory): ``[B, 3, S, S]``."""
        return torch.zeros(batch_size, 3, self.image_size, self.image_size)

    def freeze(self) -> "Backbone":
        """Set ``requires_grad=False`` on every parameter and switch to eval mode."""
        for p in self.parameters():
            p.requires_grad_(False)
        return self.eval()

    def tuning_module(self) -> nn.Module:
        """The module the PEFT tuners adapt (and an exported adapter belongs to): the network
        that computes the pooled feature (for CLIP, its image tower): the wrapped ``model``, or
        the backbone itself when it wraps none."""
        return self._modules.get("model") or self

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def weights_state(self) -> dict[str, torch.Tensor]:
        """The state dict a ``backbone.weights`` file of this family holds (the family's loader
        reads it back); the module's own by default."""
        return self.state_dict()


def load_state_file(path: str, what: str = "backbone.weights") -> dict[str, torch.Tensor]:
    """A state dict from a local file: ``.safetensors``, or a torch file read with
    ``weights_only=True`` (nothing is unpickled). A missing or unreadable file fails with one
    line naming it."""
    import os

    if not os.path.isfile(path):
        raise MissingAssetError(f"{what}={path!r}: no such file")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # corrupt or foreign file
        raise MissingAssetError(f"{what}={path!r} is not a readable state dict ({err})") from err


def file_weights_id(path: str, prefix: str) -> str:
    """``<prefix>:<sha256 of the file, 16 hex>``: the identity of local weights in the
    feature-cache key (a retrained file at the same path gets a new key)."""
    import hashlib

    with open(path, "rb") as fh:
        return f"{prefix}:{hashlib.sha256(fh.read()).hexdigest()[:16]}"


#: ``backbone.family`` -> ``fn(cfg, load_weights) -> Backbone`` (each family module registers).
BACKBONE_BUILDERS: dict[str, Callable[[BackboneConfig, bool], Backbone]] = plugin_registry()


def register_backbone_family(name: str):
    """Register ``fn(cfg, load_weights) -> Backbone`` under ``backbone.family=name``."""

    def deco(fn):
        BACKBONE_BUILDERS[name] = fn
        return fn

    return deco
