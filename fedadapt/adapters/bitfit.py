"""BitFit: only the frozen backbone's bias terms train (Ben Zaken et al. 2022, arXiv 2106.10199).

No tuner is added: the backbone's own biases (of its linear, convolution and normalisation
layers, or of the layers ``method.target_modules`` names) are unfrozen, and they and the head
are the trainable, communicated tensors. It needs no ``peft``; its export is the bias tensors
beside the head (a state dict of the backbone to load over the pretrained one).
"""

from __future__ import annotations

from dataclasses import dataclass

from fedadapt.adapters.registry import register_method
from fedadapt.adapters.tuners import TunerConfig, build_tuned, module_names
from fedadapt.config import ConfigError


@dataclass
class BitfitConfig(TunerConfig):
    """``method=bitfit``: ``target_modules`` null trains every bias of the backbone's tuning
    module (linear, convolution and normalisation layers)."""

    name: str = "bitfit"


@register_method("bitfit", BitfitConfig)
def build_bitfit(cfg: BitfitConfig, backbone, num_classes, with_backbone):
    cfg.check()
    model = build_tuned(cfg, backbone, num_classes, with_backbone)
    module = model.get_submodule(model.tuned_prefix)
    biases = [n for n, p in module.named_parameters() if n.rsplit(".", 1)[-1] == "bias"]
    if cfg.target_modules is not None:
        layers = module_names(module)
        missing = [t for t in cfg.target_modules
                   if not any(n == t or n.endswith("." + t) for n in layers)]
        if missing:
            raise ConfigError(f"method.target_modules={list(cfg.target_modules)} is invalid: "
                              f"the backbone has no linear or convolution layer named {missing}")
        biases = [b for b in biases if any(
            b[:-len(".bias")] == t or b[:-len(".bias")].endswith("." + t)
            for t in cfg.target_modules)]
    if not biases:
        raise ConfigError(f"method=bitfit: the backbone's {model.tuned_prefix} has no bias "
                          f"terms to train (method.target_modules={cfg.target_modules})")
    chosen = set(biases)
    for n, p in module.named_parameters():
        p.requires_grad_(n in chosen)
    return model
