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

**Ranks per client** (``method.ranks=[2,4,8]``): each client trains LoRA at its own rank, by
tier in ``setting=multitier`` (tier i: ``ranks[i]``), else by ``method.rank_fractions`` (or in
equal shares), assigned with the run's seed (:func:`assign_ranks`). The global LoRA has the
largest rank; a client receives and sends its own rank's slices only (``A[:r]``, ``B[:, :r]``),
and trains them inside the process's largest-rank model with the other components zero, which
stay zero (their gradients are zero), so clients of different ranks train side by side. Every
client's update is scaled by ``alpha / max(ranks)``: a rank-r client's LoRA has ``alpha *
r / max(ranks)``, the same scale for every rank, as the heterogeneous-rank aggregators
(``strategy=hetlora|flexlora|fedsa_lora``, :mod:`fedadapt.strategies.lora_rank`) assume.
``method.share=a`` keeps each client's ``B`` on the client (FedSA-LoRA; set by
``strategy=fedsa_lora``).

**Tensor names** are peft's: a LoRA layer ``X`` trains ``X.lora_A.weight`` (``r x in``) and
``X.lora_B.weight`` (``out x r``); an adapter name may sit between (``X.lora_A.default.weight``).
A and B are paired by swapping the ``lora_A`` name component for ``lora_B``
(:func:`lora_pairs`). A layer's folded update (FLoRA's and FedEx-LoRA's, FlexLoRA's for the
server's model) is ``X.base_delta`` (:data:`BASE_DELTA`): the model folds it into the layer's
frozen weight when it loads it (:meth:`Folding.fold`). The strategies
(:mod:`fedadapt.strategies.lora_rank` and its five papers), the grid, the workers and the export
read these names from here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import nn

from fedadapt.adapters.model import AdaptedModel, structure_cached
from fedadapt.adapters.registry import register_method
from fedadapt.adapters.tuners import (
    TunedExitModel,
    TunedModel,
    TunerConfig,
    build_tuned,
    inject,
    resolve_targets,
)
from fedadapt.config import ConfigError

#: The name components of a LoRA layer's factors.
LORA_A, LORA_B = "lora_A", "lora_B"
#: Last name component of a layer's folded update (``X.base_delta``).
BASE_DELTA = "base_delta"


# -- tensor names -------------------------------------------------------------------------------

def _swap(name: str, old: str, new: str) -> str:
    parts = name.split(".")
    parts[parts.index(old)] = new
    return ".".join(parts)


def is_lora_a(name: str) -> bool:
    """Whether ``name`` is a LoRA layer's A (``lora_A`` a name component)."""
    return LORA_A in name.split(".")


def pair_of(a_name: str) -> str:
    """``X.lora_B[.adapter].weight`` for ``X.lora_A[.adapter].weight``."""
    return _swap(a_name, LORA_A, LORA_B)


def lora_pairs(names: Iterable[str]) -> dict[str, str]:
    """``{A name: B name}`` of every LoRA layer among ``names`` (``lora_A`` -> ``lora_B`` as a
    name component); ValueError naming a LoRA tensor without its pair, or two adapters of one
    layer (they would share ``X.base_delta``)."""
    names = list(names)
    present = set(names)
    pairs: dict[str, str] = {}
    for name in names:
        parts = name.split(".")
        if LORA_A in parts:
            b = _swap(name, LORA_A, LORA_B)
            if b not in present:
                raise ValueError(f"{name!r} is a LoRA A without its B {b!r}")
            pairs[name] = b
        elif LORA_B in parts and _swap(name, LORA_B, LORA_A) not in present:
            raise ValueError(f"{name!r} is a LoRA B without its A "
                             f"{_swap(name, LORA_B, LORA_A)!r}")
    layers = [base_delta_name(a) for a in pairs]
    if len(set(layers)) != len(layers):
        raise ValueError(f"two LoRA adapters on one layer ({sorted(pairs)}): one adapter per "
                         f"layer is supported")
    return pairs


def base_delta_name(a_name: str) -> str:
    """``X.base_delta`` for ``X.lora_A[.adapter].weight``."""
    parts = a_name.split(".")
    return ".".join(parts[:parts.index(LORA_A)] + [BASE_DELTA])


def is_base_delta(name: str) -> bool:
    """Whether ``name`` is a LoRA layer's folded update (``X.base_delta``)."""
    return name.rsplit(".", 1)[-1] == BASE_DELTA


# -- folded updates (FLoRA, FedEx-LoRA) ---------------------------------------------------------

