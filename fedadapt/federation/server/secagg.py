"""Secure aggregation (``secagg=secaggplus``): a round's training through Flower's own SecAgg+.

Why not the Message-API strategies. Flower 1.41's SecAgg+ is ``SecAggPlusWorkflow`` (server)
with ``secaggplus_mod`` (client), and both speak the legacy API only: the workflow samples
through a legacy ``Strategy.configure_fit(server_round, parameters, client_manager)`` and hands
the unmasked result to ``Strategy.aggregate_fit(server_round, results, failures)``; the mod reads
the ClientApp's reply as a legacy ``FitRes`` (``compat.recorddict_to_fitres``) and replaces its
arrays with masked integers in a ConfigRecord. A Message-API strategy's ``aggregate_train(
server_round, replies)`` wants each client's ``ArrayRecord``: under SecAgg+ no reply carries one,
only the sum of them all exists, after the protocol's fourth stage. So a SecAgg+ round is run
here by Flower's workflow with Flower's legacy ``FedAvg``, in place of ``configure_train`` ->
the grid -> ``aggregate_train`` of fedadapt's loop (:mod:`fedadapt.federation.server.loop`); the
rest of the round (evaluation, rows, checkpoints) is the loop's, with the run's Message-API
strategy for evaluation.

Each Flower node must be one client (the protocol's keys and masks are a node's): the deployment
engine, or in simulation one node per client (``execute=in_process("clients")``,
``run_in_process``; ``secagg=secaggplus`` makes ``node_layout`` put one node per client on
``federation.backend``, tested in process, not yet on Ray). The messages of the four stages go
to the nodes as Flower's workflow makes them (:class:`SecAggGrid` counts their bytes); on the
node,
:mod:`fedadapt.federation.client.secagg` runs ``secaggplus_mod`` and hands the training stage to
fedadapt's ClientApp in its own layout.

What the server learns: the example-weighted mean of the parameters of the clients that reached
the third stage (a client that drops out after sharing its keys is unmasked from its neighbours'
shares), and, in the clear as in Flower's workflow, each client's ``num_examples`` and metrics
(``train_loss``) in its ``FitRes``.

Quantisation (Flower's, stated in docs/federation.md): client i with weight n_i sends its
parameters scaled by q_i = round(n_i / W * T) / T (W: ``secagg.max_weight``, T:
``secagg.quantization_range``), clipped to [-c, c] (c: ``secagg.clipping_range``) and
stochastically rounded to T levels over [-c, c]; the server divides the unmasked sum by
sum q_i. Without clipping (|q_i p_i| <= c) and without wrap-around (n T < ``modulus_range``),
each coordinate differs from FedAvg's weighted mean by less than :func:`quantisation_bound`:
n (2c + max|p|) / (T sum q_i), plus float32 rounding (the round's arrays return in the global
model's dtype).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Optional

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict

from fedadapt.config import make_secagg_workflow as make_workflow

if TYPE_CHECKING:  # pragma: no cover
    from fedadapt.config import SecAggConfig
    from fedadapt.federation.server.loop import ServerPlan, ServerState
    from fedadapt.federation.wire.grid import ClientGrid

#: The fit config key that names the global tensors, in the order of the legacy ``Parameters``
#: (which carry no names): one string, the names joined by newlines (a legacy config value is
#: a scalar).
NAMES_KEY = "fedadapt.secagg-names"


def quantisation_bound(weights: Iterable[float], max_abs: float, sa: "SecAggConfig",
                       max_weight: float) -> float:
    """The largest difference per coordinate between SecAgg+'s mean and FedAvg's for clients
    of these weights (training examples) whose parameters are at most ``max_abs`` in size (see
    the module docstring), before float32 rounding."""
    t = int(sa.quantization_range)
    q = [round(w / max_weight * t) / t for w in weights]
    return len(q) * (2 * float(sa.clipping_range) + max_abs) / (t * sum(q))


def _value_bytes(value) -> int:
    """A config or metric value's payload: bytes and text by length, a number 8 bytes (a
    bool 1), a list the sum of its items (the protocol's keys, shares and masked vectors are
    lists of bytes)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, (list, tuple)):
        return sum(_value_bytes(v) for v in value)
    return 1 if isinstance(value, bool) else 8


def _bytes(content: RecordDict) -> int:
    """A message's payload: its arrays' bytes (Flower's ``count_bytes``), its config and metric
    values' (:func:`_value_bytes`) and every name."""
    total = 0
    for name, rec in content.items():
        total += len(name)
        if isinstance(rec, ArrayRecord):
            total += rec.count_bytes()
        else:
            total += sum(len(k) + _value_bytes(v) for k, v in rec.items())
    return total


