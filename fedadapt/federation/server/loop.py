"""The server's round loop (the one place it lives) and the ServerApp around it.

A Flower strategy drives every round through its own hooks, unchanged: ``summary()`` at the
start, then per round ``configure_train`` -> the grid -> ``aggregate_train`` and, every
``eval_every`` rounds, ``configure_evaluate`` -> the grid -> ``aggregate_evaluate``. The grid it
is handed (:class:`fedadapt.federation.wire.grid.ClientGrid`) shows one node per client and packs
the messages for the clients of one worker into one Flower message underneath; the deployment
engine (a node is a client) runs the same loop. The strategy samples with the run's own seeded
``random`` and ``numpy.random`` states (:class:`fedadapt.strategies.state.SeededStreams`), which
go into every checkpoint with the strategy's own state.

Around the strategy the loop keeps what fedadapt guarantees: every reply is screened before the
strategy sees it (:mod:`fedadapt.federation.server.faults`: a reply with other tensor names or
shapes than that client trains, or NaN values, reaches the strategy as an error reply), the round
stops the run when too few clients replied usably, the global model is evaluated on the
server, and the per-client metrics, bytes and privacy spent are recorded in the round's row.
As Flower's ``Strategy.start`` does, it keeps what the strategy returns: ``aggregate_train``'s
and ``aggregate_evaluate``'s metrics go into the row as ``strategy/train/<key>`` and
``strategy/evaluate/<key>``; a user's ``evaluate_fn(server_round, arrays)`` is called where the
global model is evaluated (its metrics as ``evaluate_fn/<key>``), and with ``eval_round0`` the
initial model is evaluated first (a ``round: 0`` row). :func:`flower_result` reads a Flower
``Result`` from the rows. After each round it calls ``on_round(state)``: the hook where
progress, metrics and checkpoints go. Nothing per round grows with the clients registered: only
with those sampled.

Bytes are what the clients would exchange on real devices: each sampled client receives the
global tensors it trains (once per client, although a simulation worker gets them once per
message) and sends the tensors it trained.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from logging import WARNING
from typing import Callable, Optional

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import Result

from fedadapt.codec import TRAIN_EXAMPLES
from fedadapt.config import FedadaptError
from fedadapt.devices import return_freed_memory
from fedadapt.federation.server.faults import RoundFailed, Screened, require_enough, screen_clients
from fedadapt.federation.server.interrupt import StoppableGrid
from fedadapt.federation.wire.grid import ClientGrid, Nodes, handshake, node_id
from fedadapt.settings import per_tier_accuracy
from fedadapt.strategies.asynchronous import AsynchronousStrategy
from fedadapt.strategies.fedavg import aggregate_client_metrics
from fedadapt.strategies.privacy import privacy_spent
from fedadapt.strategies.state import SeededStreams, load_strategy_state, strategy_state
from fedadapt.userimport import UserCodeError, user_error

__all__ = ["Nodes", "ServerPlan", "ServerState", "execute_plan", "flower_result", "handshake",
           "make_server_app", "run_round_loop"]

#: How often the ServerApp polls for replies (Flower's default is 0.1 s, which would add up
#: to a tenth of a second to every exchange).
PULL_INTERVAL = 0.005


@dataclass
class ServerState:
    """What the server holds between rounds."""

    strategy: object
    arrays: ArrayRecord
    num_rounds: int
    #: The strategy's randomness (client sampling, DP noise), seeded per run.
    streams: SeededStreams = field(default_factory=lambda: SeededStreams(0))
    server_round: int = 0
    history: list[dict] = field(default_factory=list)
    cum_bytes: int = 0
    #: Round of the last complete checkpoint (clients may prune their state files up to it).
    checkpoint_round: int = 0
    #: Per-client evaluation results, ``{round: {client: metrics}}`` (written to
    #: ``clients.jsonl`` at the end, never into the per-round rows).
    client_metrics: dict[str, dict[str, dict]] = field(default_factory=dict)
    #: One row per client after the personalization step (empty without one).
    personalized: list[dict] = field(default_factory=list)
    #: One row per client after a server-trained method's phase (empty without one).
    delivered: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    #: A simulated fleet's clock: the simulated second the last round ended (``sim_time_s``).
    sim_time: float = 0.0
    #: When the server is (``in round 3``): what an error raised inside the user's code names.
    stage: str = "before round 1"

    def strategy_checkpoint(self) -> tuple[dict, dict]:
        """``(json, arrays)``: the sampling and noise streams and the strategy's attributes."""
        attrs, arrays = strategy_state(self.strategy, self.arrays)
        return {"streams": self.streams.state_dict(), "attributes": attrs}, arrays

    def flower_result(self) -> Result:
        """What Flower's ``Strategy.start`` returns, for the rounds so far."""
        return flower_result(self.history, self.arrays)


