"""Load a data set from its card (hub id) or a local path, in fedadapt's standard form.

Every loader returns a ``DatasetDict`` with a ``train`` and a ``test`` split and columns
``image`` (``datasets.Image``), ``label`` (``ClassLabel``) and, where the card has them, ``client``
(natural id such as FEMNIST's writer), ``domain`` and extras such as ``coarse_label``. The result
is saved once under ``<cache_dir>/data/`` and memory-mapped by every process that needs it.

Local copies (``dataset.path``): a ``save_to_disk`` folder, IDX files, ``<root>/<domain>/<class>/``
image folders (for cards with domains) or an image folder. ``derived:`` cards are drawn from
Fashion-MNIST or scikit-learn's digits by :mod:`fedadapt.data.domains`.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from fedadapt.assets import MissingAssetError
from fedadapt.config import ConfigError, DatasetConfig, FedadaptError
from fedadapt.data.catalogue import DatasetCard, load_card
from fedadapt.data.hub import load_hub
from fedadapt.data.integrity import CacheIntegrityError

# Bump when the preparation below changes, so stale prepared copies are not reused.
_PREP_VERSION = 2
#: The column (while preparing) and the files (``<SOURCE_ROWS>-<split>.npy`` in the copy) of
#: each row's row in the source.
SOURCE_ROWS = "__source_row__"


@dataclass(frozen=True)
class PreparedDataset:
    """A standardised data set on disk. Picklable; cheap to send to Ray workers."""

    name: str
    path: str  # save_to_disk folder of a DatasetDict(train, test)
    fingerprint: str
    num_classes: int
    class_names: tuple[str, ...]
    num_train: int
    num_test: int
    columns: tuple[str, ...]
    #: The key of the copy's source (card and path, not the seed: :func:`source_key`); None for
    #: a copy that records no source rows.
    source_key: Optional[str] = None
    #: ``((split, source split), ...)``: which split of the source each split's rows come from.
    source_splits: tuple[tuple[str, str], ...] = ()

    def load(self):
        """The ``DatasetDict``, memory-mapped from disk (cached per process)."""
        return open_prepared(self.path)

    def source_rows(self, split: str) -> Optional[tuple[str, np.ndarray]]:
        """``(source split, rows)``: the row of the source each row of ``split`` came from
        (:mod:`fedadapt.data.rows` shares decoded images and features by them); None when not
        recorded."""
        base = dict(self.source_splits).get(split)
        path = Path(self.path) / f"{SOURCE_ROWS}-{split}.npy"
        if self.source_key is None or base is None or not path.is_file():
            return None
        return base, np.load(path)


_OPEN: dict[str, object] = {}


def column(ds, name: str, dtype=None) -> np.ndarray:
    """``np.asarray(ds[name], dtype)``, read through Arrow in one go: datasets 4 returns a lazy
    ``Column`` that numpy reads row by row (60,000 labels: half a second)."""
    return np.asarray(ds.with_format("arrow")[name].to_pylist(), dtype=dtype)


def open_prepared(path: str):
    """The prepared ``DatasetDict`` at ``path``. :func:`prepare_dataset` checked every file's
    digest before the run; other processes (Ray workers, decoding workers) check that the
    files are all there at their recorded sizes, once."""
    if path not in _OPEN:
        from datasets import load_from_disk
        from fedadapt.data.integrity import check_folder

        check_folder(path, "prepared data set", digests=False)
        _OPEN[path] = load_from_disk(path)
    return _OPEN[path]


# -- sources ----------------------------------------------------------------------------------
def _image_label_features(num_classes: int, names: Optional[list]):
    from datasets import ClassLabel, Features, Image

    label = ClassLabel(names=list(names)) if names else ClassLabel(num_classes=num_classes)
    return Features({"image": Image(), "label": label})


def load_sklearn_digits(card: DatasetCard):
    """scikit-learn's bundled digits as 8x8 grayscale images (values 0..16 scaled to 0..255)."""
    from sklearn.datasets import load_digits

    from datasets import Dataset, DatasetDict

    bunch = load_digits()
    images = (bunch.images * (255.0 / 16.0)).round().astype(np.uint8)  # [N, 8, 8]
    ds = Dataset.from_dict(
        {"image": list(images), "label": bunch.target.astype(int).tolist()},
        features=_image_label_features(card.num_classes, [str(i) for i in range(10)]),
    )
    return DatasetDict(train=ds)


