"""AST, the Audio Spectrogram Transformer (Gong et al. 2021), initialised from ImageNet DeiT.

The Accumulator paper (``shared/papers/accumulator-anytime-fl.txt``, Sec. 5.1) runs Speech
Commands v2 on "a pretrained DeiT-small ... with 16x16 patches on ILSVRC-2012 as the foundation
model, which can be used for both image and speech recognition – i.e. the backbone of AST". This
is ``transformers.ASTModel`` with DeiT-S's sizes (D = 384, 12 blocks, 6 heads, MLP 1536), 16 x 16
patches at frequency and time stride 10 (12 x 12 patches on a 128-frame x 128-bin spectrogram:
AST's Speech Commands setting), its weights converted from the image model the way AST does
(:func:`ast_from_vit`):

* the patch embedding's three input channels are summed into one (a spectrogram in all three
  channels of the image kernel gives the same response);
* the position embeddings of the image's ``g x g`` patch grid are cut to the spectrogram's
  ``f x t`` grid from the middle (or bilinearly interpolated along an axis that is longer),
  frequency along the image's rows, time along its columns;
* AST's two leading tokens (CLS and distillation) both take the CLS token and its position
  embedding (DeiT-S has no distillation token; a distilled DeiT's own is used);
* the blocks and the final LayerNorm are copied exactly.

With ``backbone.weights=null`` the AST is random (tests, ``fedadapt-inspect``).

Which token an exit reads
-------------------------
Exits read the **CLS token at position 0**, as for the ViT (the paper speaks of CLS tokens), and
the Accumulator's hook replaces that token before each block. AST's own pooled output averages
the first two tokens after the final LayerNorm; from DeiT-S weights both tokens enter with the same
embedding and position embedding, so through the frozen blocks they stay equal (attention treats
equal tokens alike) and that average *is* the CLS token; once the Accumulator replaces position 0,
position 1 still carries the unmodulated stream, which an exit should not read. The pooled feature
(``forward``, methods on cached features) is the final-norm CLS token likewise.

The extractor settings (``backbone.arch``: ``max_length``, ``num_mel_bins``, ``feature_mean``,
``feature_std``, ``sampling_rate``) define the spectrograms; :mod:`fedadapt.data.audio` computes
them with ``transformers.ASTFeatureExtractor``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.assets import MissingAssetError, prefetch_hint
from fedadapt.backbones.base import register_backbone_family
from fedadapt.backbones.vit import ViTBackbone
from fedadapt.config import BackboneConfig, ConfigError

#: ``backbone.arch`` keys that configure the feature extractor, not ``ASTConfig`` (defaults:
#: AST's Speech Commands normalisation, 16 kHz).
EXTRACTOR_KEYS = {"feature_mean": -6.845978, "feature_std": 5.5654526, "sampling_rate": 16_000}
#: ``backbone.arch`` keys of ``ASTConfig`` that shape the spectrogram input (kept when the sizes
#: come from converted image weights).
INPUT_KEYS = ("frequency_stride", "time_stride", "max_length", "num_mel_bins")


class ASTBackbone(ViTBackbone):
    """Frozen AST with the ViT backbone's per-layer interface (exits, CLS hook, adapters).

    Parameters
    ----------
    model : transformers.ASTModel
    weights_id : str
        Hub id, local path or ``random``.
    sampling_rate : int
        Hz of the clips the spectrograms are computed from.
    feature_mean, feature_std : float
        The feature extractor's normalisation of the log-mel values.
    """

    modality = "audio"

    def __init__(self, *, model: nn.Module, weights_id: str, sampling_rate: int,
                 feature_mean: float, feature_std: float) -> None:
        super().__init__(model=model, weights_id=weights_id, image_size=model.config.max_length)
        self.num_mel_bins = int(model.config.num_mel_bins)
        self.max_length = int(model.config.max_length)
        self.sampling_rate = int(sampling_rate)
        self.feature_mean = float(feature_mean)
        self.feature_std = float(feature_std)

    def embed(self, spectrograms: torch.Tensor) -> torch.Tensor:  # [B, T, F] -> [B, 2 + P, D]
        return self.model.embeddings(spectrograms)

    def example_input(self, batch_size: int = 1) -> torch.Tensor:
        """Zeros of a batch of spectrograms ``[B, T, F]``."""
        return torch.zeros(batch_size, self.max_length, self.num_mel_bins)


def _fit_axis(grid: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """Cut ``grid`` (``[1, D, H, W]``) to ``n`` along ``dim`` (2: rows, 3: columns) from the
    middle, or interpolate it bilinearly to ``n`` when it is shorter (AST's rule)."""
    size = grid.shape[dim]
    if n <= size:
        return grid.narrow(dim, size // 2 - n // 2, n)
    out = (n, grid.shape[3]) if dim == 2 else (grid.shape[2], n)
    return F.interpolate(grid, size=out, mode="bilinear", align_corners=False)


def _blocks(model: nn.Module) -> nn.ModuleList:
    return model.layers if "layers" in model._modules else model.encoder.layer


@torch.no_grad()
def ast_from_vit(vit: nn.Module, config) -> nn.Module:
    """An ``ASTModel`` with ``config``'s input geometry and ``vit``'s weights (a
    ``transformers`` ``ViTModel`` or ``DeiTModel``), converted as AST does (module docstring).

    Shapes: patch kernel ``[D, 3, p, p] -> [D, 1, p, p]``; position embeddings
    ``[1, lead + g*g, D] -> [1, 2 + f*t, D]`` (``lead``: 1 for ViT/DeiT-S, 2 for a distilled
    DeiT).
    """
    from transformers import ASTModel

    ast = ASTModel(config)
    src, dst = vit.embeddings, ast.embeddings
    proj = src.patch_embeddings.projection
    if proj.kernel_size != dst.patch_embeddings.projection.kernel_size:
        raise ConfigError(f"backbone.arch: AST patch size {config.patch_size} differs from the "
                          f"image weights' {proj.kernel_size[0]}")
    dst.patch_embeddings.projection.weight.copy_(proj.weight.sum(dim=1, keepdim=True))
    dst.patch_embeddings.projection.bias.copy_(proj.bias)
    cls = src.cls_token  # [1, 1, D]
    dist = getattr(src, "distillation_token", None)
    lead = 1 if dist is None else 2
    pos = src.position_embeddings  # [1, lead + g*g, D]
    g = int(round((pos.shape[1] - lead) ** 0.5))
    grid = pos[:, lead:].reshape(1, g, g, -1).permute(0, 3, 1, 2)  # [1, D, g(freq), g(time)]
    f_dim, t_dim = dst.get_shape(config)
    grid = _fit_axis(_fit_axis(grid, t_dim, 3), f_dim, 2)  # [1, D, f, t]
    patches = grid.flatten(2).transpose(1, 2)  # [1, f*t, D], frequency-major as AST's patches
    dst.cls_token.copy_(cls)
    dst.distillation_token.copy_(cls if dist is None else dist)
    dst.position_embeddings.copy_(torch.cat([pos[:, :1], pos[:, lead - 1:lead], patches], 1))
    _blocks(ast).load_state_dict(_blocks(vit).state_dict())
    ast.layernorm.load_state_dict(vit.layernorm.state_dict())
    return ast


def _source_config(cfg: BackboneConfig):
    """The weights' ``transformers`` config; one line naming what is missing otherwise."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.weights)
    except (OSError, ValueError) as err:
        if str(cfg.weights).startswith(("/", ".", "~")):  # a local folder, not a hub id
            raise MissingAssetError(
                f"backbone.weights={cfg.weights!r}: no ViT, DeiT or AST weights there "
                f"(config.json and model.safetensors, as save_pretrained writes them)") from err
        raise MissingAssetError(prefetch_hint(
            f"Backbone weights {cfg.weights!r} (the image model AST starts from)",
            backbone=cfg.name)) from err


def _ast_config(source, arch: dict):
    """``ASTConfig`` with the image model's sizes and ``arch``'s input geometry."""
    from transformers import ASTConfig

    return ASTConfig(
        hidden_size=source.hidden_size, num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        intermediate_size=source.intermediate_size, hidden_act=source.hidden_act,
        layer_norm_eps=source.layer_norm_eps, qkv_bias=getattr(source, "qkv_bias", True),
        patch_size=source.patch_size, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        **{k: arch[k] for k in INPUT_KEYS if k in arch})


def _pretrained(cfg: BackboneConfig, arch: dict) -> nn.Module:
    """AST weights as they are, or image weights (ViT / DeiT) converted to AST."""
    from transformers import ASTModel, DeiTModel, ViTModel

    source = _source_config(cfg)
    kind = source.model_type
    if kind == "audio-spectrogram-transformer":
        return ASTModel.from_pretrained(cfg.weights)
    if kind not in ("vit", "deit"):
        raise ConfigError(f"backbone.weights={cfg.weights!r} is a {kind} checkpoint: AST starts "
                          f"from ViT / DeiT (or AST) weights")
    model_cls = ViTModel if kind == "vit" else DeiTModel
    try:
        image = model_cls.from_pretrained(cfg.weights, add_pooling_layer=False)
    except (OSError, ValueError) as err:
        raise MissingAssetError(prefetch_hint(f"Backbone weights {cfg.weights!r}",
                                              backbone=cfg.name)) from err
    return ast_from_vit(image, _ast_config(source, arch))


@register_backbone_family("ast")
def build_ast(cfg: BackboneConfig, load_weights: bool) -> ASTBackbone:
    from transformers import ASTConfig, ASTModel

    arch = dict(cfg.arch)
    arch.pop("init_seed", None)  # used by build_backbone
    extractor = {k: arch.pop(k, v) for k, v in EXTRACTOR_KEYS.items()}
    weights_id: Optional[str] = None
    if load_weights and cfg.weights:
        model, weights_id = _pretrained(cfg, arch), str(cfg.weights)
    else:
        model = ASTModel(ASTConfig(**arch))
    return ASTBackbone(model=model, weights_id=weights_id or "random", **extractor)
