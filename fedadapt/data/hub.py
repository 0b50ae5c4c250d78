"""A catalogue card's Hugging Face hub data set, with one line that says how to fetch it when it
cannot be had (offline and not cached)."""

from __future__ import annotations

from fedadapt.assets import MissingAssetError, prefetch_hint
from fedadapt.config import ConfigError
from fedadapt.data.catalogue import DatasetCard


def hub_load(card: DatasetCard):
    """``load_dataset`` of the card's hub id (with its ``hub_config`` and ``hub_revision``)."""
    from datasets import load_dataset

    return load_dataset(card.hub_id, card.hub_config, revision=card.hub_revision)


def load_hub(card: DatasetCard):
    """The card's hub data set (from the Hugging Face cache offline); when it cannot be had,
    one line saying what and naming the ``fedadapt-prefetch`` command."""
    try:
        return hub_load(card)
    except Exception as err:  # offline / not cached: say what and how to get it
        if isinstance(err, ConfigError):
            raise
        what = card.hub_id + "".join(f", {k} {v}" for k, v in (
            ("config", card.hub_config), ("revision", card.hub_revision)) if v)
        raise MissingAssetError(
            prefetch_hint(f"Data set {what!r} (dataset={card.name})", dataset=card.name)
            + (f" Offline alternative: {card.source[4:]} via `apt-get install "
               f"dataset-fashion-mnist`." if card.source.startswith("idx:") else "")
        ) from err