def read_idx(path: str) -> np.ndarray:
    """Read one IDX file (optionally gzipped): the MNIST family's format."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        data = fh.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i: 8 + 4 * i], "big") for i in range(ndim)]
    body = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise ValueError(f"{path} is truncated: {body.size} values for shape {dims}")
    return body.reshape(dims)


def _find_idx(folder: str, prefix: str, kind: str) -> Optional[str]:
    """``<prefix>-images-idx3-ubyte`` or ``<prefix>-labels-idx1-ubyte`` (optionally .gz)."""
    for suffix in ("", ".gz"):
        p = os.path.join(folder, f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"
                         f"{suffix}")
        if os.path.isfile(p):
            return p
    return None


def load_idx_folder(folder: str, card: DatasetCard):
    """``train-images-idx3-ubyte[.gz]`` / ``t10k-...`` pairs in ``folder``."""
    from datasets import Dataset, DatasetDict

    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        img, lab = _find_idx(folder, prefix, "images"), _find_idx(folder, prefix, "labels")
        if img and lab:
            images, labels = read_idx(img), read_idx(lab)
            splits[split] = Dataset.from_dict(
                {"image": list(images), "label": labels.astype(int).tolist()},
                features=_image_label_features(card.num_classes, card.class_names),
            )
    if "train" not in splits:
        raise MissingAssetError(f"No IDX files (train-images-idx3-ubyte[.gz], "
                                f"train-labels-idx1-ubyte[.gz]) in {folder}")
    return DatasetDict(splits)


# -- <root>/<domain>/<class>/<image> folders (PACS, VLCS, Office-Home as DomainBed lays them out)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _subdirs(folder: Path) -> list[Path]:
    return sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))


def _norm_name(name: str) -> str:
    """Case-insensitive, with ``_``, ``-`` and spaces alike: ``Real_World`` ~ ``real world``."""
    return re.sub(r"[\s_\-]+", " ", name).strip().lower()


def is_domain_folder(path: str) -> bool:
    """True when ``path``'s sub-folders are domains whose own sub-folders are class folders."""
    domains = _subdirs(Path(path).expanduser())
    return bool(domains) and all(_subdirs(d) for d in domains)


