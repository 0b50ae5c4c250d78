"""FedCLIP (``fedclip.txt``): the attention adapter AttAI on the frozen CLIP image feature, and
the paper's CLIP baselines, as one configurable model.

AttAI is ``Linear(d,d) -> Tanh -> Linear(d,d) -> Softmax`` (Sec. 3.3): an attention vector over
the feature's d dimensions that sums to one; the feature is multiplied by it (Eq. 5) and
L2-normalised, and the logits are cosine similarities with the class prompts' text features
times CLIP's logit scale (Eq. 6-7). The adapter sees only the pooled image feature, so it trains
on the foundation's feature cache; it is the only tensor that travels (525,312 scalars on
ViT-B/32, d = 512).

Losses (``method.loss``): ``contrastive``, the authors' CLIP-style symmetric cross-entropy
between the batch's image features and the text features of each sample's class prompt (targets
on the diagonal, as CLIP's pre-training; samples of the same class in one batch count as
negatives there too); or ``ce``, cross-entropy of the class logits.

The same model gives the baselines and the analyses of Sec. 4.4:

* ``fedavg_clip`` / ``fedprox_clip``: no adapter, the whole CLIP (image and text towers, logit
  scale) trains and is averaged;
* ``fedclip_text``: a second AttAI on the text features ("more adapters");
* ``fedclip_full``: adapter and backbone train together ("more trainable parameters");
* ``attai_linear`` / ``norm_linear``: for backbones without a text tower (the offline evidence
  on EfficientNet-Lite0), a linear classifier replaces the text prompts, with and without AttAI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.adapters.model import AdaptedModel, weighted_slots
from fedadapt.adapters.registry import register_method
from fedadapt.config import ConfigError, MethodConfig, check
from fedadapt.grouping import forms

CLASSIFIERS = ("prompts", "linear")
LOSSES = ("contrastive", "ce")


@dataclass
class FedClipConfig(MethodConfig):
    name: str = "fedclip"
    #: AttAI on the image feature.
    image_adapter: bool = True
    #: A second AttAI on the class prompts' text features (Sec. 4.4, Figure 3a).
    text_adapter: bool = False
    #: The CLIP towers train too (FedAvg/FedProx over CLIP; Figure 3b): images, not the cache.
    train_backbone: bool = False
    #: ``prompts``: cosine logits against the class prompts (CLIP); ``linear``: a linear
    #: classifier on the normalised feature (backbones without a text tower; a variant).
    classifier: str = "prompts"
    #: Prompt template; ``{}`` is the class name.
    prompt: str = "a picture of a {}"
    #: ``contrastive`` (the authors' symmetric CLIP loss) or ``ce`` (cross-entropy over classes).
    loss: str = "contrastive"

    def check(self) -> None:
        check(self.classifier in CLASSIFIERS, "method.classifier", self.classifier,
              f"one of {CLASSIFIERS}")
        check(self.loss in LOSSES, "method.loss", self.loss, f"one of {LOSSES}")


class AttAI(nn.Module):
    """``a = Softmax(Linear(Tanh(Linear(f))))``; ``forward(f) = a * f`` (Eq. 5)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, dim),
                                 nn.Softmax(dim=-1))

    def attention(self, feats: torch.Tensor) -> torch.Tensor:  # [B, d] -> [B, d], rows sum to 1
        return self.net(feats)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.attention(feats) * feats


