#!/usr/bin/env bash
# A parallel sweep gives the metrics of the same runs done one by one (docs/scaling.md).
# Not run by CI: it takes minutes (tests/test_rundir.py has a 2-point version).
#
#   1. `fedadapt -m hydra/launcher=joblib hydra.launcher.n_jobs=2` over 4 points
#      (seed=0,1 x partition.alpha=0.5,1000): two points at a time, each with its own private
#      Ray instance (federation.ray_num_cpus=1 each: the two share this machine's 2 cores);
#   2. the same 4 points as 4 separate `fedadapt` runs, one after another;
#   3. checks: 4 complete run directories each, in separate folders, and every point's
#      metrics.jsonl equal to its lone run's (wall-clock fields aside).
#
# Usage: scripts/sweep_check.sh      Environment: OVERRIDES (extra Hydra overrides),
#        N_JOBS (default 2), WORK (work folder; default a new /tmp/fedadapt-sweep.* folder)
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/fedadapt-sweep.XXXXXX)}
N_JOBS=${N_JOBS:-2}
export HF_HUB_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 RAY_USAGE_STATS_ENABLED=0
export FEDADAPT_CACHE=${FEDADAPT_CACHE:-$WORK/cache}
unset RAY_ADDRESS
# shellcheck disable=SC1091
[[ -n "${VIRTUAL_ENV:-}" ]] || . "$REPO/.venv/bin/activate"
RUN=(experiment=quickstart method=linear_head rounds=4 federation.ray_num_cpus=1)
# shellcheck disable=SC2206
[[ -n "${OVERRIDES:-}" ]] && RUN+=($OVERRIDES)
log() { echo "[sweep $(date +%T)] $*" >&2; }
cd "$WORK"

t=$SECONDS
fedadapt -m hydra/launcher=joblib hydra.launcher.n_jobs="$N_JOBS" seed=0,1 \
    partition.alpha=0.5,1000 "${RUN[@]}" output_dir="$WORK/parallel" >"$WORK/parallel.log" 2>&1
log "joblib sweep, 4 points, n_jobs=$N_JOBS: $((SECONDS - t)) s"
t=$SECONDS
for seed in 0 1; do
    for alpha in 0.5 1000; do
        fedadapt seed=$seed partition.alpha=$alpha "${RUN[@]}" output_dir="$WORK/alone" \
            >>"$WORK/alone.log" 2>&1
    done
done
log "the same 4 runs one by one: $((SECONDS - t)) s"

python - "$WORK" <<'EOF'
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
WALL = {"round_s", "wall_s"}


def runs(folder):
    out = {}
    for summary in sorted((work / folder).rglob("summary.json")):
        s = json.loads(summary.read_text())
        key = (s["seed"], s["partition"]["alpha"])
        assert key not in out, f"two runs of {key} under {folder}"
        rows = [json.loads(x) for x in (summary.parent / "metrics.jsonl").read_text().splitlines()]
        out[key] = (summary.parent, [{k: v for k, v in r.items() if k not in WALL} for r in rows])
    return out


parallel, alone = runs("parallel"), runs("alone")
assert sorted(parallel) == sorted(alone) and len(parallel) == 4, (sorted(parallel), sorted(alone))
assert len({d for d, _ in parallel.values()} | {d for d, _ in alone.values()}) == 8
for key in sorted(parallel):
    assert parallel[key][1] == alone[key][1], f"metrics of {key} differ"
    last = parallel[key][1][-1]
    print(f"seed {key[0]}, alpha {key[1]}: equal over {len(parallel[key][1])} rounds; final "
          f"global acc {100 * last['global_acc']:.2f}, client-mean {100 * last['client_acc']:.2f}")
EOF
log "OK ($WORK)"