#: Prefixes of the rows' keys that hold what the strategy and ``evaluate_fn`` returned.
STRATEGY_TRAIN, STRATEGY_EVALUATE, EVALUATE_FN = "strategy/train/", "strategy/evaluate/", \
    "evaluate_fn/"
#: The server's own evaluation keys of a row (fedadapt's global evaluation).
SERVER_KEYS = ("global_acc", "global_loss", "global_acc_last", "exit_acc", "unseen_acc")


def _metric_value(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) or (
        isinstance(value, list) and bool(value)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value))


def _prefixed(prefix: str, record) -> dict:
    """A MetricRecord (or dict) as row keys under ``prefix`` (numbers and lists of them)."""
    return {f"{prefix}{k}": v for k, v in dict(record or {}).items() if _metric_value(v)}


def _record(row: dict, keys=None, prefix: str = "") -> Optional[MetricRecord]:
    found = {k[len(prefix):]: v for k, v in row.items()
             if (k in keys if keys is not None else k.startswith(prefix))
             and v is not None and _metric_value(v)}
    return MetricRecord(found) if found else None


def flower_result(history: list[dict], arrays: ArrayRecord) -> Result:
    """A Flower ``Result`` from a run's rows: the final arrays, the strategy's aggregated train
    and evaluate metrics per round, and the server-side evaluation per round (fedadapt's global
    evaluation and ``evaluate_fn``'s, round 0 included when it was evaluated)."""
    result = Result(arrays=arrays)
    for row in history:
        rnd = int(row["round"])
        for where, record in ((result.train_metrics_clientapp, _record(row, prefix=STRATEGY_TRAIN)),
                              (result.evaluate_metrics_clientapp,
                               _record(row, prefix=STRATEGY_EVALUATE))):
            if record is not None:
                where[rnd] = record
        server = {**(_record(row, keys=SERVER_KEYS) or {}),
                  **(_record(row, prefix=EVALUATE_FN) or {})}
        if server:
            result.evaluate_metrics_serverapp[rnd] = MetricRecord(server)
    return result


@dataclass
class ServerPlan:
    """How the ServerApp runs; built by the method families (:mod:`fedadapt.methods`)."""

    num_clients: int
    #: The Flower strategy of the rounds (None: no rounds, a server-trained method's phase).
    make_strategy: Optional[Callable[[], object]]
    initial_arrays: ArrayRecord
    num_rounds: int
    lr_at: Callable[[int], float]
    eval_every: int
    global_eval: Optional[Callable[[ArrayRecord], dict]]
    counts: dict
    #: A user's server-side evaluation, Flower's ``evaluate_fn(server_round, arrays) ->
    #: MetricRecord | None`` (``federation.evaluate_fn``).
    evaluate_fn: Optional[Callable[[int, ArrayRecord], Optional[MetricRecord]]] = None
    #: Evaluate the initial model on the server before round 1 (``federation.eval_round0``).
    eval_round0: bool = False
    timeout: Optional[float] = None
    min_reply_fraction: float = 0.5
    on_round: Optional[Callable[[ServerState], None]] = None
    #: ``workers`` (simulation) or ``clients`` (deployment engine), and how many nodes.
    nodes: str = "workers"
    num_nodes: int = 1
    #: Each simulated worker's Ray resources (``num_cpus``, ``num_gpus``).
    resources: dict = field(default_factory=lambda: {"num_cpus": 1.0, "num_gpus": 0.0})
    #: Clients a worker trains side by side (1: one after another).
    group_size: int = 1
    #: In process: the workers serve their messages at the same time, each on a thread of its
    #: own (:mod:`fedadapt.federation.simulation.inprocess`); otherwise they take turns.
    workers_at_once: bool = False
    #: ``client_work(cid)``: a client's training examples, by which a round's clients are
    #: spread over the workers (:meth:`fedadapt.federation.wire.grid.Nodes.balanced`); None:
    #: evenly by count.
    client_work: Optional[Callable[[int], float]] = None
    #: torch's threads for the server's own work (its evaluation) while the plan runs, where
    #: the free cores cap the workers' (fedadapt.cores); None = the process's as they are.
    server_threads: Optional[int] = None
    #: ``sent_names(client)``: the names of the tensors a client trains, receives and sends
    #: back; None = every global tensor.
    sent_names: Optional[Callable[[int], list[str]]] = None
    #: ``sent_shape(client, name, global_shape)``: the shape of a tensor in the client's reply
    #: when it differs from the global one (a LoRA factor of the client's own rank; a dimension
    #: ``-n`` accepts 1..n); None = the global shapes.
    sent_shape: Optional[Callable[[int, str, tuple], tuple]] = None
    #: What the method's family does with the clients after the rounds, in order:
    #: ``phase(grid, state, plan)`` (a personalization step; a server-trained method's one
    #: phase: a plug-in delivered, the sessions served). Each leaves its rows in ``state``.
    phases: list[Callable[["ClientGrid", "ServerState", "ServerPlan"], None]] = \
        field(default_factory=list)
    #: Seeds the strategy's sampling and noise (:class:`SeededStreams`).
    seed: int = 0
    #: A checkpoint to continue from: ``{"round", "history", "cum_bytes", "strategy",
    #: "strategy_arrays", "wall_s", "client_metrics"}`` (``initial_arrays`` then holds the
    #: checkpoint's arrays).
    resume: Optional[dict] = None
    #: Simulated devices and clock (``fleet=``;
    #: :class:`fedadapt.federation.simulation.fleet.Fleet`): sampling among the clients available at
    #: a round's simulated start, clients dropped by its simulated deadline, ``sim_*`` keys in each
    #: row. None: no fleet.
    fleet: Optional[object] = None
    #: ``secagg=secaggplus``: each round's training through Flower's SecAgg+ workflow
    #: (:class:`fedadapt.federation.server.secagg.SecAggRound`); None: the strategy's hooks.
    secagg: Optional[object] = None
    #: Filled by the ServerApp: the final state, or the exception that stopped it.
    result: Optional[ServerState] = None
    error: Optional[BaseException] = None

    @property
    def resume_round(self) -> int:
        return int(self.resume["round"]) if self.resume else 0


