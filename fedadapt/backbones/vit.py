"""DeiT / ViT through Hugging Face ``transformers``.

``facebook/deit-small-patch16-224`` is stored as a ``ViTModel`` (no distillation token), so
``family=vit`` covers DeiT-S/Ti/B; ``family=deit`` loads ``DeiTModel`` checkpoints (the distilled
variants, which carry an extra token). Besides the pooled feature (the final-norm CLS token) it
exposes what the Accumulator needs: the CLS token after every block, running only the blocks up
to an exit, a hook that may replace the CLS token before each block, and parallel adapters
inserted beside each block's MLP.
"""

from __future__ import annotations

from itertools import islice
from typing import Callable, Optional

import torch
from torch import nn

from fedadapt.assets import MissingAssetError, prefetch_hint
from fedadapt.backbones.base import Backbone, register_backbone_family
from fedadapt.config import BackboneConfig

#: ``hook(layer_index, hidden_states [B, T, D]) -> hidden_states`` called before each block.
ClsHook = Callable[[int, torch.Tensor], torch.Tensor]


class ParallelMLP(nn.Module):
    """A block's frozen MLP with an adapter beside it: ``mlp(x) + adapter(x)`` (He et al. 2021)."""

    def __init__(self, *, mlp: nn.Module, adapter: nn.Module) -> None:
        super().__init__()
        self.mlp = mlp
        self.adapter = adapter

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, D] -> [B, T, D]
        return self.mlp(x) + self.adapter(x)


class ViTBackbone(Backbone):
    """Frozen ViT/DeiT from transformers with per-layer access.

    Parameters
    ----------
    model : transformers.ViTModel or transformers.DeiTModel
        Built without pooling layer.
    weights_id : str
        Hub id, local path or ``random``.
    """

    has_exits = True
    #: LoRA on the attention's query and value projections (Hu et al.'s choice); (IA)^3 on the
    #: keys, values and the MLP's second linear layer, whose input it scales (Liu et al. 2022).
    peft_targets = {"lora": ("q_proj", "v_proj"), "ia3": ("k_proj", "v_proj", "fc2"),
                    "ia3_feedforward": ("fc2",)}

    #: DeiT's image processor (facebook/deit-*-patch16-224): bicubic resize to 256, centre
    #: crop 224, ImageNet mean / std. Weights that ship a processor config override these.
    crop_pct = 224 / 256
    interpolation = "bicubic"

    def __init__(self, *, model: nn.Module, weights_id: str, image_size: int) -> None:
        super().__init__()
        self.model = model
        cfg = model.config
        self.embed_dim = cfg.hidden_size
        self.num_layers = cfg.num_hidden_layers
        self.image_size = image_size
        self.weights_id = weights_id
        self.mean = tuple(getattr(cfg, "image_mean", None) or (0.485, 0.456, 0.406))
        self.std = tuple(getattr(cfg, "image_std", None) or (0.229, 0.224, 0.225))

    def use_processor(self, processor) -> None:
        """Take the preprocessing of a transformers image processor (the weights' own):
        ``size.shortest_edge`` and ``crop_size`` give ``crop_pct``, ``resample`` the filter."""
        size, crop = processor.size, getattr(processor, "crop_size", None)
        short = _field(size, "shortest_edge") or _field(size, "height")
        crop_h = _field(crop, "height")
        if getattr(processor, "do_center_crop", False) and short and crop_h:
            self.crop_pct = float(crop_h) / float(short)
        else:
            self.crop_pct = 1.0
        self.interpolation = "bicubic" if int(getattr(processor, "resample", 2)) == 3 \
            else "bilinear"
        if getattr(processor, "image_mean", None) is not None:
            self.mean = tuple(map(float, processor.image_mean))
            self.std = tuple(map(float, processor.image_std))

    @property
    def blocks(self) -> nn.ModuleList:
        # transformers >= 5 keeps the blocks in ``model.layers``; 4.x in ``model.encoder.layer``.
        if "layers" in self.model._modules:
            return self.model.layers
        return self.model.encoder.layer

    def embed(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,T,D]
        return self.model.embeddings(images, interpolate_pos_encoding=True)

    def forward_exits(
        self,
        images: torch.Tensor,
        *,
        last_exit: Optional[int] = None,
        cls_hook: Optional[ClsHook] = None,
    ) -> list[torch.Tensor]:
        """CLS token after each block 0..last_exit (only those blocks run).

        Returns a list of ``[B, D]`` tensors: the residual stream's CLS token as each block
        outputs it. No exit applies the final LayerNorm (all exits are treated alike; the heads
        normalise where the method says so: :meth:`final_norm` is the backbone's own).
        """
        last = self.num_layers - 1 if last_exit is None else last_exit
        if not 0 <= last < self.num_layers:
            raise ValueError(f"last_exit={last} outside 0..{self.num_layers - 1}")
        h = self.embed(images)
        tokens = []
        # islice, not self.blocks[:n]: a sliced ModuleList is a new module, whose registration
        # would count as a change of the model's structure (adapters.model.structure_cached)
        for i, block in enumerate(islice(self.blocks, last + 1)):
            if cls_hook is not None:
                h = cls_hook(i, h)
            h = block(h)
            tokens.append(h[:, 0])
        return tokens

    def forward_slots(self, images: torch.Tensor, exits: list[int], rows: int, *,
                      at_exit: Callable[[int, torch.Tensor, int], None],
                      cls_hook: Optional[ClsHook] = None) -> None:
        """Clients side by side at different exits: slot ``s`` (rows ``s*rows ..``) runs blocks
        ``0..exits[s]`` (``exits`` non-increasing, so the slots still going are always the
        first ones); the blocks all slots need run once on all of them. After block ``k``,
        ``at_exit(k, hidden, lo)`` gets the hidden states ``[.., T, D]`` of the slots leaving
        there, the first of which is slot ``lo``."""
        h = self.embed(images)
        going = len(exits)
        for k, block in enumerate(islice(self.blocks, exits[0] + 1)):
            while exits[going - 1] < k:
                going -= 1
            if going * rows < len(h):
                h = h[: going * rows]
            if cls_hook is not None:
                h = cls_hook(k, h)
            h = block(h)
            lo = going
            while lo and exits[lo - 1] == k:
                lo -= 1
            if lo < going:
                at_exit(k, h[lo * rows:], lo)

    def forward(self, images: torch.Tensor) -> torch.Tensor:  # [B,3,H,W] -> [B,D]
        h = self.embed(images)
        for block in self.blocks:
            h = block(h)
        return self.final_norm(h[:, 0])

    def final_norm(self, tokens: torch.Tensor) -> torch.Tensor:  # [..., D] -> [..., D]
        """The backbone's own final LayerNorm (what DeiT's classifier reads), on any tokens."""
        return self.model.layernorm(tokens)

    def insert_mlp_adapters(self, make_adapter: Callable[[int, int], nn.Module]) -> nn.ModuleList:
        """Put ``make_adapter(layer_index, dim)`` beside every block's MLP; return the adapters.

        The adapters are trainable (the backbone stays frozen) and are registered on this module,
        so their parameters are named ``model.layers.<i>.mlp.adapter.*``.
        """
        adapters = nn.ModuleList()
        for i, block in enumerate(self.blocks):
            adapter = make_adapter(i, self.embed_dim)
            block.mlp = ParallelMLP(mlp=block.mlp, adapter=adapter)
            adapters.append(adapter)
        return adapters