def load_domain_folders(path: str, card: DatasetCard):
    """``<path>/<domain>/<class>/<image files>`` as ``DatasetDict(train=...)``.

    Columns ``image`` (file paths; ``save_to_disk`` embeds the bytes), ``label`` (``ClassLabel``
    in the card's ``class_names`` order, else the sorted class folder names) and ``domain`` (the
    folder name, spelled as in the card's ``domains`` when it matches one). Each file is opened
    with PIL to check that it is an image.
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

    root = Path(path).expanduser()
    domain_dirs = _subdirs(root)
    if card.class_names:
        names = list(card.class_names)
    else:
        names = sorted({c.name for d in domain_dirs for c in _subdirs(d)})
    index = {_norm_name(n): i for i, n in enumerate(names)}
    domain_spelling = {_norm_name(d): d for d in (card.domains or [])}

    cols: dict = {"image": [], "label": [], "domain": []}
    for ddir in domain_dirs:
        domain = domain_spelling.get(_norm_name(ddir.name), ddir.name)
        for cdir in _subdirs(ddir):
            label = index.get(_norm_name(cdir.name))
            if label is None:
                raise ConfigError(
                    f"dataset.path={path!r}: class folder {cdir.name!r} in {ddir} is not one of "
                    f"dataset={card.name}'s classes ({', '.join(names)})")
            for f in _image_files(cdir, path):
                cols["image"].append(str(f))
                cols["label"].append(label)
                cols["domain"].append(domain)
    if not cols["image"]:
        raise ConfigError(f"dataset.path={path!r}: no image files ({', '.join(IMAGE_SUFFIXES)}) "
                          f"under {root}/<domain>/<class>/")
    features = Features({"image": Image(), "label": ClassLabel(names=names),
                         "domain": Value("string")})
    return DatasetDict(train=Dataset.from_dict(cols, features=features))


def _image_files(folder: Path, path: str) -> list[Path]:
    """The image files below ``folder`` (by suffix), each opened with PIL to check that it is
    one; a broken file is refused naming it."""
    from PIL import Image as PILImage

    files = [f for f in sorted(folder.rglob("*"))
             if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES]
    for f in files:
        try:
            with PILImage.open(f) as im:
                im.verify()
        except (OSError, SyntaxError, ValueError) as err:  # PIL's "broken file"
            raise ConfigError(f"dataset.path={path!r}: {f} is not a readable image "
                              f"({err})") from err
    return files


def _load_image_folder(p: Path, path: str):
    """``<path>/<class>/<image>`` through datasets' ``imagefolder``, checked first: a folder
    with no image files (empty, or other files only) is refused with one line."""
    from datasets import load_dataset

    if not _image_files(p, path):
        others = sum(1 for f in p.rglob("*") if f.is_file())
        raise ConfigError(
            f"dataset.path={path!r} is invalid: no image files ({', '.join(IMAGE_SUFFIXES)}) "
            f"in {p} ({others} other file(s)); it takes a save_to_disk folder, IDX files, "
            f"<class>/<image> folders or <domain>/<class>/<image> folders")
    for folder in _subdirs(p):  # an empty class would silently be a class fewer
        if not any(f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES for f in folder.rglob("*")):
            raise ConfigError(f"dataset.path={path!r}: class folder {folder} has no image files "
                              f"({', '.join(IMAGE_SUFFIXES)}); add its images or remove it")
    try:
        return load_dataset("imagefolder", data_dir=str(p))
    except Exception as err:  # datasets' own errors, deep inside its builder
        raise ConfigError(f"dataset.path={path!r}: datasets' imagefolder cannot read {p} "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from err


def _load_saved(p: Path, path: str):
    """A ``save_to_disk`` folder (a ``DatasetDict`` or one ``Dataset``)."""
    from datasets import DatasetDict, load_from_disk

    try:
        ds = load_from_disk(str(p))
    except Exception as err:  # a garbled or partial save_to_disk folder
        raise ConfigError(f"dataset.path={path!r}: {p} is not a readable save_to_disk folder "
                          f"({type(err).__name__}: {str(err).splitlines()[0][:200]})") from err
    return ds if isinstance(ds, DatasetDict) else DatasetDict(train=ds)


def _load_local(path: str, card: DatasetCard):
    p = Path(path).expanduser()
    if not p.exists():
        recipe = (f" (build it with the recipe in datasets/{card.name}.md)"
                  if card.source == "local" else "")
        raise ConfigError(f"dataset.path={path!r} is invalid: no such file or folder{recipe}")
    if (p / "dataset_dict.json").exists() or (p / "state.json").exists():
        return _load_saved(p, path)
    if any(p.glob("*idx*-ubyte*")):
        return load_idx_folder(str(p), card)
    has_domains = bool(card.domains) or card.client_key == "domain"
    if p.is_dir() and has_domains and is_domain_folder(str(p)):
        return load_domain_folders(str(p), card)
    if p.is_dir():
        return _load_image_folder(p, path)
    raise ConfigError(f"dataset.path={path!r}: not a save_to_disk folder, IDX folder or image "
                      f"folder")


def load_source(card: DatasetCard, path: Optional[str] = None):
    """Raw ``DatasetDict`` from the card's source or a local ``path``."""
    if card.source == "speech_commands":  # its own layout and 12-class mapping
        from fedadapt.data.speech import load_speech_commands

        return load_speech_commands(card, path)
    if path:
        return _load_local(path, card)
    if card.source == "sklearn:digits":
        return load_sklearn_digits(card)
    if card.source.startswith("idx:") and os.path.isdir(card.source[4:]):
        return load_idx_folder(card.source[4:], card)
    if card.source.startswith("derived:"):
        return load_derived_domains(card)
    if card.hub_id:
        with hub_quietly():
            return load_hub(card)
    raise MissingAssetError(
        f"dataset={card.name} has no downloadable source; build it with the recipe in "
        f"datasets/{card.name}.md and pass dataset.path=<folder>"
    )


@contextmanager
def hub_quietly():
    """The hub's data set loaded without its retry lines: offline, huggingface_hub logs two
    lines per try of every request (five tries, 23 s) before :func:`load_hub` says in one line
    what is missing. Where the hub's host does not resolve (no network) the load reads the
    cache alone (Hugging Face's offline mode, as ``HF_HUB_OFFLINE=1``), so it fails at once."""
    import logging
    import socket
    from urllib.parse import urlparse

    import datasets.config
    import huggingface_hub.constants as hub

    hub_logger = logging.getLogger("huggingface_hub")
    saved = (hub_logger.level, hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE)
    hub_logger.setLevel(logging.ERROR)
    if not hub.HF_HUB_OFFLINE:
        try:
            socket.getaddrinfo(urlparse(hub.ENDPOINT).hostname or "huggingface.co", 443)
        except OSError:  # no network: the cache or nothing
            hub.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_logger.setLevel(saved[0])
        hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved[1], saved[2]


