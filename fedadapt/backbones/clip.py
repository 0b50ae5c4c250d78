"""CLIP through ``open_clip``: image features, class-prompt text features, logit scale.

``backbone.arch.model`` names an open_clip model (``ViT-B-32`` by default) and ``backbone.weights``
a pretrained tag (``openai``, ``laion2b_s34b_b79k``, ...) or a local checkpoint path; tests pass a
full small config in ``backbone.arch`` (``embed_dim``, ``vision_cfg``, ``text_cfg``) instead.

The activation follows the weights: OpenAI's CLIP weights were trained with QuickGELU
(``x * sigmoid(1.702 x)``) while open_clip's ``ViT-B-32`` config builds plain GELU (and only
warns when OpenAI weights are loaded into it). ``backbone.arch.quick_gelu`` (null: what the
pretrained tag's open_clip config says, ``quick_gelu: True`` for every ``openai`` tag) builds the
model with ``force_quick_gelu``, with or without loading the weights, so ``fedadapt-inspect`` and
random-weight runs have the same architecture as the real one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fedadapt.assets import MissingAssetError, prefetch_hint
from fedadapt.backbones.base import Backbone, register_backbone_family
from fedadapt.config import BackboneConfig, ConfigError
from fedadapt.log import log


class ClipBackbone(Backbone):
    """Frozen open_clip model; ``forward`` returns the (unnormalised) image embedding."""

    #: open_clip's attention keeps query, key and value in one packed ``in_proj_weight``, which
    #: peft adapts only through its MultiheadAttention layer, and that layer cannot run under
    #: ``vmap`` (grouped clients), and its ``out_proj`` is read as a bare weight (a LoRA there
    #: would never run): the PEFT methods adapt the image tower's MLPs.
    peft_targets = {"lora": ("c_fc", "c_proj"), "ia3": ("c_fc", "c_proj"),
                    "ia3_feedforward": ("c_proj",)}

    def __init__(self, *, model: nn.Module, tokenizer, weights_id: str, image_size: int) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.embed_dim = model.text_projection.shape[1] if isinstance(
            model.text_projection, torch.Tensor) else model.text_projection.out_features
        self.image_size = image_size
        self.weights_id = weights_id
        # open_clip's own preprocess for this model: bicubic resize of the shortest side to the
        # input size, centre crop, the model's mean / std
        from open_clip import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD, get_model_preprocess_cfg

        pre = get_model_preprocess_cfg(model)  # a model built from a bare config has none
        self.mean = tuple(pre.get("mean", OPENAI_DATASET_MEAN))
        self.std = tuple(pre.get("std", OPENAI_DATASET_STD))
        self.interpolation = str(pre.get("interpolation", "bicubic"))
        self.crop_pct = 1.0

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,D]
        return self.model.encode_image(images)

    def tuning_module(self) -> nn.Module:
        return self.model.visual

    def tokenize(self, prompts: list[str]) -> torch.Tensor:  # -> [C, context_length]
        return self.tokenizer(prompts)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:  # -> [C, D], L2-normalised
        device = next(self.model.parameters()).device
        feats = self.model.encode_text(self.tokenize(prompts).to(device))
        return feats / feats.norm(dim=-1, keepdim=True)

    @property
    def logit_scale(self) -> torch.Tensor:
        return self.model.logit_scale.exp()


@register_backbone_family("clip")
def build_clip(cfg: BackboneConfig, load_weights: bool) -> ClipBackbone:
    import open_clip

    arch = dict(cfg.arch)
    name = arch.pop("model", "ViT-B-32")
    arch.pop("init_seed", None)  # used by build_backbone
    quick_gelu = arch.pop("quick_gelu", None)
    if arch:  # a full config (tiny test models)
        model = open_clip.CLIP(**arch, quick_gelu=bool(quick_gelu))
        tokenizer = open_clip.SimpleTokenizer(context_length=arch["text_cfg"]["context_length"])
        weights_id = "random-quickgelu" if quick_gelu else "random"
    else:
        quick_gelu = weights_quick_gelu(name, cfg.weights, quick_gelu)
        pretrained = cfg.weights if load_weights else None
        try:
            model = open_clip.create_model(name, pretrained=pretrained,
                                           load_weights=bool(pretrained),
                                           force_quick_gelu=quick_gelu)
        except (OSError, RuntimeError, ValueError) as err:
            raise MissingAssetError(
                prefetch_hint(f"CLIP weights {name}/{cfg.weights}", backbone=cfg.name)
            ) from err
        tokenizer = open_clip.get_tokenizer(name)
        weights_id = f"{name}{'-quickgelu' if quick_gelu else ''}/{pretrained or 'random'}"
    return ClipBackbone(model=model, tokenizer=tokenizer, weights_id=weights_id,
                        image_size=cfg.image_size)


def weights_quick_gelu(model: str, weights: Optional[str], configured: Optional[bool]) -> bool:
    """Whether ``model`` is built with QuickGELU: ``configured`` (``backbone.arch.quick_gelu``)
    when set, else what open_clip's pretrained config of the tag ``weights`` says (False for a
    local path, an unknown tag or no weights)."""
    from open_clip.pretrained import get_pretrained_cfg

    tagged = bool(weights and get_pretrained_cfg(model, weights).get("quick_gelu", False))
    if configured is None:
        return tagged
    if bool(configured) != tagged and weights and get_pretrained_cfg(model, weights):
        log(f"[backbone] backbone.arch.quick_gelu={bool(configured)} although the {model}/"
            f"{weights} weights were trained with{'' if tagged else 'out'} QuickGELU")
    return bool(configured)


@dataclass(frozen=True)
class ClassText:
    """The class prompts and their features from the frozen text tower, computed once per run
    (picklable: Ray workers receive it with the run's spec and never run the text tower)."""

    prompts: tuple[str, ...]
    #: ``[C, D]``, L2-normalised, on the CPU.
    features: torch.Tensor
    #: CLIP's ``exp(logit_scale)`` (100 for OpenAI's weights).
    logit_scale: float


def class_text(backbone, class_names, template: str) -> Optional[ClassText]:
    """``template.format(name)`` for every class through ``backbone``'s text tower; None when the
    backbone has no text tower (any non-CLIP backbone). Underscores in names become spaces."""
    if not isinstance(backbone, ClipBackbone):
        return None
    if "{}" not in template:
        raise ConfigError(f"method.prompt={template!r} is invalid: it needs a '{{}}' where the "
                          f"class name goes (e.g. 'a picture of a {{}}')")
    prompts = tuple(template.format(str(c).replace("_", " ")) for c in class_names)
    return ClassText(prompts=prompts, features=backbone.encode_prompts(list(prompts)).cpu(),
                     logit_scale=float(backbone.logit_scale))