def _warn_dropped(server_round: int, what: str, screened: Screened, sampled: int) -> None:
    if screened.dropped:
        log(WARNING, "round %d: dropped %d of %d %s replies: %s", server_round,
            len(screened.dropped), sampled, what, screened.describe())


def exchange(grid: ClientGrid, messages: list[Message], timeout: Optional[float],
              expected: Optional[Callable[[int], dict]], what: str, server_round: int
              ) -> tuple[dict[int, Message], dict[int, Message], Screened]:
    """Send ``messages`` (one per client); ``(sent, replies, screened)`` by partition id. A
    client whose reply fails screening (``expected(client)``: the tensors it must send) gets
    an error reply in ``replies`` instead, carrying why."""
    sent = {grid.partition_of(m.metadata.dst_node_id): m for m in messages}
    replies = {grid.partition_of(r.metadata.src_node_id): r
               for r in grid.send_and_receive(messages, timeout=timeout)}
    screened = screen_clients(list(sent), {p: r.error.reason if r.has_error() else r.content
                                           for p, r in replies.items()}, expected)
    _warn_dropped(server_round, what, screened, len(sent))
    for cid, kind, detail in screened.dropped:
        if cid in replies and not replies[cid].has_error():
            replies[cid] = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                         reason=f"{kind}: {detail}"), reply_to=sent[cid])
    return sent, replies, screened


def _inner(strategy):
    """The innermost strategy (a DP wrapper's ``strategy``)."""
    while hasattr(strategy, "strategy"):
        strategy = strategy.strategy
    return strategy


def _check_arrays(strategy, new: ArrayRecord, current: ArrayRecord, rnd: int) -> None:
    if list(new.keys()) != list(current.keys()) or any(
            tuple(new[n].shape) != tuple(current[n].shape) for n in new.keys()):
        raise UserCodeError(f"{_hook(strategy, 'aggregate_train')} returned arrays in round "
                            f"{rnd} that are not the global model's ({len(new)} tensors, "
                            f"expected {len(current)}: "
                            f"{sorted(set(current.keys()) ^ set(new.keys()))[:3]} differ)", "")


def _hook(strategy, name: str) -> str:
    """``HalfStepFedAvg.aggregate_train``: the class that defines a strategy's hook (under a DP
    wrapper, the wrapped strategy's when the wrapper's calls it)."""
    inner = _inner(strategy)
    for obj in (inner, strategy):
        for cls in type(obj).__mro__:
            if name in vars(cls) and not cls.__module__.startswith("fedadapt."):
                return f"{cls.__name__}.{name}"
    return f"{type(inner).__name__.removeprefix('PerTensor')}.{name}"


def _messages(strategy, hook: str, returned, rnd: int) -> list[Message]:
    """What ``configure_train`` / ``configure_evaluate`` returned, checked: Messages."""
    try:
        messages = list(returned)
    except TypeError:
        messages = None
    if messages is None or not all(isinstance(m, Message) for m in messages):
        what = type(returned).__name__ if messages is None else next(
            type(m).__name__ for m in messages if not isinstance(m, Message))
        raise UserCodeError(f"{_hook(strategy, hook)} returned {what} in round {rnd}, not an "
                            f"iterable of Messages (Flower's {hook}(server_round, arrays, "
                            f"config, grid) -> Iterable[Message])", "")
    return messages


def _metrics(strategy, hook: str, returned, rnd: int):
    if returned is not None and not isinstance(returned, (MetricRecord, dict)):
        raise UserCodeError(f"{_hook(strategy, hook)} returned {type(returned).__name__} in "
                            f"round {rnd} where a MetricRecord or None is due", "")
    return returned


