"""Early-exit methods on a frozen ViT/DeiT: layer-wise heads and the Accumulator.

Paper: "Accumulator: anytime and multi-tier federated adaptation of frozen transformers"
(``shared/papers/accumulator-anytime-fl.txt``, Sec. 4.2). Module sizes follow
``docs/accumulator-sizing.md``, which reproduces the paper's Table 5 counts on CIFAR-100.

Token indexing (0-based blocks): ``c_0`` is the CLS token of the embedding output and ``c_{k+1}``
the CLS token a block ``k`` outputs. Exit ``e`` sits after block ``e`` (the paper's exits 1..12,
numbered 0..11 as in its Sec. 5 and Table 7).

* **Layer-wise linear / MLP** (``lw_linear``, ``lw_mlp``): one head per exit on ``c_{e+1}``;
  a linear head reads it through the backbone's own (frozen) final LayerNorm, as DeiT's
  classifier does, an MLP head through its own LayerNorm.
* **Accumulator** (``accumulator``): before block ``k`` a small transformer reads
  ``[client token, c_0 + p'_0, ..., c_k + p'_k]`` (``p'``: learnable layer embeddings); its output
  at position ``k + 1`` replaces the CLS token that enters block ``k`` (token replace, Eq. 7),
  and exit ``k - 1`` predicts with one MLP head shared by all exits from ``h_0 + c_k`` (residual,
  Eq. 8).
  The same call serves both, so the Accumulator runs once per block.
* Parallel adapters (He et al. 2021) beside every block's MLP combine with all of them
  (``method.parallel_adapter=true``; ``method.adapter_scale`` is He et al.'s ``s``).

The settings (conventional, anytime, multi-tier, personalization; :mod:`fedadapt.settings`)
choose which exit a training step uses and which exits are evaluated, through
:meth:`ExitModel.exit_logits`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fedadapt.adapters.heads import check_dropout
from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import register_method
from fedadapt.config import ConfigError, MethodConfig
from fedadapt.grouping import dropout, forms


@dataclass
class ExitMethodConfig(MethodConfig):
    """Shared by the early-exit methods (images in: the backbone's hooks need the pixels)."""

    use_cache: bool = False
    parallel_adapter: bool = False
    adapter_bottleneck: int = 64
    #: The parallel adapters' output scale ``s``: a block's MLP computes ``mlp(x) + s *
    #: adapter(x)``. He et al. (2021) scale their FFN parallel adapter by s = 4; the Accumulator
    #: paper names no scale, so the default 1 adds the adapter as it is.
    adapter_scale: float = 1.0
    #: Train (and federate) the whole backbone too: with ``lw_mlp`` this is the paper's
    #: "Fine-tuning" baseline (DeiT-S + layer-wise MLP heads, Table 5: 30.62M).
    train_backbone: bool = False

    def check(self) -> None:
        if self.adapter_bottleneck < 1:
            raise ConfigError(f"method.adapter_bottleneck={self.adapter_bottleneck} is invalid: "
                              f"must be >= 1")


@dataclass
class LwLinearConfig(ExitMethodConfig):
    """Per exit: ``Linear(D, C)`` on that exit's CLS token after the backbone's own final
    LayerNorm (frozen), the input DeiT's classifier reads."""

    name: str = "lw_linear"


@dataclass
class LwMlpConfig(ExitMethodConfig):
    """Per exit: ``LN(D) -> Linear(D, H) -> GELU -> Dropout -> Linear(H, C)``."""

    name: str = "lw_mlp"
    #: Hidden width; None = 4 x the backbone's width (1536 on DeiT-S).
    hidden_dim: Optional[int] = None
    dropout: float = 0.1
    head_norm: bool = True

    def check(self) -> None:
        super().check()
        check_dropout(self.dropout)
        if self.hidden_dim is not None and self.hidden_dim < 1:
            raise ConfigError(f"method.hidden_dim={self.hidden_dim} is invalid: must be >= 1 "
                              f"or null (4 x the backbone's width)")


@dataclass
class AccumulatorConfig(ExitMethodConfig):
    """The Accumulator and its shared head; the switches are Table 5 (right)'s ablations."""

    name: str = "accumulator"
    depth: int = 1
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    #: ``mlp``: ``LN -> Linear(D, 4D) -> GELU -> Linear(4D, D) -> GELU -> Linear(D, C)``;
    #: ``linear``: ``Linear(D, C)``.
    head: str = "mlp"
    #: Hidden widths of the MLP head; None = ``[4 D, D]`` (``[1536, 384]`` on DeiT-S).
    head_hidden: Optional[list[int]] = None
    token_replace: bool = True
    residual: bool = True
    #: Zero-initialise the last layer of each of the Accumulator's residual branches (the
    #: attention's output projection and the MLP's second linear layer), so that at the start
    #: its output at position ``k + 1`` is its input ``c_k + p'_k``: token replace starts from
    #: the backbone's own CLS tokens. False: PyTorch's default initialisation throughout, whose
    #: branches add an image-independent vector of about the tokens' own size before every
    #: block (docs/papers/accumulator.md, "Token replace"). The paper says only "randomly
    #: initialized".
    zero_init: bool = True

    def check(self) -> None:
        super().check()
        check_dropout(self.dropout)
        if self.depth < 1:
            raise ConfigError(f"method.depth={self.depth} is invalid: must be >= 1")
        if not self.mlp_ratio > 0:
            raise ConfigError(f"method.mlp_ratio={self.mlp_ratio} is invalid: must be > 0")
        if self.head not in ("mlp", "linear"):
            raise ConfigError(f"method.head={self.head!r} is invalid: 'mlp' or 'linear'")
        if self.head_hidden is not None and not all(h >= 1 for h in self.head_hidden):
            raise ConfigError(f"method.head_hidden={list(self.head_hidden)} is invalid: widths "
                              f">= 1, or null for [4 D, D]")


class ParallelAdapter(nn.Module):
    """``s * Linear(r, D)(ReLU(Linear(D, r)(x)))``, added beside a frozen MLP.

    He et al. (2021), "Towards a unified view of parameter-efficient transfer learning": the
    parallel adapter at the FFN, with scale ``s`` (4 in their best configuration).
    The up-projection starts at zero, so the adapted backbone starts as the pretrained one.
    """

    def __init__(self, *, dim: int, bottleneck: int, scale: float = 1.0) -> None:
        super().__init__()
        self.down = nn.Linear(dim, bottleneck)
        self.up = nn.Linear(bottleneck, dim)
        self.scale = float(scale)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        return self.scale * self.up(torch.relu(self.down(x)))


def mlp(dim: int, hidden: list[int], num_classes: int, *, norm: bool, dropout: float = 0.0
        ) -> nn.Sequential:
    """``[LN(D)] -> (Linear -> GELU -> Dropout) per hidden width -> Linear(., C)``."""
    layers: list[nn.Module] = [nn.LayerNorm(dim)] if norm else []
    width = dim
    for h in hidden:
        layers += [nn.Linear(width, h), nn.GELU(), nn.Dropout(dropout)]
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


class LayerwiseHeads(nn.Module):
    """One head per exit on that exit's CLS token (after the backbone's final LayerNorm with
    ``final_norm``, as DeiT's own classifier sees its CLS token)."""

    def __init__(self, heads: list[nn.Module], *, final_norm: bool = False) -> None:
        super().__init__()
        self.heads = nn.ModuleList(heads)
        self.final_norm = final_norm

    def run(self, backbone, images: torch.Tensor, last_exit: int, all_exits: bool = True
            ) -> list[torch.Tensor]:
        tokens = backbone.forward_exits(images, last_exit=last_exit)  # [B, D] per exit
        if self.final_norm:
            tokens = [backbone.final_norm(t) for t in tokens]
        if not all_exits:
            return [self.heads[last_exit](tokens[-1])]
        return [head(t) for head, t in zip(self.heads, tokens)]

    def run_slots(self, backbone, images: torch.Tensor, exits: list[int], rows: int
                  ) -> torch.Tensor:
        """Grouped clients at different exits (:meth:`ExitModel.slot_logits`): each slot's
        logits at its own exit, ``[len(exits) * rows, C]``."""
        out: list[torch.Tensor] = []

        def at_exit(k: int, hidden: torch.Tensor, lo: int) -> None:
            token = hidden[:, 0]
            if self.final_norm:
                token = backbone.final_norm(token)
            with forms.offset(lo), dropout.branch():
                out.append(self.heads[k](token))

        backbone.forward_slots(images, exits, rows, at_exit=at_exit)
        return torch.cat(out[::-1])


class Accumulator(nn.Module):
    """A small transformer over the CLS-token history, with a client token and a shared head.

    Parameters
    ----------
    dim, num_heads : int
        Width and heads of the backbone (the Accumulator works in its token space).
    num_layers : int
        Backbone blocks; there are ``num_layers + 1`` layer embeddings (``c_0 .. c_L``).
    """

    def __init__(self, *, dim: int, num_heads: int, num_layers: int, depth: int,
                 mlp_ratio: float, dropout: float, head: nn.Module, token_replace: bool,
                 residual: bool, zero_init: bool = True) -> None:
        super().__init__()
        self.client_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.layer_embed = nn.Parameter(torch.zeros(1, num_layers + 1, dim))
        nn.init.trunc_normal_(self.client_token, std=0.02)
        nn.init.trunc_normal_(self.layer_embed, std=0.02)
        block = nn.TransformerEncoderLayer(
            d_model=dim, nhead=num_heads, dim_feedforward=int(dim * mlp_ratio),
            dropout=dropout, activation="gelu", batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, num_layers=depth, enable_nested_tensor=False)
        if zero_init:  # each residual branch's last layer: the block starts as the identity
            for layer in self.blocks.layers:
                for out in (layer.self_attn.out_proj, layer.linear2):
                    nn.init.zeros_(out.weight)
                    nn.init.zeros_(out.bias)
        self.head = head
        self.token_replace = token_replace
        self.residual = residual

    def accumulate(self, history: list[torch.Tensor]) -> torch.Tensor:
        """``[client, c_0 + p'_0, ..., c_k + p'_k]`` -> ``[B, k + 2, D]``."""
        cls = torch.stack(history, dim=1)  # [B, k+1, D]
        rows = cls.shape[0]  # clients side by side: each row its own client's tensors
        token = forms.per_row(self, "client_token", rows)
        embed = forms.per_row(self, "layer_embed", rows)
        seq = torch.cat([token.expand(rows, -1, -1), cls + embed[:, : cls.shape[1]]], dim=1)
        return self.blocks(seq)

    def predict(self, h: torch.Tensor, cls: torch.Tensor) -> torch.Tensor:
        return self.head(h[:, 0] + cls if self.residual else h[:, 0])

    def run(self, backbone, images: torch.Tensor, last_exit: int, all_exits: bool = True
            ) -> list[torch.Tensor]:
        history: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []

        def hook(k: int, hidden: torch.Tensor) -> torch.Tensor:  # before block k
            history.append(hidden[:, 0])  # c_k, as block k-1 produced it
            h = self.accumulate(history)
            if k > 0 and all_exits:
                logits.append(self.predict(h, history[-1]))  # exit k-1
            if self.token_replace:
                hidden = torch.cat([h[:, k + 1: k + 2], hidden[:, 1:]], dim=1)
            return hidden

        tokens = backbone.forward_exits(images, last_exit=last_exit, cls_hook=hook)
        history.append(tokens[-1])  # the last exit's own token
        logits.append(self.predict(self.accumulate(history), history[-1]))
        return logits

    def run_slots(self, backbone, images: torch.Tensor, exits: list[int], rows: int
                  ) -> torch.Tensor:
        """Grouped clients at different exits (:meth:`ExitModel.slot_logits`): each slot's
        logits at its own exit, as :meth:`run` with ``all_exits=False`` gives them alone."""
        history: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []

        def hook(k: int, hidden: torch.Tensor) -> torch.Tensor:  # the slots still going
            if history and len(history[0]) != len(hidden):  # some slots left at exit k-1
                history[:] = [c[:len(hidden)] for c in history]
            history.append(hidden[:, 0])
            h = self.accumulate(history)
            if self.token_replace:
                hidden = torch.cat([h[:, k + 1: k + 2], hidden[:, 1:]], dim=1)
            return hidden

        def at_exit(k: int, hidden: torch.Tensor, lo: int) -> None:  # slots lo.. leave here
            start = lo * rows
            own = [c[start:start + len(hidden)] for c in history] + [hidden[:, 0]]
            with forms.offset(lo), dropout.branch():
                logits.append(self.predict(self.accumulate(own), hidden[:, 0]))

        backbone.forward_slots(images, exits, rows, cls_hook=hook, at_exit=at_exit)
        return torch.cat(logits[::-1])


#: The Accumulator reads its client token and layer embeddings per row itself (forms.per_row);
#: its blocks, head and the parallel adapters have torch's grouped forms.
forms.register_form(Accumulator, own=True)


class ExitModel(AdaptedModel):
    """A frozen ViT with exit heads; ``forward`` returns the logits of ``self.exit``.

    In the conventional setting ``exit`` is the last block. ``exit_logits(x, last_exit)``
    returns every exit's logits up to ``last_exit``, running only the blocks it needs.
    """

    has_exits = True

    def __init__(self, *, backbone, heads: nn.Module, parallel_adapter: bool,
                 adapter_bottleneck: int, adapter_scale: float = 1.0,
                 train_backbone: bool = False) -> None:
        super().__init__(head=heads, backbone=backbone, train_backbone=train_backbone)
        if parallel_adapter:  # trainable, added after the backbone was frozen
            backbone.insert_mlp_adapters(lambda i, d: ParallelAdapter(
                dim=d, bottleneck=adapter_bottleneck, scale=adapter_scale))
        self.exit = backbone.num_layers - 1

    @property
    def num_exits(self) -> int:
        return self.backbone.num_layers

    def exit_logits(self, images: torch.Tensor, last_exit: Optional[int] = None,
                    all_exits: bool = True) -> list[torch.Tensor]:
        """Logits of exits ``0..last_exit`` (``all_exits``) or of ``last_exit`` alone; either
        way only blocks ``0..last_exit`` run."""
        last = self.exit if last_exit is None else last_exit
        return self.head.run(self.backbone, images, last, all_exits)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B, C]
        return self.exit_logits(images, all_exits=False)[-1]

    def slot_logits(self, images: torch.Tensor, exits: list[int]) -> torch.Tensor:
        """Clients side by side (:mod:`fedadapt.grouping.forms`), slot ``s`` at exit
        ``exits[s]`` (non-increasing): the blocks every slot runs once for all, each deeper
        block on the slots that go deeper only; each slot's logits at its own exit."""
        if exits[0] == exits[-1]:  # one exit for all
            return self.exit_logits(images, last_exit=exits[0], all_exits=False)[-1]
        return self.head.run_slots(self.backbone, images, exits, forms.active().rows)

    def train(self, mode: bool = True) -> "ExitModel":
        nn.Module.train(self, mode)
        if not self.train_backbone:
            self.backbone.eval()  # frozen: no dropout in the backbone; adapters have none
        return self


