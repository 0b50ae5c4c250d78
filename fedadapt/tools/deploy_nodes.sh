#!/usr/bin/env bash
# fedadapt on Flower's deployment engine across the machines of a node list, with TLS and
# SuperNode authentication on (docs/deployment.md, "Several machines"). Run on the SuperLink's
# machine. Every SuperNode gets the wheel built here (python -m build) and installs it into its
# own venv, as a fresh machine would.
#
#   1. builds the wheel; makes a CA, the SuperLink's certificate and one ECDSA key pair per
#      SuperNode (fedadapt-deploy certs);
#   2. starts the SuperLink (its own venv with the wheel) with --ssl-ca-certfile/--ssl-certfile/
#      --ssl-keyfile and --enable-supernode-auth, and registers every SuperNode's public key
#      (flwr supernode register);
#   3. for line i of the node list: copies the wheel, ca.crt and node key i to the host,
#      installs the wheel into a venv there and starts flower-supernode with
#      --root-certificates, --auth-supernode-private-key and partition-id=i;
#   4. `flwr run` (N = the node list's length clients), checks the run finished and wrote its
#      run directory; checks that a SuperNode with an unregistered key is refused; with
#      COMPARE=1 (default) runs the same config on the simulation engine and compares metrics
#      (accuracies exactly; train losses to 1e-6, as each machine computes its own features);
#   5. stops every process it started (their process groups, on every host).
#
# Usage: fedadapt-deploy nodes NODELIST
#   NODELIST: one SuperNode per line, `HOST` (anything after it is passed to flower-supernode);
#   '#' starts a comment. localhost / 127.0.0.1 run here; any other HOST over `ssh HOST`
#   (key-based, non-interactive) with the same WORK path there.
# Environment (all optional):
#   SUPERLINK_HOST  the SuperLink's address as the SuperNodes reach it (default 127.0.0.1);
#                   the certificate is made for it
#   PORT            SuperLink port (Fleet, Control and Runtime HTTP API), default 9093
#   NODE_PORT       first SuperNode Runtime API port (node i uses NODE_PORT+i), default 9194
#   DEPS            full (default): pip install the wheel with its dependencies on each node;
#                   shared: only the wheel and flwr, the dependencies from this venv (loopback
#                   tests on one machine: no 2 GB install per node)
#   OVERRIDES       extra Hydra overrides after the 2-round quickstart ones
#   TIMEOUT         seconds for the run itself, default 900
#   COMPARE         1: also run the simulation engine and compare the metrics (default 1)
#   WORK            work folder (default a new /tmp/fedadapt-nodes.* folder)
set -euo pipefail

