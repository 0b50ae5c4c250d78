"""Grouped forms: K clients' trainable modules applied to one batch of K x B rows.

A grouped step runs the frozen backbone once, as plain PyTorch (its fused attention, native
autocast), on every client's images together; only the modules a client trains are per client.
The batch is laid out in **slots**: slot ``s`` owns rows ``s*B .. s*B+B-1`` (a client's batch,
padded to ``B`` rows whose loss weight is 0), and each trainable tensor is stacked along a
leading slot dimension. A module with a trainable tensor computes, on the ``n = rows // B``
slots it is given, each slot's rows with that slot's tensors, by batched matrix products over
the stacked tensors (``baddbmm`` / ``bmm``: the technique multi-LoRA serving uses for many
adapters over one base model). The equations are the module's own: a slot computes what one
client alone computes, to floating-point tolerance (``tests/test_grouped.py``).

How a module gets its grouped form:

* :func:`register_form` maps a module class (or a class name, for peft's layers, so that peft
  is not imported here) to a function ``form(module, prefix, slots, *args, **kwargs)`` that
  replaces its ``forward`` while slots are active (:func:`slots_active`); elsewhere the module
  runs its own forward. :func:`install` sets them on a model once.
* A module that reads its own parameters in its own code (the Accumulator's client token and
  layer embeddings) reads them through :func:`per_row`, which gives each row its slot's tensor.
* ``layouts``: how a stacked tensor is stored while it trains (a linear weight ``[K, out, in]``
  as ``[K, in, out]``, so the batched product needs no transpose per call; one with fewer than
  :data:`NARROW_COLUMNS` outputs and enough inputs as it is, see :func:`slot_matmul`);
  :func:`to_layout` and :func:`from_layout` convert.
* ``covers``: children whose tensors the form applies itself (an attention layer's projection
  weights); ``guard(module)``: a reason the form cannot serve this instance, or None.

A model with a trainable tensor that no form serves (full fine-tuning, a user's own module
without a form) trains side by side through ``vmap`` instead
(:func:`fedadapt.federation.client.grouped.train_group` chooses; :func:`unsupported` says why).

Slices: an early-exit model runs the deeper blocks on the slots that go deeper only, and the
slots leaving at an exit are a contiguous range; :func:`offset` tells the forms which slot a
sub-batch's first row belongs to.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Slots:
    """The layout of the grouped batch being computed."""

    #: Rows per slot (the batch size, B).
    rows: int
    #: Each trainable tensor stacked per slot in its stored layout, by its name in the model.
    params: dict[str, torch.Tensor]
    #: The first slot of the current sub-batch (:func:`offset`).
    lo: int = 0
    #: Where some rows are padding, on the CPU: ``(real, take)``, the rows a frozen backbone
    #: runs on (each slot's real rows) and, for every row of the batch, the one of them whose
    #: features it takes (a padding row: its slot's first, the image it repeats). None: every
    #: row runs (:func:`fedadapt.adapters.model.frozen_features`).
    distinct: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def take(self, name: str, n: int) -> Optional[torch.Tensor]:
        """Slots ``lo .. lo+n-1`` of the stacked tensor ``name`` (None: not trained here)."""
        t = self.params.get(name)
        if t is None or (self.lo == 0 and n == t.shape[0]):
            return t
        return t[self.lo:self.lo + n]


_ACTIVE: list[Optional[Slots]] = [None]


def active() -> Optional[Slots]:
    """The grouped batch being computed, or None (a module's own forward)."""
    return _ACTIVE[0]


@contextmanager
def slots_active(slots: Slots) -> Iterator[Slots]:
    """Modules with a grouped form compute ``slots`` until the block ends."""
    before = _ACTIVE[0]
    _ACTIVE[0] = slots
    try:
        yield slots
    finally:
        _ACTIVE[0] = before


@contextmanager
def offset(lo: int) -> Iterator[None]:
    """The rows given to the modules in this block start at slot ``lo`` of the batch."""
    slots = _ACTIVE[0]
    if slots is None:
        yield
        return
    before = slots.lo
    slots.lo = lo
    try:
        yield
    finally:
        slots.lo = before


# -- the registry -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Form:
    forward: Optional[Callable]
    #: ``{parameter name: (to_layout, from_layout)}`` on ``[K, *shape]`` tensors.
    layouts: dict = field(default_factory=dict)
    covers: tuple[str, ...] = ()
    guard: Optional[Callable[[nn.Module], Optional[str]]] = None
    #: The module reads its own parameters through :func:`per_row` (no forward replaced).
    own: bool = False


_FORMS: dict[object, Form] = {}


def register_form(cls, forward: Optional[Callable] = None, *, layouts: Optional[dict] = None,
                  covers: tuple[str, ...] = (), guard=None, own: bool = False) -> None:
    """Give instances of ``cls`` (a class, or ``"module.QualName"``) a grouped form."""
    _FORMS[cls] = Form(forward, dict(layouts or {}), tuple(covers), guard, own)


def form_of(module: nn.Module) -> Optional[Form]:
    """The form registered for ``module``'s class or the nearest base class, unless the class
    computes otherwise than that base (overrides its ``forward``: EfficientNet's convolutions
    pad first), which then has none."""
    own = type(module)
    for cls in own.__mro__:
        found = _FORMS.get(cls) or _FORMS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            if cls is not own and found.forward is not None and own.forward is not cls.forward:
                return None
            return found
    return None


def _dispatch(module: nn.Module, prefix: str, form: Callable, *args, **kwargs):
    slots = _ACTIVE[0]
    if slots is None:
        return type(module).forward(module, *args, **kwargs)
    return form(module, prefix, slots, *args, **kwargs)


def install(model: nn.Module) -> None:
    """Set the grouped forms on every module of ``model`` that has one (idempotent; outside
    :func:`slots_active` each module runs its own forward)."""
    for prefix, m in model.named_modules():
        f = form_of(m)
        if f is None:
            continue
        m.__dict__["_grouping_prefix"] = prefix
        if f.forward is not None and not isinstance(m.__dict__.get("forward"), partial):
            m.forward = partial(_dispatch, m, prefix, f.forward)


def unsupported(model: nn.Module) -> Optional[str]:
    """Why ``model`` cannot train through grouped forms (None: it can): a trainable tensor of a
    module that no form serves, a form's guard, or a model whose loss has no per-slot form."""
    reason = getattr(model, "slot_losses_unsupported", lambda: None)()
    if reason:
        return reason
    covered: set[str] = set()
    for name, m in model.named_modules():
        f = form_of(m)
        if f is not None and f.guard is not None:
            why = f.guard(m)
            if why:
                return f"{type(m).__name__} {name or '(model)'}: {why}"
        if f is not None:
            covered.update(f"{name}.{c}" if name else c for c in f.covers)
        own = [n for n, p in m.named_parameters(recurse=False) if p.requires_grad]
        if own and f is None and not any(name == c or name.startswith(c + ".")
                                         for c in covered):
            return (f"no grouped form for {type(m).__module__}.{type(m).__name__} "
                    f"({name}.{own[0]})")
    return None


def _layout(model: nn.Module, name: str):
    """The layout of parameter ``name``: its module's form's, or that of the nearest ancestor
    whose form covers it (``"child.param"``, or ``"child.*"`` for any parameter of a child)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, -1, -1):
        f = form_of(model.get_submodule(".".join(parts[:i])))
        if f is None:
            continue
        local = parts[i:]
        for key in (".".join(local), ".".join(local[:-1] + ["*"])):
            if key in f.layouts:
                return f.layouts[key]
        if i == len(parts) - 1 or not any(".".join(local).startswith(c + ".")
                                          for c in f.covers):
            return None
    return None


def to_layout(model: nn.Module, name: str, stacked: torch.Tensor) -> torch.Tensor:
    """``stacked`` (``[K, *shape]``) in the layout the forms read it in (contiguous)."""
    lay = _layout(model, name)
    return (lay[0](stacked) if lay else stacked).contiguous()


def from_layout(model: nn.Module, name: str, stored: torch.Tensor, shape: torch.Size
                ) -> torch.Tensor:
    """The inverse of :func:`to_layout`: ``[K, *shape]`` (``shape``: the parameter's)."""
    lay = _layout(model, name)
    out = lay[1](stored, shape) if lay and lay[1] is not None else stored
    return out.reshape(stored.shape[0], *shape)


def per_row(module: nn.Module, name: str, rows: int) -> torch.Tensor:
    """``module``'s parameter ``name`` (shape ``[1, ...]``) as the ``rows`` rows being
    computed see it: each row its slot's tensor (``[rows, ...]``) in a grouped batch where it
    trains, else the parameter itself."""
    p = getattr(module, name)
    slots = _ACTIVE[0]
    if slots is None:
        return p
    n = rows // slots.rows
    t = slots.take(f"{module.__dict__['_grouping_prefix']}.{name}", n)
    if t is None:
        return p
    return t.expand(n, slots.rows, *p.shape[1:]).reshape(rows, *p.shape[1:])


# -- the forms of torch's modules -------------------------------------------------------------

def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` (the dtype the module alone returns: a bf16 output of a frozen
    layer stays bf16 when a per-slot fp32 affine is applied to it)."""
    return t if t.dtype == dtype else t.to(dtype)


#: A per-slot product with fewer output columns than this, and at least :data:`NARROW_MIN_IN`
#: inputs, is computed with the narrow side as the product's rows (:func:`slot_matmul`), and
#: its weight is stored as it is (``[K, out, in]``, :data:`LINEAR_WEIGHT`). MKL's GEMM is slow
#: with a narrow right-hand side: a 10-class head on 1,280 features, 10 slots of 32 rows, took
#: 1.6 ms a step forward and backward against 0.7 ms transposed; at 16 columns and above the
#: plain product was as fast or faster, and so it was with 32 inputs (a small CNN's head: 1.11x
#: transposed, 0.99x at 64, 0.95x at 128; in one thread 1.36x, 0.83x and 0.89x)
#: (``benchmarks/investigations/narrow_products.py``, record ``narrow-products``).
NARROW_COLUMNS = 16
NARROW_MIN_IN = 64


def slot_matmul(x3: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x3 [n, B, in]`` times ``weight [n, out, in]`` transposed, plus ``bias`` (broadcast to
    ``[n, B, out]``): each slot's rows through its own weight. On the CPU, for a narrow weight
    (:func:`narrow`), as the transpose of ``weight @ x3^T``: the same sums, with the narrow side
    as the product's rows, forward and backward (the weight's gradient, ``g^T @ x3``,
    likewise). The result may be a transposed view."""
    if x3.device.type == "cpu" and narrow(weight.shape[1], weight.shape[2]):
        if bias is None:
            return torch.bmm(weight, x3.mT).mT
        return torch.baddbmm(bias.mT, weight, x3.mT).mT
    return torch.bmm(x3, weight.mT) if bias is None else torch.baddbmm(bias, x3, weight.mT)


def narrow(out_features: int, in_features: int) -> bool:
    """Whether a linear weight of this shape is narrow (:data:`NARROW_COLUMNS`)."""
    return out_features < NARROW_COLUMNS and in_features >= NARROW_MIN_IN


#: A linear weight ``[K, out, in]`` stored ``[K, in, out]`` (its batched product reads it with
#: no copy), or as it is where it is :func:`narrow` (the product runs transposed there); a bias
#: ``[K, out]`` stored ``[K, 1, out]``.
LINEAR_WEIGHT = (lambda t: t if narrow(t.shape[1], t.shape[2]) else t.transpose(1, 2),
                 lambda t, shape: t if narrow(shape[0], shape[1]) else t.transpose(1, 2))
ROW_VECTOR = (lambda t: t.reshape(t.shape[0], 1, -1), None)


def in_out(stored: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``layer``'s weight stored in :data:`LINEAR_WEIGHT`'s layout as ``[n, in, out]`` (a
    view)."""
    return stored.mT if narrow(layer.out_features, layer.in_features) else stored


def linear(x: torch.Tensor, n: int, weight: Optional[torch.Tensor],
           bias: Optional[torch.Tensor], frozen_weight: torch.Tensor,
           frozen_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x [n*B, ..., in]``: each slot's rows through its own ``weight`` (stored in
    :data:`LINEAR_WEIGHT`'s layout, or None: the frozen one) and ``bias`` (``[n, 1, out]``, or
    None: the frozen one)."""
    if weight is None:  # a frozen weight, a bias per slot (BitFit)
        y = F.linear(x, frozen_weight)
        out = y.view(n, -1, y.shape[-1]) + bias
        return _as(out.view(y.shape), y.dtype)
    x3 = x.reshape(n, -1, x.shape[-1])
    if bias is None:
        bias = None if frozen_bias is None else frozen_bias.view(1, 1, -1)
    y = slot_matmul(x3, weight if narrow(*frozen_weight.shape) else weight.mT, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _linear(m: nn.Linear, prefix: str, slots: Slots, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // slots.rows
    w = slots.take(prefix + ".weight", n)
    b = slots.take(prefix + ".bias", n)
    if w is None and b is None:
        return F.linear(x, m.weight, m.bias)
    return linear(x, n, w, b, m.weight, m.bias)


def _layer_norm(m: nn.LayerNorm, prefix: str, slots: Slots, x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // slots.rows
    w = slots.take(prefix + ".weight", n)
    b = slots.take(prefix + ".bias", n)
    if w is None and b is None:
        return F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    y = F.layer_norm(x, m.normalized_shape, m.weight if w is None else None,
                     m.bias if b is None else None, m.eps)
    y3 = y.view(n, -1, y.shape[-1])
    if w is not None and b is not None:
        out = torch.addcmul(b, y3, w)
    else:
        out = y3 * w if w is not None else y3 + b
    return _as(out.view(y.shape), y.dtype)


def _conv(m: nn.Conv2d, prefix: str, slots: Slots, x: torch.Tensor) -> torch.Tensor:
    """A convolution per slot: as one convolution of ``n`` times the groups over the slots'
    channels stacked side by side."""
    n = x.shape[0] // slots.rows
    w = slots.take(prefix + ".weight", n)
    b = slots.take(prefix + ".bias", n)
    if w is None and b is None:
        return m._conv_forward(x, m.weight, m.bias)
    if w is None:
        y = m._conv_forward(x, m.weight, None)
    else:
        rows = slots.rows
        xs = x.reshape(n, rows, *x.shape[1:]).transpose(0, 1).reshape(rows, -1, *x.shape[2:])
        conv = F.conv2d if m.weight.dim() == 4 else F.conv1d
        if m.padding_mode != "zeros":
            raise NotImplementedError("grouped convolution with padding_mode != 'zeros'")
        y = conv(xs, w.reshape(-1, *w.shape[2:]), None, m.stride, m.padding, m.dilation,
                 m.groups * n)
        y = y.reshape(rows, n, -1, *y.shape[2:]).transpose(0, 1).reshape(n * rows, -1,
                                                                         *y.shape[2:])
        if b is None:
            b = None if m.bias is None else m.bias.view(1, 1, -1, *([1] * (y.dim() - 2)))
            if b is None:
                return y
    out = y.view(n, -1, *y.shape[1:]) + b
    return _as(out.view(y.shape), y.dtype)


def _conv_bias_layout(t: torch.Tensor) -> torch.Tensor:  # [K, out] -> [K, 1, out, 1, 1]
    return t.view(t.shape[0], 1, t.shape[1], 1, 1)


def _batch_norm(m: nn.modules.batchnorm._BatchNorm, prefix: str, slots: Slots, x: torch.Tensor
                ) -> torch.Tensor:
    """A frozen batch norm (running statistics, as every backbone's is here) with an affine
    weight or bias per slot (BitFit's biases)."""
    n = x.shape[0] // slots.rows
    w = slots.take(prefix + ".weight", n)
    b = slots.take(prefix + ".bias", n)
    if w is None and b is None:
        return type(m).forward(m, x)
    if m.training or m.running_mean is None:
        raise NotImplementedError("grouped batch norm in training mode (batch statistics)")
    y = F.batch_norm(x, m.running_mean, m.running_var, m.weight if w is None else None,
                     m.bias if b is None else None, False, 0.0, m.eps)
    y5 = y.view(n, -1, *y.shape[1:])
    if w is not None:
        y5 = y5 * w
    if b is not None:
        y5 = y5 + b
    return _as(y5.view(y.shape), y.dtype)


def _encoder_layer(m: nn.TransformerEncoderLayer, prefix: str, slots: Slots, src: torch.Tensor,
                   src_mask=None, src_key_padding_mask=None, is_causal: bool = False
                   ) -> torch.Tensor:
    """``nn.TransformerEncoderLayer`` (pre-norm, batch first: the Accumulator's) per slot: its
    attention's projections per slot, the attention itself one fused call for every row."""
    if src_mask is not None or src_key_padding_mask is not None:
        raise NotImplementedError("grouped TransformerEncoderLayer with a mask")
    x = src
    x = x + m.dropout1(_self_attention(m.self_attn, prefix + ".self_attn", slots, m.norm1(x)))
    h = m.linear2(m.dropout(m.activation(m.linear1(m.norm2(x)))))
    return x + m.dropout2(h)


def _self_attention(attn: nn.MultiheadAttention, prefix: str, slots: Slots, x: torch.Tensor
                    ) -> torch.Tensor:
    rows, seq, dim = x.shape
    n = rows // slots.rows
    w = slots.take(prefix + ".in_proj_weight", n)
    b = slots.take(prefix + ".in_proj_bias", n)
    if w is None and b is None:
        qkv = F.linear(x, attn.in_proj_weight, attn.in_proj_bias)
    else:
        qkv = linear(x, n, w, b, attn.in_proj_weight, attn.in_proj_bias)
    heads = attn.num_heads
    q, k, v = qkv.view(rows, seq, 3, heads, dim // heads).permute(2, 0, 3, 1, 4).unbind(0)
    o = F.scaled_dot_product_attention(q, k, v)  # [rows, heads, seq, dim / heads]
    return attn.out_proj(o.transpose(1, 2).reshape(rows, seq, dim))


def _encoder_layer_guard(m: nn.TransformerEncoderLayer) -> Optional[str]:
    attn = m.self_attn
    if not (m.norm_first and attn.batch_first and attn._qkv_same_embed_dim
            and attn.in_proj_bias is not None):
        return "only the pre-norm, batch-first layer with one biased input projection"
    if attn.dropout and m.training:
        return f"attention dropout {attn.dropout} (drawn from torch's generator)"
    if m.activation not in (F.gelu, F.relu):
        return f"activation {m.activation}"
    return None


register_form(nn.Linear, _linear, layouts={"weight": LINEAR_WEIGHT, "bias": ROW_VECTOR})
register_form(nn.LayerNorm, _layer_norm, layouts={"weight": ROW_VECTOR, "bias": ROW_VECTOR})
register_form(nn.Conv2d, _conv, layouts={"bias": (_conv_bias_layout, None)})
register_form(nn.BatchNorm2d, _batch_norm, layouts={"weight": (_conv_bias_layout, None),
                                                    "bias": (_conv_bias_layout, None)})
register_form(nn.TransformerEncoderLayer, _encoder_layer, covers=("self_attn",),
              layouts={"self_attn.in_proj_weight": LINEAR_WEIGHT,
                       "self_attn.in_proj_bias": ROW_VECTOR},
              guard=_encoder_layer_guard)


__all__ = ["Slots", "active", "form_of", "from_layout", "in_out", "install", "linear", "narrow",
           "offset", "per_row", "register_form", "slots_active", "to_layout", "unsupported"]
