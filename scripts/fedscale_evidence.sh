#!/usr/bin/env bash
# The FedScale-fleet evidence of docs/fleet.md: the offline small-ViT preset (experiment=acc_offline,
# 10 clients on digits, Dirichlet 0.1, 3 a round, 40 rounds) on fleet=fedscale with a GENERATED
# pair of traces in FedScale's format (scripts/fedscale_traces.py: FedScale's own files are not
# at hand; the distributions are that script's, said in its docstring), a deadline of
# 20 simulated seconds a round (DEADLINE=S changes it) (a round goes on with whoever arrived), and a memory cap
# per device (the slowest third 6 MB, then 10 MB, then 1 GB: the Accumulator + PA needs 5.8 MB
# at its shallowest tier, 9.3 at the middle one, 14.6 at the last exit); seeds 0-2:
#   FedAvg over LoRA r = 8 with the late clients dropped, the same with their work cut short
#   (fleet.partial_work), LoRA of ranks 2/4/8 by device (HetLoRA), the multi-tier Accumulator +
#   PA with tiers from memory and compute, the anytime Accumulator + PA with exits capped by the
#   device, and FedBuff over LoRA r = 8 (no deadline: a buffer of 3 of 6 in flight).
# The small ViT is the one fedadapt-pretrain makes from scratch (its hash is in every run's
# summary.json, backbone_weights). Then fedadapt-report (simulated hours to 60%) and the docs'
# table, paired by seed (scripts/evidence_table.py).
#   bash scripts/fedscale_evidence.sh [OUT] [OVERRIDE ...]   (default OUT: outputs/fedscale_evidence)
set -euo pipefail
out=${1:-outputs/fedscale_evidence}
extra=("${@:2}")
export HF_HUB_OFFLINE=1
. "$(dirname "$0")/evidence_sweep.sh"  # ensure_small_vit, sweep
ensure_small_vit
mkdir -p "$out"
python "$(dirname "$0")/fedscale_traces.py" "$out/traces" --devices 500 --seed 0
deadline=${DEADLINE:-20}
fleet=(fleet=fedscale "fleet.capacity=$out/traces/client_device_capacity"
       "fleet.behaviour=$out/traces/client_behave_trace")
common=(experiment=acc_offline compare=[] "${fleet[@]}" partition.alpha=0.1 seed=0,1,2)
sync=(federation.round_timeout="$deadline" federation.min_reply_fraction=0.3)
memory=("fleet.memory=[6e6,10e6,1e9]")
sweep fedavg_drops setting=conventional method=lora train.lr=0.2 "${sync[@]}"
sweep fedavg_partial setting=conventional method=lora train.lr=0.2 "${sync[@]}" \
  fleet.partial_work=true
sweep lora_ranks setting=conventional method=lora "method.ranks=[2,4,8]" strategy=hetlora \
  train.lr=0.2 "${sync[@]}"
sweep multitier setting=multitier setting.tiers_from=fleet method=accumulator_pa train.lr=0.05 \
  "${sync[@]}" "${memory[@]}"
sweep anytime setting=anytime setting.tiers_from=fleet method=accumulator_pa train.lr=0.05 \
  "${sync[@]}" "${memory[@]}"
sweep fedbuff setting=conventional method=lora train.lr=0.2 strategy=fedbuff \
  strategy.buffer_size=3 strategy.concurrency=6
fedadapt-report "$out"/*/ --out "$out" --target 60
# the docs' table (docs/fleet.md), kept as the record benchmarks/records/fleet-fedscale.json
python "$(dirname "$0")/evidence_table.py" "$out" --target 0.6 \
  --columns global sim-minutes dropped to-target --record fleet-fedscale \
  --command "bash scripts/fedscale_evidence.sh" --rows \
  "fedavg_drops:LoRA r = 8, FedAvg, late clients dropped (lr 0.2)" \
  "fedavg_partial:LoRA r = 8, FedAvg, work cut at the deadline (fleet.partial_work)" \
  "lora_ranks:LoRA ranks 2/4/8 by device, HetLoRA (lr 0.2)" \
  "multitier:multi-tier Accumulator + PA, tiers from memory and compute (lr 0.05)" \
  "anytime:anytime Accumulator + PA, exits capped by the device (lr 0.05)" \
  "fedbuff:LoRA r = 8, FedBuff (buffer 3, 6 in flight; 40 updates, no deadline)"
