#!/usr/bin/env bash
# The evidence of docs/fleet.md: the offline small-ViT preset (experiment=acc_offline,
# 10 clients on digits, Dirichlet 0.1, 40 rounds) on a three-tier fleet (1, 3 and 10 GFLOP/s:
# fleet=tiers) with a deadline of 8 simulated seconds per round, which the slowest tier's clients
# with the most data miss with the full model (a client of this preset trains 1.5-24 GFLOP per
# round with full fine-tuning, 1-17 with LoRA, measured by prepare_run's flop count); seeds 0-2:
#   full fine-tuning (lw_finetune), multi-tier Accumulator + PA with tiers from the fleet, anytime
#   Accumulator + PA with exits capped by the fleet, LoRA r = 8 (FedAvg), and FedBuff over the
#   same LoRA (no deadline: buffer 3 of 6 in flight).
# Then fedadapt-report with the simulated hours to 80% and accuracy_vs_time.png, and the docs'
# table as the record fleet-tiers (scripts/evidence_table.py).
#   bash scripts/fleet_evidence.sh [OUT] [OVERRIDE ...]     (default OUT: outputs/fleet_evidence;
#   OVERRIDEs go to every run, e.g. federation.backend=inprocess: the same numbers without Ray)
set -euo pipefail
out=${1:-outputs/fleet_evidence}
extra=("${@:2}")
export HF_HUB_OFFLINE=1
. "$(dirname "$0")/evidence_sweep.sh"  # ensure_small_vit, sweep
ensure_small_vit
common=(experiment=acc_offline compare=[] fleet=tiers partition.alpha=0.1 seed=0,1,2)
# the deadline drops the clients that would arrive late; a round goes on with whoever arrived
# (one of the three is enough: min_reply_fraction 0.3, against the default's two of three)
deadline=(federation.round_timeout=8 federation.min_reply_fraction=0.3)
sweep finetune setting=conventional method=lw_finetune train.lr=0.02 "${deadline[@]}"
sweep multitier setting=multitier setting.tiers_from=fleet method=accumulator_pa \
  train.lr=0.05 "${deadline[@]}"
sweep anytime setting=anytime setting.tiers_from=fleet method=accumulator_pa train.lr=0.05 \
  "${deadline[@]}"
sweep lora setting=conventional method=lora train.lr=0.2 "${deadline[@]}"
sweep fedbuff setting=conventional method=lora train.lr=0.2 strategy=fedbuff \
  strategy.buffer_size=3 strategy.concurrency=6
fedadapt-report "$out"/*/ --out "$out" --target 80
# the docs' table (docs/fleet.md), kept as the record benchmarks/records/fleet-tiers.json
python "$(dirname "$0")/evidence_table.py" "$out" --target 0.8 \
  --columns global sim-minutes dropped to-target --record fleet-tiers \
  --command "bash scripts/fleet_evidence.sh OUT federation.backend=inprocess" --rows \
  "finetune:full fine-tuning (\`lw_finetune\`, lr 0.02)" \
  "multitier:multi-tier Accumulator + PA, tiers from the fleet (lr 0.05)" \
  "anytime:anytime Accumulator + PA, exits capped by the fleet (lr 0.05)" \
  "lora:LoRA r = 8, FedAvg (lr 0.2)" \
  "fedbuff:LoRA r = 8, FedBuff (buffer 3, 6 in flight; 40 updates, no deadline)"