LIST=${1:?usage: fedadapt-deploy nodes NODELIST}
REPO=${FEDADAPT_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)}  # the checkout
WORK=${WORK:-$(mktemp -d /tmp/fedadapt-nodes.XXXXXX)}
SUPERLINK_HOST=${SUPERLINK_HOST:-127.0.0.1}
PORT=${PORT:-9093}
NODE_PORT=${NODE_PORT:-9194}
DEPS=${DEPS:-full}
TIMEOUT=${TIMEOUT:-900}
COMPARE=${COMPARE:-1}
CONN=fedadapt-tls
mapfile -t NODES < <(sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$LIST")
N=${#NODES[@]}
((N > 0)) || { echo "no SuperNodes in $LIST" >&2; exit 2; }
OUT=$WORK/outputs
OVR="experiment=quickstart method=linear_head rounds=2 partition.num_clients=$N"
OVR="$OVR partition.fraction_fit=1.0 output_dir=$OUT${OVERRIDES:+ $OVERRIDES}"

export FLWR_HOME=$WORK/flwr HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
# shellcheck disable=SC1091
[[ -n "${VIRTUAL_ENV:-}" ]] || . "$REPO/.venv/bin/activate"
PY=$(python -c 'import sys; print(sys._base_executable)')
SITE=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
FLWR_VERSION=$(python -c 'import flwr; print(flwr.__version__)')

log() { echo "[nodes $(date +%T)] $*" >&2; }
die() { log "FAILED: $*"; exit 1; }
is_local() { [[ "$1" == localhost || "$1" == 127.0.0.1 ]]; }
on() {  # on HOST COMMAND: run a shell command on HOST
    local host=$1
    shift
    if is_local "$host"; then bash -c "$*"; else ssh -o BatchMode=yes "$host" "$*"; fi
}
put() {  # put HOST DIR FILE...: copy files into DIR on HOST
    local host=$1 dir=$2
    shift 2
    on "$host" "mkdir -p '$dir'"
    if is_local "$host"; then cp "$@" "$dir/"; else scp -q -o BatchMode=yes "$@" "$host:$dir/"; fi
}
STARTED=()  # "HOST PID" of every process group started
spawn() {  # spawn HOST LOG COMMAND: in the background in its own process group
    local host=$1 logf=$2 pid
    shift 2
    pid=$(on "$host" "setsid nohup bash -c '$*' >'$logf' 2>&1 </dev/null & echo \$!")
    STARTED+=("$host $pid")
    echo "$pid"
}
cleanup() {
    local rc=$? entry
    for entry in "${STARTED[@]}"; do on "${entry% *}" "kill -TERM -- -${entry#* } 2>/dev/null" || true; done
    sleep 3
    for entry in "${STARTED[@]}"; do on "${entry% *}" "kill -KILL -- -${entry#* } 2>/dev/null" || true; done
    if ((rc)); then
        for f in "$WORK"/*.log "$WORK"/node-*/supernode.log; do
            [[ -f "$f" ]] && { echo "----- tail $f" >&2; tail -n 15 "$f" >&2; }
        done
    fi
    log "logs and outputs kept in $WORK"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

install_cmd() {  # install_cmd DIR: make DIR/venv and install the wheel there
    local d=$1
    if [[ "$DEPS" == shared ]]; then
        echo "'$PY' -m venv '$d/venv' && echo '$SITE' > \$('$d/venv/bin/python' -c \
'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])')/fedadapt-deps.pth && \
'$d/venv/bin/pip' install -q --no-deps --ignore-installed '$d/$WHEEL_NAME' flwr==$FLWR_VERSION"
    else
        echo "python3 -m venv '$d/venv' && '$d/venv/bin/pip' install -q --upgrade pip && \
'$d/venv/bin/pip' install -q '$d/$WHEEL_NAME'"
    fi
}

wait_log() {  # wait_log FILE PATTERN WHAT: until FILE matches PATTERN (60 s)
    for _ in $(seq 120); do
        grep -q "$2" "$1" 2>/dev/null && return 0
        sleep 0.5
    done
    die "$3 (see $1)"
}

# 1. The wheel and the certificates.
t0=$SECONDS
mkdir -p "$WORK" "$FLWR_HOME"
log "work folder $WORK; $N SuperNodes from $LIST; building the wheel"
python -m build --wheel --no-isolation --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
    || die "python -m build failed (see $WORK/build.log)"
WHEEL=$(ls "$WORK"/dist/fedadapt-*.whl)
WHEEL_NAME=$(basename "$WHEEL")
python "$(dirname "${BASH_SOURCE[0]}")/deploy_certs.py" "$WORK/certs" --nodes $((N + 1)) --host "$SUPERLINK_HOST" >&2

# 2. The SuperLink (TLS, SuperNode authentication) in its own venv with the wheel.
put localhost "$WORK/superlink" "$WHEEL"
bash -c "$(install_cmd "$WORK/superlink")" || die "installing the wheel for the SuperLink"
SL_BIN=$WORK/superlink/venv/bin
C=$WORK/certs
spawn localhost "$WORK/superlink.log" "cd '$WORK' && FEDADAPT_CACHE='$WORK/superlink/cache' \
PATH='$SL_BIN':\$PATH exec '$SL_BIN/flower-superlink' --ssl-ca-certfile '$C/ca.crt' \
--ssl-certfile '$C/server.pem' --ssl-keyfile '$C/server.key' --enable-supernode-auth \
--isolation subprocess --disable-runtime-dependency-installation --host 0.0.0.0 --port $PORT" \
    >/dev/null
wait_log "$WORK/superlink.log" "listening\|Starting\|started" "the SuperLink did not start"
cat >"$FLWR_HOME/config.toml" <<EOF
[superlink]
default = "$CONN"

[superlink.$CONN]
address = "$SUPERLINK_HOST:$PORT"
root-certificates = "$C/ca.crt"
EOF
sleep 3
for ((i = 0; i < N; i++)); do
    "$SL_BIN/flwr" supernode register "$C/node-$i.pub" "$CONN" >>"$WORK/register.log" 2>&1 \
        || die "flwr supernode register node-$i (see $WORK/register.log)"
done
log "SuperLink with TLS on $SUPERLINK_HOST:$PORT; $N SuperNode keys registered"

# 3. One SuperNode per line of the node list, each installing the wheel.
for ((i = 0; i < N; i++)); do
    read -r host extra <<<"${NODES[$i]}"
    d=$WORK/node-$i
    put "$host" "$d" "$WHEEL" "$C/ca.crt" "$C/node-$i"
    on "$host" "$(install_cmd "$d")" || die "installing the wheel on $host (node $i)"
    spawn "$host" "$d/supernode.log" "cd '$d' && FEDADAPT_CACHE='$d/cache' HF_HUB_OFFLINE=1 \
FLWR_TELEMETRY_ENABLED=0 PATH='$d/venv/bin':\$PATH exec '$d/venv/bin/flower-supernode' \
--superlink '$SUPERLINK_HOST:$PORT' --root-certificates '$d/ca.crt' \
--auth-supernode-private-key '$d/node-$i' --isolation subprocess --host 127.0.0.1 \
--port $((NODE_PORT + i)) --node-config 'partition-id=$i num-partitions=$N' ${extra:-}" \
        >/dev/null
done
log "$N SuperNodes installed and started after $((SECONDS - t0)) s"

# 4. The run, from an app folder holding pyproject.toml and README.md (the FAB; every process
#    imports the installed wheel).
APP=$WORK/app
mkdir -p "$APP"
python - "$REPO/pyproject.toml" "$APP/pyproject.toml" <<'EOF'
import sys, tomllib, tomli_w
cfg = tomllib.load(open(sys.argv[1], "rb"))
cfg.get("tool", {}).get("flwr", {}).pop("federations", None)
tomli_w.dump(cfg, open(sys.argv[2], "wb"))
EOF
cp "$REPO/README.md" "$APP/"
t1=$SECONDS
log "flwr run $APP $CONN --stream --run-config 'overrides=\"$OVR\"'"
timeout "$TIMEOUT" "$SL_BIN/flwr" run "$APP" "$CONN" --stream --run-config "overrides=\"$OVR\"" \
    2>&1 | tee "$WORK/flwr-run.log" >&2 || die "flwr run failed or exceeded TIMEOUT=$TIMEOUT s"
run_id=$(grep -o 'Successfully started run [0-9]*' "$WORK/flwr-run.log" | awk '{print $4}')
[[ -n "$run_id" ]] || die "flwr run did not start a run"
status=$("$SL_BIN/flwr" ls "$CONN" --run-id "$run_id" --format json | python -c \
    'import json, sys; print(json.load(sys.stdin)["runs"][0]["status"])')
log "run $run_id: $status after $((SECONDS - t1)) s"
[[ "$status" == finished:completed ]] || die "run $run_id ended as $status"
mapfile -t summaries < <(find "$OUT" -path '*/deploy_*/summary.json')
((${#summaries[@]} == 1)) || die "expected one deploy_*/summary.json under $OUT"
run_dir=$(dirname "${summaries[0]}")

# 5. A SuperNode whose key was not registered is refused.
d=$WORK/node-unregistered
mkdir -p "$d" && cp "$C/node-$N" "$C/ca.crt" "$d/"
pid=$(spawn localhost "$d/supernode.log" "exec '$SL_BIN/flower-supernode' --superlink \
'$SUPERLINK_HOST:$PORT' --root-certificates '$d/ca.crt' --auth-supernode-private-key \
'$d/node-$N' --isolation subprocess --host 127.0.0.1 --port $((NODE_PORT + N)) \
--max-retries 0")
for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
if kill -0 "$pid" 2>/dev/null; then die "a SuperNode with an unregistered key kept running"; fi
grep -q "No SuperNode found with the given public key" "$WORK/superlink.log" \
    || die "the SuperLink did not log refusing the unregistered key"
log "a SuperNode with an unregistered key was refused: $(grep -m1 -o \
    'Failed to activate SuperNode' "$d/supernode.log" || true) (SuperLink: No SuperNode found \
with the given public key)"

# 6. The same config on the simulation engine, for comparison.
if [[ "$COMPARE" == 1 ]]; then
    # shellcheck disable=SC2086
    (cd "$WORK" && FEDADAPT_CACHE="$WORK/superlink/cache" PATH="$SL_BIN:$PATH" \
        fedadapt $OVR output_dir="$WORK/simulation") >"$WORK/simulation.log" 2>&1 \
        || die "the simulation run failed"
fi
python - "$run_dir" "$WORK/simulation" "$COMPARE" <<'EOF'
import json, sys
from pathlib import Path

import math

KEYS = ("round", "global_acc", "client_acc", "client_acc_weighted", "clients_trained")


def rows(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(x).get(k) for k in KEYS} for x in lines]


def losses(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["train_loss"] for x in lines]


s = json.loads((Path(sys.argv[1]) / "summary.json").read_text())
print(f"deployment run {sys.argv[1]}: {s['method']}, {s['partition']['num_clients']} clients, "
      f"{s['rounds']} rounds, final {s['final']['global_acc']} global, "
      f"{s['final']['client_acc']} client-mean")
if sys.argv[3] == "1":
    (sim,) = Path(sys.argv[2]).rglob("summary.json")
    assert rows(sys.argv[1]) == rows(sim.parent), "deployment and simulation metrics differ"
    # every machine computes its own feature cache: the losses agree to float32 rounding
    pairs = list(zip(losses(sys.argv[1]), losses(sim.parent)))
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in pairs), pairs
    print(f"simulation run {sim.parent}: the same accuracies round by round; train losses "
          f"{pairs} (equal to 1e-6)")
EOF
log "OK: total $((SECONDS - t0)) s"
