"""flwr-datasets' partitioners behind partition= (shard, pathological, inner Dirichlet,
size-based, grouped natural ids), partition.png and fedadapt-inspect --partition."""

import numpy as np
import pytest
from test_data import CARD, labelled

from fedadapt.config import ConfigError, PartitionConfig
from fedadapt.data.partition import partition_dataset
from fedadapt.results.plots import plot_partition


def sizes(part) -> list[int]:
    return [len(c) for c in part.clients]


def classes(part, labels) -> list[int]:
    return [len(np.unique(labels[np.concatenate([c.train, c.val, c.test])]))
            for c in part.clients]


KINDS = {
    "shard": {"shards_per_client": 2},
    "pathological": {"classes_per_client": 3, "class_assignment": "deterministic"},
    "inner_dirichlet": {"alpha": 0.1},
    "size": {"sizes": [30, 60, 90, 120]},
    "exponential": {},
    "linear": {},
    "square": {},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_partitioner(kind):
    ds = labelled(400)
    labels = np.asarray(ds["label"])
    cfg = PartitionConfig(kind=kind, num_clients=4, **KINDS[kind])
    part = partition_dataset(ds, cfg, CARD, seed=0)
    assert len(part.clients) == 4 and min(sizes(part)) > 0
    idx = np.concatenate([np.concatenate([c.train, c.val, c.test]) for c in part.clients])
    assert len(idx) == len(np.unique(idx))  # disjoint
    again = partition_dataset(ds, cfg, CARD, seed=0)
    assert all(np.array_equal(a.train, b.train) for a, b in zip(part.clients, again.clients))
    if kind == "shard":  # 8 shards of 50 samples, sorted by label: at most 2 classes per shard
        assert sizes(part) == [100] * 4 and max(classes(part, labels)) <= 4
    elif kind == "pathological":
        assert classes(part, labels) == [3, 3, 3, 3]
    elif kind == "inner_dirichlet":  # equal sizes, few classes each at alpha 0.1
        assert sizes(part) == [100] * 4 and np.mean(classes(part, labels)) < 10
    elif kind == "size":
        assert sizes(part) == [30, 60, 90, 120]
    else:  # client i's share grows with i (exp(i), i, i^2); the data is shuffled first
        assert sizes(part) == sorted(sizes(part)) and sum(sizes(part)) == 400
        assert min(classes(part, labels)) > 1


def test_partitioner_settings_fail_naming_the_key():
    from fedadapt.entry import compose_config, to_run_config

    def check(*overrides):
        return to_run_config(compose_config(list(overrides)))

    assert check("partition=shard").partition.shards_per_client == 2  # the preset
    with pytest.raises(ConfigError, match="partition.sizes=None is invalid"):
        check("partition=size", "partition.num_clients=2")
    with pytest.raises(ConfigError, match="one size >= 1 per client"):
        check("partition=size", "partition.num_clients=3", "partition.sizes=[10,20]")
    with pytest.raises(ConfigError, match="partition.class_assignment"):
        check("partition=pathological", "partition.class_assignment=greedy")
    with pytest.raises(ConfigError, match="partition.shard_size"):
        check("partition=shard", "partition.shards_per_client=null")
    ds = labelled(100)
    with pytest.raises(ConfigError, match="partition=shard .*shards_per_client"):
        partition_dataset(ds, PartitionConfig(kind="shard", num_clients=10,
                                              shards_per_client=5, shard_size=10), CARD, seed=0)
    with pytest.raises(ConfigError, match="partition=pathological .*classes_per_client"):
        partition_dataset(ds, PartitionConfig(kind="pathological", num_clients=2,
                                              classes_per_client=11), CARD, seed=0)
    with pytest.raises(ConfigError, match="partition=exponential with partition.num_clients=8 "
                                          "is invalid"):  # client 1's share e / sum e^i < 1
        partition_dataset(ds, PartitionConfig(kind="exponential", num_clients=8), CARD, seed=0)


def test_grouped_natural_ids():
    writers = [f"w{i % 9}" for i in range(90)]
    part = partition_dataset(labelled(90, extra={"client": writers}),
                             PartitionConfig(kind="natural", ids_per_client=4, num_clients=3), CARD,
                             seed=0)
    assert sizes(part) == [40, 40, 10]  # 4 + 4 + 1 writers (allow-smaller)


def test_partition_png(tmp_path):
    ds = labelled(300)
    part = partition_dataset(ds, PartitionConfig(kind="pathological", num_clients=5), CARD,
                             seed=0)
    plot_partition(part, np.asarray(ds["label"]), tmp_path / "p.png",
                   class_names=[f"digit {i}" for i in range(10)], title="toy")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    many = labelled(600, num_classes=30)  # > 20 classes: a heatmap
    part = partition_dataset(many, PartitionConfig(kind="dirichlet", num_clients=70,
                                                   min_partition_size=1), CARD, seed=0)
    plot_partition(part, np.asarray(many["label"]), tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically


def test_a_partitions_picture_is_drawn_once_and_copied_for_the_next_run(tmp_path, monkeypatch):
    """partition.png of the same partition, labels, names and title is copied from the cache
    (drawing it imports seaborn and takes seconds); anything drawn that differs draws anew."""
    from types import SimpleNamespace

    from fedadapt.results import plots

    ds = labelled(300)
    labels = np.asarray(ds["label"])
    part = partition_dataset(ds, PartitionConfig(kind="iid", num_clients=4), CARD, seed=0)
    run = SimpleNamespace(partition=PartitionConfig(kind="iid", num_clients=4),
                          dataset=SimpleNamespace(name="toy"), seed=0,
                          cache_dir=str(tmp_path / "cache"))
    drawn = []
    real = plots.plot_partition
    monkeypatch.setattr(plots, "plot_partition",
                        lambda *a, **k: (drawn.append(k["title"]), real(*a, **k)))
    plots.write_partition_plot(run, part, labels, tmp_path / "a" / "partition.png")
    plots.write_partition_plot(run, part, labels, tmp_path / "b" / "partition.png")
    assert drawn == ["toy: partition=iid, 4 clients, seed 0"]  # the second one copied
    first = (tmp_path / "a" / "partition.png").read_bytes()
    assert (tmp_path / "b" / "partition.png").read_bytes() == first
    run.seed = 1  # another title
    plots.write_partition_plot(run, part, labels, tmp_path / "c" / "partition.png")
    other = partition_dataset(ds, PartitionConfig(kind="iid", num_clients=4), CARD, seed=1)
    plots.write_partition_plot(run, other, labels, tmp_path / "d" / "partition.png")  # rows
    plots.write_partition_plot(run, other, labels[::-1].copy(), tmp_path / "e" / "p.png")
    assert len(drawn) == 4
    assert len(list((tmp_path / "cache" / "plots").glob("partition-*.png"))) == 4


def test_inspect_partition(tmp_path, cache_dir):
    from fedadapt.counts import _options, inspect_partition
    from fedadapt.entry import compose_config, to_run_config

    overrides, partition, out = _options(["--partition", "--out", str(tmp_path / "x.png"),
                                          "partition=shard", "partition.num_clients=5"])
    assert partition and out == str(tmp_path / "x.png")
    run = to_run_config(compose_config(overrides + [f"cache_dir={cache_dir}"]))
    info = inspect_partition(run, out)
    assert info["partition"] == "shard" and info["num_clients"] == 5
    assert info["classes_per_client"]["max"] <= 4  # two label-sorted shards each
    assert (tmp_path / "x.png").stat().st_size > 1000


def test_flwr_datasets_redraw_notes_are_one_line(capsys):
    """flwr-datasets warns at every Dirichlet redraw (about 400 characters each): one line
    with their count; any other note once, with its count."""
    from fedadapt.config import PartitionConfig
    from fedadapt.data.partition import _log_notes

    redraw = ("The specified min_partition_size (10) was not satisfied for alpha ([np.float64("
              "0.5)]) after {} attempts at sampling from the Dirichlet distribution.")
    _log_notes([redraw.format(i) for i in range(5)] + ["sizes do not sum"] * 2,
               PartitionConfig(min_partition_size=10))
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[data] flwr-datasets redrew the Dirichlet partition 5 time(s): a client "
                     "had fewer than partition.min_partition_size=10 samples",
                     "[data] flwr-datasets: sizes do not sum (2 times)"]


def test_dirichlet_partition_follows_its_seed():
    """Pins the Dirichlet partition ignoring its seed (``seed=0`` passed to flwr-datasets, or
    the seed left out and its default 42 used): seeds 1 and 2 give different partitions, seed 1
    twice the same; every example is in exactly one client."""
    ds = labelled(400)
    cfg = PartitionConfig(kind="dirichlet", num_clients=6, alpha=0.5)

    def members(seed):
        part = partition_dataset(ds, cfg, CARD, seed=seed)
        return [np.sort(np.concatenate([c.train, c.val, c.test])) for c in part.clients]

    one, two = members(1), members(2)
    assert all(np.array_equal(a, b) for a, b in zip(one, members(1)))
    assert not all(np.array_equal(a, b) for a, b in zip(one, two))
    assert np.array_equal(np.sort(np.concatenate(one)), np.arange(400))


def test_dirichlet_partition_gives_every_client_min_partition_size():
    """Pins the Dirichlet partition ignoring ``partition.min_partition_size`` (flwr-datasets'
    default, 10, used instead): with seed 2 its first draw gives a client 20 samples, so
    ``min_partition_size=30`` must redraw; and 70 clients over 600 samples are possible only
    with a minimum below 10."""
    ds = labelled(400)
    part = partition_dataset(ds, PartitionConfig(kind="dirichlet", num_clients=6, alpha=0.5,
                                                 min_partition_size=30), CARD, seed=2)
    assert min(sizes(part)) >= 30 and sum(sizes(part)) == 400
    loose = partition_dataset(ds, PartitionConfig(kind="dirichlet", num_clients=6, alpha=0.5,
                                                  min_partition_size=10), CARD, seed=2)
    assert min(sizes(loose)) < 30  # the same seed without the minimum: the draw it redrew
    many = partition_dataset(labelled(600), PartitionConfig(kind="dirichlet", num_clients=70,
                                                            min_partition_size=1), CARD, seed=0)
    assert len(many.clients) == 70 and sum(sizes(many)) == 600


# -- partition.py's mutation survivors (docs/reliability.md) ------------------------------------

def test_partition_stats_are_exactly_iciia_table_3s_numbers():
    """The statistics of a hand-made partition, every key and value: samples and classes per
    client (mean, population std, min, max), the training samples, the clients holding only
    validation or only test rows, each client's row, the unseen domain; and their line."""
    from fedadapt.data.partition import ClientSplit, Partition, format_stats, partition_stats

    labels = np.array([0, 0, 1, 2, 2, 1, 0, 3, 3, 1])
    ix = lambda *i: np.array(i, dtype=np.int64)  # noqa: E731
    part = Partition(clients=[ClientSplit(ix(0, 1, 2), ix(3), ix()),
                              ClientSplit(ix(), ix(4, 5), ix()),   # validation only
                              ClientSplit(ix(), ix(), ix(6, 7, 8, 9))],  # test only
                     names=["a", "b", "c"], unseen=ix(1, 2), unseen_name="sketch")
    stats = partition_stats(part, labels)
    assert stats == {
        "num_clients": 3,
        "samples_per_client": {"mean": 10 / 3, "std": float(np.std([4, 2, 4])), "min": 2,
                               "max": 4},
        "classes_per_client": {"mean": 8 / 3, "std": float(np.std([3, 2, 3])), "min": 2,
                               "max": 3},
        "train_samples": 3, "val_clients": 1, "test_clients": 1,
        "per_client": [{"name": "a", "samples": 4, "classes": 3},
                       {"name": "b", "samples": 2, "classes": 2},
                       {"name": "c", "samples": 4, "classes": 3}],
        "unseen": {"name": "sketch", "samples": 2}}
    assert format_stats(stats) == (
        "3 clients | samples/client 3.3 ± 0.9 (min 2, max 4) | classes/client 2.67 ± 0.47 | "
        "by client: 1 validation, 1 test clients | unseen: sketch (2 samples)")
    part.unseen = None
    plain = partition_stats(Partition(clients=part.clients[:1], names=["a"]), labels)
    assert "unseen" not in plain and plain["val_clients"] == plain["test_clients"] == 0
    assert format_stats({**plain, "selected_ids": {"ids": 5, "samples": 40}}) == (
        "1 clients | samples/client 4.0 ± 0.0 (min 4, max 4) | classes/client 3.00 ± 0.00 | "
        "5 natural ids selected (40 samples)")


def test_a_clients_split_keeps_a_training_row_and_is_seeded():
    """``split_client``: the fractions rounded, every row in exactly one split, sorted; at
    least one training row when the fractions would leave none; the same seed and client the
    same split, another client another."""
    from fedadapt.data.partition import split_client

    cfg = PartitionConfig(val_fraction=0.2, test_fraction=0.3)
    rows = np.arange(100, 110)
    s = split_client(rows, cfg, seed=4, client=1)
    assert (len(s.train), len(s.val), len(s.test)) == (5, 2, 3)
    assert np.array_equal(np.sort(np.concatenate([s.train, s.val, s.test])), rows)
    assert all(np.array_equal(part, np.sort(part)) for part in (s.train, s.val, s.test))
    again, other = split_client(rows, cfg, 4, 1), split_client(rows, cfg, 4, 2)
    assert np.array_equal(again.test, s.test) and np.array_equal(again.val, s.val)
    assert not np.array_equal(other.test, s.test)
    greedy = PartitionConfig(val_fraction=0.5, test_fraction=0.5)
    few = split_client(np.arange(3), greedy, seed=0, client=0)
    assert (len(few.train), len(few.val), len(few.test)) == (1, 0, 2)
    one = split_client(np.arange(1), greedy, seed=0, client=0)
    assert (len(one.train), len(one.val), len(one.test)) == (1, 0, 0)
    four = split_client(np.arange(4), PartitionConfig(val_fraction=0.5, test_fraction=0.25), 0, 0)
    assert (len(four.train), len(four.val), len(four.test)) == (1, 2, 1)


def test_natural_ids_are_selected_distinct_seeded_and_all_of_them_allowed():
    """``select_ids``: k distinct ids (every row of each), the seed's own draw (another seed,
    another draw), k equal to the number of ids allowed, one more refused naming the key."""
    from fedadapt.data.partition import select_ids

    ids = np.repeat(np.array([7, 3, 9, 1, 5, 8]), 2)
    rows = select_ids(ids, 3, seed=0, card=CARD)
    assert len(rows) == 6 and len(np.unique(ids[rows])) == 3
    assert np.array_equal(rows, np.sort(rows))
    assert all((ids == i).sum() == 2 for i in np.unique(ids[rows]))
    draws = {tuple(np.unique(ids[select_ids(ids, 3, s, CARD)])) for s in range(8)}
    assert len(draws) > 1
    assert np.array_equal(select_ids(ids, 3, 0, CARD), rows)
    assert len(select_ids(ids, 6, seed=0, card=CARD)) == 12
    with pytest.raises(ConfigError, match="partition.select_ids=7 is invalid"):
        select_ids(ids, 7, 0, CARD)


def test_enough_samples_for_the_clients_boundaries_and_words():
    """As many clients as samples is allowed, one more refused; for Dirichlet, exactly
    ``num_clients * min_partition_size`` samples is allowed, one fewer refused; each refusal
    says what it needs and has; a natural partition is not a sample-based one."""
    from fedadapt.data.partition import _check_enough

    _check_enough(PartitionConfig(kind="iid", num_clients=20), CARD, 20)
    with pytest.raises(ConfigError) as err:
        _check_enough(PartitionConfig(kind="shard", num_clients=21), CARD, 20)
    assert str(err.value) == ("partition.num_clients=21 is invalid: the training split of "
                              "dataset=digits has only 20 samples")
    _check_enough(PartitionConfig(kind="dirichlet", num_clients=4, min_partition_size=5), CARD,
                  20)
    _check_enough(PartitionConfig(kind="shard", num_clients=4, min_partition_size=6), CARD, 20)
    with pytest.raises(ConfigError) as err:
        _check_enough(PartitionConfig(kind="dirichlet", num_clients=4, min_partition_size=6),
                      CARD, 20)
    assert str(err.value) == ("partition.num_clients=4 is invalid: with "
                              "partition.min_partition_size=6 it needs 24 samples, "
                              "dataset=digits has 20")
    _check_enough(PartitionConfig(kind="natural", num_clients=50), CARD, 20)


def test_a_natural_partition_samples_its_ids_seeded_and_refuses_too_many():
    """Fewer clients than natural ids: a seeded choice of distinct ids (the same seed the same,
    each id's rows whole); exactly as many: every id; more: refused naming the ids' column."""
    writers = [f"w{i % 6}" for i in range(60)]
    data = labelled(60, extra={"client": writers})
    three = partition_dataset(data, PartitionConfig(kind="natural", num_clients=3), CARD, seed=0)
    assert len(set(three.names)) == 3 and set(three.names) <= {f"w{i}" for i in range(6)}
    assert all(len(c) == 10 for c in three.clients)
    again = partition_dataset(data, PartitionConfig(kind="natural", num_clients=3), CARD, seed=0)
    assert again.names == three.names
    others = {tuple(partition_dataset(data, PartitionConfig(kind="natural", num_clients=3), CARD,
                                      seed=s).names) for s in range(1, 6)}
    assert len(others | {tuple(three.names)}) > 1
    every = partition_dataset(data, PartitionConfig(kind="natural", num_clients=6), CARD, seed=0)
    assert sorted(every.names) == [f"w{i}" for i in range(6)]
    with pytest.raises(ConfigError) as err:
        partition_dataset(data, PartitionConfig(kind="natural", num_clients=7), CARD, seed=0)
    assert str(err.value) == ("partition.num_clients=7 is invalid: dataset=digits has 6 natural "
                              f"ids ({CARD.client_key or 'client'}) to train on")


SEEDED = {  # kind -> (its settings, flwr-datasets' partitioner with fedadapt's arguments)
    "dirichlet": (dict(alpha=0.5, min_partition_size=2),
                  lambda fp, s: fp.DirichletPartitioner(
                      num_partitions=4, partition_by="label", alpha=0.5, min_partition_size=2,
                      self_balancing=False, shuffle=True, seed=s)),
    "shard": (dict(shards_per_client=2, shard_size=10),
              lambda fp, s: fp.ShardPartitioner(
                  num_partitions=4, partition_by="label", num_shards_per_partition=2,
                  shard_size=10, keep_incomplete_shard=False, shuffle=True, seed=s)),
    "pathological": (dict(classes_per_client=3),
                     lambda fp, s: fp.PathologicalPartitioner(
                         num_partitions=4, partition_by="label", num_classes_per_partition=3,
                         class_assignment_mode="random", shuffle=True, seed=s)),
    "inner_dirichlet": (dict(alpha=0.5),
                        lambda fp, s: fp.InnerDirichletPartitioner(
                            partition_sizes=[30, 30, 30, 30], partition_by="label", alpha=0.5,
                            shuffle=True, seed=s)),
}


@pytest.mark.parametrize("kind", sorted(SEEDED))
def test_a_seeded_partition_is_flwr_datasets_own_with_the_runs_seed(kind):
    """Each label-based kind is flwr-datasets' partitioner with fedadapt's arguments (shuffled,
    the run's seed): every client holds exactly the rows of its flwr-datasets partition; the
    same seed gives the same partition, another seed another."""
    from flwr_datasets import partitioner as fp

    settings, theirs = SEEDED[kind]
    cfg = PartitionConfig(kind=kind, num_clients=4, val_fraction=0.0, test_fraction=0.2,
                          **settings)
    data = labelled(120, num_classes=6)
    parts = {s: partition_dataset(data, cfg, CARD, seed=s) for s in (3, 4)}
    for seed, part in parts.items():
        flwr = theirs(fp, seed)
        flwr.dataset = data.select_columns(["label"]).add_column("row", range(len(data)))
        for i, client in enumerate(part.clients):
            rows = np.sort(np.concatenate([client.train, client.val, client.test]))
            assert np.array_equal(rows, np.sort(flwr.load_partition(i)["row"])), (kind, seed, i)
    again = partition_dataset(data, cfg, CARD, seed=3)
    assert all(np.array_equal(a.test, b.test) for a, b in zip(again.clients, parts[3].clients))
    assert any(not np.array_equal(np.sort(np.concatenate([a.train, a.test])),
                                  np.sort(np.concatenate([b.train, b.test])))
               for a, b in zip(parts[3].clients, parts[4].clients))