class PromptHead(nn.Module):
    """Adapters and classifier on top of the pooled features.

    ``text_features`` (``[C, d]`` from the frozen text tower) and ``logit_scale`` are buffers:
    they are part of the model on every client but never trained or sent.
    """

    def __init__(self, dim: int, num_classes: int, *, image_adapter: bool, text_adapter: bool,
                 text_features: Optional[torch.Tensor], logit_scale: float) -> None:
        super().__init__()
        self.image_adapter = AttAI(dim) if image_adapter else None
        self.text_adapter = AttAI(dim) if text_adapter else None
        self.classifier = nn.Linear(dim, num_classes) if text_features is None else None
        if text_features is not None:
            self.register_buffer("text_features", text_features.clone().float())
        else:
            self.text_features = None
        self.register_buffer("logit_scale", torch.tensor(float(logit_scale)))

    def image_features(self, feats: torch.Tensor) -> torch.Tensor:
        if self.image_adapter is not None:
            feats = self.image_adapter(feats)
        return F.normalize(feats, dim=-1)

    def class_features(self, text: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[C, d]`` normalised class features: ``text`` (a trainable text tower's output) or
        the frozen prompts' features, through the text adapter if there is one."""
        text = self.text_features if text is None else text
        if self.text_adapter is not None:
            text = self.text_adapter(text)
        return F.normalize(text, dim=-1)

    def forward(self, feats: torch.Tensor, text: Optional[torch.Tensor] = None,
                scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        image = self.image_features(feats)
        if self.classifier is not None:
            return self.classifier(image)
        scale = self.logit_scale if scale is None else scale
        return scale * image @ self.class_features(text).t()

    def loss(self, feats: torch.Tensor, y: torch.Tensor, kind: str,
             text: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
        if kind == "ce" or self.classifier is not None:
            return F.cross_entropy(self(feats, text, scale), y)
        return contrastive_loss(self.image_features(feats), self.class_features(text)[y],
                                self.logit_scale if scale is None else scale)


def _text_adapter_guard(head: PromptHead):
    """Clients side by side: a trainable text adapter runs on the class prompts, once per
    client, not on a client's rows: no grouped form (those runs train through vmap)."""
    adapter = head.text_adapter
    if adapter is not None and any(p.requires_grad for p in adapter.parameters()):
        return "a trainable text adapter (per client, on the class prompts, not on its rows)"
    return None


forms.register_form(PromptHead, guard=_text_adapter_guard)


def contrastive_loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric loss between paired, normalised ``image[i]`` and ``text[i]``:
    ``(CE(s I T^T, diag) + CE(s T I^T, diag)) / 2``."""
    logits = scale * image @ text.t()
    target = torch.arange(len(image), device=image.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target))


class FedClipModel(AdaptedModel):
    """Backbone (optional: cached features) + :class:`PromptHead`. With ``train_backbone`` the
    class features come from the trainable text tower at every step, and the scale from CLIP's
    trainable logit scale."""

    def __init__(self, *, head: PromptHead, backbone, train_backbone: bool, loss: str,
                 prompt_tokens: Optional[torch.Tensor]) -> None:
        super().__init__(head=head, backbone=backbone, train_backbone=train_backbone)
        self.loss_kind = loss
        if prompt_tokens is not None:
            self.register_buffer("prompt_tokens", prompt_tokens)
        else:
            self.prompt_tokens = None

    def _inputs(self, x: torch.Tensor):
        """(image features, text features or None, scale or None) for the head."""
        if self.backbone is None:
            return x, None, None
        with torch.set_grad_enabled(self.train_backbone and torch.is_grad_enabled()):
            feats = self.backbone(x)
            if self.prompt_tokens is None:
                return feats, None, None
            return (feats, self.backbone.model.encode_text(self.prompt_tokens),
                    self.backbone.model.logit_scale.exp())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(*self._inputs(x))

    def training_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        feats, text, scale = self._inputs(x)
        return self.head.loss(feats, y, self.loss_kind, text, scale)

    def slot_losses(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                    exits=None) -> torch.Tensor:
        """:meth:`AdaptedModel.slot_losses`; the contrastive loss within each slot's own rows
        (its batch), its padding rows left out of both directions' softmax."""
        feats, text, scale = self._inputs(x)
        head = self.head
        if self.loss_kind == "ce" or head.classifier is not None:
            return weighted_slots(F.cross_entropy(head(feats, text, scale), y,
                                                  reduction="none"), weight)
        scale = head.logit_scale if scale is None else scale
        image = head.image_features(feats)
        paired = head.class_features(text)[y]
        rows = forms.active().rows
        n = len(image) // rows
        # scaled before the product, as contrastive_loss computes it (bf16 rounds alike)
        logits = torch.bmm((scale * image).view(n, rows, -1), paired.view(n, rows, -1).mT)
        real = (weight > 0).view(n, rows)
        logits = logits.masked_fill(~(real.unsqueeze(2) & real.unsqueeze(1)), -1e4)
        target = torch.arange(rows, device=x.device).repeat(n)
        both = (F.cross_entropy(logits.reshape(-1, rows), target, reduction="none")
                + F.cross_entropy(logits.mT.reshape(-1, rows), target, reduction="none"))
        return 0.5 * weighted_slots(both, weight)


def _check(cfg: FedClipConfig, class_text) -> None:
    check(cfg.classifier in CLASSIFIERS, "method.classifier", cfg.classifier,
          f"one of {CLASSIFIERS}")
    check(cfg.loss in LOSSES, "method.loss", cfg.loss, f"one of {LOSSES}")
    if cfg.classifier == "linear":
        if cfg.loss != "ce":
            raise ConfigError("method.loss=contrastive is invalid with method.classifier=linear:"
                              " the contrastive loss needs class prompts; use method.loss=ce")
        if cfg.text_adapter or cfg.train_backbone:
            raise ConfigError("method.text_adapter / method.train_backbone need "
                              "method.classifier=prompts (a CLIP backbone)")
    elif class_text is None:
        raise ConfigError(f"method={cfg.name} (method.classifier=prompts) needs a CLIP backbone "
                          f"with a text tower (backbone=clip_vit_b32); on other backbones use "
                          f"method=attai_linear")
    if cfg.train_backbone and cfg.use_cache:
        raise ConfigError(f"method.use_cache=true is invalid for method={cfg.name}: "
                          f"method.train_backbone=true changes the features every step")
    if not (cfg.image_adapter or cfg.text_adapter or cfg.train_backbone
            or cfg.classifier == "linear"):
        raise ConfigError(f"method={cfg.name}: nothing would train (enable method.image_adapter, "
                          f"method.text_adapter or method.train_backbone)")


@register_method("fedclip", FedClipConfig, uses_text=True)
def build_fedclip(cfg: FedClipConfig, backbone, num_classes, with_backbone, class_text=None):
    _check(cfg, class_text)
    prompts = cfg.classifier == "prompts"
    head = PromptHead(backbone.embed_dim, num_classes, image_adapter=cfg.image_adapter,
                      text_adapter=cfg.text_adapter,
                      text_features=class_text.features if prompts else None,
                      logit_scale=class_text.logit_scale if prompts else 1.0)
    tokens = None
    if cfg.train_backbone:
        tokens = backbone.tokenize(list(class_text.prompts))
    return FedClipModel(head=head, backbone=backbone if with_backbone else None,
                        train_backbone=cfg.train_backbone, loss=cfg.loss, prompt_tokens=tokens)