def _build(cfg: BackboneConfig, load_weights: bool, distilled: bool) -> ViTBackbone:
    from transformers import DeiTConfig, DeiTModel, ViTConfig, ViTModel

    config_cls, model_cls = (DeiTConfig, DeiTModel) if distilled else (ViTConfig, ViTModel)
    if load_weights and cfg.weights:
        try:
            model = model_cls.from_pretrained(cfg.weights, add_pooling_layer=False)
        except (OSError, ValueError) as err:
            if str(cfg.weights).startswith(("/", ".", "~")):  # a local folder, not a hub id
                raise MissingAssetError(
                    f"backbone.weights={cfg.weights!r}: no ViT weights there. A backbone the "
                    f"server pretrains is made with `fedadapt-pretrain --epochs 3 "
                    f"backbone={cfg.name} dataset=fashion_mnist --out {cfg.weights}` (offline, "
                    f"as the docs' evidence made it; Fashion-MNIST comes from Debian's "
                    f"dataset-fashion-mnist package)") from err
            raise MissingAssetError(
                prefetch_hint(f"Backbone weights {cfg.weights!r}", backbone=cfg.name)
            ) from err
        weights_id = cfg.weights
        backbone = ViTBackbone(model=model, weights_id=weights_id, image_size=cfg.image_size)
        processor = _image_processor(cfg.weights)
        if processor is not None:
            backbone.use_processor(processor)
        return backbone
    else:
        arch = dict(cfg.arch)
        arch.pop("init_seed", None)  # used by build_backbone
        arch.setdefault("image_size", cfg.image_size)
        model = model_cls(config_cls(**arch), add_pooling_layer=False)
        weights_id = "random"
    return ViTBackbone(model=model, weights_id=weights_id, image_size=cfg.image_size)


def _field(size, key: str):
    """A field of a processor's size dict (a dict, or transformers' SizeDict)."""
    if size is None:
        return None
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def _image_processor(weights: str):
    """The image processor saved with the weights (hub cache or local folder), if any."""
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(weights)
    except (OSError, ValueError):  # no preprocessor_config.json: the family's defaults
        return None


@register_backbone_family("vit")
def build_vit(cfg: BackboneConfig, load_weights: bool) -> ViTBackbone:
    return _build(cfg, load_weights, distilled=False)


@register_backbone_family("deit")
def build_deit(cfg: BackboneConfig, load_weights: bool) -> ViTBackbone:
    return _build(cfg, load_weights, distilled=True)
