"""The partition to the row and to the word: each client's splits are flwr-datasets' rows in
flwr-datasets' order split by ``split_client``; each seeded draw comes from its documented
stream; each refusal names its settings; the cache key is stable across processes. Written for
partition.py's mutation survivors (docs/reliability.md): each test's docstring names the bugs
it pins."""

import dataclasses
import json

import numpy as np
import pytest
from test_data import CARD, labelled

from fedadapt.config import ConfigError, PartitionConfig
from fedadapt.data import partition as P
from fedadapt.data.partition import partition_dataset, split_client


def members(client) -> np.ndarray:
    return np.sort(np.concatenate([client.train, client.val, client.test]))


def coarse(n: int, groups: int = 4) -> list[str]:
    return [f"s{(i // 3) % groups}" for i in range(n)]


# kind -> (fedadapt's settings, extra columns, flwr-datasets' partitioner with fedadapt's arguments)
ORDERED = {
    "dirichlet": (dict(alpha=0.5, min_partition_size=2), {},
                  lambda fp, s: fp.DirichletPartitioner(
                      num_partitions=4, partition_by="label", alpha=0.5, min_partition_size=2,
                      self_balancing=False, shuffle=True, seed=s)),
    "shard": (dict(shards_per_client=2, shard_size=10), {},
              lambda fp, s: fp.ShardPartitioner(
                  num_partitions=4, partition_by="label", num_shards_per_partition=2,
                  shard_size=10, keep_incomplete_shard=False, shuffle=True, seed=s)),
    "pathological": (dict(classes_per_client=3), {},
                     lambda fp, s: fp.PathologicalPartitioner(
                         num_partitions=4, partition_by="label", num_classes_per_partition=3,
                         class_assignment_mode="random", shuffle=True, seed=s)),
    "inner_dirichlet": (dict(alpha=0.5), {},
                        lambda fp, s: fp.InnerDirichletPartitioner(
                            partition_sizes=[30, 30, 30, 30], partition_by="label", alpha=0.5,
                            shuffle=True, seed=s)),
    "superclass": (dict(), {"coarse_label": coarse(120)},
                   lambda fp, s: fp.PathologicalPartitioner(
                       num_partitions=4, partition_by="coarse_label",
                       num_classes_per_partition=1, class_assignment_mode="first-deterministic",
                       shuffle=True, seed=s)),
    "natural": (dict(ids_per_client=2), {"client": [f"w{i % 8}" for i in range(120)]},
                lambda fp, s: fp.GroupedNaturalIdPartitioner(
                    partition_by="client", group_size=2, mode="allow-smaller",
                    sort_unique_ids=True)),
    # the ids first seen out of their sorted order (w0, w7, w6, ...): sorting them matters
    "natural-unsorted": (dict(kind="natural", ids_per_client=2),
                         {"client": [f"w{(7 * i) % 8}" for i in range(120)]},
                         lambda fp, s: fp.GroupedNaturalIdPartitioner(
                             partition_by="client", group_size=2, mode="allow-smaller",
                             sort_unique_ids=True)),
    "pathological-deterministic": (
        dict(kind="pathological", classes_per_client=2, class_assignment="deterministic"), {},
        lambda fp, s: fp.PathologicalPartitioner(
            num_partitions=4, partition_by="label", num_classes_per_partition=2,
            class_assignment_mode="deterministic", shuffle=True, seed=s)),
    "shard-incomplete": (dict(kind="shard", shards_per_client=2, shard_size=14,
                              keep_incomplete_shard=True), {},
                         lambda fp, s: fp.ShardPartitioner(
                             num_partitions=4, partition_by="label",
                             num_shards_per_partition=2, shard_size=14,
                             keep_incomplete_shard=True, shuffle=True, seed=s)),
}


