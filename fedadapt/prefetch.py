"""``fedadapt-prefetch dataset=... backbone=...``: fill the Hugging Face cache on a connected
machine, so later runs work with ``HF_HUB_OFFLINE=1`` (copy ``~/.cache/huggingface`` over)."""

from __future__ import annotations


def prefetch(run) -> list[str]:
    """Download the data set and backbone weights ``run`` names; return what was fetched."""
    from fedadapt.backbones import build_backbone
    from fedadapt.data.catalogue import load_card

    done = []
    card = load_card(run.dataset.name)
    if run.dataset.path:
        done.append(f"dataset {card.name}: local path {run.dataset.path}, nothing to fetch")
    elif card.hub_id and not card.source.startswith(("sklearn:", "idx:")):
        from datasets import load_dataset

        load_dataset(card.hub_id)
        done.append(f"dataset {card.name}: {card.hub_id}")
    else:
        done.append(f"dataset {card.name}: {card.source} (ships with a package or a recipe)")
    build_backbone(run.backbone, load_weights=True)  # from_pretrained / open_clip download
    done.append(f"backbone {run.backbone.name}: {run.backbone.weights or 'random (nothing)'}")
    return done


def _main(argv: list[str]) -> int:
    from fedadapt.cli import to_run_config
    from fedadapt.entry import compose_config

    for line in prefetch(to_run_config(compose_config(argv))):
        print("fetched", line)
    return 0


def main() -> None:
    from fedadapt.entry import run_cli

    run_cli(_main)
