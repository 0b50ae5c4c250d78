"""The model every client trains: a frozen backbone plus a method's trainable modules."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

#: Bumped whenever any module anywhere registers a parameter or a submodule (torch's global
#: registration hooks): what :func:`structure_cached` keeps is made again after that.
_STRUCTURE = [0]


def _structure_changed(*_args) -> None:
    _STRUCTURE[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_structure_changed)
torch.nn.modules.module.register_module_module_registration_hook(_structure_changed)

T = TypeVar("T")


def weighted_slots(per_row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``[n * B]`` per-row losses weighted and summed per slot of ``B`` rows: ``[n]``."""
    from fedadapt.grouping.forms import active

    return (per_row * weight).view(-1, active().rows).sum(1)


def structure_cached(module: nn.Module, name: str, make: Callable[[], T]) -> T:
    """``make()``, kept on ``module`` under ``name`` until a parameter or a submodule is next
    registered anywhere: a listing of a model's parameters or layers still holds until then."""
    cached = module.__dict__.get(name)
    if cached is None or cached[0] != _STRUCTURE[0]:
        cached = (_STRUCTURE[0], make())
        module.__dict__[name] = cached
    return cached[1]


def frozen_features(backbone: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``backbone(x)`` for a frozen backbone (eval mode, no gradient: each row's features
    depend on that row alone). On the CPU, where a larger batch costs more per image (its
    activations leave the caches): in a grouped step only the slots' real rows run, a padding
    row taking its slot's first row's features (:attr:`fedadapt.grouping.forms.Slots
    .distinct`), the rows run in chunks of the backbone's ``cpu_chunk_pixels``, in
    channels-last layout where it declares ``cpu_channels_last``, through its ``frozen_cpu()``
    form. Anywhere else: one call."""
    if x.device.type != "cpu" or len(x) == 0:
        return backbone(x)
    from fedadapt.grouping.forms import active

    slots = active()
    distinct = slots.distinct if slots is not None else None
    if distinct is not None and len(distinct[1]) != len(x):  # not the step's whole batch
        distinct = None
    pixels = getattr(backbone, "cpu_chunk_pixels", None)
    last = getattr(backbone, "cpu_channels_last", False) and x.dim() == 4
    run = backbone.frozen_cpu() if hasattr(backbone, "frozen_cpu") else backbone
    if distinct is None and pixels is None and not last:
        return run(x)
    rows = x if distinct is None else x.index_select(0, distinct[0])
    if last:
        rows = rows.contiguous(memory_format=torch.channels_last)
    per = max(1, pixels // x[0, 0].numel()) if pixels and x.dim() == 4 else len(rows)
    feats = (run(rows) if per >= len(rows)
             else torch.cat([run(part) for part in rows.split(per)]))
    return feats if distinct is None else feats.index_select(0, distinct[1])


class AdaptedModel(nn.Module):
    """Backbone (frozen, optional) followed by a trainable head.

    Parameters
    ----------
    head : nn.Module
        Maps pooled features ``[B, D]`` to logits ``[B, C]``.
    backbone : Backbone or None
        None when the inputs are cached pooled features.
    train_backbone : bool
        Full fine-tuning: the backbone's parameters train (BatchNorm statistics stay frozen).
    federated : bool
        False for local-only training: every trainable tensor is personal.
    personal : tuple of str
        Name prefixes of trainable tensors that stay on the client.
    """

    #: Capability: the model has early exits (``num_exits``, ``exit_logits``); declared by
    #: the class, never detected.
    has_exits: bool = False
    #: Capability: trainable tensors live inside the frozen backbone (PEFT tuners), so the
    #: backbone runs with gradients although its own weights are frozen.
    adapts_backbone: bool = False

    def __init__(
        self,
        *,
        head: nn.Module,
        backbone: Optional[nn.Module] = None,
        train_backbone: bool = False,
        federated: bool = True,
        personal: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head
        self.train_backbone = train_backbone
        self.federated = federated
        self.personal = personal
        #: Name parts whose tensors are personal wherever they sit (FedSA-LoRA's ``.lora_B.``).
        self.personal_parts: tuple[str, ...] = ()
        #: Names of further tensors that stay on the client (``pfl.*``:
        #: :func:`fedadapt.adapters.personal.keep_on_client`).
        self.personal_extra: frozenset[str] = frozenset()
        if backbone is not None:
            backbone.requires_grad_(train_backbone)

    @property
    def input_kind(self) -> str:
        """``images`` when the backbone runs in the model, else ``features``."""
        return "features" if self.backbone is None else "images"

    def train(self, mode: bool = True) -> "AdaptedModel":
        super().train(mode)
        if self.backbone is not None:
            if not self.train_backbone:
                self.backbone.eval()
            else:  # keep pretrained normalisation statistics
                for m in structure_cached(self, "_batch_norms", lambda: [
                        b for b in self.backbone.modules()
                        if isinstance(b, nn.modules.batchnorm._BatchNorm)]):
                    m.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # images [B,3,H,W] or feats [B,D]
        if self.backbone is not None:
            grad = self.train_backbone or self.adapts_backbone
            with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
                x = self.backbone(x) if grad else frozen_features(self.backbone, x)
        return self.head(x)

    def training_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss one training step minimises (cross-entropy unless a method says otherwise)."""
        return F.cross_entropy(self(x), y)

    def slot_losses(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                    exits: Optional[list[int]] = None) -> torch.Tensor:
        """Clients side by side (:mod:`fedadapt.grouping.forms`): ``x`` is ``n`` client slots of
        ``B`` rows; each slot's loss (``[n]``) is its rows' :meth:`training_loss`, the rows
        weighted by ``weight`` (``1 / b`` for a slot's ``b`` real rows, 0 for its padding).
        ``exits``: the exit each slot trains (early-exit models), None for the own forward."""
        logits = self(x) if exits is None else self.slot_logits(x, exits)
        return weighted_slots(F.cross_entropy(logits, y, reduction="none"), weight)

    def slot_losses_unsupported(self) -> Optional[str]:
        """Why this model's loss has no per-slot form (None: it has)."""
        cls = type(self)
        if (cls.training_loss is not AdaptedModel.training_loss
                and cls.slot_losses is AdaptedModel.slot_losses):
            return f"{cls.__name__} has its own training_loss and no slot_losses"
        return None

    # -- what trains, what travels -------------------------------------------------------
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        """``list(self.named_parameters())``, listed again only after a parameter or module was
        registered somewhere (the walk over a ViT's thousands of modules costs milliseconds,
        and a round asks for the trainable names many times per client)."""
        return structure_cached(self, "_named_params_cache",
                                lambda: list(self.named_parameters()))

    def trainable_names(self) -> list[str]:
        return [n for n, p in self.named_params() if p.requires_grad]

    def personal_names(self) -> list[str]:
        names = self.trainable_names()
        if not self.federated:
            return names
        return [n for n in names if (self.personal and n.startswith(self.personal))
                or any(p in n for p in self.personal_parts) or n in self.personal_extra]

    def tuner_names(self) -> list[str]:
        """The tensors a PEFT method trains inside the backbone (none here;
        :class:`~fedadapt.adapters.tuners.Tuned` models have them)."""
        return []

    def communicated_names(self) -> list[str]:
        personal = set(self.personal_names())
        return [n for n in self.trainable_names() if n not in personal]

    def tensors(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Detached CPU copies of the named parameters."""
        params = dict(self.named_params())
        return {n: params[n].detach().cpu().clone() for n in names}

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy named tensors into parameters; names and shapes must match exactly."""
        params = dict(self.named_params())
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise KeyError(f"unknown tensor names: {unknown[:5]}")
        with torch.no_grad():
            for n, t in tensors.items():
                if params[n].shape != t.shape:
                    raise ValueError(f"{n}: shape {tuple(t.shape)} != {tuple(params[n].shape)}")
                params[n].copy_(t)

    def count(self, names: list[str]) -> int:
        params = dict(self.named_parameters())
        return sum(params[n].numel() for n in names)
