"""The server's round loop (the one place it lives) and the ServerApp around it.

Flower nodes are *workers* in simulation (a handful, each training many clients) and *clients*
on the deployment engine; :class:`Nodes` hides which. Every exchange goes through :func:`ask`:
the clients a round samples are split over the nodes, one message per node carries the shared
records (the global arrays) once and names its clients, and each reply brings one set of records
per client (:mod:`fedadapt.federation.records`). Screening, aggregation, byte counts, metrics,
checkpoints and personal state all stay per client.

``run_rounds`` samples clients with the strategy's seeded RNG, trains them, screens and
aggregates their replies (:mod:`fedadapt.federation.faults`; per-tensor means over the clients
that trained each tensor) and, every ``eval_every`` rounds, evaluates the global tensors on the
server and on a ``fraction_evaluate`` sample of clients. After each round it calls
``on_round(state)``: the hook where progress, metrics and checkpoints go. Nothing per round
grows with the clients registered: only with those sampled.

Bytes are what the clients would exchange on real devices: each sampled client receives the
global tensors it trains (once per client, although a simulation worker gets them once per
message) and sends the tensors it trained.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from logging import WARNING
from typing import Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedadapt.devices import return_freed_memory
from fedadapt.federation import records
from fedadapt.federation.faults import Screened, require_enough, screen_clients
from fedadapt.federation.interrupt import StoppableGrid
from fedadapt.settings import per_tier_accuracy

#: How often the ServerApp polls for replies (Flower's default is 0.1 s, which would add up
#: to a tenth of a second to every exchange).
PULL_INTERVAL = 0.005


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
    #: Per-client evaluation results, ``{round: {client: metrics}}`` (written to
    #: ``clients.jsonl`` at the end, never into the per-round rows).
    client_metrics: dict[str, dict[str, dict]] = field(default_factory=dict)
    #: One row per client after the personalization step (empty without one).
    personalized: list[dict] = field(default_factory=list)
    #: One row per client after a plug-in's delivery (empty without one).
    delivered: list[dict] = field(default_factory=list)
    started: float = field(default_factory=time.time)


@dataclass
class Nodes:
    """The Flower nodes: ``workers`` (simulation: a message names the clients a worker trains)
    or ``clients`` (deployment: one node per client). ``node_ids`` maps each node's
    ``partition-id`` to its node id."""

    kind: str
    node_ids: dict[int, int]

    def assign(self, pids: list[int], per_message: Optional[int] = None
               ) -> list[tuple[int, list[int]]]:
        """``(node id, clients)`` of each message: one per client on the deployment engine;
        in simulation the clients split evenly and in order over the workers (at most
        ``per_message`` clients a message)."""
        if self.kind == "clients":
            return [(self.node_ids[p], [p]) for p in pids]
        workers = sorted(self.node_ids)
        n = len(pids)
        chunks = len(workers) if per_message is None else max(
            len(workers), -(-n // per_message))
        bounds = [round(i * n / chunks) for i in range(chunks + 1)]
        return [(self.node_ids[workers[i % len(workers)]], pids[a:b])
                for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]


def wait_for_nodes(grid: Grid, n: int, timeout: float = 300.0) -> list[int]:
    """Block until ``n`` nodes are connected (the ServerApp may start before they register)."""
    deadline = time.time() + timeout
    while True:
        nodes = list(grid.get_node_ids())
        if len(nodes) >= n:
            return nodes
        if time.time() > deadline:
            raise RuntimeError(f"only {len(nodes)} of {n} nodes connected within {timeout} s")
        time.sleep(0.1)


def handshake(grid: Grid, n: int) -> dict[int, int]:
    """Ask every node for its partition id (once per run); return ``{partition_id: node_id}``.
    The nodes warm up first (model, data), so round timeouts measure rounds, not start-up."""
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
class Asked:
    """The outcome of :func:`ask`: each client's records or failure, and its bytes."""

    sent: list[int]
    replies: dict[int, RecordDict | str]
    down: dict[int, int]
    up: dict[int, int]


def _record_bytes(content: RecordDict) -> int:
    return sum(r.count_bytes() for r in content.array_records.values())


