"""Domains as clients: <root>/<domain>/<class>/ folders, the VLCS card, derived domain data."""

import os

import numpy as np
import pytest
from PIL import Image as PILImage

from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
from fedadapt.assets import MissingAssetError
from fedadapt.config import ConfigError, DatasetConfig, PartitionConfig
from fedadapt.data import loading
from fedadapt.data.catalogue import DatasetCard, available, load_card
from fedadapt.data.domains import DOMAIN_KINDS, make_domains, render_domain
from fedadapt.data.loading import (
    is_domain_folder,
    load_derived_domains,
    load_source,
    prepare_dataset,
    standardise,
)
from fedadapt.data.partition import partition_dataset
from fedadapt.paths import catalogue_file

PACS = load_card("pacs")


def make_tree(root, domains, classes, per_class: int = 2):
    """``root/<domain>/<class>/<i>.png``: tiny random RGB images saved with PIL."""
    rng = np.random.default_rng(0)
    for domain in domains:
        for cls in classes:
            folder = root / domain / cls
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 255, (6, 6, 3), dtype=np.uint8)
                PILImage.fromarray(pixels).save(folder / f"{i}.png")
    return root


def all_indices(split) -> np.ndarray:
    return np.concatenate([split.train, split.val, split.test])


def test_domain_folders_load_in_the_cards_class_order(tmp_path):
    # Reverse-sorted class folders, one domain spelled differently: order and names come from
    # the card, matched case-insensitively with "_", "-" and spaces alike.
    classes = sorted(PACS.class_names, reverse=True)
    make_tree(tmp_path / "PACS", ["art_painting", "cartoon", "photo"], classes)
    make_tree(tmp_path / "PACS", ["Sketch"], [c.upper() for c in classes])
    (tmp_path / "PACS" / "README.txt").write_text("files beside the domains are ignored")
    assert is_domain_folder(str(tmp_path / "PACS"))

    ds = load_source(PACS, str(tmp_path / "PACS"))["train"]
    assert set(ds.column_names) == {"image", "label", "domain"}
    assert ds.features["label"].names == PACS.class_names
    assert len(ds) == 4 * 7 * 2
    assert sorted(set(ds["domain"])) == ["art_painting", "cartoon", "photo", "sketch"]
    names = ds.features["label"].names
    paths = [row["path"] for row in ds.with_format("arrow")["image"].to_pylist()]
    for path, label in zip(paths, ds["label"]):  # each label is its class folder's
        assert os.path.basename(os.path.dirname(path)).lower() == names[label]
    assert ds[0]["image"].size == (6, 6)


def test_domain_spelling_and_sorted_folders_without_class_names(tmp_path):
    card = load_card("office_home")  # no class_names: sorted class folder names
    make_tree(tmp_path, ["Art", "Real_World"], ["Mug", "Alarm_Clock"], per_class=1)
    ds = load_source(card, str(tmp_path))["train"]
    assert ds.features["label"].names == ["Alarm_Clock", "Mug"]
    assert sorted(set(ds["domain"])) == ["Art", "Real World"]  # the card's spelling


def test_domain_partition_holds_out_the_unseen_domain(tmp_path, cache_dir):
    make_tree(tmp_path / "PACS", PACS.domains, PACS.class_names)
    prepared = prepare_dataset(DatasetConfig(name="pacs", path=str(tmp_path / "PACS")),
                               cache_dir, seed=0)
    assert prepared.num_classes == 7 and prepared.num_train + prepared.num_test == 56
    assert {"image", "label", "domain"} <= set(prepared.columns)
    train = prepared.load()["train"]
    part = partition_dataset(train, PartitionConfig(kind="domain", val_fraction=0.2,
                                                    test_fraction=0.2), PACS, seed=0)
    assert sorted(part.names) == ["art_painting", "cartoon", "photo"]
    assert part.unseen_name == "sketch" == PACS.default_holdout
    domains = np.asarray(train["domain"])
    assert set(domains[part.unseen]) == {"sketch"}
    for name, split in zip(part.names, part.clients):
        assert set(domains[all_indices(split)]) == {name}
        assert len(split.val) > 0 and len(split.test) > 0
        assert not set(all_indices(split)) & set(part.unseen)