def _aggregated(strategy, returned, rnd: int) -> tuple[Optional[ArrayRecord], object]:
    """What ``aggregate_train`` returned, checked: ``(ArrayRecord | None, MetricRecord |
    None)``."""
    if not (isinstance(returned, tuple) and len(returned) == 2
            and (returned[0] is None or isinstance(returned[0], ArrayRecord))):
        what = (f"a tuple of {len(returned)}" if isinstance(returned, tuple)
                else type(returned).__name__)
        if isinstance(returned, tuple) and len(returned) == 2:
            what = f"({type(returned[0]).__name__}, {type(returned[1]).__name__})"
        raise UserCodeError(f"{_hook(strategy, 'aggregate_train')} returned {what} in round "
                            f"{rnd}, not (ArrayRecord | None, MetricRecord | None) (Flower's "
                            f"aggregate_train(server_round, replies))", "")
    return returned[0], _metrics(strategy, "aggregate_train", returned[1], rnd)


def _in_dtypes_of(current: ArrayRecord, new: ArrayRecord) -> ArrayRecord:
    """``new`` with each tensor in the global model's dtype. Flower's FedOpt strategies scale
    by a numpy float64 (``eta_norm``), which under numpy 2 turns float32 arrays into float64:
    the model would travel at twice the bytes from round 1 on."""
    if all(new[n].dtype == current[n].dtype for n in new.keys()):
        return new
    return ArrayRecord({n: a if a.dtype == current[n].dtype else
                        Array(np.asarray(a.numpy(), dtype=np.dtype(current[n].dtype)))
                        for n, a in new.items()})


def privacy_row(strategy) -> dict:
    """The round's privacy figures: epsilon spent (an accountant's), the clipping norm (DP)."""
    out = {}
    if hasattr(strategy, "clipping_norm"):
        out["dp_clipping_norm"] = float(strategy.clipping_norm)
    spent = privacy_spent(strategy)
    if spent is not None:
        out["epsilon"], out["delta"] = spent["epsilon"], spent["delta"]
    return out


def _train_round(grid: ClientGrid, state: ServerState, plan: ServerPlan, rnd: int,
                 config: ConfigRecord) -> tuple[dict, int, int]:
    """One round of training through the strategy's hooks; its row so far and the bytes."""
    if plan.secagg is not None:  # secagg=secaggplus: Flower's SecAgg+ workflow and FedAvg
        return plan.secagg.train_round(grid, state, plan, rnd, config)
    strategy, fleet = state.strategy, plan.fleet
    expected = _expected_shapes(state, plan)
    grid.trained = plan.sent_names
    start, sim = _offer_available(grid, state, plan, rnd)
    try:
        with state.streams.use("train"):
            messages = _messages(strategy, "configure_train",
                                 strategy.configure_train(rnd, state.arrays, config, grid), rnd)
    finally:
        grid.only = None
    asynchronous = isinstance(_inner(strategy), AsynchronousStrategy)
    # fleet.partial_work: a client that cannot finish by the deadline trains what it can
    cut = (_cut_work(fleet, grid, messages) if getattr(fleet, "partial_work", False)
           and not asynchronous else {})
    sent, replies, screened = exchange(grid, messages, plan.timeout, expected, "training",
                                        rnd)
    down, up = grid.take_bytes()
    if fleet is not None:  # the fleet's clock: when each client arrives, or the round's time
        sim.update(_fleet_clock(fleet, start, state, asynchronous, screened, replies, sent,
                                down, up, cut))
    require_enough(screened, len(sent), plan.min_reply_fraction, rnd)
    served = grid.take_nodes()
    train_loss, train_metrics = _aggregate_train(state, screened, replies, rnd, asynchronous)
    if fleet is not None and asynchronous:  # the clock: the update's simulated second
        previous, state.sim_time = state.sim_time, max(state.sim_time, _inner(strategy).now)
        sim.update({"sim_round_s": state.sim_time - previous, "sim_time_s": state.sim_time})
    row = _train_row(rnd, plan, strategy, sent, screened, served, train_loss, train_metrics,
                     sim)
    del messages, sent, replies, screened  # freed before the next round
    return_freed_memory()
    return row, sum(down.values()), sum(up.values())


def _expected_shapes(state: ServerState, plan: ServerPlan) -> Callable[[int], dict[str, tuple]]:
    """``expected(cid)``: the name and shape of each tensor client ``cid`` sends (every global
    tensor at its global shape, unless the plan says otherwise), for screening its reply."""
    shapes = {name: tuple(arr.shape) for name, arr in state.arrays.items()}
    names = plan.sent_names or (lambda cid: list(shapes))
    shape = plan.sent_shape or (lambda cid, name, global_shape: global_shape)

    def expected(cid: int) -> dict[str, tuple]:
        return {n: shape(cid, n, shapes[n]) for n in names(cid)}
    return expected