class Folding:
    """What a model with peft's LoRA adds to a tuned model: each LoRA layer's frozen weight
    set from a folded update ``X.base_delta`` among the tensors it loads."""

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """:meth:`AdaptedModel.load_tensors`, and each ``X.base_delta`` among ``tensors``
        folded into the frozen weight of LoRA layer ``X`` (:meth:`fold`)."""
        deltas = {n: t for n, t in tensors.items() if is_base_delta(n)}
        if deltas:
            self.fold(deltas)
            tensors = {n: t for n, t in tensors.items() if n not in deltas}
        super().load_tensors(tensors)

    def fold(self, deltas: dict[str, torch.Tensor]) -> None:
        """Set each LoRA layer's frozen weight to ``W0 + s * D``: ``W0`` its pretrained weight,
        ``s`` its LoRA scaling, ``D`` = ``deltas["X.base_delta"]`` (``out x in``, or the conv
        weight's shape) for layer ``X``; a layer without a delta gets ``W0`` back. The weight is
        replaced, never added to, so a client folds the global ``D`` it receives whatever it
        folded before (:mod:`fedadapt.strategies.flora`, :mod:`fedadapt.strategies.fedex_lora`)."""
        layers = self.lora_layers()
        unknown = sorted(set(deltas) - set(layers))
        if unknown:
            raise KeyError(f"unknown tensor names: {unknown[:5]} (no LoRA layer of that name)")
        with torch.no_grad():
            for name, layer in layers.items():
                weight = layer.get_base_layer().weight
                if not hasattr(layer, "fedadapt_w0"):
                    if name not in deltas:
                        continue  # never folded: the pretrained weight as it is
                    layer.fedadapt_w0 = weight.detach().clone()
                w0 = layer.fedadapt_w0
                if name not in deltas:
                    weight.copy_(w0)
                    continue
                d = deltas[name]
                if d.numel() != w0.numel():
                    raise ValueError(f"{name}: {d.numel()} numbers for a weight of shape "
                                     f"{tuple(w0.shape)}")
                (scale,) = {float(s) for s in layer.scaling.values()}
                weight.copy_(w0 + scale * d.reshape(w0.shape).to(w0.device, w0.dtype))

    def lora_layers(self) -> dict[str, nn.Module]:
        """``{"X.base_delta": peft LoRA layer X}`` of every LoRA layer (the name a folded
        update of layer ``X`` has)."""
        from peft.tuners.lora import LoraLayer

        return structure_cached(self, "_lora_layers_cache", lambda: {
            f"{n}.{BASE_DELTA}": m for n, m in self.named_modules() if isinstance(m, LoraLayer)})


class LoraModel(Folding, TunedModel):
    """A frozen backbone with peft's LoRA inside, and a head."""


class LoraExitModel(Folding, TunedExitModel):
    """A frozen ViT with peft's LoRA inside, and one head per exit."""


@dataclass
class LoraMethodConfig(TunerConfig):
    """``method=lora``: the rank, scale, dropout and targets of peft's LoRA."""

    #: Its update is the product ``B A`` alone, which a strategy can fold into the frozen
    #: weights (FLoRA, FedEx-LoRA); DoRA's magnitude vector is not.
    plain_lora: ClassVar[bool] = True

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
    #: Each client its own rank (see the module docstring); null: every client ``rank``. The
    #: global LoRA then has rank ``max(ranks)`` (``rank`` is not used).
    ranks: Optional[list[int]] = None
    #: The share of clients at each of ``ranks`` (outside multitier); null: equal shares.
    rank_fractions: Optional[list[float]] = None
    #: What a client shares: ``both`` (A and B) or ``a`` (B stays on the client: FedSA-LoRA).
    share: str = "both"

    def check(self) -> None:
        super().check()
        if self.rank <= 0:
            raise ConfigError(f"method.rank={self.rank} is invalid: the LoRA rank must be >= 1")
        if not self.alpha > 0:
            raise ConfigError(f"method.alpha={self.alpha} is invalid: must be > 0")
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"method.lora_dropout={self.lora_dropout} is invalid: must be in "
                              f"[0, 1)")
        if self.share not in ("both", "a"):
            raise ConfigError(f"method.share={self.share!r} is invalid: 'both' (A and B "
                              f"travel) or 'a' (B stays on each client, FedSA-LoRA)")
        if self.ranks is not None:
            if not self.ranks or not all(isinstance(r, int) and r >= 1 for r in self.ranks):
                raise ConfigError(f"method.ranks={list(self.ranks)} is invalid: LoRA ranks, "
                                  f"each an integer >= 1 (e.g. [2,4,8])")
            if self.rslora:
                raise ConfigError("method.rslora=true is invalid with method.ranks: rsLoRA's "
                                  "scale alpha/sqrt(r) differs by rank, and clients of "
                                  "different ranks share one scale (alpha / max(ranks))")
            if self.ffa:
                raise ConfigError("method.ffa=true is invalid with method.ranks: FFA-LoRA "
                                  "shares one frozen A of one rank")
        if self.rank_fractions is not None:
            fr = list(self.rank_fractions)
            if self.ranks is None or len(fr) != len(self.ranks) or any(f < 0 for f in fr) \
                    or abs(sum(fr) - 1) > 1e-6:
                raise ConfigError(f"method.rank_fractions={fr} is invalid: one share >= 0 per "
                                  f"entry of method.ranks, summing to 1")

    @property
    def global_rank(self) -> int:
        """The rank of the global LoRA (and of the process's model)."""
        return max(self.ranks) if self.ranks else int(self.rank)