@pytest.mark.parametrize("kind", sorted(ORDERED))
def test_each_client_is_flwr_datasets_partition_in_its_order_then_split(kind):
    """Each client's train / val / test rows are exactly ``split_client`` of its flwr-datasets
    partition's rows *in flwr-datasets' order* (the order decides the seeded split): pins a
    partitioner built with ``shuffle=False`` (or None) instead of True, the superclass
    partitioner with another assignment mode, class count or partition count, and a grouped
    natural partition that is not grouped (``ids_per_client`` > 2 asked instead of > 1), groups
    other ids (``sort_unique_ids``) or names a client by another row's id; the class assignment
    and the incomplete shards the config asks for not passed on."""
    from flwr_datasets import partitioner as fp

    settings, extra, theirs = ORDERED[kind]
    settings = {"kind": kind, **settings}
    cfg = PartitionConfig(num_clients=4, val_fraction=0.2, test_fraction=0.3, **settings)
    data = labelled(120, num_classes=6, extra=extra)
    seed = 5
    part = partition_dataset(data, cfg, CARD, seed=seed)
    flwr = theirs(fp, seed)
    key = {"superclass": "coarse_label", "natural": "client"}.get(cfg.kind)
    flwr.dataset = data.select_columns(["label"] + ([key] if key else [])).add_column(
        "row", range(len(data)))
    assert len(part.clients) == flwr.num_partitions == 4
    for i, client in enumerate(part.clients):
        want = split_client(np.asarray(flwr.load_partition(i)["row"]), cfg, seed, i)
        for name in ("train", "val", "test"):
            assert np.array_equal(getattr(client, name), getattr(want, name)), (kind, i, name)
    if cfg.kind == "natural":  # each grouped client is named by its partition's first row's id
        assert part.names == [str(flwr.load_partition(i)["client"][0]) for i in range(4)]


def test_a_superclass_partition_names_its_clients_by_number():
    """Superclass clients are ``client-<i>`` (the mixed ones first), not their superclass:
    pins the superclass branch of the naming skipped."""
    data = labelled(120, extra={"coarse_label": coarse(120)})
    part = partition_dataset(data, PartitionConfig(kind="superclass", num_clients=4), CARD, 0)
    assert part.names == ["client-0", "client-1", "client-2", "client-3"]