def _offer_available(grid: ClientGrid, state: ServerState, plan: ServerPlan, rnd: int
                     ) -> tuple[Optional[float], dict]:
    """With a fleet, the clients the strategy may sample now (``grid.only``: available, and
    their training fits in their device's memory), the simulated second they start from and
    the row's counts of those left out; ``(None, {})`` without a fleet."""
    fleet, sim = plan.fleet, {}
    if fleet is None:
        return None, sim
    start = fleet.next_available(state.sim_time)
    exact = getattr(fleet, "exact", False)  # fleet.fedscale_semantics=exact
    if start is None and exact:
        raise RoundFailed(f"round {rnd}: no client of the fleet is online at simulated second "
                          f"{state.sim_time:.1f} by FedScale's availability "
                          f"(fleet.fedscale_semantics=exact: its round waits for no one, and "
                          f"FedScale's simulator fails there too)")
    if start is None:
        raise RoundFailed(f"round {rnd}: no client of the fleet is ever available again "
                          f"after simulated second {state.sim_time:.1f} (fleet.trace)")
    available = fleet.available(start)
    # fleet.memory: a client whose training does not fit in its device is not sampled
    fits = getattr(fleet, "fits", None)
    grid.only = {c for c in available if fits is None or fits[c]}
    if exact:  # FedScale's over-selection: the strategy takes every client it offers
        grid.only = set(fleet.select(available))
    sim["sim_unavailable"] = plan.num_clients - len(available)
    if getattr(fleet, "memory_capped", False):
        sim["sim_no_memory"] = len(available) - len(grid.only)
    return start, sim


def _fleet_clock(fleet, start: float, state: ServerState, asynchronous: bool, screened,
                 replies, sent, down, up, cut) -> dict:
    """The fleet's clock after the exchange: an asynchronous strategy is told when each client
    it started will arrive; a round of the others is placed on the simulated clock."""
    if asynchronous:
        return _arrivals(fleet, start, _inner(state.strategy), screened, replies, sent, down, up)
    return _simulated_round(fleet, start, state, screened, replies, sent, down, up, cut)


def _aggregate_train(state: ServerState, screened, replies: dict, rnd: int,
                     asynchronous: bool) -> tuple[Optional[float], Optional[dict]]:
    """The strategy's ``aggregate_train`` on the replies, the new global arrays checked and
    kept in the old ones' dtypes; the round's train loss (the clients' weighted mean; for an
    asynchronous strategy, the loss of the updates it applied) and the strategy's metrics."""
    strategy = state.strategy
    weight = getattr(_inner(strategy), "weighted_by_key", "num-examples")
    good = [content for _, content in screened.good]
    # read before the strategy aggregates: some strategies consume the replies' arrays
    train_loss = (float(aggregate_client_metrics(good, weight)["train_loss"])
                  if good else None)
    del good
    with state.streams.use("train"):  # DP noise: numpy's generator
        new_arrays, train_metrics = _aggregated(strategy, strategy.aggregate_train(
            rnd, [replies[p] for p in sorted(replies)]), rnd)
    if asynchronous:  # the loss of the updates applied, not of the clients started now
        loss = (train_metrics or {}).get("train_loss")
        train_loss = float(loss) if loss is not None else None
    if new_arrays is not None:
        _check_arrays(strategy, new_arrays, state.arrays, rnd)
        state.arrays = _in_dtypes_of(state.arrays, new_arrays)
    return train_loss, train_metrics


def _train_row(rnd: int, plan: ServerPlan, strategy, sent, screened, served, train_loss,
               train_metrics, sim: dict) -> dict:
    """The round's metrics row as training leaves it (evaluation fills its columns later)."""
    return {"round": rnd, "lr": plan.lr_at(rnd), "clients_sampled": len(sent),
            "clients_trained": len(screened.good), "clients_failed": len(screened.dropped),
            "failures": screened.counts(),
            "late_clients": sorted(c for c, kind, _ in screened.dropped
                                   if kind in ("timeout", "sim_late")),
            "train_loss": train_loss,
            "global_acc": None, "global_loss": None, "client_acc": None,
            "client_acc_weighted": None, "clients_evaluated": None, **privacy_row(strategy),
            **({"trained_on": served} if len(served) > 1 else {}),
            **_prefixed(STRATEGY_TRAIN, train_metrics), **sim}


#: Why a fleet's clock drops a client (its failure kind is ``sim_<why>``).
SIM_DROPS = {"offline": "went offline before it finished",
             "late": "after the simulated deadline federation.round_timeout",
             "discarded": "beyond fleet.keep_first (or, with fleet.fedscale_semantics=exact, "
                          "beyond the round's target count of fastest clients)"}


