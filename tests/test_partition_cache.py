"""The partition cache (``<cache_dir>/partitions/``): a cached partition is the computed one,
any change of what it depends on misses, a bad file is recomputed; and the partitions read off
flwr-datasets' partitioners are those ``load_partition`` gives."""

import dataclasses
from dataclasses import dataclass

import numpy as np
import pytest
from test_data import CARD, labelled

from fedadapt.config import DatasetConfig, PartitionConfig
from fedadapt.data import integrity
from fedadapt.data import partition as P
from fedadapt.data.integrity import problem, seal, sidecar
from fedadapt.data.loading import prepare_dataset


@dataclass(frozen=True)
class Generated:
    """A stand-in for :class:`~fedadapt.data.loading.PreparedDataset` over generated data."""

    ds: object
    name: str = "generated"
    fingerprint: str = "generated-0"

    def load(self):
        return {"train": self.ds}


def assert_same(a: P.Partition, b: P.Partition) -> None:
    assert a.names == b.names and a.unseen_name == b.unseen_name and a.stats == b.stats
    assert (a.unseen is None) == (b.unseen is None)
    if a.unseen is not None:
        assert a.unseen.dtype == b.unseen.dtype and np.array_equal(a.unseen, b.unseen)
    assert len(a.clients) == len(b.clients)
    for x, y in zip(a.clients, b.clients):
        for split in ("train", "val", "test"):
            u, v = getattr(x, split), getattr(y, split)
            assert u.dtype == v.dtype == np.int64 and np.array_equal(u, v), split


@pytest.fixture
def counted(monkeypatch):
    """How many times the partition was computed."""
    calls = []
    compute = P.partition_dataset

    def partition_dataset(*args, **kwargs):
        calls.append(args[1])
        return compute(*args, **kwargs)

    monkeypatch.setattr(P, "partition_dataset", partition_dataset)
    return calls


def files(folder) -> list:
    return sorted((folder / "partitions").glob("*.npz"))


@pytest.mark.parametrize("kw", [
    dict(kind="dirichlet", num_clients=12, alpha=0.3, min_partition_size=5, val_fraction=0.2),
    dict(kind="iid", num_clients=7, val_fraction=0.1, test_fraction=0.3),
    dict(kind="shard", num_clients=6),
])
def test_cached_partition_is_the_computed_one(kw, cache_dir, tmp_path, counted):
    prepared = prepare_dataset(DatasetConfig(name="digits"), cache_dir, seed=0)
    cfg = PartitionConfig(**kw)
    computed = P.partition_dataset(prepared.load()["train"], cfg, CARD, 0)
    first = P.cached_partition(prepared, cfg, CARD, 0, str(tmp_path))
    again = P.cached_partition(prepared, cfg, CARD, 0, str(tmp_path))
    assert len(counted) == 2 and len(files(tmp_path)) == 1  # the direct call and the first
    assert_same(computed, first)
    assert_same(computed, again)


def test_cached_natural_and_domain_partitions(tmp_path, counted):
    """Names from the data, an unseen (held-out) domain, selected ids' statistics."""
    writers = [f"w{i % 9}" for i in range(180)]
    domains = [("photo", "sketch", "art")[i % 3] for i in range(180)]
    data = Generated(labelled(180, extra={"client": writers, "domain": domains}))
    for cfg in (PartitionConfig(kind="domain", holdout="sketch", val_fraction=0.2),
                PartitionConfig(kind="natural", num_clients=5, select_ids=5),
                PartitionConfig(kind="natural", num_clients=6, val_clients=0.5)):
        first = P.cached_partition(data, cfg, CARD, 3, str(tmp_path))
        again = P.cached_partition(data, cfg, CARD, 3, str(tmp_path))
        assert_same(P.partition_dataset(data.ds, cfg, CARD, 3), again)
        assert_same(first, again)
    assert again.unseen is None and first.unseen is None
    domain = P.cached_partition(data, PartitionConfig(kind="domain", holdout="sketch",
                                                      val_fraction=0.2), CARD, 3, str(tmp_path))
    assert domain.unseen_name == "sketch" and len(domain.unseen) == 60
    assert len(counted) == 3 + 3  # each config computed once, and once more directly