class SecAggGrid:
    """The grid Flower's workflow is given: the clients' own Flower nodes under their real node
    ids (``secaggplus_mod`` keys its masks by the id its node receives messages at), each
    message sent as the workflow made it, its payload counted both ways per client."""

    def __init__(self, grid: "ClientGrid") -> None:
        self._clients = grid
        self._grid = grid._grid  # the Flower grid under fedadapt's packing
        self.node_of = dict(grid.nodes.node_ids)  # partition id -> Flower node id
        self.client_of = {nid: cid for cid, nid in self.node_of.items()}
        self.down: dict[int, int] = {}
        self.up: dict[int, int] = {}
        self.stages: list[float] = []  # each stage's seconds
        self.replied: list[int] = []  # each stage's replies
        #: Why a client dropped out: the first error each sent.
        self.errors: dict[int, str] = {}
        #: The clients of the first stage (those the legacy strategy sampled).
        self.sampled: list[int] = []

    @property
    def run(self):
        return getattr(self._grid, "run", None)

    def get_node_ids(self) -> list[int]:
        """The nodes of the clients the strategy may sample (fedadapt's grid's)."""
        return [self.node_of[self._clients.partition_of(n)]
                for n in self._clients.get_node_ids()]

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: Optional[float] = None) -> list[Message]:
        t0 = time.perf_counter()
        messages = list(messages)
        for msg in messages:
            cid = self.client_of[msg.metadata.dst_node_id]
            self.down[cid] = self.down.get(cid, 0) + _bytes(msg.content)
            if not self.stages:
                self.sampled.append(cid)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        for reply in replies:
            cid = self.client_of[reply.metadata.src_node_id]
            if not reply.has_error():
                self.up[cid] = self.up.get(cid, 0) + _bytes(reply.content)
            elif cid not in self.errors:
                self.errors[cid] = str(reply.error.reason)
        self.stages.append(time.perf_counter() - t0)
        self.replied.append(sum(1 for r in replies if not r.has_error()))
        return replies


@dataclass
class _Fitted:
    """What the legacy FedAvg's metric aggregation saw: each result's weight and metrics."""

    results: list = field(default_factory=list)

    def __call__(self, pairs: list) -> dict:
        self.results = list(pairs)
        total = sum(n for n, _ in pairs)
        losses = [(n, m["train_loss"]) for n, m in pairs if "train_loss" in m]
        if not losses or total == 0:
            return {}
        return {"train_loss": sum(n * float(v) for n, v in losses) / total}