# -- derived domain data sets (offline evidence) --------------------------------------------
#: Images per domain of ``fmnist_domains`` (four domains: 6,000 of Fashion-MNIST's training images).
FMNIST_PER_DOMAIN = 1500


def fashion_mnist_train() -> tuple[np.ndarray, np.ndarray]:
    """Fashion-MNIST's 60,000 training images ``[N, 28, 28]`` uint8 and labels.

    From the IDX files of the ``fashion_mnist`` card's ``idx:`` folder (Debian's
    ``dataset-fashion-mnist``), else from a cached hub copy.
    """
    card = load_card("fashion_mnist")
    folder = card.source[4:] if card.source.startswith("idx:") else ""
    img = _find_idx(folder, "train", "images") if folder else None
    lab = _find_idx(folder, "train", "labels") if folder else None
    if img and lab:
        return read_idx(img), read_idx(lab)
    try:
        from datasets import load_dataset

        with hub_quietly():
            train = load_dataset(card.hub_id, split="train")
    except Exception as err:  # offline / not cached
        raise MissingAssetError(
            f"Fashion-MNIST is not available on this machine: no IDX files in {folder or '?'} "
            f"(install them with `apt-get install dataset-fashion-mnist`) and no cached hub copy "
            f"{card.hub_id} (on a connected machine run `python -c \"import datasets; "
            f"datasets.load_dataset('{card.hub_id}')\"` and copy ~/.cache/huggingface here)."
        ) from err
    images = np.stack([np.asarray(im.convert("L"), dtype=np.uint8) for im in train["image"]])
    return images, np.asarray(train["label"])


def load_derived_domains(card: DatasetCard, per_domain: Optional[int] = None):
    """``derived:fashion_mnist_domains`` / ``derived:digits_domains`` as ``DatasetDict(train)``.

    Four disjoint random subsets (seed 0) drawn as the domains of
    :data:`fedadapt.data.domains.DOMAIN_KINDS`; columns ``image``, ``label``, ``domain`` and
    ``source_index`` (row in the source training set).
    """
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
    from fedadapt.data.domains import DOMAIN_KINDS, make_domains

    kind = card.source[len("derived:"):]
    if kind == "fashion_mnist_domains":
        images, labels = fashion_mnist_train()
        per_domain = per_domain or FMNIST_PER_DOMAIN
    elif kind == "digits_domains":
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = (bunch.images * (255.0 / 16.0)).round().astype(np.uint8)
        labels = bunch.target
        per_domain = per_domain or len(images)  # as many as fit: 1,797 // 4 = 449 each
    else:
        raise ConfigError(f"dataset={card.name}: unknown source {card.source!r} (known: "
                          f"derived:fashion_mnist_domains, derived:digits_domains)")
    kinds = tuple(card.domains or DOMAIN_KINDS)
    cols = make_domains(images, labels, per_domain, seed=0, kinds=kinds)
    label = (ClassLabel(names=list(card.class_names)) if card.class_names
             else ClassLabel(num_classes=card.num_classes))
    features = Features({"image": Image(), "label": label, "domain": Value("string"),
                         "source_index": Value("int64")})
    return DatasetDict(train=Dataset.from_dict(cols, features=features))


