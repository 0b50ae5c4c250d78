"""Weights and data that are not on this machine: the error that says so and the line that
names the ``fedadapt-prefetch`` command to fetch them."""

from __future__ import annotations

from fedadapt.config import FedadaptError


class MissingAssetError(FedadaptError, RuntimeError):
    """Weights or data are not available offline; the message names the fetch command."""


def prefetch_hint(what: str, *, backbone: str | None = None, dataset: str | None = None) -> str:
    args = " ".join(
        f"{k}={v}" for k, v in (("dataset", dataset), ("backbone", backbone)) if v is not None
    )
    return (
        f"{what} is not available on this machine (offline: HF_HUB_OFFLINE=1 or no network). "
        f"On a connected machine run `fedadapt-prefetch {args}` to put it into the Hugging Face "
        f"cache, then copy ~/.cache/huggingface here (or set backbone.weights / dataset.path to "
        f"a local copy)."
    )