def changed(value):
    """A different value of a config field's type (validity does not matter to the key)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, list):
        return value + [1]
    return 3  # None


def test_every_key_misses_the_cache():
    cfg = PartitionConfig()
    base = P.partition_key("fp", cfg, CARD, 0)
    assert P.partition_key("fp", PartitionConfig(), CARD, 0) == base
    keys = {P.partition_key("other-fp", cfg, CARD, 0), P.partition_key("fp", cfg, CARD, 1)}
    for f in dataclasses.fields(PartitionConfig):
        other = dataclasses.replace(cfg, **{f.name: changed(getattr(cfg, f.name))})
        keys.add(P.partition_key("fp", other, CARD, 0))
    for card_field in ("name", "client_key", "default_holdout"):
        card = dataclasses.replace(CARD, **{card_field: changed(getattr(CARD, card_field))})
        keys.add(P.partition_key("fp", cfg, card, 0))
    assert base not in keys and len(keys) == 2 + len(dataclasses.fields(PartitionConfig)) + 3


def test_a_changed_setting_or_seed_recomputes(tmp_path, counted):
    data = Generated(labelled(200))
    cfg = PartitionConfig(num_clients=5, min_partition_size=5)
    base = P.cached_partition(data, cfg, CARD, 0, str(tmp_path))
    for other, seed in ((dataclasses.replace(cfg, alpha=0.1), 0),
                        (dataclasses.replace(cfg, val_fraction=0.3), 0),
                        (dataclasses.replace(cfg, num_clients=6), 0),
                        (cfg, 1)):
        part = P.cached_partition(data, other, CARD, seed, str(tmp_path))
        assert_same(part, P.partition_dataset(data.ds, other, CARD, seed))
    assert len(counted) == 1 + 2 * 4 and len(files(tmp_path)) == 5
    assert_same(P.cached_partition(data, cfg, CARD, 0, str(tmp_path)), base)
    assert len(counted) == 9


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "sealed garbage"])
def test_a_bad_cache_file_is_recomputed(damage, tmp_path, counted, capsys, monkeypatch):
    data = Generated(labelled(200))
    cfg = PartitionConfig(num_clients=5, min_partition_size=5, val_fraction=0.2)
    part = P.cached_partition(data, cfg, CARD, 0, str(tmp_path))
    [path] = files(tmp_path)
    blob = bytearray(path.read_bytes())
    if damage == "flipped byte":
        blob[len(blob) // 2] ^= 0xFF
        path.write_bytes(bytes(blob))
    elif damage == "truncated":
        path.write_bytes(bytes(blob[:len(blob) // 2]))
    else:  # readable digest, unreadable content (a file a newer or older version wrote)
        path.write_bytes(b"not an npz")
        seal(path)
    monkeypatch.setattr(integrity, "_CHECKED", set())  # the next run: a new process
    capsys.readouterr()
    again = P.cached_partition(data, cfg, CARD, 0, str(tmp_path))
    err = capsys.readouterr().err
    assert len(counted) == 2
    assert_same(part, again)
    lines = [line for line in err.splitlines() if line.startswith("[cache]")]
    assert len(lines) == 1 and str(path) in lines[0] and "Traceback" not in err, err
    assert problem(path) is None and sidecar(path).is_file()  # rewritten, sealed
    assert_same(part, P.cached_partition(data, cfg, CARD, 0, str(tmp_path)))
    assert len(counted) == 2


KINDS = {
    "dirichlet": dict(num_clients=8, alpha=0.3, min_partition_size=5),
    "iid": dict(num_clients=7),
    "shard": dict(num_clients=5, shards_per_client=2),
    "pathological": dict(num_clients=5, classes_per_client=3),
    "inner_dirichlet": dict(num_clients=4, alpha=0.2),
    "size": dict(num_clients=3, sizes=[50, 100, 120]),
    "exponential": dict(num_clients=4),
    "linear": dict(num_clients=4),
    "natural": dict(num_clients=9),
    "natural-grouped": dict(kind="natural", num_clients=4, ids_per_client=2),
    "domain": dict(holdout="none"),
    "superclass": dict(num_clients=6, mixed_fraction=0.5),
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_partitions_read_off_the_partitioner_are_load_partitions(name, monkeypatch):
    """The partitions read from flwr-datasets' index maps (or cut as IID shards) are those
    that loading each partition gives, in the same order: same rows, names, splits."""
    n = 300
    ds = labelled(n, extra={"client": [f"w{i % 9}" for i in range(n)],
                            "domain": [("a", "b", "c")[i % 3] for i in range(n)],
                            "coarse_label": [str(i % 3) for i in range(n)]})
    ds = ds.shuffle(seed=5).select(range(280))  # an indices mapping underneath
    kw = {"kind": name, **KINDS[name]}
    cfg = PartitionConfig(**kw)
    fast = P.partition_dataset(ds, cfg, CARD, seed=2)
    monkeypatch.setattr(P, "_positions", lambda partitioner, k: None)
    assert_same(fast, P.partition_dataset(ds, cfg, CARD, seed=2))