def test_bad_domain_folders_name_the_path_and_folder(tmp_path):
    make_tree(tmp_path / "bad", ["photo", "sketch"], ["dog", "zebra"], per_class=1)
    with pytest.raises(ConfigError, match=r"dataset.path=.*'zebra' in .*photo"):
        load_source(PACS, str(tmp_path / "bad"))
    (tmp_path / "empty" / "photo" / "dog").mkdir(parents=True)
    (tmp_path / "empty" / "photo" / "dog" / "notes.txt").write_text("not an image")
    with pytest.raises(ConfigError, match="dataset.path=.*no image files"):
        load_source(PACS, str(tmp_path / "empty"))
    (tmp_path / "broken" / "photo" / "dog").mkdir(parents=True)
    (tmp_path / "broken" / "photo" / "dog" / "0.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(ConfigError, match="0.jpg is not a readable image"):
        load_source(PACS, str(tmp_path / "broken"))


def test_a_flat_class_folder_is_not_a_domain_folder(tmp_path):
    for cls in ("dog", "horse"):
        (tmp_path / cls).mkdir()
        PILImage.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(tmp_path / cls / "0.png")
    assert not is_domain_folder(str(tmp_path))
    ds = load_source(PACS, str(tmp_path))["train"]  # the imagefolder branch, as before
    assert len(ds) == 2 and "domain" not in ds.column_names


def test_standardise_takes_hub_names_or_standard_names():
    """A card mapping hub column names loads both its hub copy and a domain-folder copy."""
    card = DatasetCard(name="toy", source="hub", hub_id="x/toy", num_classes=2,
                       columns={"image": "img", "label": "fine", "domain": "domain"},
                       splits={"train": "train", "test": None})
    px = [np.zeros((4, 4), dtype=np.uint8)] * 10
    for image_col, label_col in (("img", "fine"), ("image", "label")):
        raw = DatasetDict(train=Dataset.from_dict(
            {image_col: px, label_col: [0, 1] * 5, "domain": ["a"] * 10},
            features=Features({image_col: Image(), label_col: ClassLabel(num_classes=2),
                               "domain": Value("string")})))
        out = standardise(raw, card, DatasetConfig(name="toy"), seed=0)
        assert set(out["train"].column_names) == {"image", "label", "domain"}


def test_render_domain():
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (5, 8, 8), dtype=np.uint8)
    np.testing.assert_array_equal(render_domain(images, "original", rng), images)
    np.testing.assert_array_equal(render_domain(images, "inverted", rng), 255 - images)

    step = np.zeros((2, 8, 8), dtype=np.uint8)
    step[0, :, 4:] = 200  # a vertical edge; image 1 is flat
    edges = render_domain(step, "edges", rng)
    assert edges.dtype == np.uint8 and edges[0].max() == 255 and edges[1].max() == 0
    assert edges[0, :, [3, 4]].min() == 255 and edges[0, :, [0, 1, 6, 7]].max() == 0

    gray = np.full((4, 32, 32), 128, dtype=np.uint8)
    a = render_domain(gray, "noisy", np.random.default_rng(1))
    b = render_domain(gray, "noisy", np.random.default_rng(1))
    np.testing.assert_array_equal(a, b)  # seeded
    assert a.dtype == np.uint8 and 50 < (a.astype(float) - 128).std() < 65  # sigma 60, clipped
    white = render_domain(np.full((1, 32, 32), 250, dtype=np.uint8), "noisy", rng)
    assert white.max() == 255  # clipped, not wrapped around
    with pytest.raises(ValueError, match="unknown domain kind"):
        render_domain(images, "blurred", rng)


def test_make_domains_draws_disjoint_subsets():
    images = np.arange(10 * 2 * 2, dtype=np.uint8).reshape(10, 2, 2)
    cols = make_domains(images, np.arange(10) % 3, per_domain=100, seed=0)
    assert len(cols["image"]) == 8 and set(cols["domain"]) == set(DOMAIN_KINDS)  # 10 // 4 = 2
    assert len(set(cols["source_index"])) == 8
    again = make_domains(images, np.arange(10) % 3, per_domain=100, seed=0)
    assert cols["source_index"] == again["source_index"]


