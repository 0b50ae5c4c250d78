#!/usr/bin/env bash
# The evidence of docs/peft.md, "Differential privacy with ranks": client-side DP
# (dp=client_fixed, clipping norm 1.0) on LoRA of ranks 2/4/8, where the maths allows it
# (strategy=fedsa_lora, and hetlora without its sparsity weights), beside homogeneous rank-8
# LoRA under FedAvg with the same DP. The preset of scripts/lora_ranks_evidence.sh: the offline
# pretrained small ViT (experiment=acc_offline, setting=conventional), 10 clients on digits,
# 3 per round, 40 rounds, LoRA at lr 0.2, Dirichlet 0.1, every client testing on its own 20%;
# uniform client weights (DP's noise is calibrated to them), seeds 0-2; noise multipliers 0
# (clipping alone, no privacy), 0.3 and 1.0; epsilon at delta 1e-5 from Flower's accountant.
# Then fedadapt-report OUT, and the docs' table as the record lora-dp (scripts/evidence_table.py).
#   bash scripts/lora_dp_evidence.sh [OUT] [OVERRIDE ...]
#   (default OUT: outputs/lora_dp; OVERRIDEs go to every run, e.g. federation.backend=inprocess)
set -euo pipefail
out=${1:-outputs/lora_dp}
extra=("${@:2}")
export HF_HUB_OFFLINE=1
. "$(dirname "$0")/evidence_sweep.sh"  # ensure_small_vit, sweep
ensure_small_vit
common=(experiment=acc_offline setting=conventional compare=[] method=lora train.lr=0.2
        partition.fraction_evaluate=1.0 partition.test_fraction=0.2 partition.alpha=0.1
        method.weighting=uniform seed=0,1,2)
ranks=(method.ranks=[2,4,8])
plain=(strategy=hetlora strategy.sparsity_weighted=false)
dp=(dp=client_fixed dp.clipping_norm=1.0)
sweep hetlora_plain_nodp "${ranks[@]}" "${plain[@]}"
sweep hetlora_plain_clip "${ranks[@]}" "${plain[@]}" "${dp[@]}" dp.noise_multiplier=0 \
  dp.accounting=false
sweep hetlora_plain_dp "${ranks[@]}" "${plain[@]}" "${dp[@]}" dp.noise_multiplier=0.3,1.0
sweep fedsa_lora_dp "${ranks[@]}" strategy=fedsa_lora "${dp[@]}" dp.noise_multiplier=0.3,1.0
sweep rank8_fedavg_dp strategy=fedavg method.rank=8 "${dp[@]}" dp.noise_multiplier=0.3,1.0
fedadapt-report "$out"
# the docs' table (docs/peft.md), kept as the record benchmarks/records/lora-dp.json
python "$(dirname "$0")/evidence_table.py" "$out" --columns noise epsilon global clients \
  --record lora-dp --command "bash scripts/lora_dp_evidence.sh OUT federation.backend=inprocess" \
  --rows "hetlora_plain_nodp:\`hetlora\`, no sparsity weights, no DP" \
  "hetlora_plain_clip:the same, clipping only (no privacy)" \
  "hetlora_plain_dp?dp.noise_multiplier=0.3:the same, DP" \
  "hetlora_plain_dp?dp.noise_multiplier=1.0:the same, DP" \
  "fedsa_lora_dp?dp.noise_multiplier=0.3:\`fedsa_lora\`, DP (clients keep their own \`B\`)" \
  "fedsa_lora_dp?dp.noise_multiplier=1.0:\`fedsa_lora\`, DP" \
  "rank8_fedavg_dp?dp.noise_multiplier=0.3:rank 8 on every client, \`fedavg\`, DP" \
  "rank8_fedavg_dp?dp.noise_multiplier=1.0:rank 8 on every client, \`fedavg\`, DP"
