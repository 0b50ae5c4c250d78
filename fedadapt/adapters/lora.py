"""LoRA, DoRA and FFA-LoRA on the frozen backbone, through Hugging Face ``peft``'s LoRA tuner.

* **LoRA** (Hu et al. 2021, arXiv 2106.09685): a target layer ``W`` computes
  ``W x + (alpha / r) B A x`` with ``A`` (``r x d_in``, peft's Kaiming-uniform init) and ``B``
  (``d_out x r``, zeros), so training starts from the pretrained backbone. By default the
  attention's query and value projections of a transformer (Hu et al.'s choice), the pointwise
  convolutions of EfficientNet (peft's Conv2d LoRA).
* **DoRA** (Liu et al. 2024, arXiv 2402.09353; ``method=dora``): peft's ``use_dora``, the weight
  split into a magnitude vector (trained) and a direction updated by LoRA.
* **FFA-LoRA** (Sun et al., ICLR 2024, arXiv 2403.12313; ``method.ffa=true``): ``A`` frozen at its
  random initialisation, only ``B`` trained and averaged. Averaging ``B`` and ``A`` separately is
  not averaging ``B A`` (the mean of products is not the product of means), the error FedAvg
  makes with plain LoRA; with ``A`` fixed and shared, the mean of the clients' ``B A`` is exactly
  ``mean(B) A``, and half the LoRA tensors travel. ``A`` is drawn from the run's seed in every
  process (the model's seeded initialisation), so all clients and the server share it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedadapt.adapters.model import AdaptedModel
from fedadapt.adapters.registry import register_method
from fedadapt.adapters.tuners import TunerConfig, build_tuned, inject, resolve_targets
from fedadapt.config import ConfigError


@dataclass
class LoraMethodConfig(TunerConfig):
    """``method=lora``: the rank, scale, dropout and targets of peft's LoRA."""

    name: str = "lora"
    #: The rank ``r`` of ``B A``.
    rank: int = 8
    #: ``alpha``: the update is scaled by ``alpha / r`` (``alpha / sqrt(r)`` with ``rslora``).
    alpha: float = 16.0
    #: Dropout on the LoRA branch's input (peft's ``lora_dropout``).
    lora_dropout: float = 0.0
    #: Rank-stabilised scaling ``alpha / sqrt(r)`` (Kalajdzievski 2023).
    rslora: bool = False
    #: FFA-LoRA: ``A`` frozen at its seeded random init; only ``B`` trains and travels.
    ffa: bool = False

    def check(self) -> None:
        super().check()
        if self.rank <= 0:
            raise ConfigError(f"method.rank={self.rank} is invalid: the LoRA rank must be >= 1")
        if not self.alpha > 0:
            raise ConfigError(f"method.alpha={self.alpha} is invalid: must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"method.lora_dropout={self.lora_dropout} is invalid: must be in "
                              f"[0, 1)")


@dataclass
class DoraMethodConfig(LoraMethodConfig):
    """``method=dora``: LoRA with peft's weight-decomposed variant (``use_dora``)."""

    name: str = "dora"

    def check(self) -> None:
        super().check()
        if self.ffa:
            raise ConfigError("method.ffa=true is invalid for method=dora: FFA-LoRA freezes A "
                              "of plain LoRA (use method=lora method.ffa=true)")


def _build(cfg: LoraMethodConfig, backbone, num_classes: int, with_backbone: bool,
           dora: bool) -> AdaptedModel:
    from peft import LoraConfig

    cfg.check()
    model = build_tuned(cfg, backbone, num_classes, with_backbone)
    targets = resolve_targets(cfg, backbone, "lora")
    inject(model, LoraConfig(r=int(cfg.rank), lora_alpha=float(cfg.alpha),
                             lora_dropout=float(cfg.lora_dropout), target_modules=targets,
                             use_rslora=bool(cfg.rslora), use_dora=dora, bias="none",
                             base_model_name_or_path=getattr(backbone, "weights_id", None)))
    if cfg.ffa:
        for n, p in model.named_parameters():
            if ".lora_A." in n:
                p.requires_grad_(False)
    return model


@register_method("lora", LoraMethodConfig)
def build_lora(cfg, backbone, num_classes, with_backbone):
    return _build(cfg, backbone, num_classes, with_backbone, dora=False)


@register_method("dora", DoraMethodConfig)
def build_dora(cfg, backbone, num_classes, with_backbone):
    return _build(cfg, backbone, num_classes, with_backbone, dora=True)
