"""``fedadapt-inspect method=... backbone=... dataset=...``: parameter and FLOP counts as JSON.

Built from the architecture alone: random weights, no download, no data (the number of classes
comes from the dataset card). Counts are exact integers from the built modules.

* ``backbone_params``: the frozen backbone as the method receives it (adapters excluded).
* ``trainable_params``: parameters with ``requires_grad`` (for ``finetune``: backbone + head).
* ``communicated_params``: scalars each client sends per round (= receives); personal tensors
  and local-only models send nothing.
* ``per_exit`` (backbones with exits): for each exit l, the backbone's cumulative parameters
  (embeddings + blocks 0..l) and the FLOPs of running them on one image at ``image_size``,
  counted by ``torch.utils.flop_counter`` (2 FLOPs per multiply-accumulate; matmuls,
  convolutions and attention; elementwise ops not counted).
"""

from __future__ import annotations

import json


def inspect_run(run, *, flops: bool = True) -> dict:
    """Counts for a :class:`~fedadapt.config.RunConfig` (random weights, no data).

    ``flops=False`` skips the per-exit FLOP count (one forward per exit).
    """
    from fedadapt.adapters import build_model, method_spec
    from fedadapt.backbones import build_backbone
    from fedadapt.backbones.clip import class_text as clip_class_text
    from fedadapt.data.catalogue import load_card
    from fedadapt.measure import per_exit_counts

    card = load_card(run.dataset.name)
    backbone = build_backbone(run.backbone, load_weights=False)
    backbone_params = backbone.num_params()
    per_exit = (per_exit_counts(backbone) if flops and hasattr(backbone, "forward_exits")
                else None)
    class_text = None
    if method_spec(run.method).uses_text:
        names = card.class_names or [str(i) for i in range(card.num_classes)]
        class_text = clip_class_text(backbone, names, run.method.prompt)
    model = build_model(run.method, backbone, card.num_classes, with_backbone=True,
                        class_text=class_text)
    result = {
        "method": run.method.name,
        "backbone": run.backbone.name,
        "dataset": run.dataset.name,
        "num_classes": card.num_classes,
        "embed_dim": backbone.embed_dim,
        "backbone_params": backbone_params,
        "trainable_params": model.count(model.trainable_names()),
        "communicated_params": model.count(model.communicated_names()),
        "personal_params": model.count(model.personal_names()),
    }
    if per_exit is not None:
        result["per_exit"] = per_exit
    extra = method_spec(run.method).counts
    if extra is not None:
        result[run.method.name] = extra(run.method, backbone.embed_dim, card.num_classes)
    return result


def _main(argv: list[str]) -> int:
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config(argv))
    print(json.dumps(inspect_run(run), indent=2))
    return 0


def main() -> None:
    from fedadapt.entry import run_cli

    run_cli(_main)