def _drop_simulated(screened: Screened, replies: dict, sent: dict, up: dict,
                    dropped: dict[int, str]) -> dict:
    """The clients the clock drops (``{client: why}``) leave ``screened.good`` and get an error
    reply as a real timeout's or disconnection's would; what they would have sent never
    arrives, so it leaves ``up`` (the round's ``bytes_up``). Returns the row's ``sim_<why>``
    counts."""
    for cid, why in sorted(dropped.items()):
        up.pop(cid, None)
        screened.dropped.append((cid, f"sim_{why}", SIM_DROPS[why]))
        replies[cid] = Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                     reason=f"sim_{why}: {SIM_DROPS[why]}"), reply_to=sent[cid])
    screened.good = [(cid, content) for cid, content in screened.good if cid not in dropped]
    whys = list(dropped.values())
    return {f"sim_{why}": whys.count(why) for why in SIM_DROPS}


def _cut_work(fleet, grid: ClientGrid, messages: list[Message]) -> dict[int, int]:
    """``fleet.partial_work``: each client that cannot finish by the deadline is told to
    train the examples it can train in time (:meth:`Fleet.partial_examples
    <fedadapt.federation.simulation.fleet.Fleet.partial_examples>`, its bytes counted as the grid
    will count them), in its own copy of the message's config record (``train-examples``; the
    other records stay shared). Returns ``{client: examples}`` of those clients; one that
    cannot train even one example in time is left as it is, and is late."""
    cut = {}
    for msg in messages:
        cid = grid.partition_of(msg.metadata.dst_node_id)
        n = fleet.partial_examples(cid, *grid.bytes_of(cid, msg.content))
        if not 0 < n < fleet.examples[cid]:
            continue
        content = RecordDict(dict(msg.content.items()))
        name = "config" if isinstance(content.get("config"), ConfigRecord) else next(
            (k for k, r in content.items() if isinstance(r, ConfigRecord)), "config")
        content[name] = ConfigRecord({**dict(content.get(name) or {}),
                                      TRAIN_EXAMPLES: n})
        msg.content = content
        cut[cid] = n
    return cut


def _simulated_round(fleet, start: float, state: ServerState, screened: Screened,
                     replies: dict, sent: dict, down: dict, up: dict,
                     cut: Optional[dict[int, int]] = None) -> dict:
    """The round on the fleet's clock (:meth:`~fedadapt.federation.simulation.fleet.Fleet.round`):
    the clients it drops (offline before they finish, later than the deadline, beyond
    ``keep_first``) are dropped (:func:`_drop_simulated`); the clock moves to the round's end;
    returns the row's ``sim_*`` keys (``sim_partial``, with ``fleet.partial_work``: the
    clients kept whose work was cut at the deadline, ``cut``)."""
    cut = cut or {}
    dropped, seconds = fleet.round(start, [cid for cid, _ in screened.good], down, up, cut)
    counts = _drop_simulated(screened, replies, sent, up, dropped)
    if getattr(fleet, "partial_work", False):
        counts["sim_partial"] = sum(1 for cid, _ in screened.good if cid in cut)
    previous, state.sim_time = state.sim_time, start + seconds
    return {"sim_round_s": state.sim_time - previous, "sim_time_s": state.sim_time, **counts}


def _arrivals(fleet, start: float, strategy: AsynchronousStrategy, screened: Screened,
              replies: dict, sent: dict, down: dict, up: dict) -> dict:
    """An asynchronous strategy's clients started at ``start``: when each will arrive on the
    fleet's clock, told to the strategy by node (:meth:`AsynchronousStrategy.arrive`); one that
    would go offline first is dropped (:func:`_drop_simulated`). Returns the row's ``sim_*``
    counts."""
    arrivals, offline = {}, {}
    for cid, _ in screened.good:
        seconds = fleet.seconds(cid, down.get(cid, 0), up.get(cid, 0))
        if fleet.offline_before(cid, start, seconds) is not None:
            offline[cid] = "offline"
        else:
            arrivals[node_id(cid)] = (start, seconds)
    strategy.arrive(arrivals)
    return _drop_simulated(screened, replies, sent, up, offline)


