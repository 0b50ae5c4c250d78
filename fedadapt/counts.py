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
  convolutions and attention, the CPU kernel's included: fedadapt.measure.count_cpu_attention;
  elementwise ops not counted).

``fedadapt-inspect --partition [--out FILE] dataset=... partition=...`` instead loads the data
set (offline: from the cache or a package), partitions it as a run would, prints the partition's
statistics as JSON (samples and classes per client) and draws ``partition.png`` (classes per
client; ``--out`` names another file). No backbone is built.
"""

from __future__ import annotations

import json
from pathlib import Path


def inspect_run(run, *, flops: bool = True) -> dict:
    """Counts for a :class:`~fedadapt.config.RunConfig` (random weights, no data).

    ``flops=False`` skips the per-exit FLOP count (one forward per exit).
    """
    from fedadapt.adapters import build_model, method_spec
    from fedadapt.adapters.personal import keep_on_client
    from fedadapt.backbones import build_backbone
    from fedadapt.backbones.clip import class_text as clip_class_text
    from fedadapt.data.catalogue import load_card
    from fedadapt.measure import per_exit_counts

    card = load_card(run.dataset.name)
    backbone = build_backbone(run.backbone, load_weights=False)
    backbone_params = backbone.num_params()
    per_exit = (per_exit_counts(backbone) if flops and backbone.has_exits
                else None)
    class_text = None
    if method_spec(run.method).uses_text:
        names = card.class_names or [str(i) for i in range(card.num_classes)]
        class_text = clip_class_text(backbone, names, run.method.prompt)
    model = build_model(run.method, backbone, card.num_classes, with_backbone=True,
                        class_text=class_text)
    # pfl=: sends less
    keep_on_client(model, run.pfl.keeps, run.pfl.norms, card.num_classes, run.pfl.name)
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


def inspect_partition(run, out: str | Path) -> dict:
    """Partition ``run``'s training split as a run would; draw ``out`` (``partition.png``) and
    return the statistics."""
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.loading import prepare_dataset
    from fedadapt.data.partition import partition_dataset
    from fedadapt.results.plots import write_partition_plot

    prepared = prepare_dataset(run.dataset, run.cache_dir, run.seed)
    train = prepared.load()["train"]
    partition = partition_dataset(train, run.partition, load_card(run.dataset.name), run.seed)
    write_partition_plot(run, partition, train["label"], out,
                         class_names=list(prepared.class_names))
    return {"dataset": run.dataset.name, "partition": run.partition.kind, "seed": run.seed,
            "figure": str(Path(out).resolve()), **partition.stats}


def _options(argv: list[str]) -> tuple[list[str], bool, str]:
    """``(Hydra overrides, --partition given, --out FILE)``."""
    from fedadapt.config import ConfigError

    rest, partition, out = [], False, "partition.png"
    args = iter(argv)
    for a in args:
        if a == "--partition":
            partition = True
        elif a == "--out" or a.startswith("--out="):
            out = a.split("=", 1)[1] if "=" in a else next(args, "")
            if not out:
                raise ConfigError("--out needs a file name (e.g. --out partition.png)")
        else:
            rest.append(a)
    return rest, partition, out


def _main(argv: list[str]) -> int:
    from fedadapt.entry import compose_config, to_run_config

    overrides, partition, out = _options(argv)
    run = to_run_config(compose_config(overrides))
    result = inspect_partition(run, out) if partition else inspect_run(run)
    print(json.dumps(result, indent=2))
    return 0


def main() -> None:
    from fedadapt.entry import run_cli

    run_cli(_main)
