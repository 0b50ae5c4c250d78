#!/usr/bin/env bash
# The Accumulator's offline evidence of docs/papers/accumulator.md, regenerated and kept as
# records: Tables 1-2's stand-in (experiment=acc_offline: multi-tier and conventional, Dirichlet
# 0.1 and 1000, seed 0; 24 runs), its alpha-1000 multi-tier column over seeds 1-2 (12 runs),
# Table 6's communication layout of that column, Table 4's personalization stand-in (one FL run,
# then four parts at two learning rates), and the token-replace measurements (seven variants of
# 40 rounds, scripts/token_replace.py). Each ends as a record (benchmarks/records/): acc-offline,
# acc-offline-seeds, acc-offline-communication, acc-personalized-lr, token-replace; the docs'
# tables are re-rendered from them.
# Offline, on the small ViT fedadapt-pretrain makes (about 5 min, once per cache). On 2 CPU cores,
# in process, in one torch thread: about 4 min per point of acc_offline, 15 min for the seeds.
# A sweep that finished is not run again: rerun the script to go on after a stop.
#   bash scripts/acc_offline_evidence.sh [OUT] [OVERRIDE ...]
#   (default OUT: outputs/acc_offline_evidence; OVERRIDEs go to every run, e.g.
#   federation.backend=inprocess)
set -euo pipefail
out=${1:-outputs/acc_offline_evidence}
extra=("${@:2}")
here=$(dirname "$0")
export HF_HUB_OFFLINE=1
. "$here/evidence_sweep.sh"  # ensure_small_vit, sweep
common=(experiment=acc_offline)
ensure_small_vit

sweep acc_offline setting=multitier,conventional partition.alpha=0.1,1000
sweep acc_offline_seeds setting=multitier partition.alpha=1000 seed=1,2
common=(experiment=acc_offline_personalization partition.alpha=1000)
if [ ! -f "$out/pers_fl/.done" ]; then
  fedadapt "${common[@]}" setting=multitier "${extra[@]}" output_dir="$out/pers_fl"
  touch "$out/pers_fl/.done"
fi
fl=$(dirname "$(find "$out/pers_fl/" -name summary.json | head -n 1)")
parts=(setting.personalize=trainable,adapters,accumulator,client_token "setting.init_from='$fl'")
sweep pers_lr_fl "${parts[@]}"
sweep pers_lr_0.001 "${parts[@]}" setting.lr=0.001
if [ ! -f "$out/token_replace.json" ]; then
  paper="train.lr=0.005 train.momentum=0" fast="train.lr=0.01 train.momentum=0.9"
  python "$here/token_replace.py" --rounds 40 --out "$out/token_replace" \
    --variant "random init, SGD 5e-3 (paper)=method.zero_init=false $paper" \
    --variant "zero init, SGD 5e-3 (paper)=method.zero_init=true $paper" \
    --variant "no token replace, SGD 5e-3 (paper)=method.token_replace=false $paper" \
    --variant "random init, SGD 1e-2 m 0.9=method.zero_init=false $fast" \
    --variant "zero init, SGD 1e-2 m 0.9=method.zero_init=true $fast" \
    --variant "no token replace, SGD 1e-2 m 0.9=method.token_replace=false method.zero_init=false $fast" \
    --variant "zero init, SGD 1e-2 m 0.9, gradient norm clipped at 1=method.zero_init=true train.clip_grad_norm=1.0 $fast"
fi

# the docs' tables, kept as records
command="bash scripts/acc_offline_evidence.sh OUT ${extra[*]}"
methods=("lw_finetune:fine-tuning (\`lw_finetune\`)" "lw_linear:L.W. linear (\`lw_linear\`)"
         "lw_mlp:L.W. MLP (\`lw_mlp\`)" "accumulator:Accumulator (\`accumulator\`)"
         "accumulator_pa:Accumulator + PA (\`accumulator_pa\`)"
         "acc_no_replace:Accumulator + PA, no token replace (\`acc_no_replace\`)")
python "$here/report_record.py" acc-offline "$out/acc_offline" --layout paper --bold \
  --command "$command   # its acc_offline sweep" --rows "${methods[@]}" --columns \
  "partition.alpha=0.1, setting.name=multitier:multi-tier, alpha 0.1" \
  "partition.alpha=1000.0, setting.name=multitier:multi-tier, alpha 1000" \
  "partition.alpha=0.1, setting.name=conventional:conventional, alpha 0.1" \
  "partition.alpha=1000.0, setting.name=conventional:conventional, alpha 1000"
seed0=$(find "$out/acc_offline/" -maxdepth 1 -name "*partition.alpha=1000,setting=multitier*")
short=()
for m in lw_finetune lw_linear lw_mlp accumulator accumulator_pa acc_no_replace; do
  short+=("$m:\`$m\`")
done
python "$here/report_record.py" acc-offline-seeds "$seed0" "$out/acc_offline_seeds" \
  --layout paper --bold --command "$command   # the alpha-1000 multi-tier point and its seeds 1-2" \
  --rows "${short[@]}" --columns "all:multi-tier, alpha 1000, seeds 0-2"
python "$here/report_record.py" acc-offline-communication "$seed0" --layout communication \
  --command "$command   # the alpha-1000 multi-tier point, fedadapt-report --layout communication" \
  --rows accumulator:\`accumulator\` accumulator_pa:\`accumulator_pa\` \
  acc_no_replace:\`acc_no_replace\` lw_finetune:\`lw_finetune\` lw_mlp:\`lw_mlp\` \
  lw_linear:\`lw_linear\`
python "$here/report_record.py" acc-personalized-lr "$out/pers_lr_fl" "$out/pers_lr_0.001" \
  --layout personalization --bold --first "personalized part" \
  --command "$command   # its personalization runs" --rows \
  "accumulator_pa [trainable]:everything trained in FL (Accumulator, head, adapters)" \
  "accumulator_pa [adapters]:parallel adapters only" \
  "accumulator_pa [accumulator]:Accumulator and head" \
  "accumulator_pa [client_token]:client token only (64 parameters)" \
  --columns "setting.lr=None:lr 5e-3 (the FL's)" "setting.lr=0.001:lr 0.001"
python "$here/token_replace.py" --merge "$out/token_replace.json" --out docs/token_replace \
  --record token-replace --command "$command   # its scripts/token_replace.py variants"
