"""Loading from local paths, IDX files, partitioners, per-client splits and statistics."""

import gzip

import numpy as np
import pytest

from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
from fedadapt.config import ConfigError, DatasetConfig, PartitionConfig
from fedadapt.data.catalogue import DatasetCard, available, load_card
from fedadapt.data.loading import load_idx_folder, prepare_dataset, read_idx, standardise
from fedadapt.data.partition import partition_dataset


def labelled(n: int, num_classes: int = 10, extra: dict | None = None) -> Dataset:
    rng = np.random.default_rng(0)
    cols = {"image": [rng.integers(0, 255, (8, 8), dtype=np.uint8) for _ in range(n)],
            "label": (np.arange(n) % num_classes).tolist()}
    feats = {"image": Image(), "label": ClassLabel(num_classes=num_classes)}
    for name, values in (extra or {}).items():
        cols[name] = values
        feats[name] = Value("string")
    return Dataset.from_dict(cols, features=Features(feats))


CARD = load_card("digits")


def test_catalogue_has_the_cards():
    assert {"cifar100", "femnist", "pacs", "office_home", "inaturalist", "fashion_mnist",
            "digits"} <= set(available())
    with pytest.raises(ConfigError, match="dataset='nope'"):
        load_card("nope")


@pytest.mark.parametrize("num_clients", [3, 7])
@pytest.mark.parametrize("kind", ["iid", "dirichlet"])
def test_requested_number_of_clients(kind, num_clients):
    part = partition_dataset(labelled(300), PartitionConfig(kind=kind, num_clients=num_clients,
                                                            min_partition_size=5), CARD, seed=0)
    assert len(part.clients) == num_clients
    all_idx = np.concatenate([np.concatenate([c.train, c.val, c.test]) for c in part.clients])
    assert len(all_idx) == len(np.unique(all_idx)) == 300  # disjoint and complete


def test_smaller_alpha_gives_fewer_classes_per_client():
    ds = labelled(1000)
    classes = {a: partition_dataset(ds, PartitionConfig(alpha=a, num_clients=10), CARD, seed=1)
               .stats["classes_per_client"]["mean"] for a in (0.05, 1000.0)}
    assert classes[0.05] < classes[1000.0]
    assert classes[1000.0] == 10


def test_client_split_is_seeded_and_disjoint():
    cfg = PartitionConfig(kind="iid", num_clients=4, val_fraction=0.1, test_fraction=0.2)
    a = partition_dataset(labelled(200), cfg, CARD, seed=3)
    b = partition_dataset(labelled(200), cfg, CARD, seed=3)
    c = partition_dataset(labelled(200), cfg, CARD, seed=4)
    for x, y in zip(a.clients, b.clients):
        assert np.array_equal(x.train, y.train) and np.array_equal(x.test, y.test)
    assert any(not np.array_equal(x.test, y.test) for x, y in zip(a.clients, c.clients))
    for cl in a.clients:
        assert len(cl.test) == 10 and len(cl.val) == 5 and len(cl.train) == 35
        assert not set(cl.train) & set(cl.test)


def test_natural_and_domain_partitions():
    writers = [f"w{i % 5}" for i in range(100)]
    domains = [["art", "photo", "sketch"][i % 3] for i in range(90)]
    natural = partition_dataset(labelled(100, extra={"client": writers}),
                                PartitionConfig(kind="natural", num_clients=5), CARD, seed=0)
    assert sorted(natural.names) == [f"w{i}" for i in range(5)]
    card = DatasetCard(name="toy", source="local", hub_id=None, columns={}, splits={},
                       num_classes=10, default_holdout="sketch")
    dom = partition_dataset(labelled(90, extra={"domain": domains}),
                            PartitionConfig(kind="domain"), card, seed=0)
    assert sorted(dom.names) == ["art", "photo"] and dom.unseen_name == "sketch"
    seen = np.concatenate([np.concatenate([c.train, c.val, c.test]) for c in dom.clients])
    assert not set(seen) & set(dom.unseen)  # the held-out domain is never a training client
    assert dom.stats["unseen"] == {"name": "sketch", "samples": 30}


def test_bad_partitions_name_the_setting():
    with pytest.raises(ConfigError, match="partition.num_clients=5000"):
        partition_dataset(labelled(100), PartitionConfig(num_clients=5000), CARD, seed=0)
    with pytest.raises(ConfigError, match="partition=natural"):
        partition_dataset(labelled(100), PartitionConfig(kind="natural"), CARD, seed=0)