def _evaluate_round(grid: ClientGrid, state: ServerState, plan: ServerPlan, rnd: int,
                    config: ConfigRecord, row: dict) -> int:
    """Server-side and client-side evaluation of the global arrays; fills ``row``, keeps the
    per-client values in ``state.client_metrics``; returns the bytes sent down."""
    row.update(_server_eval(plan, rnd, state.arrays))
    grid.trained = plan.sent_names
    with state.streams.use("evaluate"):
        messages = _messages(state.strategy, "configure_evaluate", state.strategy
                             .configure_evaluate(rnd, state.arrays, config, grid), rnd)
    if not messages:
        return 0
    _, replies, checked = exchange(grid, messages, plan.timeout, None, "evaluation", rnd)
    down, _ = grid.take_bytes()
    row["clients_evaluated"] = len(checked.good)
    contents = [content for _, content in checked.good]
    # fedadapt's own means (example-weighted and per client), whatever the strategy weights by
    metrics = aggregate_client_metrics(contents, "num-examples") if contents else None
    with state.streams.use("evaluate"):
        returned = _metrics(state.strategy, "aggregate_evaluate", state.strategy
                            .aggregate_evaluate(rnd, [replies[p] for p in sorted(replies)]), rnd)
    row.update(_prefixed(STRATEGY_EVALUATE, returned))
    if metrics is not None and "accuracy" in metrics:
        row["client_acc"] = float(metrics["accuracy_client_mean"])
        row["client_acc_weighted"] = float(metrics["accuracy"])
    if metrics is not None and "val_accuracy_client_mean" in metrics:
        row["val_acc"] = float(metrics["val_accuracy_client_mean"])
    per_client = {str(cid): dict(content.metric_records["metrics"])
                  for cid, content in checked.good}
    state.client_metrics[str(rnd)] = per_client
    tiers = [(m["tier"], m["accuracy"]) for m in per_client.values() if "tier" in m]
    if tiers:
        row["tier_acc"] = per_tier_accuracy(tiers)
    return sum(down.values())


def _server_eval(plan: ServerPlan, rnd: int, arrays: ArrayRecord) -> dict:
    """The server's evaluation of ``arrays``: fedadapt's global one and the user's
    ``evaluate_fn`` (whose ``accuracy`` / ``loss`` fill the global columns without the
    former)."""
    out = plan.global_eval(arrays) if plan.global_eval is not None else {}
    if plan.evaluate_fn is not None:
        returned = plan.evaluate_fn(rnd, arrays)
        if returned is not None and not isinstance(returned, (MetricRecord, dict)):
            name = getattr(plan.evaluate_fn, "__qualname__", "evaluate_fn")
            raise UserCodeError(f"{name} (federation.evaluate_fn) returned "
                                f"{type(returned).__name__} in round {rnd}, not a MetricRecord "
                                f"(Flower's evaluate_fn(server_round, arrays) -> MetricRecord "
                                f"| None)", "")
        out.update(_prefixed(EVALUATE_FN, returned))
        if plan.global_eval is None and returned is not None:
            for key, col in (("accuracy", "global_acc"), ("loss", "global_loss")):
                if key in returned:
                    out[col] = float(returned[key])
    return out


def _round0(state: ServerState, plan: ServerPlan) -> None:
    """The initial model evaluated on the server: a ``round: 0`` row (as Flower's ``start``
    evaluates before round 1)."""
    t0 = time.time()
    state.stage = "in round 0 (the initial model's evaluation)"
    row = {"round": 0, "lr": None, "clients_sampled": 0, "clients_trained": 0,
           "clients_failed": 0, "train_loss": None, "global_acc": None, "global_loss": None,
           "client_acc": None, "client_acc_weighted": None, "clients_evaluated": None,
           **_server_eval(plan, 0, state.arrays)}
    _close_round(state, plan, row, t0, bytes_up=0, bytes_down=0)


def _close_round(state: ServerState, plan: ServerPlan, row: dict, t0: float, *, bytes_up: int,
                 bytes_down: int) -> None:
    """The round's row completed (bytes, counts, times) and kept; then ``on_round``."""
    state.cum_bytes += bytes_up + bytes_down
    row.update({"bytes_up": bytes_up, "bytes_down": bytes_down, "cum_bytes": state.cum_bytes,
                **plan.counts, "round_s": time.time() - t0,
                "wall_s": time.time() - state.started})
    state.server_round = row["round"]
    state.history.append(row)
    if plan.on_round is not None:
        plan.on_round(state)


def run_round_loop(grid: ClientGrid, state: ServerState, plan: ServerPlan) -> ServerState:
    """Run rounds ``state.server_round + 1 .. state.num_rounds`` (after round 0's evaluation
    when the plan asks for it and the run starts afresh)."""
    if plan.eval_round0 and state.server_round == 0 and not state.history:
        _round0(state, plan)
    # what the process holds when the rounds start (modules, data, models: 400,000 objects in
    # benchmarks/investigations/peer_pfl.py's W3) is left out of the collector's full scans
    # while they run: each
    # took 0.2 s, every 200 rounds or so of W3 (1.0 ms a round on average; 0.09 ms frozen)
    gc.freeze()
    try:
        with state.streams.held():
            for rnd in range(state.server_round + 1, state.num_rounds + 1):
                t0 = time.time()
                state.stage = f"in round {rnd}"
                config = {"lr": plan.lr_at(rnd), "checkpoint-round": state.checkpoint_round}
                row, bytes_down, bytes_up = _train_round(grid, state, plan, rnd,
                                                         ConfigRecord(config))
                if rnd % plan.eval_every == 0 or rnd == state.num_rounds:
                    bytes_down += _evaluate_round(grid, state, plan, rnd, ConfigRecord(config),
                                                  row)
                _close_round(state, plan, row, t0, bytes_up=bytes_up, bytes_down=bytes_down)
    finally:
        gc.unfreeze()  # collectable again after the run (a sweep runs many in one process)
    return state