def ask(grid: Grid, nodes: Nodes, pids: list[int], shared: RecordDict, message_type: str,
        *, per_client: Optional[Callable[[int], RecordDict]] = None,
        shared_bytes: Optional[Callable[[int], int]] = None, timeout: Optional[float] = None,
        per_message: Optional[int] = None) -> Asked:
    """One exchange with clients ``pids``: ``shared`` records (and ``per_client(pid)``'s) to
    their nodes, their per-client replies back. ``shared_bytes(pid)`` is what of the shared
    arrays that client counts as received (default: all of them)."""
    config = shared.config_records.get("config") or ConfigRecord({})
    all_shared = _record_bytes(shared)
    msgs, groups, down = [], [], {}
    for node, group in nodes.assign(pids, per_message):
        content = RecordDict({k: v for k, v in shared.items() if k != "config"})
        content["config"] = ConfigRecord({**dict(config), records.CLIENTS: list(group),
                                          "nodes": nodes.kind})
        for pid in group:
            own = per_client(pid) if per_client else RecordDict()
            for name, record in own.items():
                content[records.key(pid, name)] = record
            down[pid] = (shared_bytes(pid) if shared_bytes else all_shared) + _record_bytes(own)
        msgs.append(Message(content, dst_node_id=node, message_type=message_type))
        groups.append(group)
    replies = list(grid.send_and_receive(msgs, timeout=timeout))
    by_id = {m.metadata.message_id: g for m, g in zip(msgs, groups)}
    out: dict[int, RecordDict | str] = {}
    up: dict[int, int] = {}
    for reply in replies:
        group = by_id.get(reply.metadata.reply_to_message_id, [])
        if reply.has_error():  # the whole message failed: every client of it
            out.update({pid: str(reply.error.reason) for pid in group})
            continue
        for pid, content in records.unpack(reply.content).items():
            if pid in group:
                out[pid] = content
                up[pid] = _record_bytes(content)
    return Asked(sent=list(pids), replies=out, down=down, up=up)


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
    #: ``workers`` (simulation) or ``clients`` (deployment engine), and how many nodes.
    nodes: str = "workers"
    num_nodes: int = 1
    #: Each simulated worker's Ray resources (``num_cpus``, ``num_gpus``).
    resources: dict = field(default_factory=lambda: {"num_cpus": 1.0, "num_gpus": 0.0})
    #: Clients a worker trains side by side (1: one after another).
    group_size: int = 1
    #: ``sent_names(client)``: the tensor names (and shapes) a client trains and sends back;
    #: None = every global tensor.
    sent_names: Optional[Callable[[int], dict[str, tuple]]] = None
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
    #: A checkpoint to continue from: ``{"round", "history", "cum_bytes", "strategy", "wall_s",
    #: "client_metrics"}`` (``initial_arrays`` then holds the checkpoint's arrays).
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


class _Sizes:
    """Bytes of the global arrays restricted to a client's names (cached per name set)."""

    def __init__(self, arrays: ArrayRecord, names_of: Optional[Callable[[int], dict]]) -> None:
        self.arrays, self.names_of, self.cache = arrays, names_of, {}

    def __call__(self, pid: int) -> int:
        names = tuple(sorted(self.names_of(pid))) if self.names_of else None
        if names not in self.cache:
            subset = self.arrays if names is None else ArrayRecord(
                {n: self.arrays[n] for n in names if n in self.arrays})
            self.cache[names] = subset.count_bytes()
        return self.cache[names]


def _payload(nodes: Nodes, state: ServerState, plan: ServerPlan, config: ConfigRecord
             ) -> dict:
    """``ask``'s arguments that carry the global arrays: a worker gets them once per message
    (each client counts what it trains); a deployment client gets only what it trains."""
    if nodes.kind == "clients" and plan.sent_names is not None:
        return {"shared": RecordDict({"config": config}), "shared_bytes": lambda pid: 0,
                "per_client": lambda pid: RecordDict({"arrays": ArrayRecord(
                    {n: state.arrays[n] for n in plan.sent_names(pid)})})}
    return {"shared": RecordDict({"arrays": state.arrays, "config": config}),
            "shared_bytes": _Sizes(state.arrays, plan.sent_names)}