def write_idx(path, array: np.ndarray):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as fh:
        fh.write(header + array.astype(np.uint8).tobytes())


def test_idx_folder(tmp_path):
    images = np.arange(5 * 4 * 4).reshape(5, 4, 4) % 255
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([0, 1, 2, 1, 0]))
    np.testing.assert_array_equal(read_idx(str(tmp_path / "train-images-idx3-ubyte.gz")), images)
    dsd = load_idx_folder(str(tmp_path), load_card("fashion_mnist"))
    assert len(dsd["train"]) == 5 and dsd["train"][1]["label"] == 1
    (tmp_path / "bad-idx1-ubyte").write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x09abc")
    with pytest.raises(ValueError, match="truncated"):
        read_idx(str(tmp_path / "bad-idx1-ubyte"))


def test_local_save_to_disk_path_and_missing_column(tmp_path, cache_dir):
    DatasetDict(train=labelled(50)).save_to_disk(str(tmp_path / "local"))
    prepared = prepare_dataset(DatasetConfig(name="digits", path=str(tmp_path / "local")),
                               cache_dir, seed=0)
    assert prepared.num_train + prepared.num_test == 50 and prepared.num_classes == 10
    no_label = DatasetDict(train=labelled(20).remove_columns("label"))
    with pytest.raises(ConfigError, match="column"):
        standardise(no_label, CARD, DatasetConfig(name="digits"), seed=0)


def test_digits_ship_with_scikit_learn(cache_dir):
    prepared = prepare_dataset(DatasetConfig(name="digits"), cache_dir, seed=0)
    assert prepared.num_train == 1437 and prepared.num_test == 360
    assert prepared.load()["train"][0]["image"].size == (8, 8)


def test_missing_hub_data_names_the_prefetch_command(cache_dir):
    """Offline, a hub data set that is not cached fails with what is missing and the command."""
    from fedadapt.assets import MissingAssetError

    with pytest.raises(MissingAssetError, match="fedadapt-prefetch dataset=cifar100"):
        prepare_dataset(DatasetConfig(name="cifar100"), cache_dir, seed=0)
    with pytest.raises(MissingAssetError, match="recipe"):
        prepare_dataset(DatasetConfig(name="inaturalist"), cache_dir, seed=0)


def test_iid_is_shuffled_and_seeded():
    ds = labelled(200).sort("label")  # stored in class order
    a = partition_dataset(ds, PartitionConfig(kind="iid", num_clients=4), CARD, seed=0)
    b = partition_dataset(ds, PartitionConfig(kind="iid", num_clients=4), CARD, seed=1)
    assert a.stats["classes_per_client"]["min"] == 10  # not one class block per client
    assert any(not np.array_equal(x.train, y.train) for x, y in zip(a.clients, b.clients))


def writers_data(num_writers: int = 40, seed: int = 0) -> Dataset:
    """A generated natural-id data set: writers holding 5..40 samples each (FEMNIST-like)."""
    sizes = np.random.default_rng(seed).integers(5, 41, num_writers)
    writers = [f"f{w:04d}" for w, size in enumerate(sizes) for _ in range(size)]
    order = np.random.default_rng(seed + 1).permutation(len(writers))  # rows not by writer
    return labelled(len(writers), extra={"client": [writers[i] for i in order]})


