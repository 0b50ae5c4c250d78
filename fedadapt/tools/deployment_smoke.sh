#!/usr/bin/env bash
# Smoke test of fedadapt on Flower's deployment engine, offline and on 127.0.0.1 only:
# start a SuperLink and N SuperNodes, `flwr run` a small quickstart (2 rounds, N clients), check
# that the run finished and wrote <output_dir>/quickstart/deploy_*/summary.json, then stop
# every process this script started. See docs/deployment.md.
#
# Usage: fedadapt-deploy smoke [N]                 (N SuperNodes = clients, default 3)
# Environment (all optional):
#   PORT       SuperLink port (Fleet, Control and Runtime HTTP API), default 9093
#   NODE_PORT  first SuperNode Runtime API port (node i uses NODE_PORT+i), default 9194
#   TIMEOUT    seconds allowed for the run itself, default 600
#   OVERRIDES  extra Hydra overrides appended to the small quickstart ones
#   WORK       work folder (logs, FLWR_HOME, staged app, outputs); default a new /tmp folder
set -euo pipefail

N=${1:-3}
PORT=${PORT:-9093}
NODE_PORT=${NODE_PORT:-9194}
TIMEOUT=${TIMEOUT:-600}
REPO=${FEDADAPT_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}  # the checkout
WORK=${WORK:-$(mktemp -d /tmp/fedadapt-deploy.XXXXXX)}
APP=$WORK/app/fedadapt
OUT=$WORK/outputs
CONN=local-deployment
OVR="experiment=quickstart method=linear_head rounds=2 partition.num_clients=$N"
OVR="$OVR partition.fraction_fit=1.0 output_dir=$OUT${OVERRIDES:+ $OVERRIDES}"

export FLWR_HOME=$WORK/flwr HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
# shellcheck disable=SC1091
[[ -n "${VIRTUAL_ENV:-}" ]] || . "$REPO/.venv/bin/activate"

