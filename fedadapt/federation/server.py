"""The server's round loop (the one place it lives) and the ServerApp around it.

``run_rounds`` drives a Flower strategy through ``configure_train -> send_and_receive ->
aggregate_train`` and, every ``eval_every`` rounds, a server-side evaluation of the global tensors
plus a federated evaluation on the clients' local test splits. After each round it calls
``on_round(state)`` with a :class:`ServerState` that holds everything the run has (arrays,
strategy, round, history): the hook where progress, metrics and checkpoints go.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp


@dataclass
class ServerState:
    """What the server holds between rounds."""

    strategy: object
    arrays: ArrayRecord
    num_rounds: int
    server_round: int = 0
    history: list[dict] = field(default_factory=list)
    cum_bytes: int = 0
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


def run_rounds(
    grid: Grid,
    state: ServerState,
    *,
    lr_at: Callable[[int], float],
    eval_every: int,
    global_eval: Optional[Callable[[ArrayRecord], dict]],
    counts: dict,
    timeout: Optional[float] = None,
    on_round: Optional[Callable[[ServerState], None]] = None,
) -> ServerState:
    """Run rounds ``state.server_round + 1 .. state.num_rounds``."""
    strategy = state.strategy
    for rnd in range(state.server_round + 1, state.num_rounds + 1):
        t0 = time.time()
        config = ConfigRecord({"lr": lr_at(rnd)})
        train_msgs = list(strategy.configure_train(rnd, state.arrays, config, grid))
        replies = strategy.in_partition_order(grid.send_and_receive(train_msgs, timeout=timeout))
        failed = [m for m in replies if m.has_error()]
        if failed:
            raise RuntimeError(f"round {rnd}: {len(failed)} client(s) failed: "
                               f"{failed[0].error.reason}")
        new_arrays, train_metrics = strategy.aggregate_train(rnd, replies)
        if new_arrays is not None:
            state.arrays = new_arrays
        bytes_down, bytes_up = _bytes(train_msgs), _bytes(replies)
        row = {"round": rnd, "lr": lr_at(rnd), "clients_trained": len(replies),
               "train_loss": float(train_metrics["train_loss"]) if train_metrics else None,
               "global_acc": None, "global_loss": None, "client_acc": None,
               "client_acc_weighted": None}
        if rnd % eval_every == 0 or rnd == state.num_rounds:
            if global_eval is not None:
                row.update(global_eval(state.arrays))
            eval_msgs = list(strategy.configure_evaluate(rnd, state.arrays, ConfigRecord(), grid))
            if eval_msgs:
                eval_replies = strategy.in_partition_order(
                    grid.send_and_receive(eval_msgs, timeout=timeout))
                bytes_down += _bytes(eval_msgs)
                metrics = strategy.aggregate_evaluate(rnd, eval_replies)
                if metrics is not None and "accuracy" in metrics:
                    row["client_acc"] = float(metrics["accuracy_client_mean"])
                    row["client_acc_weighted"] = float(metrics["accuracy"])
        state.cum_bytes += bytes_up + bytes_down
        row.update({"bytes_up": bytes_up, "bytes_down": bytes_down,
                    "cum_bytes": state.cum_bytes, **counts,
                    "round_s": time.time() - t0, "wall_s": time.time() - state.started})
        state.server_round = rnd
        state.history.append(row)
        if on_round is not None:
            on_round(state)
    return state


@dataclass
class ServerPlan:
    """How the ServerApp sets up a run; built by :mod:`fedadapt.experiment`."""

    num_clients: int
    make_strategy: Callable[[], object]
    initial_arrays: ArrayRecord
    num_rounds: int
    lr_at: Callable[[int], float]
    eval_every: int
    global_eval: Optional[Callable[[ArrayRecord], dict]]
    counts: dict
    timeout: Optional[float] = None
    on_round: Optional[Callable[[ServerState], None]] = None
    #: Filled by the ServerApp: the final state, or the exception that stopped it.
    result: Optional[ServerState] = None
    error: Optional[BaseException] = None


def execute_plan(grid: Grid, plan: ServerPlan) -> ServerState:
    """Run ``plan`` on ``grid``: handshake, then the rounds. Used by every launcher."""
    strategy = plan.make_strategy()
    strategy.set_nodes(handshake(grid, plan.num_clients))
    state = ServerState(strategy=strategy, arrays=plan.initial_arrays, num_rounds=plan.num_rounds)
    return run_rounds(grid, state, lr_at=plan.lr_at, eval_every=plan.eval_every,
                      global_eval=plan.global_eval, counts=plan.counts, timeout=plan.timeout,
                      on_round=plan.on_round)


def make_server_app(plan: ServerPlan) -> ServerApp:
    """A ServerApp that executes ``plan`` and stores its result (or error) on it."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context) -> None:
        try:
            plan.result = execute_plan(grid, plan)
        except BaseException as err:  # handed back to the launcher, which re-raises
            plan.error = err

    return app