def test_a_seeded_selection_of_writers_for_the_natural_and_iid_partitions():
    """Accumulator paper, FEMNIST: the same seeded writers (and only their samples) for the
    by-writer and the IID partition."""
    ds = writers_data()
    writer = np.asarray(ds["client"])
    natural = partition_dataset(ds, PartitionConfig(kind="natural", num_clients=12,
                                                    select_ids=12, val_fraction=0,
                                                    test_fraction=0), CARD, seed=5)
    iid = partition_dataset(ds, PartitionConfig(kind="iid", num_clients=12, select_ids=12,
                                                val_fraction=0, test_fraction=0), CARD, seed=5)
    chosen = set(natural.names)
    assert len(chosen) == 12
    for name, c in zip(natural.names, natural.clients):  # one client per writer, all of it
        assert set(writer[c.train]) == {name}
        assert len(c.train) == int((writer == name).sum())
    rows = np.flatnonzero(np.isin(writer, sorted(chosen)))
    for part in (natural, iid):
        got = np.concatenate([c.train for c in part.clients])
        assert np.array_equal(np.sort(got), rows)  # the selected writers' samples, each once
        assert part.stats["selected_ids"] == {"ids": 12, "samples": len(rows)}
    assert {len(c.train) for c in iid.clients} <= {len(rows) // 12, len(rows) // 12 + 1}
    # seeded: the same seed selects the same writers whatever the row order, another seed not
    shuffled = ds.select(np.random.default_rng(9).permutation(len(ds)))
    again = partition_dataset(shuffled, PartitionConfig(kind="natural", num_clients=12,
                                                        select_ids=12), CARD, seed=5)
    other = partition_dataset(ds, PartitionConfig(kind="natural", num_clients=12,
                                                  select_ids=12), CARD, seed=6)
    assert set(again.names) == chosen and set(other.names) != chosen


def test_bad_writer_selections_name_the_setting():
    ds = writers_data(num_writers=8)
    with pytest.raises(ConfigError, match="partition.select_ids=9 .*only 8"):
        partition_dataset(ds, PartitionConfig(kind="iid", num_clients=3, select_ids=9), CARD, 0)
    with pytest.raises(ConfigError, match="partition.select_ids=3 .*no natural id"):
        partition_dataset(labelled(50), PartitionConfig(kind="iid", num_clients=3,
                                                        select_ids=3), CARD, 0)
    from fedadapt.entry import compose_config, to_run_config

    with pytest.raises(ConfigError, match="partition.num_clients=100 .*select_ids=381"):
        to_run_config(compose_config(["dataset=femnist", "partition=natural",
                                      "partition.num_clients=100", "partition.select_ids=381"]))


def test_the_synthetic_cifar100_loads_as_cifar100_through_dataset_path(tmp_path, cache_dir,
                                                                       monkeypatch):
    """fedadapt.tools.synthetic_cifar100 (the GPU check's stand-in for the hub's CIFAR-100)
    writes CIFAR-100's columns, so dataset=cifar100 dataset.path=... loads it: 100 classes,
    32x32 RGB, the same images for the same seed."""
    import importlib
    import sys

    module = importlib.import_module("fedadapt.tools.synthetic_cifar100")  # its pool pickles
    for name in ("a", "b"):
        monkeypatch.setattr(sys, "argv", ["x", str(tmp_path / name), "--train", "300",
                                          "--test", "100", "--seed", "3"])
        module.main()
    prepared = prepare_dataset(DatasetConfig(name="cifar100", path=str(tmp_path / "a")),
                               cache_dir, seed=0)
    assert (prepared.num_train, prepared.num_test, prepared.num_classes) == (300, 100, 100)
    a, b = (DatasetDict.load_from_disk(str(tmp_path / n))["train"] for n in "ab")
    assert a[0]["img"].size == (32, 32) and a[0]["img"].mode == "RGB"
    assert a["fine_label"] == b["fine_label"] and a[5]["img"].tobytes() == b[5]["img"].tobytes()


def test_labels_are_kept_once_and_read_later_without_datasets(tmp_path):
    """A split's labels are read from the prepared copy once and kept, sealed, under
    ``<cache_dir>/labels/``: a later process reads them without importing ``datasets``, and a
    file that fails its digest is read again from the copy."""
    import dataclasses
    import json
    import subprocess
    import sys

    from fedadapt.data import sources
    from fedadapt.data.loading import column

    prepared = prepare_dataset(DatasetConfig(name="digits"), str(tmp_path), seed=0)
    want = column(prepared.load()["train"], "label", np.int64)
    sources.clear_cache()
    np.testing.assert_array_equal(sources._labels(prepared, "train"), want)
    path = sources.labels_path(prepared, "train")
    assert path.is_file() and path.parent == tmp_path / "labels"
    code = ("import json, sys; from fedadapt.data.loading import PreparedDataset; "
            "from fedadapt.data.sources import _labels; "
            "p = PreparedDataset(**json.loads(sys.argv[1])); "
            "print(int(_labels(p, 'train').sum()), 'datasets' in sys.modules)")
    fields = json.dumps(dataclasses.asdict(prepared))
    out = subprocess.run([sys.executable, "-c", code, fields], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == [str(int(want.sum())), "False"]
    data = bytearray(path.read_bytes())
    data[-1] ^= 1  # the last label changed in place, same size
    path.write_bytes(bytes(data))
    sources.clear_cache()
    np.testing.assert_array_equal(sources._labels(prepared, "train"), want)
