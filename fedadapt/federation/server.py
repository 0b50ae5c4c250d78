"""The server's round loop (the one place it lives) and the ServerApp around it.

``run_rounds`` drives a Flower strategy through ``configure_train -> send_and_receive ->
aggregate_train`` and, every ``eval_every`` rounds, a server-side evaluation of the global tensors
plus a federated evaluation on the clients' local test splits. After each round it calls
``on_round(state)`` with a :class:`ServerState` that holds everything the run has (arrays,
strategy, round, history): the hook where progress, metrics and checkpoints go.

Replies are screened before aggregation (:mod:`fedadapt.federation.faults`): a client that
raised, timed out or sent other names, shapes or non-finite values is dropped from the round
with a warning and counted in the round's metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import WARNING
from typing import Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedadapt.federation.faults import Screened, require_enough, screen_replies
from fedadapt.federation.interrupt import StoppableGrid
from fedadapt.settings import per_tier_accuracy


@dataclass
class ServerState:
    """What the server holds between rounds."""

    strategy: object
    arrays: ArrayRecord
    num_rounds: int
    server_round: int = 0
    history: list[dict] = field(default_factory=list)
    cum_bytes: int = 0
    #: Round of the last complete checkpoint (clients may prune their state files up to it).
    checkpoint_round: int = 0
    #: One row per client after the personalization step (empty without one).
    personalized: list[dict] = field(default_factory=list)
    #: One row per client after a plug-in's delivery (empty without one).
    delivered: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.time)


def _bytes(messages) -> int:
    total = 0
    for m in messages:
        if m.has_content():
            total += sum(r.count_bytes() for r in m.content.array_records.values())
    return total


def wait_for_nodes(grid: Grid, n: int, timeout: float = 300.0) -> list[int]:
    """Block until ``n`` nodes are connected (the ServerApp may start before they register)."""
    deadline = time.time() + timeout
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.time() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {n} clients connected within {timeout} s")
        time.sleep(0.1)


def handshake(grid: Grid, n: int) -> dict[int, int]:
    """Ask every node for its partition id; return ``{partition_id: node_id}``."""
    nodes = wait_for_nodes(grid, n)
    msgs = [Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=nid,
                    message_type=MessageType.QUERY) for nid in nodes]
    mapping = {}
    for reply in grid.send_and_receive(msgs):
        if reply.has_error():
            raise RuntimeError(f"handshake failed on node {reply.metadata.src_node_id}: "
                               f"{reply.error.reason}")
        pid = int(reply.content.metric_records["metrics"]["partition-id"])
        mapping[pid] = reply.metadata.src_node_id
    if sorted(mapping) != list(range(n)):
        raise RuntimeError(f"handshake: partitions {sorted(mapping)} != 0..{n - 1}")
    return mapping


@dataclass
class ServerPlan:
    """How the ServerApp runs; built by :mod:`fedadapt.experiment`."""

    num_clients: int
    make_strategy: Callable[[], object]
    initial_arrays: ArrayRecord
    num_rounds: int
    lr_at: Callable[[int], float]
    eval_every: int
    global_eval: Optional[Callable[[ArrayRecord], dict]]
    counts: dict
    timeout: Optional[float] = None
    min_reply_fraction: float = 0.5
    on_round: Optional[Callable[[ServerState], None]] = None
    #: After the rounds, send the final model to every client for local personalization
    #: (``setting=personalization``); the replies' metrics land in ``ServerState.personalized``.
    personalize: bool = False
    #: A server-trained plug-in: ``arrays_for(partition_id) -> ArrayRecord`` is sent to every
    #: client in one round (phase ``plugin``); the replies' metrics land in
    #: ``ServerState.delivered``.
    plugin_arrays: Optional[Callable[[int], ArrayRecord]] = None
    #: A session plug-in's server (:class:`fedadapt.federation.sessions.SessionServer`):
    #: after the rounds, :func:`converse` with every client; rows land in ``delivered``.
    sessions: Optional[object] = None
    #: A checkpoint to continue from: ``{"round", "history", "cum_bytes", "strategy", "wall_s"}``
    #: (``initial_arrays`` then holds the checkpoint's arrays).
    resume: Optional[dict] = None
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


def run_rounds(grid: Grid, state: ServerState, plan: ServerPlan) -> ServerState:
    """Run rounds ``state.server_round + 1 .. state.num_rounds``."""
    strategy = state.strategy
    expected = {name: tuple(arr.shape) for name, arr in state.arrays.items()}
    for rnd in range(state.server_round + 1, state.num_rounds + 1):
        t0 = time.time()
        config = ConfigRecord({"lr": plan.lr_at(rnd), "resume-round": plan.resume_round,
                               "checkpoint-round": state.checkpoint_round,
                               "round-timeout": float(plan.timeout or 0.0)})
        train_msgs = list(strategy.configure_train(rnd, state.arrays, config, grid))
        replies = strategy.in_partition_order(
            grid.send_and_receive(train_msgs, timeout=plan.timeout))
        screened = screen_replies(train_msgs, replies, expected, strategy.partition_of)
        _warn_dropped(rnd, "training", screened, len(train_msgs))
        require_enough(screened, len(train_msgs), plan.min_reply_fraction, rnd)
        new_arrays, train_metrics = strategy.aggregate_train(rnd, screened.good)
        if new_arrays is not None:
            state.arrays = new_arrays
        bytes_down, bytes_up = _bytes(train_msgs), _bytes(replies)  # dropped ones were sent too
        row = {"round": rnd, "lr": plan.lr_at(rnd), "clients_sampled": len(train_msgs),
               "clients_trained": len(screened.good), "clients_failed": len(screened.dropped),
               "failures": screened.counts(),
               "train_loss": float(train_metrics["train_loss"]) if train_metrics else None,
               "global_acc": None, "global_loss": None, "client_acc": None,
               "client_acc_weighted": None, "clients_evaluated": None}
        if rnd % plan.eval_every == 0 or rnd == state.num_rounds:
            if plan.global_eval is not None:
                row.update(plan.global_eval(state.arrays))
            eval_msgs = list(strategy.configure_evaluate(rnd, state.arrays, ConfigRecord(config),
                                                         grid))
            if eval_msgs:
                eval_replies = strategy.in_partition_order(
                    grid.send_and_receive(eval_msgs, timeout=plan.timeout))
                checked = screen_replies(eval_msgs, eval_replies, None, strategy.partition_of)
                _warn_dropped(rnd, "evaluation", checked, len(eval_msgs))
                bytes_down += _bytes(eval_msgs)
                row["clients_evaluated"] = len(checked.good)
                metrics = strategy.aggregate_evaluate(rnd, checked.good)
                if metrics is not None and "accuracy" in metrics:
                    row["client_acc"] = float(metrics["accuracy_client_mean"])
                    row["client_acc_weighted"] = float(metrics["accuracy"])
                if metrics is not None and "val_accuracy_client_mean" in metrics:
                    row["val_acc"] = float(metrics["val_accuracy_client_mean"])
                client_metrics = _metrics(checked.good)
                row["client_accs"] = {  # by partition id
                    str(strategy.partition_of[m.metadata.src_node_id]): float(cm["accuracy"])
                    for m, cm in zip(checked.good, client_metrics)}
                tiers = [(m["tier"], m["accuracy"]) for m in client_metrics if "tier" in m]
                if tiers:
                    row["tier_acc"] = per_tier_accuracy(tiers)
        state.cum_bytes += bytes_up + bytes_down
        row.update({"bytes_up": bytes_up, "bytes_down": bytes_down,
                    "cum_bytes": state.cum_bytes, **plan.counts,
                    "round_s": time.time() - t0, "wall_s": time.time() - state.started})
        state.server_round = rnd
        state.history.append(row)
        if plan.on_round is not None:
            plan.on_round(state)
    return state


def _metrics(replies) -> list[dict]:
    return [dict(m.content.metric_records["metrics"]) for m in replies]


def ask_every_client(grid: Grid, state: ServerState, plan: ServerPlan,
                     content_for: Callable[[int], RecordDict], message_type: str, what: str,
                     server_round: int, chunk: int = 32) -> tuple[list[dict], int, int]:
    """One message to every client (``content_for(partition_id)``), a chunk of clients at a
    time since each message holds its own copy of the arrays; the replies carry metrics only.
    Returns one row per client that answered (``client`` = its partition id, then its
    metrics), and the bytes sent down and up."""
    strategy = state.strategy
    nodes = list(strategy.node_of)
    checked, sent, down, up = Screened(), 0, 0, 0
    for start in range(0, len(nodes), chunk):
        part, n, d, u = _ask(grid, strategy, plan, nodes[start:start + chunk], content_for,
                             message_type)
        checked.good += part.good
        checked.dropped += part.dropped
        sent, down, up = sent + n, down + d, up + u
    _warn_dropped(server_round, what, checked, sent)
    require_enough(checked, sent, plan.min_reply_fraction, server_round)
    rows = [{"client": strategy.partition_of[r.metadata.src_node_id], **m}
            for r, m in zip(checked.good, _metrics(checked.good))]
    return rows, down, up


def _ask(grid: Grid, strategy, plan: ServerPlan, pids: list[int],
         content_for: Callable[[int], RecordDict], message_type: str
         ) -> tuple[Screened, int, int, int]:
    """One message to each of ``pids``; the screened replies, messages sent, bytes down, up."""
    msgs = [Message(content_for(pid), dst_node_id=strategy.node_of[pid],
                    message_type=message_type) for pid in pids]
    replies = strategy.in_partition_order(grid.send_and_receive(msgs, timeout=plan.timeout))
    checked = screen_replies(msgs, replies, None, strategy.partition_of)
    return checked, len(msgs), _bytes(msgs), _bytes(replies)


def personalize_clients(grid: Grid, state: ServerState, plan: ServerPlan) -> list[dict]:
    """Every client personalizes the final model on its own data and keeps what it trained;
    the replies carry metrics only. Returns one row per client that answered."""
    server_round = state.num_rounds + 1
    config = ConfigRecord({"phase": "personalize", "server-round": server_round,
                           "resume-round": plan.resume_round})
    rows, down, up = ask_every_client(
        grid, state, plan,
        lambda pid: RecordDict({"arrays": state.arrays, "config": ConfigRecord(config)}),
        MessageType.TRAIN, "personalization", server_round)
    state.cum_bytes += down + up
    return [{k: (int(v) if k in ("tier", "severity") else v) for k, v in r.items()}
            for r in rows]


def _record_phase(state: ServerState, down: int, up: int) -> None:
    """A server-trained method's one phase with the clients, as the history's only row."""
    state.cum_bytes += down + up
    state.history.append({"round": 1, "bytes_down": down, "bytes_up": up,
                          "cum_bytes": state.cum_bytes, "wall_s": time.time() - state.started})


def deliver_plugin(grid: Grid, state: ServerState, plan: ServerPlan) -> list[dict]:
    """Send every client its plug-in arrays in one round; it recognises its test split with
    them and replies with metrics only. Returns one row per client that answered."""
    rows, down, up = ask_every_client(
        grid, state, plan,
        lambda pid: RecordDict({"arrays": plan.plugin_arrays(pid),
                                "config": ConfigRecord({"phase": "plugin"})}),
        MessageType.EVALUATE, "plug-in", 1)
    _record_phase(state, down, up)
    return rows


def converse(grid: Grid, state: ServerState, plan: ServerPlan, chunk: int = 32) -> list[dict]:
    """Session plug-ins (:mod:`fedadapt.federation.sessions`), a chunk of clients at a time:
    each client uploads what its sessions hold (QUERY, phase ``session-upload``: one
    ArrayRecord per session), the server answers each session with generated parameters
    (EVALUATE, phase ``session-predict``), the client predicts and replies with metrics (and,
    for a binary task, its scores). A client whose upload is malformed (names, width,
    non-finite values) gets no answer. Returns one row per client that answered both."""
    server = plan.sessions
    strategy = state.strategy
    nodes = list(strategy.node_of)
    rows, sent, screened = [], 0, Screened()
    down = up = 0
    for start in range(0, len(nodes), chunk):
        uploads, n, d, u = _ask(
            grid, strategy, plan, nodes[start:start + chunk],
            lambda pid: RecordDict({"config": ConfigRecord({"phase": "session-upload"})}),
            MessageType.QUERY)
        sent, down, up = sent + n, down + d, up + u
        screened.dropped += uploads.dropped
        answers = {}
        for reply in uploads.good:
            pid = strategy.partition_of[reply.metadata.src_node_id]
            records = {k: v for k, v in reply.content.array_records.items()
                       if k.startswith("session.")}
            arrays = {k: v.to_torch_state_dict() for k, v in records.items()}
            problem = server.check_uploads(arrays)
            if problem:
                screened.dropped.append((pid, "bad_upload", problem))
                continue
            answers[pid] = server.answer(pid, arrays,
                                         {k: v.count_bytes() for k, v in records.items()})

        def content_for(pid: int, answers=answers) -> RecordDict:
            content = RecordDict({"config": ConfigRecord({"phase": "session-predict"})})
            for name, arrays in answers[pid].items():
                content[name] = ArrayRecord(arrays)
            server.note_download(pid, {k: v.count_bytes() for k, v in
                                       content.array_records.items() if k.startswith("session.")})
            return content

        checked, _, d, u = _ask(grid, strategy, plan, sorted(answers), content_for,
                                MessageType.EVALUATE)
        down, up = down + d, up + u
        screened.good += checked.good
        screened.dropped += checked.dropped
        for reply, metrics in zip(checked.good, _metrics(checked.good)):
            pid = strategy.partition_of[reply.metadata.src_node_id]
            scores = reply.content.array_records.get("scores")
            rows.append({"client": pid, **metrics,
                         **({"scores": scores.to_torch_state_dict()} if scores else {})})
    # payload figures only for the clients that completed the conversation
    server.keep_clients({r["client"] for r in rows})
    _warn_dropped(1, "session", screened, sent)
    require_enough(screened, sent, plan.min_reply_fraction, 1)
    _record_phase(state, down, up)
    return rows


def execute_plan(grid: Grid, plan: ServerPlan) -> ServerState:
    """Run ``plan`` on ``grid``: handshake, then the rounds. Used by every launcher."""
    strategy = plan.make_strategy()
    strategy.set_nodes(handshake(grid, plan.num_clients))
    state = ServerState(strategy=strategy, arrays=plan.initial_arrays, num_rounds=plan.num_rounds)
    if plan.resume:
        strategy.load_state_dict(plan.resume["strategy"])
        state.server_round = state.checkpoint_round = plan.resume_round
        state.history = list(plan.resume["history"])
        state.cum_bytes = int(plan.resume["cum_bytes"])
        state.started -= float(plan.resume.get("wall_s", 0.0))
    state = run_rounds(grid, state, plan)
    if plan.plugin_arrays is not None:
        state.delivered = deliver_plugin(grid, state, plan)
    if plan.sessions is not None:
        state.delivered = converse(grid, state, plan)
    if plan.personalize:
        state.personalized = personalize_clients(grid, state, plan)
    return state


def make_server_app(plan: ServerPlan) -> ServerApp:
    """A ServerApp that executes ``plan`` and stores its result (or error) on it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        try:  # a stopped run ends at the next message (fedadapt.federation.interrupt)
            plan.result = execute_plan(StoppableGrid(grid), plan)
        except BaseException as err:  # handed back to the launcher, which re-raises
            plan.error = err

    return app
