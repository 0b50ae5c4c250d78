#!/usr/bin/env bash
# What a person with one GPU runs after installing fedadapt: does every run work there, and how
# fast is it? One Markdown report (report.md) with the device, the versions and every figure.
#
#   bash scripts/gpu_check.sh [--small] [OUT_DIR]      # default: outputs/gpu_check-<time>
#
# Offline. Builds its own CIFAR-100-shaped data set (scripts/synthetic_cifar100.py: 50,000 +
# 10,000 synthetic 32x32 images, 100 classes) and runs the Accumulator paper's Table 1 shape on
# it: DeiT-S at 224 px built from its architecture (backbone.weights=null), the Accumulator +
# parallel adapters, the paper's crops, batch 10; precision as a run chooses it (bf16 on a GPU).
# Steps, each under its own timeout (a step that hangs cannot eat the others' time; the report
# says which failed and why): the versions; the data set; attention kernels under vmap
# (scripts/vmap_attention.py); the fast tests (pytest -n 12); experiment=acc_conventional for 5
# rounds with defaults (s/round, GPU busy %, peak memory, the K it chose); the throughput table
# in one process (fedadapt-bench --throughput --rows: 1 x 10, 1 x 64, 10 x 10, 32 x 10 and
# LoRA 10 x 10 in bf16, 10 x 10 in fp32); the 10 x 10 bf16 row's loops under torch.profiler
# (--profile, 2 steps); experiment=acc_anytime for 3 rounds; experiment=acc_conventional
# method=lora for 3 rounds. FLASH_ROWS=10:10:bf16:accumulator_pa (rows as --rows takes them)
# adds an experiment: flash attention under vmap in bf16 (FEDADAPT_VMAP_ATTENTION=flash), the
# CUDA cases of tests/test_grouped_bf16.py and those rows with it.
# --small shrinks it to a CPU rehearsal (small_vit at 32 px, 5,000 + 500 images, a few tests),
# so the script itself is tested where no GPU is. PYTEST_ARGS replaces the test selection.
set -uo pipefail
small=0
if [ "${1:-}" = "--small" ]; then small=1; shift; fi
out=${1:-outputs/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
export FEDADAPT_CACHE=${FEDADAPT_CACHE:-$out/cache}
data=$out/cifar100-synthetic
: > "$out/steps.tsv"

if [ $small = 1 ]; then
  sizes=(--train 5000 --test 500)
  model=(backbone=small_vit)
  tests=(tests/test_grouped_bf16.py tests/test_sizing.py -q -p no:cacheprovider)
  steps=4; t_tests=300; t_run=300; t_tp=400
  small_run=(partition.num_clients=10 partition.fraction_fit=0.5)  # 100 classes, few images
else
  sizes=()
  model=(backbone=deit_small backbone.weights=null)
  tests=(-m "not slow" -n 12 -q -p no:cacheprovider --durations=15)
  steps=8; t_tests=120; t_run=150; t_tp=150
  small_run=()
fi
# PYTEST_ARGS: the tests' arguments, as a shell would split them (quotes kept); none: no tests.
if [ "${PYTEST_ARGS:-}" = none ]; then tests=()
elif [ -n "${PYTEST_ARGS:-}" ]; then eval "tests=($PYTEST_ARGS)"; fi
# RUNS and THROUGHPUT: which runs (name:preset:rounds:method) and throughput rows
# (clients:batch:precision:method) to measure; by default all of them.
runs=${RUNS:-conventional:acc_conventional:5:accumulator_pa anytime:acc_anytime:3:accumulator_pa \
lora:acc_conventional:3:lora}
rows=${THROUGHPUT:-1:10:bf16:accumulator_pa 1:64:bf16:accumulator_pa 10:10:bf16:accumulator_pa \
10:10:fp32:accumulator_pa 32:10:bf16:accumulator_pa 10:10:bf16:lora}
profile_row=10:10:bf16:accumulator_pa
if [ $small = 1 ]; then rows=${rows//:bf16:/:auto:}; profile_row=10:10:auto:accumulator_pa; fi
flash_rows=${FLASH_ROWS-}
paper=(dataset=cifar100 "dataset.path=$data" "${model[@]}")
# fedadapt-bench's rows: the paper's shape, 10 clients to draw images from
bench=("${paper[@]}" partition.num_clients=10 "train.crop_scale=[0.05,1.0]" train.lr=0.005
       train.momentum=0.0)

# step NAME SECONDS COMMAND...: runs COMMAND under its timeout, its output in NAME.log; records
# NAME, exit code and seconds in steps.tsv, then rewrites the report from what is there so far.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "[gpu_check] $name (at most ${limit} s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( SECONDS - t0 ))" "$limit" >> "$out/steps.tsv"
  python "$here/gpu_check_report.py" "$out" > /dev/null 2>&1 || true
  return $rc
}

# GPU busy % and memory, sampled every 200 ms while a run goes (nvidia-smi; none on the CPU).
watch_gpu() {
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader,nounits \
      -lms 200 > "$out/$1.smi.csv" 2> /dev/null &
    echo $!
  fi
}

step versions 30 python "$here/gpu_check_report.py" --versions
step data 60 python "$here/synthetic_cifar100.py" "$data" "${sizes[@]}"
step attention 45 python "$here/vmap_attention.py" --out "$out/attention.md"
[ "${#tests[@]}" -gt 0 ] && step tests "$t_tests" python -m pytest "${tests[@]}"

for run in $runs; do
  IFS=: read -r name preset rounds method <<< "$run"
  smi=$(watch_gpu "run-$name")
  step "run-$name" "$t_run" fedadapt "experiment=$preset" "${paper[@]}" "method=$method" \
    "rounds=$rounds" "federation.eval_every=$rounds" "output_dir=$out/runs/$name" "${small_run[@]}"
  [ -n "$smi" ] && kill "$smi" 2> /dev/null
  if [ "$name" = conventional ] && [ -n "$rows" ]; then  # the table, after the run that matters most
    step throughput "$t_tp" fedadapt-bench --throughput --rows "${rows// /,}" \
      --steps "$steps" --repeats 3 --out "$out" "${bench[@]}"
    step profile 90 fedadapt-bench --throughput --rows "${profile_row}" --profile --steps 2 \
      --repeats 1 --out "$out/profile" "${bench[@]}"
  fi
  if [ "$name" = anytime ] && [ -n "$flash_rows" ]; then  # the candidate kernel, checked and timed
    FEDADAPT_VMAP_ATTENTION=flash step flash-tests 60 python -m pytest \
      tests/test_grouped_bf16.py -k "cuda and equals_alone" -q -p no:cacheprovider
    FEDADAPT_VMAP_ATTENTION=flash step flash-throughput 75 fedadapt-bench --throughput \
      --rows "$flash_rows" --profile --steps "$steps" --repeats 3 --out "$out/flash" "${bench[@]}"
  fi
done
python "$here/gpu_check_report.py" "$out"
echo "[gpu_check] report: $out/report.md" >&2
