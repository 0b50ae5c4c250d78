#!/usr/bin/env bash
# The evidence table of docs/peft.md, "LoRA of different ranks across clients": the offline
# pretrained small ViT of experiment=acc_offline (conventional setting), 10 clients on digits, LoRA
# at lr 0.2 (LoRA r = 8's best on this preset, docs/peft.md), every client also evaluated on its
# own 20% (partition.fraction_evaluate=1.0 partition.test_fraction=0.2: FedSA-LoRA's global model
# has no B, so it is compared on the clients), Dirichlet 0.1 and 1000, seeds 0-2:
#   ranks 2/4/8 in equal shares under each aggregator (hetlora, flexlora, flora, fedex_lora,
#   fedsa_lora), against homogeneous rank-8 LoRA and every client at rank 2 (FedAvg). Every
#   client of the ranks runs has the scale alpha / max(ranks) = 16 / 8 = 2 (docs/peft.md); the
#   rank-2 baseline is run at that scale (alpha 4) and at peft's alpha 16 (scale 8).
# With `efficientnet` as the second argument, the same rows on the main job's shape instead
# (experiment=quickstart: frozen EfficientNet-Lite0 with its ImageNet weights, 64 px, 10 clients on
# digits, 3 per round, 12 rounds, the preset's SGD lr 0.002 with momentum 0.9; LoRA on the
# pointwise convolutions).
# Seed 0 of every row first, then seeds 1-2. Then the table (scripts/lora_ranks_table.py), kept
# as the record lora-ranks-small-vit or lora-ranks-efficientnet.
#   bash scripts/lora_ranks_evidence.sh [OUT] [small_vit|efficientnet] [OVERRIDE ...]
#   (default OUT: outputs/lora_ranks, or outputs/lora_ranks_efficientnet; OVERRIDEs go to every
#   run, e.g. federation.backend=inprocess: the same numbers without Ray)
set -euo pipefail
backbone=${2:-small_vit}
extra=("${@:3}")
export HF_HUB_OFFLINE=1
. "$(dirname "$0")/evidence_sweep.sh"  # ensure_small_vit, sweep
evaluate=(partition.fraction_evaluate=1.0 partition.test_fraction=0.2 partition.alpha=0.1,1000)
case $backbone in
  small_vit)
    out=${1:-outputs/lora_ranks}
    ensure_small_vit
    common=(experiment=acc_offline setting=conventional compare=[] method=lora train.lr=0.2
            "${evaluate[@]}") ;;
  efficientnet)
    out=${1:-outputs/lora_ranks_efficientnet}
    common=(experiment=quickstart compare=[] method=lora "${evaluate[@]}") ;;
  *) echo "scripts/lora_ranks_evidence.sh: the second argument is small_vit or efficientnet," \
       "not '$backbone'" >&2; exit 2 ;;
esac
for seeds in 0 1,2; do
  s=${seeds/,/}
  sweep "homogeneous_s$s" strategy=fedavg method.rank=8,2 seed=$seeds
  sweep "rank2_scale2_s$s" strategy=fedavg method.rank=2 method.alpha=4 seed=$seeds
  sweep "ranks_s$s" method.ranks=[2,4,8] strategy=hetlora,flexlora,flora,fedex_lora,fedsa_lora \
    seed=$seeds
done
# the docs' table (docs/peft.md), kept as the record lora-ranks-<backbone>
python "$(dirname "$0")/lora_ranks_table.py" "$out" --record "lora-ranks-${backbone//_/-}" \
  --command "bash scripts/lora_ranks_evidence.sh OUT $backbone federation.backend=inprocess"