@pytest.mark.parametrize("fraction,mixed", [(0.125, 1), (0.5, 4), (1.0, 8)])
def test_mixed_clients_take_their_share_of_the_data_first(fraction, mixed):
    """``partition.mixed_fraction``: ``round(fraction * clients)`` mixed clients, first, holding
    an IID split of that fraction of the (seed-shuffled) data; the other clients one superclass
    each from the rest; every row in exactly one client. Pins one mixed client taken for none
    (``k == 1``), the cut or the count divided instead of multiplied, mixing skipped (or done
    for ``fraction > 1`` only), the superclass partitioner given every client, and the rows
    after the cut (or a row of them) given again when every client is mixed."""
    n, k = 240, 8
    # one superclass per non-mixed client (flwr-datasets leaves a superclass over unused)
    data = labelled(n, num_classes=10, extra={"coarse_label": coarse(n, groups=max(k - mixed, 1))})
    cfg = PartitionConfig(kind="superclass", num_clients=k, mixed_fraction=fraction,
                          val_fraction=0.0, test_fraction=0.0)
    part = partition_dataset(data, cfg, CARD, seed=3)
    assert len(part.clients) == k
    assert np.array_equal(np.sort(np.concatenate([members(c) for c in part.clients])),
                          np.arange(n))
    cut = round(n * mixed / k)
    assert [len(c) for c in part.clients[:mixed]] == [cut // mixed] * mixed
    superclass = np.asarray(data["coarse_label"])
    for c in part.clients[mixed:]:  # one superclass each
        assert len(np.unique(superclass[members(c)])) == 1
    labels = np.asarray(data["label"])
    if mixed < k:  # a mixed client draws from many classes (an IID share of the data)
        assert len(np.unique(labels[members(part.clients[0])])) > 3


def test_each_refusal_of_flwr_datasets_names_the_kinds_settings():
    """Each kind's refusal names its own settings and carries flwr-datasets' reason: pins a
    key's words changed or lost, the fallback ``partition.num_clients`` lost, and the reason
    left out."""
    boom = ValueError("the reason")
    words = {
        "shard": "partition.shards_per_client / partition.shard_size",
        "pathological": "partition.classes_per_client",
        "inner_dirichlet": "partition.sizes / partition.alpha",
        "size": "partition.sizes",
        "iid": "partition.num_clients",
        "natural": "partition.num_clients",
    }
    for kind, keys in words.items():
        err = P._refused(PartitionConfig(kind=kind, num_clients=3), boom)
        assert str(err) == (f"partition={kind} with partition.num_clients=3 is invalid: "
                            f"flwr-datasets refused it (the reason); change {keys}"), kind
    err = P._refused(PartitionConfig(kind="dirichlet", num_clients=3, alpha=0.1,
                                     min_partition_size=7), boom)
    assert str(err) == ("partition.alpha=0.1 with partition.num_clients=3: flwr-datasets could "
                        "not give every client partition.min_partition_size=7 samples (the "
                        "reason); lower min_partition_size or num_clients")
    with pytest.raises(ConfigError) as raised:  # through the partition: flwr-datasets' reason
        partition_dataset(labelled(100), PartitionConfig(kind="shard", num_clients=10,
                                                         shards_per_client=5, shard_size=10),
                          CARD, seed=0)
    reason = str(raised.value).split("refused it (", 1)[1].split("); change", 1)[0]
    assert reason and reason != "None" and reason == str(raised.value.__cause__)


def test_clients_left_empty_are_refused_naming_the_first_five():
    """A partition that leaves clients empty is refused naming the data set and the first five
    empty clients: pins the list cut at six, the data set's name lost and the check turned
    round (refusing natural partitions only)."""
    cfg = PartitionConfig(kind="dirichlet", alpha=0.01, num_clients=20, min_partition_size=0)
    with pytest.raises(ConfigError) as err:
        partition_dataset(labelled(40), cfg, CARD, seed=0)
    assert str(err.value) == ("partition=dirichlet with partition.num_clients=20 is invalid "
                              "for dataset=digits: client(s) [2, 4, 7, 9, 10] get no sample; "
                              "use fewer clients")


def test_flwr_datasets_notes_are_logged_but_not_its_deprecations(capsys, monkeypatch):
    """A note flwr-datasets warns while partitioning is logged with its words, once; its
    deprecation warnings are not: pins the notes replaced by "None" and the filter turned
    round."""
    import warnings

    real = P._load_partitions

    def noisy(partitioner, key):
        warnings.warn("a note from the partitioner", UserWarning, stacklevel=1)
        warnings.warn("an old argument", DeprecationWarning, stacklevel=1)
        return real(partitioner, key)

    monkeypatch.setattr(P, "_load_partitions", noisy)
    partition_dataset(labelled(40), PartitionConfig(kind="iid", num_clients=2), CARD, seed=0)
    err = capsys.readouterr().err
    assert "[data] flwr-datasets: a note from the partitioner\n" in err
    assert "old argument" not in err and "None" not in err


def test_a_single_note_has_no_count(capsys):
    """A note seen once is logged without "(1 times)": pins the count always added (or from one
    note on)."""
    P._log_notes(["sizes do not sum"], PartitionConfig())
    assert capsys.readouterr().err == "[data] flwr-datasets: sizes do not sum\n"


def test_the_cache_key_is_a_stable_function_of_what_partitions(monkeypatch):
    """The cache key of a fixed input, to the character, with the libraries' versions fixed: a
    file cached by one process is found by the next, and a change to the key is a decision
    (bump ``_CACHE_VERSION``). Pins a renamed field of the hashed record, unsorted keys, a
    missing ``default=str`` (a value JSON cannot write), and the key's length; every input also
    changes it."""
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda lib: f"{lib}-1.0")
    cfg = PartitionConfig(kind="dirichlet", num_clients=4, sizes=(3, 4))  # a tuple: default=str
    key = P.partition_key("data-fingerprint", cfg, CARD, 7)
    assert len(key) == 24
    card = {k: getattr(CARD, k) for k in ("name", "client_key", "default_holdout")}
    record = {"v": P._CACHE_VERSION, "data": "data-fingerprint",
              "partition": dataclasses.asdict(cfg), "card": card, "seed": 7,
              "libraries": {lib: f"{lib}-1.0" for lib in P._DRAWN_BY}}
    import hashlib

    blob = json.dumps(record, sort_keys=True, default=str)
    assert key == hashlib.sha256(blob.encode()).hexdigest()[:24]
    others = {P.partition_key("other", cfg, CARD, 7), P.partition_key("data-fingerprint", cfg,
                                                                      CARD, 8),
              P.partition_key("data-fingerprint", dataclasses.replace(cfg, alpha=0.3), CARD, 7)}
    assert key not in others and len(others) == 3
    monkeypatch.setattr(importlib.metadata, "version", lambda lib: f"{lib}-2.0")
    assert P.partition_key("data-fingerprint", cfg, CARD, 7) != key


