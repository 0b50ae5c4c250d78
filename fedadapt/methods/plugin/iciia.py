"""ICIIA (``iciia.txt``): intra-client and inter-image attention between the frozen feature
extractor and the classifier.

The B images of ONE client form a sequence; N post-norm transformer encoder layers let each
image's feature attend to the others' (Sec. 3.2), then the classifier predicts every image:

    h = LN(x + MSA(x)),    out = LN(h + MLP(h))

Feature grouping and shuffling (Sec. 3.4): every linear projection (q, k, v, o and the MLP's two)
splits the D features into P groups of D/P, projects each group with its own D/P x D/P matrix
and then shuffles the features across groups (transpose the P x D/P layout), so a projection
costs D^2/P parameters and multiply-adds instead of D^2. ICIIA-B is P = 1, ICIIA-T is P = 256.

Inputs are ``[S, B, D]``: S independent sequences (sessions, each from one client) of B images;
attention never crosses sequences. ``key_padding_mask`` (``[S, B]``, True = padding) lets shorter
sequences share a batch. Recognition one by one (:meth:`Iciia.predict_one`,
:func:`recognize_stream`) attends the target with the client's cached recent unlabeled features
(:class:`HistoryCache`, B - 1 of them) and falls back to the original classifier while the cache
is too short.

Ablations (Table 5): ``mixing="conv"`` replaces the attention's mixing by a depthwise convolution
across the images, ``mixing="none"`` removes it; ``shuffle=False`` removes the shuffling.
:func:`iciia_counts` gives the parameter and FLOP counts of Sec. 3.5 / Table 1.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from fedadapt.adapters.heads import check_dropout
from fedadapt.adapters.registry import register_method
from fedadapt.config import ConfigError, MethodConfig, ServerTrainConfig, check, check_server_train

MIXINGS = ("attention", "conv", "none")

#: Table 1's configurations (N = 3 layers, B = 16 images).
ICIIA_B = dict(groups=1)
ICIIA_T = dict(groups=256)


def shuffle_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """``[..., D]`` seen as ``[..., P, D/P]``, transposed to ``[..., D/P, P]`` and flattened:
    feature ``j`` of group ``g`` moves to position ``j * P + g``. P = 1 is the identity."""
    if groups == 1:
        return x
    *lead, dim = x.shape
    return x.reshape(*lead, groups, dim // groups).transpose(-1, -2).reshape(*lead, dim)


def _check(dim: int, groups: int, heads: int = 1, mixing: str = "attention") -> None:
    if groups < 1 or dim % groups:
        raise ConfigError(f"method.groups={groups} is invalid: the feature dimension {dim} must "
                          f"be a multiple of it")
    if heads < 1 or dim % heads:
        raise ConfigError(f"method.heads={heads} is invalid: the feature dimension {dim} must "
                          f"be a multiple of it")
    if mixing not in MIXINGS:
        raise ConfigError(f"method.mixing={mixing!r} is invalid: one of {MIXINGS}")


class GroupedLinear(nn.Module):
    """P independent ``D/P x D/P`` projections (a block-diagonal ``D x D`` one), then
    :func:`shuffle_groups`. Parameters: ``D^2/P + D``."""

    def __init__(self, dim: int, groups: int, bias: bool = True, shuffle: bool = True) -> None:
        super().__init__()
        _check(dim, groups)
        self.groups, self.shuffle = groups, shuffle
        width = dim // groups
        self.weight = nn.Parameter(torch.empty(groups, width, width))  # [P, out, in]
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        # nn.Linear's default initialisation, per group
        bound = 1 / math.sqrt(width)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        *lead, dim = x.shape
        x = x.reshape(*lead, self.groups, dim // self.groups)
        y = torch.einsum("...pi,poi->...po", x, self.weight).reshape(*lead, dim)
        if self.bias is not None:
            y = y + self.bias
        return shuffle_groups(y, self.groups) if self.shuffle else y


class IciiaLayer(nn.Module):
    """One post-norm encoder layer across the images of each sequence (``[S, B, D]``).

    ``mixing``: ``attention`` (H-head scaled dot-product softmax attention over the B images),
    ``conv`` (a depthwise kernel-3 convolution across the images on the value projection) or
    ``none`` (``o(v(x))``, no mixing). q and k exist only with ``attention`` (elsewhere they
    would get no gradient). Dropout on the attention weights and on both residual branches.
    """

    def __init__(self, dim: int, groups: int = 1, heads: int = 4, dropout: float = 0.1,
                 mixing: str = "attention", shuffle: bool = True) -> None:
        super().__init__()
        _check(dim, groups, heads, mixing)
        check_dropout(dropout)
        self.heads, self.mixing = heads, mixing

        def proj() -> GroupedLinear:
            return GroupedLinear(dim, groups, shuffle=shuffle)

        if mixing == "attention":
            self.q, self.k = proj(), proj()
        if mixing == "conv":
            self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.v, self.o = proj(), proj()
        self.attn_drop = nn.Dropout(dropout)
        self.drop1, self.drop2 = nn.Dropout(dropout), nn.Dropout(dropout)
        self.mlp = nn.Sequential(proj(), nn.ReLU(), nn.Dropout(dropout), proj())
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # [S, B, D] -> [S, H, B, D/H]
        s, b, d = x.shape
        return x.reshape(s, b, self.heads, d // self.heads).transpose(1, 2)

    def mix(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """The mixing across images, before the output projection: ``[S, B, D]``."""
        v = self.v(x)
        if self.mixing == "none":
            return v
        if self.mixing == "conv":
            if key_padding_mask is not None:  # padding contributes like the conv's zero padding
                v = v.masked_fill(key_padding_mask[..., None], 0.0)
            return self.conv(v.transpose(1, 2)).transpose(1, 2)
        q, k, v = self._split(self.q(x)), self._split(self.k(x)), self._split(v)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [S, H, B, B]
        if key_padding_mask is not None:
            # the dtype's minimum, not -inf: an all-padding sequence gives no NaN
            scores = scores.masked_fill(key_padding_mask[:, None, None, :],
                                        torch.finfo(scores.dtype).min)
        out = self.attn_drop(scores.softmax(dim=-1)) @ v  # [S, H, B, D/H]
        return out.transpose(1, 2).reshape(x.shape)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        h = self.norm1(x + self.drop1(self.o(self.mix(x, key_padding_mask))))
        return self.norm2(h + self.drop2(self.mlp(h)))


class Iciia(nn.Module):
    """N :class:`IciiaLayer` then ``Linear(D, C)``; ``forward([S, B, D]) -> [S, B, C]``
    (a single sequence ``[B, D]`` gives ``[B, C]``). ``classifier_relu`` puts a ReLU between
    the last layer and the classifier, as the authors' code does (mikudehuane/ICIIA,
    ``code/model/attention/encoder.py``, ``PartitionedTransformerEncoder.activation``; the
    paper does not mention it)."""

    def __init__(self, dim: int, num_classes: int, layers: int = 3, groups: int = 1,
                 heads: int = 4, dropout: float = 0.1, mixing: str = "attention",
                 shuffle: bool = True, classifier_relu: bool = False) -> None:
        super().__init__()
        if layers < 1:
            raise ConfigError(f"method.layers={layers} is invalid: must be >= 1")
        self.layers = nn.ModuleList(IciiaLayer(dim, groups, heads, dropout, mixing, shuffle)
                                    for _ in range(layers))
        self.classifier_relu = classifier_relu
        self.classifier = nn.Linear(dim, num_classes)

    def encode(self, feats: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None
               ) -> torch.Tensor:
        """The calibrated features, ``[S, B, D]``."""
        for layer in self.layers:
            feats = layer(feats, key_padding_mask)
        return feats

    def forward(self, feats: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None
                ) -> torch.Tensor:
        if feats.dim() == 2:
            mask = None if key_padding_mask is None else key_padding_mask[None]
            return self(feats[None], mask)[0]
        feats = self.encode(feats, key_padding_mask)
        return self.classifier(torch.relu(feats) if self.classifier_relu else feats)

    def predict_one(self, history: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """One-by-one mode: the target's logits ``[C]`` from the sequence history + target
        (``[h, D]``, ``[D]``; ``h`` may be 0). In eval mode this equals the batch-mode logits
        of the same images (attention is permutation-equivariant)."""
        history = history.to(target).reshape(-1, target.shape[-1])
        return self(torch.cat([history, target[None]]))[-1]


class HistoryCache:
    """A client's most recent unlabeled features (FIFO, ``capacity`` = B - 1)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity={capacity} must be >= 0")
        self._feats: deque[torch.Tensor] = deque(maxlen=capacity)

    def add(self, feat: torch.Tensor) -> None:
        self._feats.append(feat.detach())

    def features(self) -> torch.Tensor:
        """``[h, D]``, oldest first (``[0, 0]`` while empty)."""
        return torch.stack(list(self._feats)) if self._feats else torch.empty(0, 0)

    def __len__(self) -> int:
        return len(self._feats)


