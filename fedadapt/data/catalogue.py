"""Dataset cards: ``datasets/<name>.yaml`` read into :class:`DatasetCard`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import yaml

from fedadapt.config import ConfigError
from fedadapt.paths import catalogue, catalogue_file


@dataclass(frozen=True)
class DatasetCard:
    name: str
    source: str
    hub_id: Optional[str]
    columns: dict
    splits: dict
    num_classes: int
    client_key: Optional[str] = None
    domains: Optional[list] = None
    default_holdout: Optional[str] = None
    class_names: Optional[list] = None
    #: ``[H, W]`` when every image has this size (decoded at native resolution, see
    #: :mod:`fedadapt.data.store`); None for data of mixed sizes.
    image_size: Optional[list] = None
    #: With ``image_size``: 1 (grey) or 3 (RGB) channels stored.
    channels: Optional[int] = None
    #: The source's test split holds clients of its own (unseen test users, e.g. FedScale's
    #: iNaturalist test users), not a global test set: its rows join the prepared training
    #: split marked ``test_client`` = 1, and ``partition=natural`` makes each of those users an
    #: unseen client holding test data only.
    test_split_clients: bool = False
    #: ``image`` or ``audio`` (clips turned into spectrograms by an audio backbone's feature
    #: extractor, :mod:`fedadapt.data.audio`).
    modality: str = "image"
    #: Audio: the clips' sampling rate in Hz.
    sampling_rate: Optional[int] = None
    #: The hub data set's configuration (``load_dataset(hub_id, hub_config)``) and revision
    #: (a branch, tag, commit or ``refs/pr/<n>``); None = the default / ``main``.
    hub_config: Optional[str] = None
    hub_revision: Optional[str] = None
    #: Source splits carried into the prepared data set unchanged, besides ``train`` and
    #: ``test`` (e.g. Speech Commands' ``noise``: the background recordings).
    keep_splits: list = field(default_factory=list)
    #: The data set's clients only personalize a model federated on another data set (Speech
    #: Commands' validation speakers): runs need ``setting=personalization`` with
    #: ``setting.init_from``.
    personalize_only: bool = False
    license: str = ""
    size: str = ""
    papers: list = field(default_factory=list)


def available() -> list[str]:
    return sorted(p.name[:-5] for p in catalogue().iterdir() if p.name.endswith(".yaml"))


def load_card(name: str) -> DatasetCard:
    path = catalogue_file(f"{name}.yaml")
    if not path.is_file():
        raise ConfigError(f"dataset={name!r} is invalid: no card datasets/{name}.yaml "
                          f"(available: {', '.join(available())})")
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    known = set(DatasetCard.__dataclass_fields__)
    return DatasetCard(**{k: v for k, v in raw.items() if k in known})