def _train_round(grid: Grid, nodes: Nodes, state: ServerState, plan: ServerPlan, rnd: int,
                 config: ConfigRecord) -> tuple[dict, int, int]:
    """Sample, train, screen and aggregate one round; its row so far and the bytes."""
    strategy = state.strategy
    pids = strategy.sample_train()
    shapes = {name: tuple(arr.shape) for name, arr in state.arrays.items()}
    expected = (lambda pid: {n: shapes[n] for n in plan.sent_names(pid)}) \
        if plan.sent_names else (lambda pid: shapes)
    asked = ask(grid, nodes, pids, message_type=MessageType.TRAIN, timeout=plan.timeout,
                **_payload(nodes, state, plan, strategy.round_config(rnd, ConfigRecord(config))))
    screened = screen_clients(pids, asked.replies, expected)
    _warn_dropped(rnd, "training", screened, len(pids))
    require_enough(screened, len(pids), plan.min_reply_fraction, rnd)
    new_arrays, train_metrics = strategy.aggregate_clients(
        state.arrays, [content for _, content in screened.good])
    if new_arrays is not None:
        state.arrays = new_arrays
    row = {"round": rnd, "lr": plan.lr_at(rnd), "clients_sampled": len(pids),
           "clients_trained": len(screened.good), "clients_failed": len(screened.dropped),
           "failures": screened.counts(),
           "train_loss": float(train_metrics["train_loss"]) if train_metrics else None,
           "global_acc": None, "global_loss": None, "client_acc": None,
           "client_acc_weighted": None, "clients_evaluated": None}
    down, up = sum(asked.down.values()), sum(asked.up.values())
    del asked, screened  # the replies: freed before the next round
    return_freed_memory()
    return row, down, up


def _evaluate_round(grid: Grid, nodes: Nodes, state: ServerState, plan: ServerPlan, rnd: int,
                    config: ConfigRecord, row: dict) -> int:
    """Server-side and client-side evaluation of the global arrays; fills ``row``, keeps the
    per-client values in ``state.client_metrics``; returns the bytes sent down."""
    if plan.global_eval is not None:
        row.update(plan.global_eval(state.arrays))
    pids = state.strategy.sample_evaluate()
    if not pids:
        return 0
    asked = ask(grid, nodes, pids, message_type=MessageType.EVALUATE, timeout=plan.timeout,
                **_payload(nodes, state, plan,
                           state.strategy.round_config(rnd, ConfigRecord(config))))
    checked = screen_clients(pids, asked.replies, None)
    _warn_dropped(rnd, "evaluation", checked, len(pids))
    row["clients_evaluated"] = len(checked.good)
    contents = [content for _, content in checked.good]
    metrics = state.strategy.aggregate_evaluate_clients(contents)
    if metrics is not None and "accuracy" in metrics:
        row["client_acc"] = float(metrics["accuracy_client_mean"])
        row["client_acc_weighted"] = float(metrics["accuracy"])
    if metrics is not None and "val_accuracy_client_mean" in metrics:
        row["val_acc"] = float(metrics["val_accuracy_client_mean"])
    per_client = {str(pid): dict(content.metric_records["metrics"])
                  for pid, content in checked.good}
    state.client_metrics[str(rnd)] = per_client
    tiers = [(m["tier"], m["accuracy"]) for m in per_client.values() if "tier" in m]
    if tiers:
        row["tier_acc"] = per_tier_accuracy(tiers)
    return sum(asked.down.values())