@torch.no_grad()
def recognize_stream(module: Iciia, original_classifier: Callable[[torch.Tensor], torch.Tensor],
                     feats: torch.Tensor, history_size: int, min_history: int) -> torch.Tensor:
    """Recognize ``feats`` (``[n, D]``, in arrival order) one by one: ``[n, C]`` logits.

    Image t uses ``module.predict_one`` with the cache of the up to ``history_size`` previous
    features, or ``original_classifier`` while the cache holds fewer than ``min_history``
    (cold start); then it joins the cache. Put both modules in eval mode first.
    """
    if min_history > history_size:
        raise ValueError(f"min_history={min_history} > history_size={history_size}: the module "
                         f"would never be used")
    cache = HistoryCache(history_size)
    out = []
    for feat in feats:
        if len(cache) < min_history:
            out.append(original_classifier(feat[None])[0])
        else:
            out.append(module.predict_one(cache.features(), feat))
        cache.add(feat)
    return torch.stack(out)


def iciia_counts(dim: int, layers: int = 3, groups: int = 1, images: int = 16, heads: int = 4
                 ) -> dict:
    """Parameters and FLOPs of N ICIIA layers on sequences of B = ``images`` (Sec. 3.5).

    * ``paper_params``: ``6 D^2 N / P``, the projections' weights (the paper's formula);
    * ``projection_params``: weights and biases of the 6 projections, ``6 (D^2/P + D) N``
      (what Table 1 prints for ICIIA-T, e.g. 0.14M for D = 1280);
    * ``module_params``: every parameter of the N layers (LayerNorms too), no classifier;
    * ``paper_flops``: ``(6 B D^2 / P + 2 B^2 D) N``, multiply-adds (the paper's formula);
    * ``measured_flops``: ``torch.utils.flop_counter.FlopCounterMode`` on one ``[1, B, D]``
      sequence through the layers in eval mode. It counts only matrix products (einsum, bmm,
      mm, addmm, convolutions), 2 FLOPs per multiply-add; biases, softmax, LayerNorm and ReLU
      are not counted, so it is ``2 x paper_flops``.

    The layers are built on the meta device: nothing is allocated or computed.
    """
    from torch.utils.flop_counter import FlopCounterMode

    _check(dim, groups, heads)
    d, n, p, b = dim, layers, groups, images
    with torch.device("meta"):
        stack = nn.Sequential(*(IciiaLayer(d, p, heads) for _ in range(n))).eval()
        x = torch.zeros(1, b, d)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        stack(x)
    return {
        "paper_params": 6 * d * (d // p) * n,
        "projection_params": 6 * (d * (d // p) + d) * n,
        "module_params": sum(t.numel() for t in stack.parameters()),
        "paper_flops": (6 * b * d * (d // p) + 2 * b * b * d) * n,
        "measured_flops": counter.get_total_flops(),
    }


# -- the method: ICIIA as a server-trained plug-in ---------------------------------------------

@dataclass
class IciiaConfig(MethodConfig, ServerTrainConfig):
    """ICIIA, trained once on the server (``fedadapt.methods.plugin.train``), delivered to the
    clients for recognition only. ``iciia_b``: P = 1, ``iciia_t``: P = 256."""

    name: str = "iciia"
    layers: int = 3
    #: P, the feature groups of every projection (1: ICIIA-B, 256: ICIIA-T).
    groups: int = 1
    heads: int = 4
    dropout: float = 0.1
    #: ``attention``, or the Table 5 ablations ``conv`` and ``none``.
    mixing: str = "attention"
    shuffle: bool = True
    #: B: images per training sequence and per batch-mode recognition (B - 1 cached one by one).
    images: int = 16
    #: One by one: the original classifier answers while fewer features are cached (cold start;
    #: the paper: ICIIA-B beats the original from 3 historical images, ICIIA-T from 5).
    min_history: int = 3
    #: A ReLU between the last layer and the classifier (the authors' code has one).
    classifier_relu: bool = False
    #: Server training (Algorithm 1): SGD (the authors' momentum default: 0), gradient-norm
    #: clipping at ``clip``, early stopping on validation. The same settings train the baselines.
    clip: float = 5.0
    #: Sequences (each of one client) per SGD step; the paper: 1.
    sequences_per_step: int = 1
    #: Baselines in the same run: the original classifier's epochs (when it is trained on the
    #: cached features), prompt tuning (a D/2 token per client) and each client's last-layer
    #: fine-tuning (the authors' ``finetune.py``): up to ``finetune_epochs`` epochs (0 = skip)
    #: of batches of ``finetune_batch`` with gradient clipping ``clip``, early stopping after
    #: ``patience`` epochs without gain on the client's validation split, the best epoch's
    #: accuracy reported (epoch 0: the original classifier).
    classifier_epochs: int = 30
    finetune_epochs: int = 100
    finetune_batch: int = 16
    prompt_tuning: bool = True
    #: Figure 6: also recognise every test image with exactly h cached features, for each h
    #: here (images with fewer than h predecessors are left out of that h's accuracy).
    history_sweep: list[int] = field(default_factory=list)
    #: fedadapt-inspect: count for this D instead of the backbone's (Table 1's backbones).
    feature_dim: Optional[int] = None

    def check(self) -> None:
        _check_config(self)


class IciiaHead(nn.Module):
    """The module on pooled features ``[B, D]``: the batch is ONE client's sequence."""

    def __init__(self, module: Iciia) -> None:
        super().__init__()
        self.module = module

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.module(feats)


@register_method("iciia", IciiaConfig, family="plugin", counts=lambda cfg, d, c: _counts(cfg, d))
def build_iciia(cfg: IciiaConfig, backbone, num_classes, with_backbone):
    from fedadapt.adapters.model import AdaptedModel

    _check_config(cfg)
    dim = cfg.feature_dim or backbone.embed_dim  # Iciia checks mixing, groups and heads
    check(cfg.finetune_epochs >= 0, "method.finetune_epochs", cfg.finetune_epochs,
          "must be >= 0")
    module = Iciia(dim, num_classes, layers=cfg.layers, groups=cfg.groups, heads=cfg.heads,
                   dropout=cfg.dropout, mixing=cfg.mixing, shuffle=cfg.shuffle,
                   classifier_relu=cfg.classifier_relu)
    return AdaptedModel(head=IciiaHead(module), backbone=backbone if with_backbone else None)


def _check_config(cfg: IciiaConfig) -> None:
    """The domains of ICIIA's keys (the module's own shape rules: :class:`Iciia`)."""
    check_server_train(cfg, "method")
    for key in ("layers", "groups", "heads", "images", "sequences_per_step", "classifier_epochs",
                "finetune_batch"):
        check(getattr(cfg, key) >= 1, f"method.{key}", getattr(cfg, key), "must be >= 1")
    check(cfg.clip > 0, "method.clip", cfg.clip, "must be > 0")
    check_dropout(cfg.dropout)
    check(cfg.mixing in MIXINGS, "method.mixing", cfg.mixing, f"one of {MIXINGS}")
    check(0 <= cfg.min_history <= cfg.images - 1, "method.min_history", cfg.min_history,
          f"must be in 0..method.images-1 ({cfg.images - 1} cached features)")
    check(all(h >= 0 for h in cfg.history_sweep), "method.history_sweep",
          list(cfg.history_sweep), "numbers of cached features >= 0")
    check(cfg.feature_dim is None or cfg.feature_dim >= 1, "method.feature_dim",
          cfg.feature_dim, "must be >= 1 or null (the backbone's width)")
    check(cfg.use_cache, "method.use_cache", cfg.use_cache,
          "ICIIA trains on the foundation's cached features")


def _counts(cfg: IciiaConfig, embed_dim: int) -> dict:
    """Table 1's figures for ``images`` = B and the configured D (``method.feature_dim``)."""
    dim = cfg.feature_dim or embed_dim
    return {"feature_dim": dim, "layers": cfg.layers, "groups": cfg.groups,
            "images": cfg.images,
            **iciia_counts(dim, cfg.layers, cfg.groups, cfg.images, cfg.heads)}
