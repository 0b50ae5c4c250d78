# Shared by the evidence scripts (sourced, not run): the offline small ViT's pretrained weights,
# and `sweep NAME OVERRIDE...`, one `fedadapt -m` into "$out/NAME" with the script's "${common[@]}"
# and "${extra[@]}". A sweep that finished (its .done) is not run again: rerun the script to go on
# after a stop.

# Pretrain the small ViT on Fashion-MNIST once (the offline presets' frozen backbone).
ensure_small_vit() {
  local weights=${FEDADAPT_CACHE:-$HOME/.cache/fedadapt}/pretrained/small_vit-fashion_mnist-s0
  [ -d "$weights" ] || fedadapt-pretrain --epochs 3 dataset=fashion_mnist backbone=small_vit
}

sweep() {
  local name=$1; shift
  [ -f "$out/$name/.done" ] && return
  fedadapt -m "${common[@]}" "$@" "${extra[@]}" hydra.sweep.dir="$out/$name"
  touch "$out/$name/.done"
}
