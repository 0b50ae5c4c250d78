"""LoRA adapters of different ranks across clients: five papers' aggregation rules as Flower
strategies (subclasses of Flower's ``FedAvg``, Message API).

Tensor names are peft's: a LoRA layer ``X`` trains ``X.lora_A.weight`` (``r x in``) and
``X.lora_B.weight`` (``out x r``); an adapter name may sit between (``X.lora_A.default.weight``).
A and B are paired by swapping the ``lora_A`` name component for ``lora_B``
(:func:`lora_pairs`). peft's Conv2d LoRA is read as the same matrices: ``A`` (``r x in x kh x
kw``) flattened to ``r x (in kh kw)`` and ``B`` (``out x r x 1 x 1``) to ``out x r``. Every other
tensor (a head, biases, DoRA's magnitude vectors) is FedAvg's weighted mean
(:func:`fedadapt.strategies.fedavg.average_by_tensor`, weighted by ``weighted_by_key`` from
each reply's MetricRecord).

**Ranks.** Each strategy takes ``rank_of``: a Flower node id -> that client's LoRA rank (set by
fedadapt, not a user key). The global record holds every layer at the largest rank ``r_max``
(the rank of its ``A``); ``configure_train`` and ``configure_evaluate`` send client k its own
rank-``r_k`` slices (clients of one rank share one record, which the grid sends once per
worker). A reply may hold a rank smaller than it was sent (HetLoRA's self-pruning), never a
larger one.

**Folded updates.** FLoRA and FedEx-LoRA change the frozen weights. The global record carries
that change as one dense tensor per layer, ``X.base_delta`` (``out x in``, or the conv weight's
shape), accumulated over the rounds; each client gets it with its LoRA factors and must use
``W0 + s * base_delta`` as the layer's frozen weight, ``W0`` the pretrained weight (replace,
never add to an already folded weight). FlexLoRA's global record holds one too (the part of its
full-rank ``W`` beyond the rank-``r_max`` factors), for the server's model only: its clients
are not sent it.

**Scaling.** peft computes ``W x + s B A x`` with ``s = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA). Every formula here is on the raw factors and raw products ``B A`` (``base_delta``
too); the client applies its ``s``. The averaged raw products are the averages of the clients'
effective updates only when ``s`` is the same on every client (``alpha`` proportional to ``r``,
e.g. ``alpha = r``); with a fixed ``alpha`` and different ranks, one raw ``B A`` is a rank-4
client's update at twice the scale of a rank-8 client's. The strategies cannot see ``s``.

Module-level helpers (pure, on float64 torch matrices): :func:`lora_pairs`,
:func:`base_delta_name`, :func:`check_rank`, :func:`pad_rank`, :func:`truncate_rank`,
:func:`normalise`, :func:`weighted_product_sum`, :func:`svd_split`, :func:`sparsity_weights`,
:func:`self_prune` (HetLoRA's client-side rule), and one aggregator per paper
(:func:`hetlora_aggregate`, :func:`flexlora_aggregate`, :func:`flora_stack`,
:func:`fedsa_aggregate`, :func:`fedex_aggregate`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from fedadapt.strategies.fedavg import PerTensorFedAvg, average_by_tensor
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid

from fedadapt.config import ConfigError
from fedadapt.federation.records import to_array

__all__ = ["BASE_DELTA", "FLoRA", "FedExLoRA", "FedSALoRA", "FlexLoRA", "HetLoRA",
           "LoRARankStrategy", "base_delta_name", "check_rank", "fedex_aggregate",
           "fedsa_aggregate", "flexlora_aggregate", "flora_stack", "hetlora_aggregate",
           "is_base_delta",
           "lora_pairs", "normalise", "pad_rank", "self_prune", "sparsity_weights", "svd_split",
           "truncate_rank", "weighted_product_sum"]

LORA_A, LORA_B = "lora_A", "lora_B"

#: Last name component of a layer's folded update (``X.base_delta``).
BASE_DELTA = "base_delta"

Tensor = torch.Tensor


# -- names and ranks --------------------------------------------------------------------------

def _swap(name: str, old: str, new: str) -> str:
    parts = name.split(".")
    parts[parts.index(old)] = new
    return ".".join(parts)


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


def check_rank(rank, what: str = "rank") -> int:
    """``rank`` as an int >= 1; :class:`ConfigError` naming ``what`` otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ConfigError(f"{what}={rank!r} is invalid: a LoRA rank is an integer >= 1")
    return int(rank)


# -- matrices ---------------------------------------------------------------------------------

