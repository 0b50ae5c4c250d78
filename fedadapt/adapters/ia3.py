"""(IA)^3 on the frozen backbone, through Hugging Face ``peft``'s IA3 tuner.

Liu et al. 2022 ("Few-shot parameter-efficient fine-tuning is better and cheaper than in-context
learning", arXiv 2205.05638): learned vectors rescale activations elementwise, initialised at 1,
so training starts from the pretrained backbone. A target layer's output is scaled (keys and
values of the attention), or its input for the ``feedforward`` targets (the MLP's second linear
layer reads the rescaled intermediate activations). The fewest trainable tensors of the PEFT
methods: one vector per target layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fedadapt.adapters.registry import register_method
from fedadapt.adapters.tuners import TunerConfig, build_tuned, inject, resolve_targets
from fedadapt.config import ConfigError


@dataclass
class Ia3MethodConfig(TunerConfig):
    """``method=ia3``: peft's (IA)^3; ``feedforward_modules`` are the targets whose input is
    scaled (a subset of ``target_modules``)."""

    name: str = "ia3"
    #: null: the backbone's defaults (with ``target_modules`` null) or none.
    feedforward_modules: Optional[list[str]] = None


@register_method("ia3", Ia3MethodConfig)
def build_ia3(cfg: Ia3MethodConfig, backbone, num_classes, with_backbone):
    from peft import IA3Config

    cfg.check()
    model = build_tuned(cfg, backbone, num_classes, with_backbone)
    targets = resolve_targets(cfg, backbone, "ia3")
    if cfg.feedforward_modules is not None:
        feedforward = list(cfg.feedforward_modules)
    elif cfg.target_modules is None:
        feedforward = list(backbone.peft_targets.get("ia3_feedforward", ()))
    else:
        feedforward = []
    outside = [f for f in feedforward if f not in targets]
    if outside:
        raise ConfigError(f"method.feedforward_modules={feedforward} is invalid: {outside} are "
                          f"not in the target modules {targets}")
    inject(model, IA3Config(target_modules=targets, feedforward_modules=feedforward,
                            base_model_name_or_path=getattr(backbone, "weights_id", None)))
    return model
