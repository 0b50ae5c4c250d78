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
    from fedadapt.backbones.base import MissingAssetError
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config(argv))
    try:
        lines = prefetch(run)
    except MissingAssetError:
        raise
    except Exception as err:  # a download failed: say so plainly, without a deep traceback
        raise MissingAssetError(
            f"could not download what dataset={run.dataset.name} backbone={run.backbone.name} "
            f"need ({type(err).__name__}: {err}). fedadapt-prefetch needs a network connection "
            f"to the Hugging Face hub; HF_HUB_OFFLINE must not be set.") from err
    for line in lines:
        print("fetched", line)
    return 0


def main() -> None:
    from fedadapt.entry import run_cli

    run_cli(_main)