def _matrix_a(a) -> Tensor:
    """A (``r x in``, or a conv's ``r x in x kh x kw``) as a float64 ``r x in'`` matrix."""
    t = torch.as_tensor(a).double()
    return t.reshape(t.shape[0], -1)


def _matrix_b(b, name: str = "B") -> Tensor:
    """B (``out x r``, or a conv's ``out x r x 1 x 1``) as a float64 ``out x r`` matrix."""
    t = torch.as_tensor(b).double()
    if t.dim() < 2 or any(s != 1 for s in t.shape[2:]):
        raise ValueError(f"{name!r} has shape {tuple(t.shape)}: a LoRA B is out x r (x 1 x 1)")
    return t.reshape(t.shape[0], t.shape[1])


def pad_rank(a: Tensor, b: Tensor | None, r: int) -> tuple[Tensor, Tensor | None]:
    """``A`` (``r_k x in``) and ``B`` (``out x r_k``) zero-padded to rank ``r``: zero rows of
    A, zero columns of B (the product is unchanged). ``b`` may be None (A alone)."""
    k = a.shape[0]
    if k > r:
        raise ValueError(f"rank {k} cannot be padded to the smaller rank {r}")
    a = torch.nn.functional.pad(a, (0, 0, 0, r - k))
    return a, (None if b is None else torch.nn.functional.pad(b, (0, r - k)))


def truncate_rank(a, b, r: int):
    """The first ``r`` rank components: ``A[:r]``, ``B[:, :r]`` (any array type; ``b`` may be
    None)."""
    return a[:r], (None if b is None else b[:, :r])


def normalise(weights: Sequence[float]) -> list[float]:
    """``weights / sum(weights)``; ValueError when they do not sum to > 0."""
    total = float(sum(weights))
    if not total > 0:
        raise ValueError(f"weights {list(weights)} do not sum to a positive number")
    return [float(w) / total for w in weights]


def weighted_product_sum(As: Sequence[Tensor], Bs: Sequence[Tensor], weights: Sequence[float]
                         ) -> Tensor:
    """``sum_k w_k B_k A_k`` (ranks may differ; the product is ``out x in``)."""
    return sum(w * (b @ a) for a, b, w in zip(As, Bs, weights))


def svd_split(w: Tensor, r: int) -> tuple[Tensor, Tensor]:
    """The rank-``r`` truncated SVD ``W ~ U_r S_r V_r^T`` split symmetrically:
    ``A = S_r^{1/2} V_r^T`` (``r x in``), ``B = U_r S_r^{1/2}`` (``out x r``); ``B A`` is the
    best rank-``r`` approximation of ``W`` (Eckart-Young). Ranks beyond ``min(out, in)`` are
    zero."""
    u, s, vh = torch.linalg.svd(w, full_matrices=False)
    root = s[:r].sqrt()
    return pad_rank(root[:, None] * vh[:r], u[:, :r] * root, r)


# -- the papers' aggregators (float64 matrices; p: weights summing to 1) ----------------------

def sparsity_weights(As: Sequence[Tensor], Bs: Sequence[Tensor],
                     base: Sequence[float] | None = None) -> list[float]:
    """HetLoRA's sparsity weights: ``w_k ∝ ||B_k A_k||_F`` (times ``base[k]`` when given, the
    data-size weights), normalised to sum 1. When every product is zero (B still at its zero
    initialisation) the weights are ``base`` (or uniform), normalised."""
    base = [1.0] * len(As) if base is None else [float(x) for x in base]
    raw = [float(torch.linalg.matrix_norm(b @ a)) * x for a, b, x in zip(As, Bs, base)]
    return normalise(raw if sum(raw) > 0 else base)


def hetlora_aggregate(As: Sequence[Tensor], Bs: Sequence[Tensor], r_max: int,
                      base: Sequence[float] | None = None, sparsity: bool = True
                      ) -> tuple[Tensor, Tensor, list[float]]:
    """HetLoRA: ``A = sum_k w_k pad(A_k)``, ``B = sum_k w_k pad(B_k)`` with the
    :func:`sparsity_weights` ``w`` (``sparsity=False``: ``w`` is ``base``, or uniform,
    normalised: the plain zero-padded average), every factor zero-padded to ``r_max``; returns
    ``(A, B, w)``."""
    w = (sparsity_weights(As, Bs, base) if sparsity else
         normalise([1.0] * len(As) if base is None else base))
    padded = [pad_rank(a, b, r_max) for a, b in zip(As, Bs)]
    return (sum(wk * a for wk, (a, _) in zip(w, padded)),
            sum(wk * b for wk, (_, b) in zip(w, padded)), w)


