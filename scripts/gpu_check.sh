#!/usr/bin/env bash
# What a person with one GPU runs after `pip install`: the test suite on CUDA, the throughput
# benchmark at batch 10 and 64 on the paper-shaped configuration (DeiT-S at 224 px, random
# weights, the Accumulator + PA, the paper's crop augmentation, bf16 on CUDA) and a 3-round
# paper-shaped run; one Markdown report with the device, the versions and every figure.
#
#   bash scripts/gpu_check.sh [OUT_DIR]        # default: outputs/gpu_check-<time>
#
# Offline: the data are scikit-learn's digits upsampled to 224 px (no download); DeiT-S is built
# from its architecture (backbone.weights=null). Set PYTEST_ARGS to pass options to pytest
# (e.g. "-x -n 8" with pytest-xdist).
set -uo pipefail
out=${1:-outputs/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0
report="$out/report.md"
paper=(backbone=deit_small backbone.weights=null dataset=digits method=accumulator_pa
       "train.crop_scale=[0.05,1.0]" train.lr=0.005 train.momentum=0.0)

{
  echo "# fedadapt GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python - <<'PY'
import platform, torch
print(f"python {platform.python_version()} | torch {torch.__version__} | cuda {torch.version.cuda}"
      f" | {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NO GPU VISIBLE'}")
from importlib.metadata import version
print(" | ".join(f"{p} {version(p)}" for p in ("fedadapt", "flwr", "ray", "transformers",
                                               "open_clip_torch", "timm", "hydra-core")))
PY
  echo '```'
} > "$report"

echo "[gpu_check] 1/3 the test suite on CUDA" >&2
start=$(date +%s)
python -m pytest -q ${PYTEST_ARGS:-} > "$out/pytest.log" 2>&1
rc=$?
{
  echo
  echo "## Test suite (exit code $rc, $(( $(date +%s) - start )) s)"
  echo
  echo '```'
  tail -n 15 "$out/pytest.log"
  echo '```'
} >> "$report"

echo "[gpu_check] 2/3 throughput: one client at batch 10 and 64, ten clients x 10 side by side" >&2
{
  echo
  echo "## Throughput of local training (\`fedadapt-bench --throughput\`)"
  echo
  echo "Command: \`fedadapt-bench --throughput --steps 8 --clients K ${paper[*]} partition.num_clients=1 train.batch_size=B\`"
  echo "(K clients side by side: the bare loop steps at K x B)"
  echo
  echo "| clients x batch | fedadapt img/s | bare loop img/s | data path img/s | ratio | GPU util % | precision |"
  echo "|---|---|---|---|---|---|---|"
} >> "$report"
for kb in 1:10 1:64 10:10; do
  k=${kb%%:*}; bs=${kb##*:}
  fedadapt-bench --throughput --steps 8 --repeats 5 --clients "$k" \
    --out "$out/throughput-k$k-b$bs.json" "${paper[@]}" partition.num_clients=1 \
    train.batch_size="$bs" > "$out/throughput-k$k-b$bs.log" 2>&1
  python - "$out/throughput-k$k-b$bs.json" "$k x $bs" >> "$report" <<'PY' || echo "| $k x $bs | failed: see throughput-k$k-b$bs.log | | | | | |" >> "$report"
import json, sys
r = json.load(open(sys.argv[1]))
f = lambda v, d=0: "—" if v is None else f"{v:,.{d}f}"
print(f"| {sys.argv[2]} | {f(r['fedadapt_images_per_s'])} | {f(r['bare_images_per_s'])} | "
      f"{f(r['data_images_per_s'])} | {f(r['ratio'], 2)} | {f(r['gpu_utilisation_mean'])} | "
      f"{r['precision']} |")
PY
done

echo "[gpu_check] 3/3 a 3-round paper-shaped run" >&2
start=$(date +%s)
fedadapt experiment=custom "${paper[@]}" partition.num_clients=20 partition.fraction_fit=0.5 \
  rounds=3 train.batch_size=10 output_dir="$out/run" > "$out/run.log" 2>&1
rc=$?
{
  echo
  echo "## 3-round run (exit code $rc, $(( $(date +%s) - start )) s)"
  echo
  echo "Command: \`fedadapt experiment=custom ${paper[*]} partition.num_clients=20 partition.fraction_fit=0.5 rounds=3 train.batch_size=10\`"
  echo
  grep -E "round [0-9]+/3" "$out/run.log" | sed 's/^/    /'
  echo
  cat "$(ls -d "$out"/run/custom/*/ 2>/dev/null | head -1)table.md" 2>/dev/null
} >> "$report"
echo "[gpu_check] report: $report" >&2
cat "$report"