def _needs_exits(backbone, name: str) -> None:
    if not backbone.has_exits:
        raise ConfigError(f"method={name} needs a backbone with exits (backbone.family=vit or "
                          f"deit), not {type(backbone).__name__}")


def _exit_model(cfg, backbone, heads: nn.Module) -> ExitModel:
    if cfg.adapter_bottleneck < 1:
        raise ConfigError(f"method.adapter_bottleneck={cfg.adapter_bottleneck} is invalid: "
                          f"must be >= 1")
    if not (math.isfinite(cfg.adapter_scale) and cfg.adapter_scale > 0):
        raise ConfigError(f"method.adapter_scale={cfg.adapter_scale} is invalid: must be > 0 "
                          f"(He et al. use 4)")
    return ExitModel(backbone=backbone, heads=heads, parallel_adapter=cfg.parallel_adapter,
                     adapter_bottleneck=cfg.adapter_bottleneck, adapter_scale=cfg.adapter_scale,
                     train_backbone=cfg.train_backbone)


@register_method("lw_linear", LwLinearConfig)
def build_lw_linear(cfg, backbone, num_classes, with_backbone):
    _needs_exits(backbone, cfg.name)
    heads = [nn.Linear(backbone.embed_dim, num_classes) for _ in range(backbone.num_layers)]
    return _exit_model(cfg, backbone, LayerwiseHeads(heads, final_norm=True))