def flexlora_aggregate(As: Sequence[Tensor], Bs: Sequence[Tensor], p: Sequence[float],
                       r_max: int) -> tuple[Tensor, Tensor]:
    """FlexLoRA's factors: the rank-``r_max`` :func:`svd_split` of ``W = sum_k p_k B_k A_k``
    (:class:`FlexLoRA` keeps ``W - B A`` beside them, as ``X.base_delta``)."""
    return svd_split(weighted_product_sum(As, Bs, p), r_max)


def flora_stack(As: Sequence[Tensor], Bs: Sequence[Tensor], p: Sequence[float]
                ) -> tuple[Tensor, Tensor]:
    """FLoRA's stacking: ``A_stack = [A_1; ...; A_K]`` (rows, ``sum r_k x in``),
    ``B_stack = [p_1 B_1, ..., p_K B_K]`` (columns, ``out x sum r_k``), so that
    ``B_stack A_stack = sum_k p_k B_k A_k`` exactly."""
    return torch.cat(list(As), dim=0), torch.cat([pk * b for pk, b in zip(p, Bs)], dim=1)


def fedsa_aggregate(As: Sequence[Tensor], p: Sequence[float], r_max: int) -> Tensor:
    """FedSA-LoRA: ``A = sum_k p_k pad(A_k)``, zero-padded to ``r_max``; B is not shared."""
    return sum(pk * pad_rank(a, None, r_max)[0] for a, pk in zip(As, p))


def fedex_aggregate(As: Sequence[Tensor], Bs: Sequence[Tensor], p: Sequence[float],
                    r_max: int) -> tuple[Tensor, Tensor, Tensor]:
    """FedEx-LoRA: ``A = sum_k p_k pad(A_k)``, ``B = sum_k p_k pad(B_k)`` (FedAvg) and the
    residual ``R = sum_k p_k B_k A_k - B A``, so that ``B A + R = sum_k p_k B_k A_k``;
    returns ``(A, B, R)``."""
    padded = [pad_rank(a, b, r_max) for a, b in zip(As, Bs)]
    a = sum(pk * x for pk, (x, _) in zip(p, padded))
    b = sum(pk * y for pk, (_, y) in zip(p, padded))
    return a, b, weighted_product_sum(As, Bs, p) - b @ a


def self_prune(a, b, gamma: float):
    """HetLoRA's rank self-pruning on the client (``A``: ``r x in``, ``B``: ``out x r``; numpy
    or torch; peft's conv shapes too): drop the last rank component while its contribution is
    small, ``||B[:, -1] A[-1, :]||_F < gamma * ||B A||_F`` (the norms of the pair as pruned so
    far), keeping rank >= 1; returns ``(A[:r'], B[:, :r'])``. With ``B A = 0`` (B at its zero
    initialisation) nothing is pruned.

    Our reading of Cho et al. (EMNLP 2024), who prune trailing ranks whose contribution has
    become small (their clients also add a norm regulariser on those trailing ranks to the local
    loss; that regulariser is the client's training and is not here). The server accepts a
    reply whose rank is below the rank it sent."""
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not (
            math.isfinite(gamma) and gamma >= 0):
        raise ConfigError(f"gamma={gamma!r} is invalid: a finite number >= 0")
    am, bm = _matrix_a(a), _matrix_b(b)
    r = am.shape[0]
    while r > 1:
        last = torch.linalg.vector_norm(bm[:, r - 1]) * torch.linalg.vector_norm(am[r - 1])
        if not last < gamma * torch.linalg.matrix_norm(bm[:, :r] @ am[:r]):
            break
        r -= 1
    return truncate_rank(a, b, r)


# -- records ----------------------------------------------------------------------------------

def _torch(array: Array) -> Tensor:
    return torch.from_numpy(array.numpy())


def _torch_dtype(array: Array) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype  # not decoded


def _array(t: Tensor, shape, dtype: torch.dtype) -> Array:
    return to_array(t.reshape(shape).to(dtype).contiguous())


def _sliced(array: Array, rank: int, axis: int) -> Array:
    """``array`` cut to its first ``rank`` entries along ``axis`` (itself when already there)."""
    if array.shape[axis] == rank:
        return array
    t = _torch(array)
    return to_array((t[:rank] if axis == 0 else t[:, :rank]).contiguous())


def _reply_weight(content: RecordDict, key: str) -> float:
    return float(next(iter(content.metric_records.values()))[key])