def run_rounds(grid: Grid, nodes: Nodes, state: ServerState, plan: ServerPlan) -> ServerState:
    """Run rounds ``state.server_round + 1 .. state.num_rounds``."""
    for rnd in range(state.server_round + 1, state.num_rounds + 1):
        t0 = time.time()
        config = {"lr": plan.lr_at(rnd), "checkpoint-round": state.checkpoint_round,
                  "round-timeout": float(plan.timeout or 0.0), "group-size": plan.group_size}
        row, bytes_down, bytes_up = _train_round(grid, nodes, state, plan, rnd,
                                                 ConfigRecord(config))
        if rnd % plan.eval_every == 0 or rnd == state.num_rounds:
            bytes_down += _evaluate_round(grid, nodes, state, plan, rnd, ConfigRecord(config),
                                          row)
        state.cum_bytes += bytes_up + bytes_down
        row.update({"bytes_up": bytes_up, "bytes_down": bytes_down,
                    "cum_bytes": state.cum_bytes, **plan.counts,
                    "round_s": time.time() - t0, "wall_s": time.time() - state.started})
        state.server_round = rnd
        state.history.append(row)
        if plan.on_round is not None:
            plan.on_round(state)
    return state


def ask_every_client(grid: Grid, nodes: Nodes, plan: ServerPlan, shared: RecordDict,
                     message_type: str, what: str, server_round: int,
                     per_client: Optional[Callable[[int], RecordDict]] = None,
                     chunk: int = 32) -> tuple[list[dict], int, int]:
    """One message's worth of records to every client, at most ``chunk`` clients a message
    (per-client records hold their own copies of arrays); the replies carry metrics only.
    Returns one row per client that answered (``client`` = its partition id, then its
    metrics), and the bytes sent down and up."""
    pids = list(range(plan.num_clients))
    asked = ask(grid, nodes, pids, shared, message_type, per_client=per_client,
                timeout=plan.timeout, per_message=chunk)
    checked = screen_clients(pids, asked.replies, None)
    _warn_dropped(server_round, what, checked, len(pids))
    require_enough(checked, len(pids), plan.min_reply_fraction, server_round)
    rows = [{"client": pid, **dict(content.metric_records["metrics"])}
            for pid, content in checked.good]
    return rows, sum(asked.down.values()), sum(asked.up.values())


def personalize_clients(grid: Grid, nodes: Nodes, state: ServerState, plan: ServerPlan
                        ) -> list[dict]:
    """Every client personalizes the final model on its own data and keeps what it trained;
    the replies carry metrics only. Returns one row per client that answered."""
    server_round = state.num_rounds + 1
    payload = _payload(nodes, state, plan, ConfigRecord(
        {"phase": "personalize", "server-round": server_round, "group-size": plan.group_size}))
    rows, down, up = ask_every_client(grid, nodes, plan, payload["shared"], MessageType.TRAIN,
                                      "personalization", server_round,
                                      per_client=payload.get("per_client"))
    state.cum_bytes += down + up
    return [{k: (int(v) if k in ("tier", "severity") else v) for k, v in r.items()}
            for r in rows]


def _record_phase(state: ServerState, down: int, up: int) -> None:
    """A server-trained method's one phase with the clients, as the history's only row."""
    state.cum_bytes += down + up
    state.history.append({"round": 1, "bytes_down": down, "bytes_up": up,
                          "cum_bytes": state.cum_bytes, "wall_s": time.time() - state.started})


def deliver_plugin(grid: Grid, nodes: Nodes, state: ServerState, plan: ServerPlan
                   ) -> list[dict]:
    """Send every client its plug-in arrays in one round; it recognises its test split with
    them and replies with metrics only. Returns one row per client that answered."""
    rows, down, up = ask_every_client(
        grid, nodes, plan, RecordDict({"config": ConfigRecord({"phase": "plugin"})}),
        MessageType.EVALUATE, "plug-in", 1,
        per_client=lambda pid: RecordDict({"arrays": plan.plugin_arrays(pid)}))
    _record_phase(state, down, up)
    return rows