@register_method("lw_mlp", LwMlpConfig)
def build_lw_mlp(cfg, backbone, num_classes, with_backbone):
    _needs_exits(backbone, cfg.name)
    check_dropout(cfg.dropout)
    hidden = cfg.hidden_dim or 4 * backbone.embed_dim
    heads = [mlp(backbone.embed_dim, [hidden], num_classes, norm=cfg.head_norm,
                 dropout=cfg.dropout) for _ in range(backbone.num_layers)]
    return _exit_model(cfg, backbone, LayerwiseHeads(heads))


@register_method("accumulator", AccumulatorConfig)
def build_accumulator(cfg, backbone, num_classes, with_backbone):
    _needs_exits(backbone, cfg.name)
    check_dropout(cfg.dropout)
    if cfg.depth < 1:
        raise ConfigError(f"method.depth={cfg.depth} is invalid: must be >= 1")
    dim = backbone.embed_dim
    if cfg.head == "mlp":
        hidden = list(cfg.head_hidden) if cfg.head_hidden is not None else [4 * dim, dim]
        head = mlp(dim, hidden, num_classes, norm=True, dropout=cfg.dropout)
    elif cfg.head == "linear":
        head = nn.Linear(dim, num_classes)
    else:
        raise ConfigError(f"method.head={cfg.head!r} is invalid: 'mlp' or 'linear'")
    acc = Accumulator(dim=dim, num_heads=backbone.model.config.num_attention_heads,
                      num_layers=backbone.num_layers, depth=cfg.depth,
                      mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout, head=head,
                      token_replace=cfg.token_replace, residual=cfg.residual,
                      zero_init=cfg.zero_init)
    return _exit_model(cfg, backbone, acc)