def ask_every_client(grid: ClientGrid, plan: ServerPlan, shared: RecordDict,
                     message_type: str, what: str, server_round: int,
                     per_client: Optional[Callable[[int], RecordDict]] = None,
                     cids: Optional[list[int]] = None) -> tuple[list[dict], int, int]:
    """One message to every client (``cids``, default all): the ``shared`` records (the same
    objects in every message, so a worker gets them once) and ``per_client(cid)``'s; the
    replies carry metrics. Returns one row per client that answered usably (``client`` = its
    partition id, then its metrics), and the bytes sent down and up."""
    cids = list(range(plan.num_clients)) if cids is None else cids
    messages = []
    for cid in cids:
        content = RecordDict(dict(shared.items()))
        for name, record in (per_client(cid) if per_client else RecordDict()).items():
            content[name] = record
        messages.append(Message(content, dst_node_id=node_id(cid), message_type=message_type))
    _, _, checked = exchange(grid, messages, plan.timeout, None, what, server_round)
    require_enough(checked, len(cids), plan.min_reply_fraction, server_round)
    down, up = grid.take_bytes()
    rows = [{"client": cid, **dict(content.metric_records["metrics"])}
            for cid, content in checked.good]
    return rows, sum(down.values()), sum(up.values())


def record_phase(state: ServerState, down: int, up: int) -> None:
    """A server-trained method's one phase with the clients, as the history's only row."""
    state.cum_bytes += down + up
    state.history.append({"round": 1, "bytes_down": down, "bytes_up": up,
                          "cum_bytes": state.cum_bytes, "wall_s": time.time() - state.started})


def execute_plan(grid: Grid, plan: ServerPlan) -> ServerState:
    """Run ``plan`` on ``grid``: handshake once, then the rounds and phases. Used by every
    launcher. An exception raised inside the user's code (their strategy's hooks, their
    ``evaluate_fn``) becomes a :class:`~fedadapt.userimport.UserCodeError`: one line naming
    their function and the round, then their frames."""
    held: list[ServerState] = []  # the state, once there is one: it says when it raised
    threads = torch.get_num_threads()
    if plan.server_threads:
        torch.set_num_threads(plan.server_threads)
    try:
        return _execute(grid, plan, held)
    except FedadaptError:
        raise
    except Exception as err:
        raised = user_error(err, held[0].stage if held else "when the strategy was built")
        if raised is None:
            raise
        raise raised from err
    finally:
        torch.set_num_threads(threads)


def _execute(grid: Grid, plan: ServerPlan, held: list) -> ServerState:
    if hasattr(grid, "pull_interval") and not isinstance(grid, StoppableGrid):  # Flower's own
        grid.pull_interval = min(grid.pull_interval, PULL_INTERVAL)  # (deployment engine)
    strategy = plan.make_strategy() if plan.make_strategy is not None else None
    nodes = Nodes(plan.nodes, handshake(grid, plan.num_nodes), work=plan.client_work)
    clients = ClientGrid(grid, nodes, plan.num_clients, group_size=plan.group_size)
    state = ServerState(strategy=strategy, arrays=plan.initial_arrays, num_rounds=plan.num_rounds,
                        streams=SeededStreams(plan.seed))
    held.append(state)
    if plan.resume:
        state.stage = f"when its checkpoint of round {plan.resume_round} was loaded"
        saved = plan.resume["strategy"]
        state.streams.load_state_dict(saved["streams"])
        load_strategy_state(strategy, saved["attributes"], plan.resume.get("strategy_arrays", {}),
                            state.arrays)
        state.server_round = state.checkpoint_round = plan.resume_round
        state.history = list(plan.resume["history"])
        state.client_metrics = dict(plan.resume.get("client_metrics", {}))
        state.cum_bytes = int(plan.resume["cum_bytes"])
        state.started -= float(plan.resume.get("wall_s", 0.0))
        state.sim_time = next((float(r["sim_time_s"]) for r in reversed(state.history)
                               if "sim_time_s" in r), 0.0)
    state.stage = f"before round {state.server_round + 1}"
    if strategy is not None and state.server_round < state.num_rounds:
        strategy.summary()  # Flower's own start: logged at INFO (federation.verbose)
    state = run_round_loop(clients, state, plan)
    state.stage = f"after round {state.num_rounds}"
    for phase in plan.phases:
        phase(clients, state, plan)
    return state


def make_server_app(plan: ServerPlan) -> ServerApp:
    """A ServerApp that executes ``plan`` and stores its result (or error) on it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        try:  # a stopped run ends at the next message (fedadapt.federation.server.interrupt)
            plan.result = execute_plan(StoppableGrid(grid, PULL_INTERVAL), plan)
        except BaseException as err:  # handed back to the launcher, which re-raises
            plan.error = err

    return app
