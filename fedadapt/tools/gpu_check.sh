#!/usr/bin/env bash
# What a person with one GPU runs after installing fedadapt: does every run work there, and how
# fast is it? One Markdown report (report.md) with the device, the versions and every figure.
#
#   fedadapt-gpu-check [--small] [OUT_DIR]      # default: outputs/gpu_check-<time>
#
# Offline: it builds its own data (fedadapt/tools/synthetic_cifar100.py: a CIFAR-100-shaped set of
# 50,000 + 10,000 synthetic 32x32 images, 100 classes, and a PACS-shaped one, 2,000 images over
# 4 domains and 7 classes) and every backbone from its architecture (backbone.weights=null).
# Steps, each under its own timeout (a step that hangs cannot eat the others' time; the report
# says which failed and why):
#   versions; data; the fast tests (pytest -n 12, CUDA visible);
#   the throughput table in one process (fedadapt-bench --throughput --rows: 1 x 10 and 10 x 10,
#   32 x 10 side by side, LoRA 10 x 10, bf16), eager, then the 10 x 10 rows captured
#   (federation.compile=true, against a bare step captured the same way);
#   with PROFILE=1, the 10 x 10 row's loops under torch.profiler (2 steps);
#   a few rounds of each paper preset at its paper shape: the Accumulator's Table 1
#   (experiment=acc_conventional, DeiT-S at 224 px, 100 clients, 10 a round, captured by
#   default on a GPU; RUNS=conventional-eager adds it eager), anytime, multi-tier, LoRA; FedCLIP
#   on CLIP ViT-B/32
#   (fedclip_pacs); ICIIA (iciia_cifar100), DUET and CDC-MMPG (sessions_cifar100), trained on the
#   server for 1-2 epochs; each with its s/round (or s/epoch), GPU busy % and peak memory.
# The AST speech presets are not in it: they need audio data this script does not make yet.
# --small shrinks it to a CPU rehearsal (small models, 5,000 + 500 images, a few tests), so the
# script itself is tested where no GPU is. PYTEST_ARGS replaces the test selection (none: no
# tests); RUNS and THROUGHPUT select runs (by name) and rows (clients:batch:precision:method).
set -uo pipefail
small=0
if [ "${1:-}" = "--small" ]; then small=1; shift; fi
out=${1:-outputs/gpu_check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
cd "${FEDADAPT_REPO:-$PWD}"  # the fast tests are the checkout's (fedadapt-gpu-check sets it)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 FLWR_TELEMETRY_ENABLED=0 PYTHONUNBUFFERED=1
export FEDADAPT_CACHE=${FEDADAPT_CACHE:-$out/cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$FEDADAPT_CACHE/inductor}
data=$out/cifar100-synthetic
pacs=$out/pacs-synthetic
: > "$out/steps.tsv"

if [ $small = 1 ]; then
  sizes=(--train 5000 --test 500)
  vit=(backbone=small_vit)
  cnn=(backbone=small_cnn)
  clip=(backbone.weights=null)
  pacs_size=(--train 200)
  tests=(tests/test_grouped.py tests/test_sizing.py -q -p no:cacheprovider -m "not slow")
  steps=4; t_tests=300; t_run=300; t_tp=900  # inductor compiles a shape in 1-3 min here
  # 100 classes, few images: 3 clients a round of about 150 images each
  few=(partition.num_clients=10 partition.fraction_fit=0.3 dataset.max_samples=1500)
  precision=auto
else
  sizes=()
  vit=(backbone=deit_small backbone.weights=null)
  cnn=(backbone.weights=null)  # the preset's EfficientNet from its architecture
  clip=(backbone.weights=null)
  pacs_size=(--train 2000)
  tests=(-m "not slow" -n 12 -q -p no:cacheprovider --durations=15)
  steps=8; t_tests=120; t_run=90; t_tp=150
  few=()
  precision=bf16
fi
if [ "${PYTEST_ARGS:-}" = none ]; then tests=()
elif [ -n "${PYTEST_ARGS:-}" ]; then eval "tests=($PYTEST_ARGS)"; fi
rows=${THROUGHPUT:-1:10:P:accumulator_pa 10:10:P:accumulator_pa 32:10:P:accumulator_pa \
10:10:P:lora}
rows=${rows//:P:/:$precision:}
# captured: each row compiles its own shape (about a minute each on a GPU machine's CPUs, one
# to three on 2 cores), so fewer rows
captured_rows=${THROUGHPUT_CAPTURED:-10:10:$precision:accumulator_pa 10:10:$precision:lora}
[ $small = 1 ] && captured_rows=${THROUGHPUT_CAPTURED:-10:10:$precision:accumulator_pa}
profile_row=10:10:$precision:accumulator_pa
cifar=(dataset=cifar100 "dataset.path=$data")
# fedadapt-bench's rows: the paper's shape, 10 clients to draw images from
bench=("${cifar[@]}" "${vit[@]}" partition.num_clients=10 "train.crop_scale=[0.05,1.0]"
       train.lr=0.005 train.momentum=0.0)

# The runs: NAME|ROUNDS|OVERRIDES (the rounds run with evaluation at the last one only).
all_runs=(
  "conventional|5|experiment=acc_conventional method=accumulator_pa ${cifar[*]} ${vit[*]} ${few[*]}"
  "conventional-eager|3|experiment=acc_conventional method=accumulator_pa federation.compile=false ${cifar[*]} ${vit[*]} ${few[*]}"
  "anytime|3|experiment=acc_anytime method=accumulator_pa ${cifar[*]} ${vit[*]} ${few[*]}"
  "multitier|3|experiment=acc_multitier method=accumulator_pa ${cifar[*]} ${vit[*]} ${few[*]}"
  "lora|3|experiment=acc_conventional method=lora ${cifar[*]} ${vit[*]} ${few[*]}"
  "fedclip|3|experiment=fedclip_pacs method=fedclip dataset.path=$pacs ${clip[*]}"
  "iciia|1|experiment=iciia_cifar100 method=iciia_b method.max_epochs=2 method.classifier_epochs=2 method.finetune_epochs=0 ${cifar[*]} ${cnn[*]}"
  "duet|1|experiment=sessions_cifar100 method=duet method.max_epochs=2 method.classifier_epochs=2 ${cifar[*]} ${cnn[*]}"
  "cdc_mmpg|1|experiment=sessions_cifar100 method=cdc_mmpg method.adr_epochs=1 method.max_epochs=1 ${cifar[*]} ${cnn[*]}"
)
# conventional-eager is left out by default (the throughput rows compare eager and captured)
selected=${RUNS:-conventional anytime multitier lora fedclip iciia duet cdc_mmpg}

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
step data-pacs 60 python "$here/synthetic_cifar100.py" "$pacs" --like pacs "${pacs_size[@]}"
[ "${#tests[@]}" -gt 0 ] && step tests "$t_tests" python -m pytest "${tests[@]}"

if [ -n "$rows" ]; then
  step throughput "$t_tp" fedadapt-bench --throughput --rows "${rows// /,}" \
    --steps "$steps" --repeats 3 --out "$out" "${bench[@]}" federation.compile=false
  step throughput-captured "$t_tp" fedadapt-bench --throughput --rows "${captured_rows// /,}" \
    --steps "$steps" --repeats 3 --out "$out/captured" "${bench[@]}" federation.compile=true
  if [ -n "${PROFILE:-}" ]; then  # PROFILE=1: the 10 x 10 row's loops under torch.profiler
    step profile 90 fedadapt-bench --throughput --rows "${profile_row}" --profile --steps 2 \
      --repeats 1 --out "$out/profile" "${bench[@]}" federation.compile=false
  fi
fi

for run in "${all_runs[@]}"; do
  IFS='|' read -r name rounds overrides <<< "$run"
  [[ " $selected " == *" $name "* ]] || continue
  smi=$(watch_gpu "run-$name")
  # shellcheck disable=SC2086  # the overrides are words
  step "run-$name" "$t_run" fedadapt $overrides "rounds=$rounds" "federation.eval_every=$rounds" \
    "output_dir=$out/runs/$name"
  [ -n "$smi" ] && kill "$smi" 2> /dev/null
done
python "$here/gpu_check_report.py" "$out"
echo "[gpu_check] report: $out/report.md" >&2