# -- standardisation --------------------------------------------------------------------------
def standardise(raw, card: DatasetCard, cfg: DatasetConfig, seed: int,
                number_rows: Optional[dict] = None):
    """Rename columns to the standard names, ensure ClassLabel, train/test splits. With
    ``number_rows`` (a dict, filled with ``{split: source split}``), the train and test rows
    carry their row in the source in the column :data:`SOURCE_ROWS`."""
    from datasets import DatasetDict

    out = _standard_splits(raw, card)
    if card.test_split_clients and "test" in out:  # the test split's users: unseen clients
        out = _test_users_into_train(out)
    if number_rows is not None:  # each row's row in the source, before the seeded draws below
        origin = {name: name for name in out}
        out = {name: ds.add_column(SOURCE_ROWS, np.arange(len(ds), dtype=np.int64))
               for name, ds in out.items()}
    out = _with_test_split(out, cfg, seed)
    if cfg.max_samples is not None and cfg.max_samples < len(out["train"]):
        out["train"] = out["train"].shuffle(seed=seed).select(range(cfg.max_samples))
    if number_rows is not None:  # a test split drawn from the training data: its train rows
        number_rows.update({name: origin.get(name, "train") for name in ("train", "test")})
    for name in card.keep_splits:  # carried as they are (e.g. background noise recordings)
        if name not in raw:
            raise ConfigError(f"dataset={card.name}: source has no split {name!r} "
                              f"(has {list(raw)})")
        out[name] = raw[name]
    return DatasetDict(out)


def _standard_splits(raw, card: DatasetCard) -> dict:
    """The source's train and (if the card names one it has) test split, each with the
    standard columns (:func:`_standard_columns`); refused without the training split."""
    train_name = card.splits.get("train") or "train"
    if train_name not in raw:
        raise ConfigError(f"dataset={card.name}: source has no split {train_name!r} "
                          f"(has {list(raw)})")
    out = {}
    for std_split, src_split in (("train", train_name), ("test", card.splits.get("test"))):
        if src_split is not None and src_split in raw:
            out[std_split] = _standard_columns(raw[src_split], card)
    return out


def _standard_columns(ds, card: DatasetCard):
    """``ds``'s columns the card maps, renamed to the standard names, its label a ClassLabel;
    refused when a column the card names is missing."""
    from datasets import ClassLabel

    # A local copy built by fedadapt's loaders (domain folders) already has standard names.
    columns = {std: src if src in ds.column_names or std not in ds.column_names else std
               for std, src in card.columns.items()}
    missing = [src for src in columns.values() if src not in ds.column_names]
    if missing:
        raise ConfigError(
            f"dataset={card.name}: column(s) {missing} named in datasets/{card.name}.yaml are "
            f"missing from the data (columns: {ds.column_names})")
    renames = {src: std for std, src in columns.items() if src != std}
    ds = ds.select_columns(list(columns.values())).rename_columns(renames)
    if not isinstance(ds.features["label"], ClassLabel):
        ds = ds.class_encode_column("label")
    return ds


def _with_test_split(out: dict, cfg: DatasetConfig, seed: int) -> dict:
    """``out`` with a test split: its own, an empty one (``dataset.test_fraction=0``: no global
    test set) or ``dataset.test_fraction`` of the training split, stratified with the seed."""
    if "test" in out:
        return out
    if cfg.test_fraction == 0:
        return {**out, "test": out["train"].select([])}
    parts = out["train"].train_test_split(test_size=cfg.test_fraction, seed=seed,
                                          stratify_by_column="label")
    return {"train": parts["train"], "test": parts["test"]}


def _test_users_into_train(out: dict) -> dict:
    """The source's test split appended to its training split, every row marked in the column
    ``test_client`` (0: a training user's, 1: a test user's); no global test split remains
    (``partition=natural`` turns the marked users into unseen test clients)."""
    from datasets import Value, concatenate_datasets

    train, test = out["train"], out["test"]
    if "client" not in train.column_names or "client" not in test.column_names:
        raise ConfigError("a data set whose test split holds its own users needs their "
                          "natural id (the card's client column) in both splits")
    train = train.add_column("test_client", [0] * len(train)).cast_column(
        "test_client", Value("int8"))
    test = test.add_column("test_client", [1] * len(test)).cast_column(
        "test_client", Value("int8"))
    if test.features["client"] != train.features["client"]:
        test = test.cast_column("client", train.features["client"])
    return {"train": concatenate_datasets([train, test]), "test": test.select([])}


def _failed_check(folder: Path) -> Optional[str]:
    """Check a prepared copy against its seal (every file's size and SHA-256); one that fails
    (or predates the seal) is deleted so that it is rebuilt. Returns what failed, or None."""
    from fedadapt.data.integrity import folder_problem
    from fedadapt.log import log

    if not folder.exists():
        return None
    bad = folder_problem(folder)
    if bad is not None:
        log(f"[cache] prepared data set {folder}: {bad}; rebuilding it")
        shutil.rmtree(folder, ignore_errors=True)
        _OPEN.pop(str(folder), None)
    return bad