def test_digits_domains(cache_dir):
    from sklearn.datasets import load_digits

    card = load_card("digits_domains")
    ds = load_source(card)["train"]
    domains = np.asarray(ds["domain"])
    source = np.asarray(ds["source_index"])
    assert len(ds) == 4 * 449 and ds.features["label"].names == card.class_names
    groups = {d: set(source[domains == d]) for d in DOMAIN_KINDS}
    assert all(len(g) == 449 for g in groups.values())
    assert len(set().union(*groups.values())) == 4 * 449  # disjoint
    digits = (load_digits().images * (255.0 / 16.0)).round().astype(np.uint8)
    assert np.array_equal(ds["label"], load_digits().target[source])
    for i in np.flatnonzero(domains == "inverted")[:20]:
        assert np.array_equal(np.asarray(ds[int(i)]["image"]), 255 - digits[source[i]])
    for i in np.flatnonzero(domains == "original")[:20]:
        assert np.array_equal(np.asarray(ds[int(i)]["image"]), digits[source[i]])

    prepared = prepare_dataset(DatasetConfig(name="digits_domains"), cache_dir, seed=0)
    assert prepared.num_train + prepared.num_test == 4 * 449 and "domain" in prepared.columns
    part = partition_dataset(prepared.load()["train"], PartitionConfig(kind="domain"), card,
                             seed=0)
    assert sorted(part.names) == ["edges", "inverted", "original"]
    assert part.unseen_name == "noisy"
    whole = prepare_dataset(DatasetConfig(name="digits_domains", test_fraction=0.0), cache_dir,
                            seed=0)  # no global test set: the held-out domain is the test
    assert whole.num_train == 4 * 449 and whole.num_test == 0
    assert whole.load()["test"].features == whole.load()["train"].features


def test_fmnist_domains_card_and_missing_files(monkeypatch):
    card = load_card("fmnist_domains")
    assert card.domains == list(DOMAIN_KINDS) and card.default_holdout == "noisy"
    assert card.class_names == load_card("fashion_mnist").class_names
    folder = "/usr/share/datasets/fashion-mnist"
    if os.path.isfile(os.path.join(folder, "train-images-idx3-ubyte.gz")):
        ds = load_derived_domains(card, per_domain=10)["train"]
        assert len(ds) == 40 and len(set(ds["source_index"])) == 40
        assert ds[0]["image"].size == (28, 28)

    fake = DatasetCard(name="fashion_mnist", source="idx:/nonexistent/fashion-mnist",
                       hub_id="zalando-datasets/fashion_mnist", columns={}, splits={},
                       num_classes=10)
    monkeypatch.setattr(loading, "load_card", lambda name: fake)
    with pytest.raises(MissingAssetError, match="apt-get install dataset-fashion-mnist"):
        load_derived_domains(card)


def test_vlcs_card_tree_and_missing_path(tmp_path, cache_dir):
    assert {"vlcs", "fmnist_domains", "digits_domains"} <= set(available())
    card = load_card("vlcs")
    assert card.num_classes == 5 and card.default_holdout == "VOC2007" in card.domains
    assert catalogue_file("vlcs.md").is_file()
    with pytest.raises(MissingAssetError, match="datasets/vlcs.md"):
        prepare_dataset(DatasetConfig(name="vlcs"), cache_dir, seed=0)
    with pytest.raises(ConfigError, match="datasets/vlcs.md"):
        prepare_dataset(DatasetConfig(name="vlcs", path=str(tmp_path / "nope")), cache_dir, 0)

    make_tree(tmp_path / "VLCS", card.domains, card.class_names, per_class=2)
    prepared = prepare_dataset(DatasetConfig(name="vlcs", path=str(tmp_path / "VLCS")),
                               cache_dir, seed=0)
    assert prepared.class_names == tuple(card.class_names)
    part = partition_dataset(prepared.load()["train"], PartitionConfig(kind="domain"), card,
                             seed=0)
    assert sorted(part.names) == ["Caltech101", "LabelMe", "SUN09"]
    assert part.unseen_name == "VOC2007"