def _reply_arrays(content: RecordDict) -> ArrayRecord:
    return next(iter(content.array_records.values()))


class LoRARankStrategy(PerTensorFedAvg):
    """FedAvg whose clients train LoRA at their own ranks: the shared machinery of the five
    strategies below (sending each client its slices, reading and checking the replies' factors,
    the FedAvg mean of every other tensor, accumulating ``X.base_delta``); on
    :class:`~fedadapt.strategies.fedavg.PerTensorFedAvg`, which keeps the arrays each round
    sends (``_sent_arrays``, never checkpointed).

    ``rank_of(node_id) -> rank`` gives each client's rank (an int from 1 to the global rank of
    each layer; :class:`ConfigError` naming ``rank_of(<node>)`` otherwise). The other parameters
    are FedAvg's. A subclass defines :meth:`client_arrays` (what a rank-r client is sent) and
    :meth:`aggregate_layer` (one layer's new factors and base_delta increment).

    Flower's reply check (every reply with the same keys) is left out: the shapes differ by rank.
    Each reply's LoRA factors are checked against what its client was sent (ValueError naming the
    tensor and node). A layer is aggregated over the replies that hold it (a layer nobody sent
    keeps its value, as in :class:`~fedadapt.strategies.fedavg.PerTensorFedAvg`); a
    ``base_delta`` in a reply is ignored (only the server folds)."""

    #: Whether clients send (and the server aggregates) B.
    shares_b = True

    def __init__(self, rank_of: Callable[[int], int], **kwargs) -> None:
        """``kwargs``: FedAvg's parameters (``fraction_train``, ``weighted_by_key``, ...)."""
        if not callable(rank_of):
            raise ConfigError(f"rank_of={rank_of!r} is invalid: a function node id -> LoRA rank")
        super().__init__(**kwargs)
        self.rank_of = rank_of

    def pairs(self, names: Iterable[str]) -> dict[str, str]:
        """``{A name: B name}`` of the LoRA layers among ``names`` (:func:`lora_pairs`)."""
        return lora_pairs(names)

    def client_rank(self, node_id: int) -> int:
        """``rank_of(node_id)``, checked."""
        return check_rank(self.rank_of(node_id), f"rank_of({node_id})")

    # -- sending --------------------------------------------------------------------------

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        return self._per_client(super().configure_train(server_round, arrays, config, grid),
                                arrays, MessageType.TRAIN)

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        return self._per_client(super().configure_evaluate(server_round, arrays, config, grid),
                                arrays, MessageType.EVALUATE)

    def _per_client(self, messages: Iterable[Message], arrays: ArrayRecord,
                    message_type: str) -> list[Message]:
        """FedAvg's messages (one shared record) re-addressed with each client's own arrays:
        one record per rank, shared by the clients of that rank."""
        pairs = self.pairs(arrays.keys())
        by_rank: dict[int, RecordDict] = {}
        out = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            rank = self.client_rank(node)
            if rank not in by_rank:
                for a_name in pairs:
                    if rank > arrays[a_name].shape[0]:
                        raise ConfigError(f"rank_of({node})={rank} is invalid: above the global "
                                          f"rank {arrays[a_name].shape[0]} of {a_name!r}")
                by_rank[rank] = RecordDict({
                    self.arrayrecord_key: self.client_arrays(arrays, pairs, rank),
                    self.configrecord_key: msg.content[self.configrecord_key]})
            out.append(Message(content=by_rank[rank], message_type=message_type,
                               dst_node_id=node))
        return out

    def client_arrays(self, arrays: ArrayRecord, pairs: dict[str, str], rank: int
                      ) -> ArrayRecord:
        """What a rank-``rank`` client is sent: here the truncation (``A[:rank]``,
        ``B[:, :rank]``) of every LoRA layer, every other tensor as it is."""
        bs = set(pairs.values())
        out = ArrayRecord()
        for name, array in arrays.items():
            out[name] = (_sliced(array, rank, 0) if name in pairs else
                         _sliced(array, rank, 1) if name in bs else array)
        return out

    # -- aggregating ----------------------------------------------------------------------

    def aggregate_train(self, server_round: int, replies: Iterable[Message]
                        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        valid, _ = self._check_and_log_replies(replies, is_train=True, validate=False)
        if not valid:
            return None, None
        contents = [msg.content for msg in valid]
        current = self._sent_arrays
        pairs = self.pairs(current.keys())
        lora = set(pairs) | set(pairs.values())
        others = ArrayRecord({n: a for n, a in current.items()
                              if n not in lora and not is_base_delta(n)})
        new: dict[str, Array] = dict(average_by_tensor(others, contents,
                                                       self.weighted_by_key).items())
        weights = [_reply_weight(c, self.weighted_by_key) for c in contents]
        for a_name, b_name in pairs.items():
            new.update(self._aggregate_pair(current, a_name, b_name, valid, weights))
        out = ArrayRecord()
        for name in [*current.keys(), *(n for n in new if n not in current)]:
            out[name] = new[name] if name in new else current[name]
        return out, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def _aggregate_pair(self, current: ArrayRecord, a_name: str, b_name: str,
                        replies: list[Message], weights: list[float]) -> dict[str, Array]:
        """One layer: the replies' factors read and checked, :meth:`aggregate_layer`, the
        result back in the record's shapes and dtypes (``X.base_delta`` accumulated)."""
        a_now, b_now = current[a_name], current[b_name] if b_name in current else None
        r_max, width = a_now.shape[0], math.prod(a_now.shape[1:])
        As, Bs, ws, ranks = [], [], [], []
        for msg, w in zip(replies, weights):
            sent = _reply_arrays(msg.content)
            node = msg.metadata.src_node_id
            if a_name not in sent:
                if self.shares_b and b_name in sent:
                    raise ValueError(f"the reply of node {node} holds {b_name!r} without its "
                                     f"pair {a_name!r}")
                continue
            a = _matrix_a(_torch(sent[a_name]))
            bound = min(self.client_rank(node), r_max)
            if a.shape[0] > bound or a.shape[1] != width:
                raise ValueError(f"the reply of node {node} holds {a_name!r} of shape "
                                 f"{tuple(sent[a_name].shape)}: at most rank {bound} of "
                                 f"{tuple(a_now.shape)} was expected")
            if self.shares_b:
                if b_name not in sent:
                    raise ValueError(f"the reply of node {node} holds {a_name!r} without its "
                                     f"pair {b_name!r}")
                b = _matrix_b(_torch(sent[b_name]), b_name)
                if tuple(b.shape) != (b_now.shape[0], a.shape[0]):
                    raise ValueError(f"the reply of node {node} holds {b_name!r} of shape "
                                     f"{tuple(sent[b_name].shape)}: out x {a.shape[0]} (the "
                                     f"rank of its A) was expected")
                Bs.append(b)
            As.append(a)
            ws.append(w)
            ranks.append(bound)
        if not As or sum(ws) <= 0:  # as average_by_tensor: nobody sent it, the layer stays
            return {}
        a_new, b_new, delta = self.aggregate_layer(a_name, current, As, Bs, ws, ranks)
        dtype = _torch_dtype(a_now)
        out = {}
        if a_new is not None:
            out[a_name] = _array(a_new, a_now.shape, dtype)
        if b_new is not None:
            out[b_name] = _array(b_new, b_now.shape, dtype)
        if delta is not None:
            d_name = base_delta_name(a_name)
            shape = (b_now.shape[0], *a_now.shape[1:])
            if d_name in current:
                old = current[d_name]
                delta = _torch(old).double().reshape(delta.shape) + delta
                dtype = _torch_dtype(old)
            out[d_name] = _array(delta, shape, dtype)
        return out

    def aggregate_layer(self, a_name: str, current: ArrayRecord, As: list[Tensor],
                        Bs: list[Tensor], weights: list[float], ranks: list[int]
                        ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        """One layer's ``(A, B, base_delta increment)`` as float64 matrices (``r_max x in``,
        ``out x r_max``, ``out x in``; None: unchanged / none) from the replies that hold it:
        ``As`` (``r_k x in``), ``Bs`` (``out x r_k``; empty when B is not shared), the
        replies' ``weighted_by_key`` weights (not normalised) and the ranks their clients were
        sent (``current``: the global record they were sent slices of)."""
        raise NotImplementedError

    def _base_delta(self, arrays: ArrayRecord, a_name: str, b_name: str) -> Tensor:
        """The layer's ``base_delta`` in ``arrays`` as a float64 ``out x in`` matrix (zero
        before the first fold)."""
        d_name = base_delta_name(a_name)
        if d_name in arrays:
            return _torch(arrays[d_name]).double().reshape(arrays[b_name].shape[0], -1)
        return torch.zeros(arrays[b_name].shape[0], math.prod(arrays[a_name].shape[1:]),
                           dtype=torch.float64)


class HetLoRA(LoRARankStrategy):
    """HetLoRA (Cho et al., "Heterogeneous LoRA for Federated Fine-tuning of On-Device
    Foundation Models", EMNLP 2024).

    The global LoRA has the largest rank ``r_max``. Client k (rank ``r_k``) is sent the
    truncation ``A[:r_k]``, ``B[:, :r_k]``. Per layer, over the clients that sent it::

        w_k = ||B_k A_k||_F * (n_k if data_weighted else 1),   normalised to sum 1
        A = sum_k w_k pad(A_k, r_max),   B = sum_k w_k pad(B_k, r_max)

    ``pad`` appends zero rows to A and zero columns to B (sparsity-weighted aggregation; ``n_k``
    is the reply's ``weighted_by_key``). When every product is zero (B at its zero
    initialisation) ``w_k`` falls back to ``n_k`` (or uniform), normalised. A reply's rank may
    be below the rank sent (the client's :func:`self_prune`); its missing components are zero
    in the padding. Raw factors and products: the client applies its scaling ``alpha / r``.
    With equal ranks and equal norms this is FedAvg (uniform, or weighted by ``n_k`` with
    ``data_weighted``). Every other tensor: FedAvg's mean. With ``prune_gamma > 0`` the
    clients prune their trailing rank components after training (:func:`self_prune`, the
    ``prune-gamma`` in their config) and keep the smaller rank in later rounds (the server
    sends them that rank from then on).

    ``sparsity_weighted=False`` drops the sparsity weights: ``w_k`` is ``n_k`` (or uniform),
    the plain zero-padded average. The new global factors are then the padded truncations
    sent (public) plus the mean of the clients' updates, which is what client-side DP's noise
    is calibrated to (``dp=client_fixed``; the sparsity weights depend on the updates)."""

    def __init__(self, rank_of: Callable[[int], int], data_weighted: bool = False,
                 prune_gamma: float = 0.0, sparsity_weighted: bool = True, **kwargs) -> None:
        super().__init__(rank_of, **kwargs)
        self.data_weighted = bool(data_weighted)
        self.sparsity_weighted = bool(sparsity_weighted)
        if isinstance(prune_gamma, bool) or not isinstance(prune_gamma, (int, float)) or not (
                math.isfinite(prune_gamma) and prune_gamma >= 0):
            raise ConfigError(f"prune_gamma={prune_gamma!r} is invalid: a finite number >= 0 "
                              f"(0: no pruning)")
        self.prune_gamma = float(prune_gamma)
        #: Each client's rank after its self-pruning (node id as text -> rank): it keeps it.
        self.pruned: dict[str, int] = {}

    def client_rank(self, node_id: int) -> int:
        """The client's rank, or the smaller one it pruned itself to (it keeps it)."""
        rank = super().client_rank(node_id)
        return min(rank, self.pruned.get(str(node_id), rank))

    def configure_train(self, server_round, arrays, config, grid):
        """As for every rank strategy, with ``prune-gamma`` in the clients' config: a client
        prunes its trailing rank components (:func:`self_prune`) after training."""
        if self.prune_gamma > 0:
            config = ConfigRecord({**dict(config), "prune-gamma": self.prune_gamma})
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        out = super().aggregate_train(server_round, replies)
        for msg in replies:  # the ranks the clients pruned themselves to
            if msg.has_error():
                continue
            arrays = _reply_arrays(msg.content)
            a_names = [n for n in arrays.keys() if LORA_A in n.split(".")]
            if a_names:
                node = str(msg.metadata.src_node_id)
                rank = int(arrays[a_names[0]].shape[0])
                self.pruned[node] = min(rank, self.pruned.get(node, rank))
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        a, b, _ = hetlora_aggregate(As, Bs, current[a_name].shape[0],
                                    weights if self.data_weighted else None,
                                    sparsity=self.sparsity_weighted)
        return a, b, None


class FlexLoRA(LoRARankStrategy):
    """FlexLoRA (Bai et al., "Federated Fine-tuning of Large Language Models under Heterogeneous
    Tasks and Client Resources", NeurIPS 2024).

    Per layer, over the clients that sent it (``p_k``: the replies' ``weighted_by_key``
    weights, normalised)::

        W = sum_k p_k B_k A_k                         (full size, out x in)
        W ~ U_r S_r V_r^T                             (truncated SVD)
        B = U_r S_r^{1/2},   A = S_r^{1/2} V_r^T      (the symmetric split)

    The server holds the whole ``W`` (of rank up to ``sum r_k``, above ``r_max``): the global
    record keeps its rank-``r_max`` factors ``B A`` and the rest, ``X.base_delta = W - B A``,
    so that the global model the server evaluates and exports, ``W0 + s (base_delta + B A)``
    (the residual folded into the frozen weight, as FLoRA's and FedEx-LoRA's are), is
    ``W0 + s W`` exactly. Client k is sent the rank-``r_k`` factors of ``W``, its best
    rank-``r_k`` approximation, and no ``base_delta`` (its LoRA holds its whole update; its
    frozen weight stays ``W0``). When ``W`` is zero (round 1: B at its zero initialisation) the
    SVD would give zero A and B, which never train, so the client is sent the truncation of the
    global factors instead. Products of raw factors: the client applies its scaling
    ``alpha / r``. Every other tensor: FedAvg's mean."""

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for a_name, b_name in pairs.items():
            out.pop(base_delta_name(a_name), None)  # the server's: the client's LoRA holds W
            a_now, b_now = arrays[a_name], arrays[b_name]
            w = self._whole(arrays, a_name, b_name)
            if not bool(w.any()):
                continue  # the truncation, as sent by super()
            a, b = svd_split(w, rank)
            dtype = _torch_dtype(a_now)
            out[a_name] = _array(a, (rank, *a_now.shape[1:]), dtype)
            out[b_name] = _array(b, (b_now.shape[0], rank, *b_now.shape[2:]), dtype)
        return out

    def _whole(self, arrays: ArrayRecord, a_name: str, b_name: str) -> Tensor:
        """The layer's whole ``W = base_delta + B A`` (``out x in``, float64)."""
        product = _matrix_b(_torch(arrays[b_name]), b_name) @ _matrix_a(_torch(arrays[a_name]))
        return self._base_delta(arrays, a_name, b_name) + product

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        w = weighted_product_sum(As, Bs, normalise(weights))
        a, b = svd_split(w, current[a_name].shape[0])
        b_name = _swap(a_name, LORA_A, LORA_B)
        # base_delta accumulates its increments: the new one makes it W - B A
        return a, b, w - b @ a - self._base_delta(current, a_name, b_name)


class FLoRA(LoRARankStrategy):
    """FLoRA (Wang et al., "FLoRA: Federated Fine-Tuning Large Language Models with
    Heterogeneous Low-Rank Adaptations", NeurIPS 2024).

    Per layer, over the clients that sent it (``p_k``: the replies' ``weighted_by_key``
    weights, normalised)::

        A_stack = [A_1; ...; A_K]            (the A_k stacked as rows)
        B_stack = [p_1 B_1, ..., p_K B_K]    (the p_k B_k stacked as columns)
        base_delta <- base_delta + B_stack A_stack       (= sum_k p_k B_k A_k, exactly)

    then a fresh LoRA: A drawn as peft initialises it (Kaiming-uniform with a = sqrt(5):
    uniform(-1/sqrt(in), 1/sqrt(in)), from the strategy's own generator, ``seed``), B = 0,
    at ``r_max``. Each round client k is sent ``X.base_delta`` (accumulated over the rounds;
    zero before the first) and the fresh factors truncated to ``r_k``; it folds
    ``s * base_delta`` into its frozen weight (``W0 + s * base_delta``, ``s`` its LoRA scaling)
    and trains the new LoRA. ``base_delta`` stands for the stacked factors, which the paper
    sends instead (``sum r_k`` ranks: fewer numbers than the dense ``out x in`` when
    ``sum r_k < out in / (out + in)``). Every other tensor: FedAvg's mean."""

    def __init__(self, rank_of: Callable[[int], int], seed: int = 0, **kwargs) -> None:
        super().__init__(rank_of, **kwargs)
        self.rng = np.random.default_rng(seed)  # numpy Generator: checkpointed with the state

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for a_name, b_name in pairs.items():
            d_name = base_delta_name(a_name)
            if d_name not in arrays:
                out[d_name] = _array(self._base_delta(arrays, a_name, b_name),
                                     (arrays[b_name].shape[0], *arrays[a_name].shape[1:]),
                                     _torch_dtype(arrays[a_name]))
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        a_stack, b_stack = flora_stack(As, Bs, normalise(weights))
        r_max, width = current[a_name].shape[0], As[0].shape[1]
        bound = 1.0 / math.sqrt(width)
        fresh_a = torch.from_numpy(self.rng.uniform(-bound, bound, size=(r_max, width)))
        fresh_b = torch.zeros(Bs[0].shape[0], r_max, dtype=torch.float64)
        return fresh_a, fresh_b, b_stack @ a_stack


class FedSALoRA(LoRARankStrategy):
    """FedSA-LoRA (Guo et al., "Selective Aggregation for Low-Rank Adaptation in Federated
    Learning", ICLR 2025).

    Only the A matrices are shared: client k is sent ``A[:r_k]`` (and every non-LoRA tensor),
    never B, and any B in its reply is ignored; B stays on the client (its own, kept across
    rounds). Per layer, over the clients that sent A (``p_k``: the replies'
    ``weighted_by_key`` weights, normalised)::

        A = sum_k p_k pad(A_k, r_max)

    With heterogeneous ranks (not in the paper) each A_k is zero-padded to ``r_max`` (zero
    rows); with equal ranks this is FedAvg on A. The global record's B keeps its initial value
    and is never sent: the global model has no B of its own (evaluate it on the clients, with
    theirs). Raw A: the scaling ``s`` multiplies the client's own ``B A``. Every other tensor:
    FedAvg's mean."""

    shares_b = False

    def pairs(self, names):
        """Every A with its B's name: the global record may hold no B at all (fedadapt keeps
        B on each client, a personal tensor, so it is not part of the global model)."""
        names = list(names)
        if not any(LORA_B in n.split(".") for n in names):
            return {n: _swap(n, LORA_A, LORA_B) for n in names if LORA_A in n.split(".")}
        return lora_pairs(names)

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for b_name in pairs.values():
            if b_name in out:
                del out[b_name]
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        return fedsa_aggregate(As, normalise(weights), current[a_name].shape[0]), None, None


class FedExLoRA(LoRARankStrategy):
    """FedEx-LoRA (Singhal et al., "FedEx-LoRA: Exact Aggregation for Federated and Efficient
    Fine-Tuning of Foundation Models", ACL 2025).

    Per layer, over the clients that sent it (``p_k``: the replies' ``weighted_by_key``
    weights, normalised)::

        A = sum_k p_k A_k,   B = sum_k p_k B_k                (FedAvg)
        R = sum_k p_k B_k A_k - B A                           (the residual)
        base_delta <- base_delta + R

    so that the global model, ``W0 + s (base_delta + B A)``, moves by exactly
    ``s sum_k p_k B_k A_k`` (raw products; ``s`` the client's scaling), and with one rank the
    new global model is exactly the ``p``-weighted mean of the clients' models.

    Heterogeneous ranks (not in the paper): client k is sent ``A[:r_k]``, ``B[:, :r_k]`` and
    ``D_k = base_delta + B[:, r_k:] A[r_k:]`` (the components it cannot hold folded in, so it
    starts from the exact global model); A_k and B_k are zero-padded to ``r_max`` before the
    means, and the folded tails are kept::

        base_delta <- sum_k p_k D_k + R = base_delta + R + sum_k p_k B[:, r_k:] A[r_k:]

    (``B``, ``A`` on the right: the global factors sent), so the new global model is again
    exactly the mean of the clients' models ``W0 + s (D_k + B_k A_k)``. Every other tensor:
    FedAvg's mean."""

    def client_arrays(self, arrays, pairs, rank):
        out = super().client_arrays(arrays, pairs, rank)
        for a_name, b_name in pairs.items():
            a_now, b_now = arrays[a_name], arrays[b_name]
            d_name = base_delta_name(a_name)
            if d_name in arrays and rank == a_now.shape[0]:
                continue  # as it is
            delta = self._base_delta(arrays, a_name, b_name)
            if rank < a_now.shape[0]:
                a = _matrix_a(_torch(a_now))
                b = _matrix_b(_torch(b_now), b_name)
                delta = delta + b[:, rank:] @ a[rank:]
            dtype = _torch_dtype(arrays[d_name]) if d_name in arrays else _torch_dtype(a_now)
            out[d_name] = _array(delta, (b_now.shape[0], *a_now.shape[1:]), dtype)
        return out

    def aggregate_layer(self, a_name, current, As, Bs, weights, ranks):
        p = normalise(weights)
        a, b, residual = fedex_aggregate(As, Bs, p, current[a_name].shape[0])
        if min(ranks) < current[a_name].shape[0]:  # the tails the clients were sent folded
            b_name = _swap(a_name, LORA_A, LORA_B)
            a_now = _matrix_a(_torch(current[a_name]))
            b_now = _matrix_b(_torch(current[b_name]), b_name)
            residual = residual + sum(pk * (b_now[:, r:] @ a_now[r:]) for pk, r in zip(p, ranks))
        return a, b, residual
