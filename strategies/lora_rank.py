"""LoRA adapters of different ranks across clients: what five papers' aggregation rules share,
as a Flower strategy (a subclass of Flower's ``FedAvg``, Message API) and pure helpers.

The strategies, one per paper: :class:`~fedadapt.strategies.hetlora.HetLoRA`,
:class:`~fedadapt.strategies.flexlora.FlexLoRA`, :class:`~fedadapt.strategies.flora.FLoRA`,
:class:`~fedadapt.strategies.fedsa_lora.FedSALoRA`,
:class:`~fedadapt.strategies.fedex_lora.FedExLoRA`. Tensor names are peft's, read through
:mod:`fedadapt.adapters.lora` (:func:`~fedadapt.adapters.lora.lora_pairs`: ``X.lora_A...`` with
``X.lora_B...``; ``X.base_delta``). peft's Conv2d LoRA is read as the same matrices: ``A``
(``r x in x kh x kw``) flattened to ``r x (in kh kw)`` and ``B`` (``out x r x 1 x 1``) to
``out x r``. Every other tensor (a head, biases, DoRA's magnitude vectors) is FedAvg's weighted
mean (:func:`fedadapt.strategies.fedavg.average_by_tensor`, weighted by ``weighted_by_key``
from each reply's MetricRecord).

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

Helpers (pure, on float64 torch matrices): :func:`check_rank`, :func:`matrix_a`,
:func:`matrix_b`, :func:`pad_rank`, :func:`truncate_rank`, :func:`normalise`,
:func:`weighted_product_sum`, :func:`svd_split`; each paper's aggregator is in its strategy's
module.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
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

from fedadapt.adapters.lora import base_delta_name, is_base_delta, lora_pairs
from fedadapt.codec import to_array
from fedadapt.config import ConfigError
from fedadapt.strategies.fedavg import PerTensorFedAvg, average_by_tensor

__all__ = ["LoRARankStrategy", "array_of", "as_torch", "check_rank", "matrix_a", "matrix_b",
           "normalise", "pad_rank", "reply_arrays", "svd_split", "torch_dtype", "truncate_rank",
           "weighted_product_sum"]

Tensor = torch.Tensor


# -- ranks ------------------------------------------------------------------------------------

def check_rank(rank, what: str = "rank") -> int:
    """``rank`` as an int >= 1; :class:`ConfigError` naming ``what`` otherwise."""
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
        raise ConfigError(f"{what}={rank!r} is invalid: a LoRA rank is an integer >= 1")
    return int(rank)


# -- matrices ---------------------------------------------------------------------------------

def matrix_a(a) -> Tensor:
    """A (``r x in``, or a conv's ``r x in x kh x kw``) as a float64 ``r x in'`` matrix."""
    t = torch.as_tensor(a).double()
    return t.reshape(t.shape[0], -1)


def matrix_b(b, name: str = "B") -> Tensor:
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


# -- records ----------------------------------------------------------------------------------

def as_torch(array: Array) -> Tensor:
    """``array`` decoded, as a torch tensor."""
    return torch.from_numpy(array.numpy())


def torch_dtype(array: Array) -> torch.dtype:
    """The torch dtype of ``array``'s values (without decoding them)."""
    return torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype  # not decoded


def array_of(t: Tensor, shape, dtype: torch.dtype) -> Array:
    """``t`` as an Array of ``shape`` and ``dtype``."""
    return to_array(t.reshape(shape).to(dtype).contiguous())


def _sliced(array: Array, rank: int, axis: int) -> Array:
    """``array`` cut to its first ``rank`` entries along ``axis`` (itself when already there)."""
    if array.shape[axis] == rank:
        return array
    t = as_torch(array)
    return to_array((t[:rank] if axis == 0 else t[:, :rank]).contiguous())


def _reply_weight(content: RecordDict, key: str) -> float:
    return float(next(iter(content.metric_records.values()))[key])


def reply_arrays(content: RecordDict) -> ArrayRecord:
    """A reply's arrays (its first ArrayRecord)."""
    return next(iter(content.array_records.values()))


class LoRARankStrategy(PerTensorFedAvg):
    """FedAvg whose clients train LoRA at their own ranks: the shared machinery of the five
    strategies (sending each client its slices, reading and checking the replies' factors, the
    FedAvg mean of every other tensor, accumulating ``X.base_delta``); on
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
            sent = reply_arrays(msg.content)
            node = msg.metadata.src_node_id
            if a_name not in sent:
                if self.shares_b and b_name in sent:
                    raise ValueError(f"the reply of node {node} holds {b_name!r} without its "
                                     f"pair {a_name!r}")
                continue
            a = matrix_a(as_torch(sent[a_name]))
            bound = min(self.client_rank(node), r_max)
            if a.shape[0] > bound or a.shape[1] != width:
                raise ValueError(f"the reply of node {node} holds {a_name!r} of shape "
                                 f"{tuple(sent[a_name].shape)}: at most rank {bound} of "
                                 f"{tuple(a_now.shape)} was expected")
            if self.shares_b:
                if b_name not in sent:
                    raise ValueError(f"the reply of node {node} holds {a_name!r} without its "
                                     f"pair {b_name!r}")
                b = matrix_b(as_torch(sent[b_name]), b_name)
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
        dtype = torch_dtype(a_now)
        out = {}
        if a_new is not None:
            out[a_name] = array_of(a_new, a_now.shape, dtype)
        if b_new is not None:
            out[b_name] = array_of(b_new, b_now.shape, dtype)
        if delta is not None:
            d_name = base_delta_name(a_name)
            shape = (b_now.shape[0], *a_now.shape[1:])
            if d_name in current:
                old = current[d_name]
                delta = as_torch(old).double().reshape(delta.shape) + delta
                dtype = torch_dtype(old)
            out[d_name] = array_of(delta, shape, dtype)
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
            return as_torch(arrays[d_name]).double().reshape(arrays[b_name].shape[0], -1)
        return torch.zeros(arrays[b_name].shape[0], math.prod(arrays[a_name].shape[1:]),
                           dtype=torch.float64)