@dataclass
class SecAggRound:
    """``secagg=secaggplus`` for a run's rounds: :meth:`train_round` takes the place of the
    loop's ``_train_round``."""

    config: "SecAggConfig"
    #: ``W``: the weight a client's examples are divided by (at most 1 each).
    max_weight: float
    #: The share of the clients sampled per round (``partition.fraction_fit``).
    fraction_fit: float
    timeout: Optional[float] = None
    #: The last round's protocol: seconds and replies per stage, bytes by client.
    last: dict = field(default_factory=dict)

    def workflow(self):
        return make_workflow(self.config, max_weight=self.max_weight, timeout=self.timeout)

    def _legacy_context(self, grid: SecAggGrid, state: "ServerState", rnd: int,
                        config: ConfigRecord, fitted: _Fitted):
        from flwr.server import ServerConfig, SimpleClientManager
        from flwr.server.compat.grid_client_proxy import GridClientProxy
        from flwr.server.compat.legacy_context import LegacyContext
        from flwr.server.strategy import FedAvg
        from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
        from flwr.server.workflow.constant import Key as WorkflowKey

        nodes = grid.get_node_ids()
        names = list(state.arrays.keys())
        fit_config = {**dict(config), "server-round": rnd, NAMES_KEY: "\n".join(names)}
        strategy = FedAvg(fraction_fit=self.fraction_fit, fraction_evaluate=0.0,
                          min_fit_clients=2, min_available_clients=len(nodes),
                          on_fit_config_fn=lambda _rnd: dict(fit_config),
                          fit_metrics_aggregation_fn=fitted, inplace=False)
        manager = SimpleClientManager()
        run_id = getattr(grid.run, "run_id", 0)
        for nid in nodes:
            manager.register(GridClientProxy(nid, grid, run_id))
        context = LegacyContext(Context(run_id=run_id, node_id=0, node_config={},
                                        state=RecordDict(), run_config={}),
                                config=ServerConfig(num_rounds=state.num_rounds),
                                strategy=strategy, client_manager=manager)
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
            {WorkflowKey.CURRENT_ROUND: rnd})
        context.state.array_records[MAIN_PARAMS_RECORD] = state.arrays
        return context, MAIN_PARAMS_RECORD

    def train_round(self, grid: "ClientGrid", state: "ServerState", plan: "ServerPlan",
                    rnd: int, config: ConfigRecord) -> tuple[dict, int, int]:
        """One round of training through Flower's ``SecAggPlusWorkflow`` and legacy
        ``FedAvg`` (see the module docstring); the round's row so far and its bytes (every
        stage's payload, both ways). The round fails (:class:`RoundFailed`) when the protocol
        halts (too few clients left for a secret's threshold) or fewer than
        ``federation.min_reply_fraction`` of the sampled clients' parameters are in the sum."""
        from fedadapt.federation.server.faults import RoundFailed
        from fedadapt.federation.server.loop import privacy_row

        sa_grid = SecAggGrid(grid)
        fitted = _Fitted()
        with state.streams.use("train"):  # the workflow's sampling and its neighbours' shuffle
            context, key = self._legacy_context(sa_grid, state, rnd, config, fitted)
            self.workflow()(sa_grid, context)
        sampled = len(sa_grid.sampled)
        new = context.state.array_records[key]
        self.last = {"stage_s": list(sa_grid.stages), "stage_replies": list(sa_grid.replied),
                     "down": dict(sa_grid.down), "up": dict(sa_grid.up)}
        if new is state.arrays:
            raise RoundFailed(f"round {rnd}: SecAgg+ halted at stage {len(sa_grid.stages)} of "
                              f"4: {sa_grid.replied[-1] if sa_grid.replied else 0} of "
                              f"{sampled} sampled clients replied, too few for the "
                              f"reconstruction threshold (secagg.reconstruction_threshold)"
                              + "".join(f"; client {c}: {why}" for c, why in
                                        sorted(sa_grid.errors.items())[:3]))
        trained = len(fitted.results)
        if trained < plan.min_reply_fraction * sampled:
            raise RoundFailed(f"round {rnd}: only {trained} of {sampled} sampled clients' "
                              f"parameters are in SecAgg+'s sum (federation.min_reply_fraction"
                              f"={plan.min_reply_fraction})")
        state.arrays = self._as_global(state.arrays, new)
        loss = fitted(fitted.results).get("train_loss")
        row = {"round": rnd, "lr": plan.lr_at(rnd), "clients_sampled": sampled,
               "clients_trained": trained, "clients_failed": sampled - trained,
               "failures": ({"secagg_dropped": sampled - trained} if sampled > trained
                            else {}),
               "late_clients": [], "train_loss": loss,
               "global_acc": None, "global_loss": None, "client_acc": None,
               "client_acc_weighted": None, "clients_evaluated": None,
               **privacy_row(state.strategy),
               "secagg_stage_s": [round(s, 6) for s in sa_grid.stages],
               "secagg_stage_replies": list(sa_grid.replied)}
        return row, sum(sa_grid.down.values()), sum(sa_grid.up.values())

    @staticmethod
    def _as_global(current: ArrayRecord, new: ArrayRecord) -> ArrayRecord:
        """The workflow's arrays (legacy ``Parameters``: float64, named 0..n-1) under the
        global model's names, shapes and dtypes."""
        values = list(new.values())
        if len(values) != len(current):
            raise RuntimeError(f"SecAgg+ returned {len(values)} tensors for the global "
                               f"model's {len(current)}")
        out = ArrayRecord()
        for (name, old), arr in zip(current.items(), values):
            data = np.asarray(arr.numpy(), dtype=np.dtype(old.dtype)).reshape(old.shape)
            out[name] = Array(data)
        return out


def secagg_round(cfg, max_weight: float, timeout: Optional[float]) -> Optional[SecAggRound]:
    """The run's :class:`SecAggRound` (None: ``secagg=none``)."""
    sa = cfg.secagg
    if sa.name == "none":
        return None
    return SecAggRound(config=sa, max_weight=float(sa.max_weight or max_weight),
                       fraction_fit=float(cfg.partition.fraction_fit),
                       timeout=sa.timeout if sa.timeout is not None else timeout)


__all__ = ["NAMES_KEY", "SecAggGrid", "SecAggRound", "make_workflow", "quantisation_bound",
           "secagg_round"]