def test_cached_partitions_of_two_data_sets_are_two_files(tmp_path):
    """The cache key holds the data's fingerprint: two data sets with the same settings are
    two cache files (pins the fingerprint left out of the key)."""

    class Prepared:
        def __init__(self, fingerprint, data):
            self.fingerprint, self.name, self.data = fingerprint, "digits", data

        def load(self):
            return {"train": self.data}

    cfg = PartitionConfig(kind="iid", num_clients=2)
    a = P.cached_partition(Prepared("A", labelled(20)), cfg, CARD, 0, str(tmp_path))
    b = P.cached_partition(Prepared("B", labelled(30)), cfg, CARD, 0, str(tmp_path))
    assert sum(len(c) for c in a.clients) == 20 and sum(len(c) for c in b.clients) == 30
    assert len(list((tmp_path / "partitions").glob("*.npz"))) == 2


def test_an_unreadable_cache_file_is_logged_with_its_errors_kind(tmp_path, capsys):
    """The recomputation's line names the error's kind (pins ``NoneType`` in its place)."""

    class Prepared:
        fingerprint, name = "F", "digits"

        def load(self):
            return {"train": labelled(20)}

    cfg = PartitionConfig(kind="iid", num_clients=2)
    P.cached_partition(Prepared(), cfg, CARD, 0, str(tmp_path))
    (path,) = (tmp_path / "partitions").glob("*.npz")
    P._save_cached(path, "another key", P.partition_dataset(labelled(20), cfg, CARD, 0))
    capsys.readouterr()
    P.cached_partition(Prepared(), cfg, CARD, 0, str(tmp_path))
    assert (f"[cache] partition {path}: unreadable (ValueError: its content does not match its "
            f"key); recomputing it") in capsys.readouterr().err