def converse(grid: Grid, nodes: Nodes, state: ServerState, plan: ServerPlan, chunk: int = 32
             ) -> list[dict]:
    """Session plug-ins (:mod:`fedadapt.federation.sessions`), a chunk of clients at a time:
    each client uploads what its sessions hold (QUERY, phase ``session-upload``: one
    ArrayRecord per session), the server answers each session with generated parameters
    (EVALUATE, phase ``session-predict``), the client predicts and replies with metrics (and,
    for a binary task, its scores). A client whose upload is malformed (names, width,
    non-finite values) gets no answer. Returns one row per client that answered both."""
    server = plan.sessions
    rows, screened, down, up = [], Screened(), 0, 0
    pids = list(range(plan.num_clients))
    for start in range(0, len(pids), chunk):
        part = pids[start:start + chunk]
        uploads = ask(grid, nodes, part, RecordDict({"config": ConfigRecord(
            {"phase": "session-upload"})}), MessageType.QUERY, timeout=plan.timeout,
            per_message=chunk)
        down, up = down + sum(uploads.down.values()), up + sum(uploads.up.values())
        first = screen_clients(part, uploads.replies, None)
        screened.dropped += first.dropped
        answers = {}
        for pid, content in first.good:
            sessions = {k: v for k, v in content.array_records.items()
                        if k.startswith("session.")}
            arrays = {k: v.to_torch_state_dict() for k, v in sessions.items()}
            problem = server.check_uploads(arrays)
            if problem:
                screened.dropped.append((pid, "bad_upload", problem))
                continue
            answers[pid] = server.answer(pid, arrays,
                                         {k: v.count_bytes() for k, v in sessions.items()})

        def content_for(pid: int, answers=answers) -> RecordDict:
            content = RecordDict()
            for name, arrays in answers[pid].items():
                content[name] = ArrayRecord(arrays)
            server.note_download(pid, {k: v.count_bytes() for k, v in
                                       content.array_records.items() if k.startswith("session.")})
            return content

        predicted = ask(grid, nodes, sorted(answers), RecordDict({"config": ConfigRecord(
            {"phase": "session-predict"})}), MessageType.EVALUATE, per_client=content_for,
            timeout=plan.timeout, per_message=chunk)
        down, up = down + sum(predicted.down.values()), up + sum(predicted.up.values())
        second = screen_clients(sorted(answers), predicted.replies, None)
        screened.good += second.good
        screened.dropped += second.dropped
        for pid, content in second.good:
            scores = content.array_records.get("scores")
            rows.append({"client": pid, **dict(content.metric_records["metrics"]),
                         **({"scores": scores.to_torch_state_dict()} if scores else {})})
    # payload figures only for the clients that completed the conversation
    server.keep_clients({r["client"] for r in rows})
    _warn_dropped(1, "session", screened, len(pids))
    require_enough(screened, len(pids), plan.min_reply_fraction, 1)
    _record_phase(state, down, up)
    return rows


def execute_plan(grid: Grid, plan: ServerPlan) -> ServerState:
    """Run ``plan`` on ``grid``: handshake once, then the rounds and phases. Used by every
    launcher."""
    if hasattr(grid, "pull_interval") and not isinstance(grid, StoppableGrid):  # Flower's own
        grid.pull_interval = min(grid.pull_interval, PULL_INTERVAL)  # (deployment engine)
    strategy = plan.make_strategy()
    nodes = Nodes(plan.nodes, handshake(grid, plan.num_nodes))
    state = ServerState(strategy=strategy, arrays=plan.initial_arrays, num_rounds=plan.num_rounds)
    if plan.resume:
        strategy.load_state_dict(plan.resume["strategy"])
        state.server_round = state.checkpoint_round = plan.resume_round
        state.history = list(plan.resume["history"])
        state.client_metrics = dict(plan.resume.get("client_metrics", {}))
        state.cum_bytes = int(plan.resume["cum_bytes"])
        state.started -= float(plan.resume.get("wall_s", 0.0))
    state = run_rounds(grid, nodes, state, plan)
    if plan.plugin_arrays is not None:
        state.delivered = deliver_plugin(grid, nodes, state, plan)
    if plan.sessions is not None:
        state.delivered = converse(grid, nodes, state, plan)
    if plan.personalize:
        state.personalized = personalize_clients(grid, nodes, state, plan)
    return state


def make_server_app(plan: ServerPlan) -> ServerApp:
    """A ServerApp that executes ``plan`` and stores its result (or error) on it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        try:  # a stopped run ends at the next message (fedadapt.federation.interrupt)
            plan.result = execute_plan(StoppableGrid(grid, PULL_INTERVAL), plan)
        except BaseException as err:  # handed back to the launcher, which re-raises
            plan.error = err

    return app
