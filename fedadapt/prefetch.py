"""``fedadapt-prefetch dataset=... backbone=...``: fill the Hugging Face cache on a connected
machine, so later runs work with ``HF_HUB_OFFLINE=1`` (copy ``~/.cache/huggingface`` over)."""

from __future__ import annotations


def prefetch(run) -> list[str]:
    """Download the data set and backbone weights ``run`` names; return what was fetched.

    Progress is one :func:`fedadapt.progress.task` bar over the steps (data set, weights);
    Hugging Face's own download bars are off, so the display (or a log file) stays clean.
    """
    from fedadapt import progress
    from fedadapt.backbones import build_backbone
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.hub import hub_load

    progress.quiet_libraries()
    done = []
    card = load_card(run.dataset.name)
    with progress.task("prefetch", total=2, unit="steps", interval=0) as bar:
        if run.dataset.path:
            done.append(f"dataset {card.name}: local path {run.dataset.path}, nothing to fetch")
        elif card.hub_id and not card.source.startswith(("sklearn:", "idx:")):
            what = card.hub_id + _hub_detail(card)
            bar.update(info=f"downloading dataset {what}")
            hub_load(card)
            done.append(f"dataset {card.name}: {what}")
        else:
            done.append(f"dataset {card.name}: {card.source} (ships with a package or a recipe)")
        bar.advance(1, info=f"backbone {run.backbone.name}: {run.backbone.weights or 'random'}")
        build_backbone(run.backbone, load_weights=True)  # from_pretrained / open_clip download
        note = (" (image weights, converted to AST when the backbone is built)"
                if run.backbone.family == "ast" and run.backbone.weights else "")
        done.append(f"backbone {run.backbone.name}: "
                    f"{run.backbone.weights or 'random (nothing)'}{note}")
        bar.advance(1, info="done")
    return done


def _hub_detail(card) -> str:
    """`` (config C, revision R)`` of a hub data set that has them."""
    parts = [f"{k} {v}" for k, v in (("config", card.hub_config),
                                     ("revision", card.hub_revision)) if v]
    return f" ({', '.join(parts)})" if parts else ""


def _main(argv: list[str]) -> int:
    from fedadapt.assets import MissingAssetError
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
