"""What the PEFT methods share: Hugging Face ``peft``'s tuners inside the frozen backbone, a head.

The methods (:mod:`~fedadapt.adapters.lora`: LoRA, DoRA, FFA-LoRA; :mod:`~fedadapt.adapters.ia3`;
:mod:`~fedadapt.adapters.bitfit`) put their trainable tensors into the backbone's
:meth:`~fedadapt.backbones.base.Backbone.tuning_module` with peft's own
``inject_adapter_in_model`` (no layer is written here), and a linear or MLP head on the pooled
feature reads its output. Only the trainable tensors travel and are averaged, each by name,
like any method's; the frozen weights are shared by the clients a worker trains side by side,
while each client's LoRA matrices are its own (:mod:`fedadapt.federation.client.grouped`).

``method.exits=true`` (a ViT/DeiT/AST backbone) gives one head per block instead, for the
anytime, multi-tier and personalization settings: a tier-k client runs blocks 0..k, so it
trains and sends its exit's head and the tuner tensors of those blocks only.
``method.personal=true`` keeps the tuner tensors on each client (a personal LoRA that never
leaves it; the head is federated). ``setting.personalize=tuner`` fine-tunes the tuner tensors
alone after FL.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from fedadapt.adapters.exits import ExitModel, LayerwiseHeads, mlp
from fedadapt.adapters.heads import check_head, make_head
from fedadapt.adapters.model import AdaptedModel
from fedadapt.config import ConfigError, MethodConfig
from fedadapt.grouping import forms


@dataclass
class TunerConfig(MethodConfig):
    """Keys every PEFT method has: its head, exits, personal tuners, target modules."""

    #: Images in: the tuned backbone's features change at every step, so none are cached.
    use_cache: bool = False
    #: ``linear``: ``Linear(D, C)``; ``mlp``: ``Linear(D, H) -> GELU -> Dropout -> Linear(H, C)``.
    head: str = "linear"
    hidden_dim: int = 256
    #: The MLP head's dropout (not the tuner's).
    dropout: float = 0.0
    #: One head per block (needs a backbone with exits): the anytime / multi-tier settings.
    exits: bool = False
    #: The tuner tensors stay on each client (never sent); the head is federated.
    personal: bool = False
    #: Module names to adapt, matched on their last name components (``q_proj``,
    #: ``attention.q_proj``); null: the backbone's defaults (its ``peft_targets``).
    target_modules: Optional[list[str]] = None

    def check(self) -> None:
        check_head(self.head, self.hidden_dim, self.dropout)
        if self.use_cache:
            raise ConfigError(f"method.use_cache=true is invalid for {self.name}: the tuned "
                              f"backbone's features change at every step")
        if self.target_modules is not None and not all(
                isinstance(t, str) and t.strip(". ") for t in self.target_modules):
            raise ConfigError(f"method.target_modules={list(self.target_modules)} is invalid: "
                              f"module names (e.g. [q_proj, v_proj]), or null for the "
                              f"backbone's defaults")


class Tuned:
    """What a model with PEFT tuners adds to :class:`AdaptedModel`: its tuner tensors by name,
    the peft config and where it was injected (for :mod:`fedadapt.export`), and the tuner's
    dropout in training mode although the frozen backbone stays in eval mode."""

    adapts_backbone = True
    peft_config: object = None  # peft's config (None: BitFit, which needs no peft)
    tuned_prefix: str = ""  # the tuning module's name in the model (``backbone.model``)

    def tuner_names(self) -> list[str]:
        return [n for n in self.trainable_names() if n.startswith(self.tuned_prefix + ".")]

    def train(self, mode: bool = True):
        super().train(mode)
        for name, m in self.named_modules():
            if ".lora_dropout." in name + ".":
                m.train(mode)
        return self


class TunedModel(Tuned, AdaptedModel):
    """A frozen backbone with PEFT tuners inside, and a head."""


class TunedExitModel(Tuned, ExitModel):
    """A frozen ViT with PEFT tuners inside, and one head per exit."""


def module_names(module: nn.Module) -> list[str]:
    """The adaptable layers of ``module`` (linear and convolution layers), by name; not the
    output projection of a ``nn.MultiheadAttention``, which reads its weight directly (a tuner
    wrapped around it would never run)."""
    kinds = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
    inside_mha = {f"{n}.out_proj" for n, m in module.named_modules()
                  if isinstance(m, nn.MultiheadAttention)}
    return [n for n, m in module.named_modules()
            if n and isinstance(m, kinds) and n not in inside_mha]


def resolve_targets(cfg, backbone, kind: str) -> list[str]:
    """``method.target_modules`` (or the backbone's defaults for ``kind``), each checked to name
    at least one linear or convolution layer of the tuning module; ConfigError naming the key."""
    bname = getattr(backbone, "name", None) or type(backbone).__name__
    targets = cfg.target_modules
    if targets is None:
        targets = list(backbone.peft_targets.get(kind, ()))
        if not targets:
            raise ConfigError(f"method={cfg.name} on {bname}: the backbone names no default "
                              f"target modules; set method.target_modules (its layers: "
                              f"{_layer_summary(backbone)})")
    layers = module_names(backbone.tuning_module())
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in layers)]
    if missing:
        raise ConfigError(f"method.target_modules={list(targets)} is invalid: {bname} has no "
                          f"linear or convolution layer named {missing} (its layers: "
                          f"{_layer_summary(backbone)})")
    return list(targets)


def _layer_summary(backbone) -> str:
    leaves = sorted({n.rsplit(".", 1)[-1] for n in module_names(backbone.tuning_module())})
    return ", ".join(leaves[:12]) + (", ..." if len(leaves) > 12 else "") if leaves else "none"


def build_tuned(cfg: TunerConfig, backbone, num_classes: int, with_backbone: bool,
                kinds: tuple[type, type] = (TunedModel, TunedExitModel)) -> AdaptedModel:
    """The frozen backbone and the head (or one head per exit), before any tuner is added:
    a ``kinds[0]`` (one head) or a ``kinds[1]`` (one head per exit)."""
    check_head(cfg.head, cfg.hidden_dim, cfg.dropout)
    if not with_backbone or backbone is None or not hasattr(backbone, "tuning_module"):
        raise ConfigError(f"method={cfg.name} adapts the backbone: it needs images, not cached "
                          f"features (method.use_cache=false)")
    if cfg.exits:
        if not backbone.has_exits:
            raise ConfigError(f"method.exits=true is invalid for backbone "
                              f"{type(backbone).__name__}: it has no exits (use a ViT, DeiT or "
                              f"AST backbone)")
        dim, n = backbone.embed_dim, backbone.num_layers
        if cfg.head == "linear":  # through the backbone's own final LayerNorm, as lw_linear
            heads = LayerwiseHeads([nn.Linear(dim, num_classes) for _ in range(n)],
                                   final_norm=True)
        else:
            heads = LayerwiseHeads([mlp(dim, [cfg.hidden_dim], num_classes, norm=True,
                                        dropout=cfg.dropout) for _ in range(n)])
        model: AdaptedModel = kinds[1](backbone=backbone, heads=heads,
                                       parallel_adapter=False, adapter_bottleneck=1)
    else:
        head = make_head(cfg.head, backbone.embed_dim, num_classes, cfg.hidden_dim, cfg.dropout)
        model = kinds[0](head=head, backbone=backbone)
    module = backbone.tuning_module()
    model.tuned_prefix = next(n for n, m in model.named_modules() if m is module)
    if cfg.personal:
        model.personal = (model.tuned_prefix + ".",)
    return model


def inject(model: AdaptedModel, peft_config) -> None:
    """peft's ``inject_adapter_in_model`` into the model's tuning module; its errors become
    one line naming the method's keys."""
    from peft import inject_adapter_in_model

    module = model.get_submodule(model.tuned_prefix)
    try:
        with warnings.catch_warnings():  # peft warns about its experimental layers
            warnings.simplefilter("ignore")
            inject_adapter_in_model(peft_config, module)
    except (ValueError, TypeError, RuntimeError) as err:
        raise ConfigError(f"method.target_modules={list(peft_config.target_modules)}: peft "
                          f"cannot adapt these layers: {str(err).splitlines()[0]}") from err
    model.peft_config = peft_config
    model.backbone.requires_grad_(False)
    for n, p in module.named_parameters():  # only what the tuner added trains
        p.requires_grad_(_is_tuner_tensor(n))


def _is_tuner_tensor(name: str) -> bool:
    return any(part in name for part in (".lora_A.", ".lora_B.", ".lora_magnitude_vector.",
                                         ".ia3_l."))


# -- clients side by side (fedadapt.grouping.forms) ----------------------------------------------
# LoRA (and FFA-LoRA, ranks) needs no form of its own: peft's layer computes
# ``lora_B(lora_A(dropout(x))) * scaling``, whose linear layers and dropout have theirs. DoRA's
# magnitude and (IA)^3's vectors are read by peft's layers directly: their forms follow peft's
# own equations (peft 0.21: ``DoraLinearLayer.forward``, ``ia3.Linear.forward``), per slot.


def _dora(m, prefix: str, slots: forms.Slots, x: torch.Tensor, *, lora_A, lora_B, scaling,
          base_layer, base_result=None, adapter_name="default") -> torch.Tensor:
    """peft's DoRA output beside the base layer's, per slot: ``(m / ||W + s B A||_c - 1) *
    base + m / ||W + s B A||_c * s * B A x`` with the norm detached (DoRA, Sec. 4.3)."""
    n = x.shape[0] // slots.rows
    magnitude = slots.take(prefix + ".weight", n)  # [n, 1, out]
    a = slots.take(lora_A.__dict__["_grouping_prefix"] + ".weight", n)
    b = slots.take(lora_B.__dict__["_grouping_prefix"] + ".weight", n)
    if magnitude is None or a is None or b is None:
        raise NotImplementedError("grouped DoRA trains its magnitude, A and B")
    a = forms.in_out(a, lora_A)  # [n, in, r]
    b = forms.in_out(b, lora_B)  # [n, r, out]
    weight = base_layer.weight.to(x.dtype)  # [out, in]
    lora_t = torch.bmm(a, b).to(x.dtype)  # (B A)^T per slot: [n, in, out]
    norm = torch.linalg.norm(weight.t() + scaling * lora_t.detach(), dim=1).to(weight.dtype)
    scale = magnitude / norm.detach().unsqueeze(1)  # [n, 1, out]
    lora = lora_B(lora_A(x))
    if base_result is not None:
        if base_layer.bias is not None:
            base_result = base_result - base_layer.bias
    else:
        base_result = F.linear(x, weight)
    out = lora.shape[-1]
    result = ((scale - 1) * base_result.view(n, -1, out)
              + scale * lora.view(n, -1, out) * scaling)
    return result.view(*base_result.shape[:-1], out)


def _ia3(m, prefix: str, slots: forms.Slots, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """peft's (IA)^3 linear layer per slot: the input (feedforward) or the output scaled by the
    slot's vector."""
    n = x.shape[0] // slots.rows
    vectors = [slots.take(f"{prefix}.ia3_l.{a}", n) for a in m.active_adapters
               if a in m.ia3_l.keys()]
    if m.disable_adapters or m.merged or not vectors or any(v is None for v in vectors):
        if any(v is not None for v in vectors):
            raise NotImplementedError("grouped (IA)^3 with frozen vectors beside trained ones")
        return type(m).forward(m, x, *args, **kwargs)
    scaling = vectors[0]
    for v in vectors[1:]:
        scaling = scaling * v  # [n, 1, features]
    previous = x.dtype
    if m.is_feedforward:
        interm = (x.to(scaling.dtype).view(n, -1, x.shape[-1]) * scaling).view(x.shape)
        return m.base_layer(interm.to(previous), *args, **kwargs)
    result = m.base_layer(x, *args, **kwargs)
    return (result.view(n, -1, result.shape[-1]) * scaling).view(result.shape).to(result.dtype)


forms.register_form("peft.tuners.lora.dora.DoraLinearLayer", _dora,
                    layouts={"weight": forms.ROW_VECTOR})
forms.register_form("peft.tuners.ia3.layer.Linear", _ia3, covers=("ia3_l",),
                    layouts={"ia3_l.*": forms.ROW_VECTOR})


__all__ = ["TunerConfig", "Tuned", "TunedModel", "TunedExitModel", "build_tuned", "inject",
           "resolve_targets", "module_names"]