def _build_prepared(card: DatasetCard, cfg: DatasetConfig, seed: int, key: str,
                    folder: Path) -> None:
    """Load, standardise and save the data set under a temporary name, seal it (size and
    SHA-256 of every file), then rename it to ``folder``."""
    from fedadapt.data.integrity import seal_folder

    origin: dict = {}
    dsd = standardise(load_source(card, cfg.path), card, cfg, seed, number_rows=origin)
    rows = {name: np.asarray(dsd[name].with_format("arrow")[SOURCE_ROWS].to_pylist(),
                             dtype=np.int64) for name in origin}
    for name in origin:
        dsd[name] = dsd[name].remove_columns(SOURCE_ROWS)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # An empty split (dataset.test_fraction=0) needs num_shards: datasets' size estimate
        # divides by its length.
        dsd.save_to_disk(str(tmp), num_shards={k: 1 for k, d in dsd.items() if len(d) == 0})
        for name, r in rows.items():
            np.save(tmp / f"{SOURCE_ROWS}-{name}.npy", r)
        names = dsd["train"].features["label"].names
        meta = {"fingerprint": f"{card.name}-{key}-{dsd['train']._fingerprint}",
                "num_classes": len(names), "class_names": names,
                "num_train": len(dsd["train"]), "num_test": len(dsd["test"]),
                "columns": dsd["train"].column_names,
                "source_key": source_key(card, cfg), "source_splits": origin}
        (tmp / "fedadapt_meta.json").write_text(json.dumps(meta))
        seal_folder(tmp)
        os.replace(tmp, folder)
    except OSError:
        if not (folder / "fedadapt_meta.json").is_file():  # not: another process finished first
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: Card fields added after prepared copies existed: part of the key only when set, so the
#: copies of cards that do not use them keep their keys.
_LATER_FIELDS = ("modality", "sampling_rate", "hub_config", "hub_revision", "keep_splits",
                 "personalize_only")


def _card_key(card: DatasetCard) -> dict:
    fields = DatasetCard.__dataclass_fields__
    unset = {k for k in _LATER_FIELDS
             if getattr(card, k) == (fields[k].default_factory() if fields[k].default_factory
                                     is not dataclasses.MISSING else fields[k].default)}
    return {k: v for k, v in card.__dict__.items() if k not in unset}


def source_key(card: DatasetCard, cfg: DatasetConfig) -> str:
    """The key of a data set's standardised source: its card and path, not the seeded draws
    (test split, subsample) a prepared copy makes of it."""
    return hashlib.sha256(json.dumps(
        {"v": _PREP_VERSION, "card": _card_key(card), "path": cfg.path},
        sort_keys=True, default=str).encode()).hexdigest()[:16]


def prepare_dataset(cfg: DatasetConfig, cache_dir: str, seed: int) -> PreparedDataset:
    """Load, standardise and save the data set once; later calls reuse the saved copy."""
    card = load_card(cfg.name)
    key = hashlib.sha256(json.dumps(
        {"v": _PREP_VERSION, "card": _card_key(card), "path": cfg.path,
         "test_fraction": cfg.test_fraction, "max_samples": cfg.max_samples, "seed": seed},
        sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = Path(cache_dir).expanduser() / "data" / f"{card.name}-{key}"
    meta_path = folder / "fedadapt_meta.json"
    bad = _failed_check(folder)
    if not meta_path.is_file():
        try:
            _build_prepared(card, cfg, seed, key, folder)
        except FedadaptError as err:
            if bad is None:
                raise
            raise CacheIntegrityError(f"prepared data set {folder} failed its check ({bad}) and "
                                      f"cannot be rebuilt: {err}") from err
    meta = json.loads(meta_path.read_text())
    if meta["num_classes"] != card.num_classes and card.source != "local":
        raise ConfigError(f"dataset={card.name}: the data has {meta['num_classes']} classes, the "
                          f"card says {card.num_classes}")
    return PreparedDataset(name=card.name, path=str(folder), fingerprint=meta["fingerprint"],
                           num_classes=meta["num_classes"],
                           class_names=tuple(meta["class_names"]), num_train=meta["num_train"],
                           num_test=meta["num_test"], columns=tuple(meta["columns"]),
                           source_key=meta.get("source_key"),
                           source_splits=tuple(sorted((meta.get("source_splits") or {}).items())))