@dataclass
class DoraMethodConfig(LoraMethodConfig):
    """``method=dora``: LoRA with peft's weight-decomposed variant (``use_dora``)."""

    plain_lora: ClassVar[bool] = False

    name: str = "dora"

    def check(self) -> None:
        super().check()
        if self.ffa:
            raise ConfigError("method.ffa=true is invalid for method=dora: FFA-LoRA freezes A "
                              "of plain LoRA (use method=lora method.ffa=true)")
        if self.ranks is not None:
            raise ConfigError("method.ranks is invalid for method=dora: clients of different "
                              "ranks are for method=lora")


def _build(cfg: LoraMethodConfig, backbone, num_classes: int, with_backbone: bool,
           dora: bool) -> AdaptedModel:
    from peft import LoraConfig

    cfg.check()
    model = build_tuned(cfg, backbone, num_classes, with_backbone,
                        (LoraModel, LoraExitModel))
    targets = resolve_targets(cfg, backbone, "lora")
    inject(model, LoraConfig(r=cfg.global_rank, lora_alpha=float(cfg.alpha),
                             lora_dropout=float(cfg.lora_dropout), target_modules=targets,
                             use_rslora=bool(cfg.rslora), use_dora=dora, bias="none",
                             base_model_name_or_path=getattr(backbone, "weights_id", None)))
    if cfg.ffa:
        for n, p in model.named_parameters():
            if ".lora_A." in n:
                p.requires_grad_(False)
    if cfg.share == "a":  # FedSA-LoRA: each client's B is its own
        model.personal_parts = (".lora_B.",)
    return model


def assign_ranks(cfg: LoraMethodConfig, num_clients: int, tiers: list[int], seed: int,
                 speeds: Optional[list[float]] = None) -> list[int]:
    """Each client's LoRA rank: by tier (``tiers``: each client's tier exit, multitier), else
    by ``rank_fractions`` (equal shares by default) over the clients ordered by their device's
    ``speeds`` (a ``fleet=``: the slowest get ``ranks[0]``), or over a seeded permutation of
    them; [] without ``method.ranks``."""
    import numpy as np

    ranks = list(cfg.ranks or [])
    if not ranks:
        return []
    if tiers:
        levels = sorted(set(tiers))
        if len(levels) != len(ranks):
            raise ConfigError(f"method.ranks={ranks} is invalid here: setting=multitier has "
                              f"{len(levels)} tiers, one rank per tier is needed")
        return [ranks[levels.index(t)] for t in tiers]
    fractions = list(cfg.rank_fractions or [1 / len(ranks)] * len(ranks))
    order = np.random.default_rng([int(seed), 0x2A4B]).permutation(num_clients)
    if speeds is not None:  # ties (a tier's clients) in the seeded order
        order = order[np.argsort(np.asarray(speeds)[order], kind="stable")]
    bounds = np.round(np.cumsum([0.0, *fractions]) * num_clients).astype(int)
    out = [0] * num_clients
    for rank, lo, hi in zip(ranks, bounds, bounds[1:]):
        for cid in order[lo:hi]:
            out[int(cid)] = rank
    return out


@register_method("lora", LoraMethodConfig)
def build_lora(cfg, backbone, num_classes, with_backbone):
    return _build(cfg, backbone, num_classes, with_backbone, dora=False)


@register_method("dora", DoraMethodConfig)
def build_dora(cfg, backbone, num_classes, with_backbone):
    return _build(cfg, backbone, num_classes, with_backbone, dora=True)
