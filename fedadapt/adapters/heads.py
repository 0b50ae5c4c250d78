"""The first methods: frozen backbone + linear or MLP head, full fine-tuning, local only."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import register_method
from fedadapt.config import ConfigError, MethodConfig


@dataclass
class LinearHeadConfig(MethodConfig):
    name: str = "linear_head"


@dataclass
class MlpHeadConfig(MethodConfig):
    name: str = "mlp_head"
    hidden_dim: int = 256
    dropout: float = 0.0

    def check(self) -> None:
        check_head("mlp", self.hidden_dim, self.dropout)


@dataclass
class FinetuneConfig(MethodConfig):
    """Everything trainable and federated: backbone plus a head."""

    name: str = "finetune"
    head: str = "linear"
    hidden_dim: int = 256
    dropout: float = 0.0
    use_cache: bool = False

    def check(self) -> None:
        check_head(self.head, self.hidden_dim, self.dropout)


@dataclass
class LocalOnlyConfig(MethodConfig):
    """Each client trains its own head alone; nothing is sent (a reference row)."""

    name: str = "local_only"
    head: str = "linear"
    hidden_dim: int = 256
    dropout: float = 0.0

    def check(self) -> None:
        check_head(self.head, self.hidden_dim, self.dropout)


def check_dropout(dropout: float) -> None:
    if not 0 <= dropout < 1:
        raise ConfigError(f"method.dropout={dropout} is invalid: must be in [0, 1)")


def check_head(kind: str, hidden_dim: int, dropout: float) -> None:
    """The domains of a head's keys (``method.head``, ``method.hidden_dim``, ``method.dropout``)."""
    if kind not in ("linear", "mlp"):
        raise ConfigError(f"method.head={kind!r} is invalid: 'linear' or 'mlp'")
    if hidden_dim < 1:
        raise ConfigError(f"method.hidden_dim={hidden_dim} is invalid: must be >= 1")
    check_dropout(dropout)


def make_head(kind: str, dim: int, num_classes: int, hidden_dim: int = 256,
              dropout: float = 0.0) -> nn.Module:
    """``linear``: ``Linear(D, C)``; ``mlp``: ``Linear(D,H) -> GELU -> Dropout -> Linear(H,C)``."""
    check_dropout(dropout)
    if kind == "linear":
        return nn.Linear(dim, num_classes)
    if kind == "mlp":
        if hidden_dim < 1:
            raise ConfigError(f"method.hidden_dim={hidden_dim} is invalid: must be >= 1")
        return nn.Sequential(nn.Linear(dim, hidden_dim), nn.GELU(), nn.Dropout(dropout),
                             nn.Linear(hidden_dim, num_classes))
    raise ConfigError(f"method.head={kind!r} is invalid: 'linear' or 'mlp'")


def _frozen(backbone, with_backbone: bool):
    return backbone if with_backbone else None


@register_method("linear_head", LinearHeadConfig)
def build_linear_head(cfg, backbone, num_classes, with_backbone):
    return AdaptedModel(head=make_head("linear", backbone.embed_dim, num_classes),
                        backbone=_frozen(backbone, with_backbone))


@register_method("mlp_head", MlpHeadConfig)
def build_mlp_head(cfg, backbone, num_classes, with_backbone):
    head = make_head("mlp", backbone.embed_dim, num_classes, cfg.hidden_dim, cfg.dropout)
    return AdaptedModel(head=head, backbone=_frozen(backbone, with_backbone))


@register_method("finetune", FinetuneConfig)
def build_finetune(cfg, backbone, num_classes, with_backbone):
    if cfg.use_cache:
        raise ConfigError("method.use_cache=true is invalid for finetune: the backbone trains, "
                          "so its features change every step")
    head = make_head(cfg.head, backbone.embed_dim, num_classes, cfg.hidden_dim, cfg.dropout)
    return AdaptedModel(head=head, backbone=backbone, train_backbone=True)


@register_method("local_only", LocalOnlyConfig)
def build_local_only(cfg, backbone, num_classes, with_backbone):
    head = make_head(cfg.head, backbone.embed_dim, num_classes, cfg.hidden_dim, cfg.dropout)
    return AdaptedModel(head=head, backbone=_frozen(backbone, with_backbone), federated=False)