def _npz(path, key="K", names=("a",), lengths=(2, 0, 1), rows=(5, 6, 7)):
    meta = {"key": key, "names": list(names), "unseen_name": None, "stats": {}}
    np.savez(path, rows=np.asarray(rows, dtype=np.int64),
             lengths=np.asarray(lengths, dtype=np.int64),
             meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return path


@pytest.mark.parametrize("damage", [dict(key="other"), dict(rows=(5, 6)),
                                    dict(lengths=(1, 0, 1, 1, 0, 0)),
                                    dict(names=(), lengths=(), rows=())])
def test_a_cached_file_is_checked_on_each_count_alone(tmp_path, damage):
    """Each of the cache file's checks refuses it alone (another key; rows that are not the
    lengths' sum; lengths not three per client; no client) with its words: pins the checks
    joined by ``and``, and the message changed."""
    good = P._load_cached(_npz(tmp_path / "good.npz"), "K")
    assert [c.train.tolist() for c in good.clients] == [[5, 6]] and good.names == ["a"]
    with pytest.raises(ValueError) as err:
        P._load_cached(_npz(tmp_path / "bad.npz", **damage), "K")
    assert str(err.value) == "its content does not match its key"


def test_a_cache_in_a_new_folder_is_written_and_a_failed_write_says_so(tmp_path, capsys):
    """The cache's folder is made with its parents; a write that fails (its folder is a file)
    leaves no temporary file and says so in one line (it once raised ``NotADirectoryError``
    removing the temporary file there): pins ``parents`` dropped and the line lost."""
    part = P.partition_dataset(labelled(20), PartitionConfig(kind="iid", num_clients=2), CARD, 0)
    deep = tmp_path / "a" / "b" / "p.npz"
    P._save_cached(deep, "K", part)
    assert P._load_cached(deep, "K").names == part.names
    (tmp_path / "file").write_text("")
    blocked = tmp_path / "file" / "p.npz"
    P._save_cached(blocked, "K", part)
    err = capsys.readouterr().err
    assert err.startswith(f"[cache] partition {blocked}: not saved (")
    assert err.rstrip().endswith("the next run recomputes it")
    assert list(tmp_path.iterdir()) and not list(tmp_path.glob("**/*.tmp"))


def test_held_out_clients_are_each_streams_own_draw():
    """``partition.test_clients`` and ``partition.val_clients`` hold out exactly the clients
    ``numpy.random.default_rng([seed, 0x7E57])`` / ``([seed, 0x7A11])`` choose without
    replacement (separate streams: adding one never moves the other), every row of a test
    client in its test split and none in train or val (and likewise for validation): pins
    another stream, an unseeded one, drawing with replacement and a validation row left in a
    test client."""
    cfg = PartitionConfig(kind="iid", num_clients=10, test_clients=0.3, val_clients=0.2,
                          val_fraction=0.2, test_fraction=0.2)
    part = partition_dataset(labelled(200), cfg, CARD, seed=4)
    test = sorted(np.random.default_rng([4, 0x7E57]).choice(10, 3, replace=False).tolist())
    val = set(np.random.default_rng([4, 0x7A11]).choice(10, 2, replace=False).tolist())
    assert sorted(i for i, c in enumerate(part.clients)
                  if len(c.test) and not len(c.train) and not len(c.val)) == test
    # a validation client later drawn as a test client becomes a test client
    assert {i for i, c in enumerate(part.clients) if len(c.val) and not len(c.train)} \
        == val - set(test)
    assert part.stats["test_clients"] == 3


@pytest.mark.parametrize("setting,value,holds", [("test_clients", 0.04, 0),
                                                 ("test_clients", 1.0, 10),
                                                 ("val_clients", 1.0, 10)])
def test_holding_out_none_or_every_client_is_refused(setting, value, holds):
    """Holding out no client or every client is refused with its words; one client is allowed:
    pins the bounds ``0 <= k`` and ``k <= clients`` and the message lost."""
    cfg = PartitionConfig(kind="iid", num_clients=10, **{setting: value})
    with pytest.raises(ConfigError) as err:
        partition_dataset(labelled(100), cfg, CARD, seed=0)
    training = " training" if setting == "val_clients" else ""
    assert str(err.value) == (f"partition.{setting}={value} is invalid: with 10{training} "
                              f"clients it holds out {holds}; keep some on both sides")
    one = partition_dataset(labelled(100), PartitionConfig(kind="iid", num_clients=10,
                                                           **{setting: 0.1}), CARD, seed=0)
    assert one.stats[setting] == 1


def test_by_client_counts_in_the_line_each_alone():
    """The line's "by client" part appears with validation clients alone or test clients alone
    and counts each (0 for the one absent): pins the two joined by ``and``, a key misspelt and
    the default 1 (or None)."""
    base = {"num_clients": 2, "samples_per_client": {"mean": 1, "std": 0, "min": 1, "max": 1},
            "classes_per_client": {"mean": 1, "std": 0, "min": 1, "max": 1}}
    head = ("2 clients | samples/client 1.0 ± 0.0 (min 1, max 1) | classes/client 1.00 ± 0.00")
    assert P.format_stats({**base, "val_clients": 1}) == (
        head + " | by client: 1 validation, 0 test clients")
    assert P.format_stats({**base, "test_clients": 2}) == (
        head + " | by client: 0 validation, 2 test clients")
    assert P.format_stats(base) == head


def test_split_sizes_where_the_fractions_leave_no_training_row():
    """Fractions that leave no training row give it one, taking from validation first, then
    from test: 10 rows at val 0.8 / test 0.3 -> 1 / 6 / 3; 2 rows at test 1.0 -> 1 / 0 / 1:
    pins ``- 2`` for ``- 1`` in either correction."""
    s = split_client(np.arange(10), PartitionConfig(val_fraction=0.8, test_fraction=0.3), 0, 0)
    assert (len(s.train), len(s.val), len(s.test)) == (1, 6, 3)
    s = split_client(np.arange(2), PartitionConfig(val_fraction=0.0, test_fraction=1.0), 0, 0)
    assert (len(s.train), len(s.val), len(s.test)) == (1, 0, 1)


def test_inner_dirichlet_sizes_default_to_an_even_split_or_are_the_configs():
    """Inner Dirichlet without ``partition.sizes``: the samples split evenly, the remainder to
    the first clients (122 over 4: 31, 31, 30, 30); with them, exactly them: pins the remainder
    subtracted and ``partition.sizes`` ignored."""
    even = partition_dataset(labelled(122), PartitionConfig(kind="inner_dirichlet",
                                                            num_clients=4), CARD, seed=0)
    assert [len(c) for c in even.clients] == [31, 31, 30, 30]
    given = partition_dataset(labelled(122), PartitionConfig(
        kind="inner_dirichlet", num_clients=4, sizes=[20, 30, 30, 42]), CARD, seed=0)
    assert [len(c) for c in given.clients] == [20, 30, 30, 42]


def test_selected_ids_are_the_seeds_stream_and_only_for_three_kinds():
    """``select_ids`` draws from ``default_rng([seed, 0x5E1D])`` without replacement; it is
    allowed for natural, IID and Dirichlet partitions and refused for others with its words;
    without a client key the refusal says "client": pins another stream, the kinds' list, the
    messages."""
    ids = np.repeat(np.arange(10), 3)
    uniq = np.unique(ids)
    chosen = uniq[np.random.default_rng([2, 0x5E1D]).choice(10, 4, replace=False)]
    assert np.array_equal(P.select_ids(ids, 4, 2, CARD), np.flatnonzero(np.isin(ids, chosen)))
    no_key = dataclasses.replace(CARD, client_key=None)
    with pytest.raises(ConfigError) as err:
        P.select_ids(ids, 11, 0, no_key)
    assert str(err.value) == ("partition.select_ids=11 is invalid: dataset=digits has only 10 "
                              "natural ids (client)")
    data = labelled(60, extra={"client": [f"w{i % 6}" for i in range(60)]})
    part = partition_dataset(data, PartitionConfig(kind="dirichlet", num_clients=2,
                                                   select_ids=3, min_partition_size=1), CARD, 0)
    assert sum(len(c) for c in part.clients) == 30
    with pytest.raises(ConfigError) as err:
        partition_dataset(data, PartitionConfig(kind="shard", num_clients=2, select_ids=3),
                          CARD, 0)
    assert str(err.value) == ("partition.select_ids=3 is invalid for partition=shard: it "
                              "selects natural ids for the natural, iid and dirichlet "
                              "partitions")


def test_too_many_clients_for_an_iid_split_is_refused_before_flwr_datasets():
    """An IID split into more clients than samples is refused by fedadapt's own check, in its
    words: pins "iid" dropped from the sample-based kinds."""
    with pytest.raises(ConfigError) as err:
        partition_dataset(labelled(5), PartitionConfig(kind="iid", num_clients=6), CARD, 0)
    assert str(err.value) == ("partition.num_clients=6 is invalid: the training split of "
                              "dataset=digits has only 5 samples")


def test_every_partitioner_fedadapt_builds_is_read_off_its_map():
    """Every partitioner fedadapt builds has its rows read off its drawn map
    (:func:`_positions`), not 1,000 ``load_partition`` calls: pins the lookup lost or turned
    round (the rows are the same either way; tests/test_partition_cache.py checks them)."""
    from flwr_datasets import partitioner as fp

    data = labelled(60).select_columns(["label"]).add_column("__idx__", range(60))
    for partitioner in (fp.IidPartitioner(num_partitions=3),
                        fp.DirichletPartitioner(num_partitions=3, partition_by="label",
                                                alpha=1.0, min_partition_size=1, seed=0),
                        fp.SizePartitioner(partition_sizes=[10, 20, 30])):
        partitioner.dataset = data
        partitioner.load_partition(0)
        positions = P._positions(partitioner, 3)
        assert positions is not None and all(p.dtype == np.int64 for p in positions)


def _with_test_users(n_train: int = 40):
    """A training split of 4 users (ids 3, 5, 7, 9) and the source's own test users 2 and 10
    (ids of numbers, as some sources have: their order as text is 10, 2)."""
    users = [3, 5, 7, 9] * (n_train // 4) + [2] * 5 + [10] * 6
    data = labelled(len(users), extra=None)
    return data.add_column("client", users).add_column(
        "test_client", [0] * n_train + [1] * 11)


def test_the_sources_own_test_users_are_unseen_clients_named_in_text_order():
    """A source with its own test users: each is an unseen client ``test:<id>`` (after the
    training clients, in the order of the ids' text) holding all its rows as test data; too many
    training clients are refused saying the test users come on top. Pins the names or rows
    dropped, the order by number and the refusal's words."""
    data = _with_test_users()
    part = partition_dataset(data, PartitionConfig(kind="natural", num_clients=4,
                                                   test_fraction=0.25), CARD, seed=0)
    assert part.names == ["3", "5", "7", "9", "test:10", "test:2"]
    assert [len(c.test) for c in part.clients[4:]] == [6, 5]
    assert all(not len(c.train) and not len(c.val) for c in part.clients[4:])
    assert np.array_equal(part.clients[5].test, np.arange(40, 45))
    with pytest.raises(ConfigError) as err:
        partition_dataset(data, PartitionConfig(kind="natural", num_clients=5), CARD, seed=0)
    assert str(err.value) == ("partition.num_clients=5 is invalid: dataset=digits has 4 natural "
                              f"ids ({CARD.client_key or 'client'}) to train on (its test users "
                              "come on top, from its test split)")


def test_an_unknown_held_out_domain_is_refused_naming_the_domains():
    """``partition.holdout`` not among the domains: one line naming it and the domains (pins the
    message lost)."""
    data = labelled(30, extra={"domain": [("photo", "sketch")[i % 2] for i in range(30)]})
    with pytest.raises(ConfigError) as err:
        partition_dataset(data, PartitionConfig(kind="domain", holdout="cartoon"), CARD, 0)
    assert str(err.value) == ("partition.holdout='cartoon' is invalid: domains are "
                              "['photo', 'sketch']")


def test_a_cached_domain_partition_holds_out_the_cards_default_domain(tmp_path):
    """Without ``partition.holdout`` a domain partition holds out the card's default domain,
    through the cache too (pins the card not passed on when the cache computes)."""
    import dataclasses as dc

    card = dc.replace(CARD, default_holdout="sketch")
    data = labelled(30, extra={"domain": [("photo", "sketch", "art")[i % 3] for i in range(30)]})

    class Prepared:
        fingerprint, name = "D", "digits"

        def load(self):
            return {"train": data}

    part = P.cached_partition(Prepared(), PartitionConfig(kind="domain"), card, 0, str(tmp_path))
    assert part.unseen_name == "sketch" and sorted(part.names) == ["art", "photo"]


def test_mixed_clients_are_the_superclass_partitions_alone():
    """``partition.mixed_fraction`` mixes clients for the superclass partition only: an IID
    partition with it set keeps every row in its clients (pins mixing for any kind)."""
    part = partition_dataset(labelled(40), PartitionConfig(kind="iid", num_clients=4,
                                                           mixed_fraction=0.5), CARD, seed=0)
    assert np.array_equal(np.sort(np.concatenate([members(c) for c in part.clients])),
                          np.arange(40))


def test_ids_per_client_groups_natural_ids_only():
    """``partition.ids_per_client`` groups a natural partition's ids; a domain partition keeps
    one client per domain whatever it says (pins grouping for any kind)."""
    data = labelled(30, extra={"domain": [("photo", "sketch", "art")[i % 3] for i in range(30)]})
    part = partition_dataset(data, PartitionConfig(kind="domain", holdout="none",
                                                   ids_per_client=2), CARD, seed=0)
    assert sorted(part.names) == ["art", "photo", "sketch"]
