#!/usr/bin/env bash
# Two-node Ray cluster on this machine, and a fedadapt simulation on it compared with the same
# run on a private local instance (docs/scaling.md). Not run by CI: it takes minutes.
#
#   1. `ray start --head` (1 CPU) and a second `ray start --address` (1 CPU, its own raylet and
#      object store), each in its own process group, with its own temp dir and free ports;
#   2. `fedadapt federation.ray_address=<head>` with 4 clients trained per round: the workers are
#      sized per node (two workers of one CPU), Flower's actor pool puts one on each node;
#   3. the same run on a private local instance with the same two workers of one CPU;
#   4. checks: both complete, metrics.jsonl equal (wall-clock fields aside), every round of the
#      cluster run trained clients on both nodes (its rows' `trained_on`), and the cluster's
#      actor table shows this run's worker actors on both nodes;
#   5. stops exactly the processes it started (their process groups; never `ray stop`, which
#      would stop every Ray instance on the machine).
#
# Usage: scripts/ray_two_node.sh            Environment: OVERRIDES (extra Hydra overrides),
#        WORK (work folder; default a new /tmp/fedadapt-ray2.* folder)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/fedadapt-ray2.XXXXXX)}
export HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 RAY_USAGE_STATS_ENABLED=0
export FEDADAPT_CACHE=${FEDADAPT_CACHE:-$WORK/cache}
unset RAY_ADDRESS
# shellcheck disable=SC1091
[[ -n "${VIRTUAL_ENV:-}" ]] || . "$REPO/.venv/bin/activate"
RUN="experiment=quickstart method=linear_head rounds=3 partition.num_clients=4"
RUN="$RUN partition.fraction_fit=1.0 federation.eval_every=1${OVERRIDES:+ $OVERRIDES}"

log() { echo "[ray2 $(date +%T)] $*" >&2; }
die() { log "FAILED: $*"; exit 1; }
GROUPS_STARTED=()
cleanup() {
    local rc=$? g
    for g in "${GROUPS_STARTED[@]}"; do kill -TERM -- "-$g" 2>/dev/null || true; done
    sleep 2
    for g in "${GROUPS_STARTED[@]}"; do kill -KILL -- "-$g" 2>/dev/null || true; done
    ((rc)) && for f in "$WORK"/*.log; do echo "----- tail $f" >&2; tail -n 20 "$f" >&2; done
    log "logs and outputs kept in $WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_ports() {  # free_ports N: N TCP ports free right now
    python - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

node() {  # node NAME ARGS...: `ray start --block` in its own session (process group)
    local name=$1
    shift
    read -r agent grpc env metrics mgr om <<<"$(free_ports 6)"
    setsid ray start --block --num-cpus 1 --num-gpus 0 --object-store-memory 100000000 \
        --temp-dir "$WORK/ray" --disable-usage-stats \
        --dashboard-agent-listen-port "$agent" --dashboard-agent-grpc-port "$grpc" \
        --runtime-env-agent-port "$env" --metrics-export-port "$metrics" \
        --node-manager-port "$mgr" --object-manager-port "$om" "$@" >"$WORK/$name.log" 2>&1 &
    GROUPS_STARTED+=($!)
}

nodes_alive() {  # nodes_alive ADDRESS: the cluster's live nodes with resources
    python - "$1" <<'EOF'
import logging, sys, ray
ray.init(address=sys.argv[1], logging_level=logging.ERROR, log_to_driver=False)
print(sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")))
EOF
}

mkdir -p "$WORK"
t0=$SECONDS
read -r gcs client dash <<<"$(free_ports 3)"
log "work folder $WORK; head node on port $gcs"
node head --head --port "$gcs" --ray-client-server-port "$client" --include-dashboard false \
    --dashboard-port "$dash"
for _ in $(seq 120); do
    addr=$(grep -o "ray start --address='[^']*'" "$WORK/head.log" | head -1 | cut -d"'" -f2 || true)
    [[ -n "$addr" ]] && break
    sleep 1
done
[[ -n "$addr" ]] || die "the head node did not start"
node worker --address "$addr"
for _ in $(seq 120); do
    [[ "$(nodes_alive "$addr" 2>/dev/null)" == 2 ]] && break
    sleep 2
done
[[ "$(nodes_alive "$addr" 2>/dev/null)" == 2 ]] || die "the second node did not join $addr"
log "two nodes up at $addr after $((SECONDS - t0)) s"

# shellcheck disable=SC2086
run() {  # run NAME OVERRIDES...: a fedadapt run into $WORK/NAME
    local name=$1 t=$SECONDS
    shift
    (cd "$WORK" && fedadapt $RUN output_dir="$WORK/$name" "$@") >"$WORK/$name.log" 2>&1 \
        || die "fedadapt ($name) failed"
    log "$name run: $((SECONDS - t)) s; $(grep -h '\[ray\]' "$WORK/$name.log" | tail -1)"
}
run cluster federation.ray_address="$addr"
run local federation.workers=2 federation.ray_num_cpus=2

python - "$WORK" "$addr" <<'EOF'
import json, logging, sys
from pathlib import Path

import ray

work, addr = Path(sys.argv[1]), sys.argv[2]
WALL = {"round_s", "wall_s", "trained_on"}


def rows_of(name):
    (summary,) = (work / name).rglob("summary.json")
    rows = [json.loads(x) for x in (summary.parent / "metrics.jsonl").read_text().splitlines()]
    return summary.parent, rows


def metrics(name):
    folder, rows = rows_of(name)
    return folder, [{k: v for k, v in r.items() if k not in WALL} for r in rows]


spread = [r.get("trained_on", {}) for r in rows_of("cluster")[1]]
assert all(len(s) == 2 for s in spread), f"clients trained per node and round: {spread}"
(cdir, cluster), (ldir, local) = metrics("cluster"), metrics("local")
assert cluster == local, "metrics differ between the cluster and the local run"
ray.init(address=addr, logging_level=logging.ERROR, log_to_driver=False)
from ray._private import state  # noqa: E402

placed = {}
for actor in state.actors().values():
    if actor["ActorClassName"] == "ClientAppActor":
        node = actor["Address"]["NodeID"][:8]
        placed[node] = placed.get(node, 0) + 1
assert len(placed) == 2, f"client actors on {placed}, not on both nodes"
last = cluster[-1]
print(f"cluster run: {cdir}\nlocal run:   {ldir}\nworker actors per node: {placed}\n"
      f"clients trained per node, round by round: {spread}\n"
      f"{len(cluster)} rounds, metrics equal; final global acc {100 * last['global_acc']:.2f}, "
      f"client-mean {100 * last['client_acc']:.2f}, train loss {last['train_loss']:.6f}")
EOF
log "OK: total $((SECONDS - t0)) s"