PIDS=()
log() { echo "[smoke $(date +%T)] $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

descendants() {  # every process below $1, deepest last
    local child
    for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do
        echo "$child"
        descendants "$child"
    done
}

alive() {  # the given pids that still run (zombies excluded)
    local pid stat
    for pid in "$@"; do
        stat=$(ps -o stat= -p "$pid" 2>/dev/null || true)
        [[ -n "$stat" && "$stat" != Z* ]] && echo "$pid"
    done
    return 0
}

cleanup() {
    local rc=$? all=() pid left
    for pid in "${PIDS[@]}"; do
        all+=("$pid")
        # shellcheck disable=SC2207
        all+=($(descendants "$pid"))
    done
    if ((${#all[@]})); then
        log "stopping ${#all[@]} processes started here: ${all[*]}"
        kill -TERM "${all[@]}" 2>/dev/null || true
        for _ in $(seq 50); do
            left=$(alive "${all[@]}")
            [[ -z "$left" ]] && break
            sleep 0.2
        done
        left=$(alive "${all[@]}")
        if [[ -n "$left" ]]; then
            log "SIGKILL to $left"
            # shellcheck disable=SC2086
            kill -KILL $left 2>/dev/null || true
        fi
    fi
    if ((rc)); then
        for f in "$WORK"/*.log; do
            [[ -f "$f" ]] && { echo "----- tail $f" >&2; tail -n 25 "$f" >&2; }
        done
    fi
    log "logs and outputs kept in $WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {  # wait_port PORT NAME PID
    local deadline=$((SECONDS + 60))
    until port_open "$1"; do
        kill -0 "$3" 2>/dev/null || die "$2 exited (see $WORK/$2.log)"
        ((SECONDS < deadline)) || die "$2 not listening on 127.0.0.1:$1 after 60 s"
        sleep 0.5
    done
}

start() {  # start NAME COMMAND...: in the background, cwd $WORK, output to $WORK/NAME.log
    local name=$1
    shift
    (cd "$WORK" && exec "$@") >"$WORK/$name.log" 2>&1 &
    PIDS+=($!)
}

for p in "$PORT" $(seq "$NODE_PORT" $((NODE_PORT + N - 1))); do
    port_open "$p" && die "127.0.0.1:$p is already in use (set PORT / NODE_PORT)"
done

# 1. Stage the app: the files git would commit (tracked or untracked, not ignored), with the
#    legacy [tool.flwr.federations] table removed. Run on the repository itself, `flwr run`
#    1.41 would move that table to $FLWR_HOME/config.toml and comment it out in pyproject.toml.
log "work folder $WORK; staging the app"
mkdir -p "$APP" "$FLWR_HOME"
while IFS= read -r -d '' f; do
    if [[ -f "$REPO/$f" ]]; then install -D -m 644 "$REPO/$f" "$APP/$f"; fi
done < <(git -C "$REPO" ls-files -z --cached --others --exclude-standard)
python - "$APP/pyproject.toml" <<'EOF'
import sys, tomllib, tomli_w
path = sys.argv[1]
with open(path, "rb") as fh:
    cfg = tomllib.load(fh)
cfg.get("tool", {}).get("flwr", {}).pop("federations", None)
with open(path, "wb") as fh:
    tomli_w.dump(cfg, fh)
EOF

# 2. The SuperLink connection `flwr run` uses (Flower >= 1.41 reads $FLWR_HOME/config.toml).
cat >"$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "$CONN"

[superlink.$CONN]
address = "127.0.0.1:$PORT"
insecure = true
EOF

# 3. SuperLink and SuperNodes, all on 127.0.0.1, using this venv (no `uv sync` per run).
t0=$SECONDS
start superlink flower-superlink --insecure --isolation subprocess \
    --disable-runtime-dependency-installation --host 127.0.0.1 --port "$PORT"
wait_port "$PORT" superlink "${PIDS[0]}"
for ((i = 0; i < N; i++)); do
    start "supernode$i" flower-supernode --insecure --superlink "127.0.0.1:$PORT" \
        --isolation subprocess --host 127.0.0.1 --port $((NODE_PORT + i)) \
        --node-config "partition-id=$i num-partitions=$N"
done
for ((i = 0; i < N; i++)); do
    wait_port $((NODE_PORT + i)) "supernode$i" "${PIDS[$((i + 1))]}"
done
log "SuperLink on 127.0.0.1:$PORT and $N SuperNodes up after $((SECONDS - t0)) s"

# 4. The run; --stream follows its log until it ends.
log "flwr run $APP $CONN --stream --run-config 'overrides=\"$OVR\"'"
t1=$SECONDS
timeout "$TIMEOUT" flwr run "$APP" "$CONN" --stream --run-config "overrides=\"$OVR\"" \
    2>&1 | tee "$WORK/flwr-run.log" || die "flwr run failed or exceeded TIMEOUT=$TIMEOUT s"
run_id=$(grep -o 'Successfully started run [0-9]*' "$WORK/flwr-run.log" | awk '{print $4}')
[[ -n "$run_id" ]] || die "flwr run did not start a run"
status=$(flwr ls "$CONN" --run-id "$run_id" --format json | python -c \
    'import json, sys; print(json.load(sys.stdin)["runs"][0]["status"])')
log "run $run_id: $status after $((SECONDS - t1)) s"
[[ "$status" == finished:completed ]] || die "run $run_id ended as $status"

# 5. The run directory.
mapfile -t summaries < <(find "$OUT" -path '*/deploy_*/summary.json')
((${#summaries[@]} == 1)) || die "expected one deploy_*/summary.json under $OUT, found ${#summaries[@]}"
run_dir=$(dirname "${summaries[0]}")
ls -l "$run_dir"
python - "${summaries[0]}" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{s['method']} on {s['dataset']}, {s['partition']['num_clients']} clients, "
      f"{s['rounds']} rounds: final {s['final']}")
EOF
log "OK: $run_dir (total $((SECONDS - t0)) s)"
