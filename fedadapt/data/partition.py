"""Split the training set into clients with flwr-datasets partitioners, then each client into
train / val / test with the seed, and describe the result (ICIIA's Table 3 statistics).

A run's partition is computed once and cached (:func:`cached_partition`): one sealed ``.npz``
per key under ``<cache_dir>/partitions/``, keyed by the prepared data set's fingerprint, the
whole partition config, the card fields read here, the seed and the versions of the libraries
that draw it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from fedadapt.config import ConfigError, PartitionConfig
from fedadapt.data.catalogue import DatasetCard
from fedadapt.data.loading import column
from fedadapt.log import log


@dataclass(frozen=True)
class ClientSplit:
    """Indices into the prepared ``train`` split."""

    train: np.ndarray
    val: np.ndarray
    test: np.ndarray

    def __len__(self) -> int:
        return len(self.train) + len(self.val) + len(self.test)


@dataclass
class Partition:
    clients: list[ClientSplit]
    #: Client names (natural id or domain), "client-<i>" otherwise.
    names: list[str]
    #: Domain partition: the held-out domain's samples, never trained on (the unseen client).
    unseen: Optional[np.ndarray] = None
    unseen_name: Optional[str] = None
    stats: dict = field(default_factory=dict)


#: Kinds whose flwr-datasets partitioner cuts the data in order (shuffled with the seed first).
IN_ORDER = ("iid", "size", "exponential", "linear", "square")
#: Kinds that split the data by its label.
BY_LABEL = ("dirichlet", "shard", "pathological", "inner_dirichlet")


def _partitioner(cfg: PartitionConfig, card: DatasetCard, seed: int, mixed: int = 0,
                 n: int = 0):
    """The flwr-datasets partitioner for ``cfg.kind`` (``n``: samples to partition)."""
    from flwr_datasets import partitioner as fp

    k = cfg.num_clients
    if cfg.kind == "iid":
        return fp.IidPartitioner(num_partitions=k)
    if cfg.kind == "superclass":  # one superclass (coarse label) per client
        return fp.PathologicalPartitioner(
            num_partitions=k - mixed, partition_by=cfg.superclass_key,
            num_classes_per_partition=1, class_assignment_mode="first-deterministic",
            shuffle=True, seed=seed)
    if cfg.kind == "dirichlet":
        return fp.DirichletPartitioner(
            num_partitions=k, partition_by="label", alpha=cfg.alpha,
            min_partition_size=cfg.min_partition_size, self_balancing=False, shuffle=True,
            seed=seed)
    if cfg.kind == "shard":
        return fp.ShardPartitioner(
            num_partitions=k, partition_by="label", num_shards_per_partition=cfg.shards_per_client,
            shard_size=cfg.shard_size, keep_incomplete_shard=cfg.keep_incomplete_shard,
            shuffle=True, seed=seed)
    if cfg.kind == "pathological":
        return fp.PathologicalPartitioner(
            num_partitions=k, partition_by="label",
            num_classes_per_partition=cfg.classes_per_client,
            class_assignment_mode=cfg.class_assignment, shuffle=True, seed=seed)
    if cfg.kind == "inner_dirichlet":
        sizes = list(cfg.sizes) if cfg.sizes else [n // k + (i < n % k) for i in range(k)]
        return fp.InnerDirichletPartitioner(partition_sizes=sizes, partition_by="label",
                                            alpha=cfg.alpha, shuffle=True, seed=seed)
    if cfg.kind == "size":
        return fp.SizePartitioner(partition_sizes=[int(x) for x in cfg.sizes])
    if cfg.kind in ("exponential", "linear", "square"):
        return {"exponential": fp.ExponentialPartitioner, "linear": fp.LinearPartitioner,
                "square": fp.SquarePartitioner}[cfg.kind](num_partitions=k)
    key = "client" if cfg.kind == "natural" else "domain"
    if cfg.kind == "natural" and cfg.ids_per_client > 1:
        return fp.GroupedNaturalIdPartitioner(partition_by=key, group_size=cfg.ids_per_client,
                                              mode="allow-smaller", sort_unique_ids=True)
    return fp.NaturalIdPartitioner(partition_by=key)


def _log_notes(notes: list[str], cfg: PartitionConfig) -> None:
    """flwr-datasets' notes (e.g. "sizes do not sum to the data set") as one line per kind:
    its Dirichlet partitioner warns at every redraw, 400 characters each, so those become one
    line with their count. (Library deprecation chatter is dropped before this.)"""
    import re

    kinds: dict[str, list[str]] = {}
    for note in notes:
        kinds.setdefault(re.sub(r"\[[^\]]*\]|\d+", "#", note), []).append(note)
    for kind, seen in kinds.items():
        if kind.startswith("The specified min_partition_size"):
            log(f"[data] flwr-datasets redrew the Dirichlet partition {len(seen)} time(s): a "
                f"client had fewer than partition.min_partition_size={cfg.min_partition_size} "
                f"samples")
        else:
            log(f"[data] flwr-datasets: {seen[0]}"
                + (f" ({len(seen)} times)" if len(seen) > 1 else ""))


def _refused(cfg: PartitionConfig, err: Exception) -> ConfigError:
    """flwr-datasets' refusal of a partition, as one line naming the settings."""
    if cfg.kind == "dirichlet":
        return ConfigError(
            f"partition.alpha={cfg.alpha} with partition.num_clients={cfg.num_clients}: "
            f"flwr-datasets could not give every client partition.min_partition_size="
            f"{cfg.min_partition_size} samples ({err}); lower min_partition_size or num_clients")
    keys = {"shard": "partition.shards_per_client / partition.shard_size",
            "pathological": "partition.classes_per_client",
            "inner_dirichlet": "partition.sizes / partition.alpha",
            "size": "partition.sizes"}.get(cfg.kind, "partition.num_clients")
    return ConfigError(f"partition={cfg.kind} with partition.num_clients={cfg.num_clients} is "
                       f"invalid: flwr-datasets refused it ({err}); change {keys}")


def split_client(indices: np.ndarray, cfg: PartitionConfig, seed: int, client: int) -> ClientSplit:
    """Seeded train/val/test split of one client's indices (train keeps at least one sample)."""
    rng = np.random.default_rng([seed, client])
    perm = rng.permutation(np.asarray(indices, dtype=np.int64))
    n = len(perm)
    n_test = int(round(n * cfg.test_fraction))
    n_val = int(round(n * cfg.val_fraction))
    if n - n_test - n_val < 1:
        n_val = max(0, n - n_test - 1)
        n_test = min(n_test, n - n_val - 1)
    return ClientSplit(train=np.sort(perm[n_test + n_val:]),
                       val=np.sort(perm[n_test:n_test + n_val]), test=np.sort(perm[:n_test]))


def select_ids(ids: np.ndarray, k: int, seed: int, card: DatasetCard) -> np.ndarray:
    """Rows (ascending) of a seeded selection of ``k`` distinct natural ids.

    The ids are drawn from their sorted unique values, so the selection depends on the seed and
    the set of ids only, never on the order of the rows.
    """
    uniq = np.unique(ids)
    if k > len(uniq):
        raise ConfigError(f"partition.select_ids={k} is invalid: dataset={card.name} has only "
                          f"{len(uniq)} natural ids ({card.client_key or 'client'})")
    chosen = uniq[np.random.default_rng([seed, 0x5E1D]).choice(len(uniq), k, replace=False)]
    return np.flatnonzero(np.isin(ids, chosen))


def partition_dataset(train_ds, cfg: PartitionConfig, card: DatasetCard, seed: int) -> Partition:
    """Partition ``train_ds`` (standard columns) into clients as ``cfg`` says."""
    rows = _selected_rows(train_ds, cfg, card, seed)  # partition.select_ids, or None for all
    n = len(train_ds) if rows is None else len(rows)
    _check_enough(cfg, card, n)
    key = _partition_key(train_ds.column_names, cfg, card)
    held = test_user_rows(train_ds, cfg, card)  # the source's own test users, if it has some
    light = _rows_to_partition(train_ds, cfg, key, rows, held, seed)
    mixed: list = []
    if cfg.kind == "superclass" and cfg.mixed_fraction > 0:
        light, mixed = _mixed_clients(light, cfg, seed)
    indices, firsts = _run_partitioner(light, cfg, card, seed, key, len(mixed))
    indices, names = _named_partitions(indices, firsts, cfg, key, mixed)
    indices, names, unseen, unseen_name = _hold_out_or_sample(indices, names, cfg, card, seed,
                                                              held)
    clients = [split_client(idx, cfg, seed, i) for i, idx in enumerate(indices)]
    if cfg.val_clients > 0:  # "by client" validation: whole training clients
        _hold_out_validation_clients(clients, indices, cfg, seed)
    if held is not None:  # each test user is an unseen client holding test data only
        _add_test_users(train_ds, held, clients, indices, names)
    if cfg.test_clients > 0:  # "by client": unseen clients hold test data only
        _hold_out_test_clients(clients, indices, cfg, seed)
    part = Partition(clients=clients, names=names, unseen=unseen, unseen_name=unseen_name)
    part.stats = partition_stats(part, column(train_ds, "label"))
    if rows is not None:
        part.stats["selected_ids"] = {"ids": int(cfg.select_ids), "samples": int(n)}
    return part


def _partition_key(columns: list[str], cfg: PartitionConfig, card: DatasetCard
                   ) -> Optional[str]:
    """The column a keyed partition groups by (``client``, ``domain`` or the superclass key),
    None for the others; refused when the data set has no such column."""
    key = {"natural": "client", "domain": "domain", "superclass": cfg.superclass_key
           }.get(cfg.kind)
    if key is not None and key not in columns:
        raise ConfigError(f"partition={cfg.kind} is invalid for dataset={card.name}: it has no "
                          f"'{key}' column (the card maps none)")
    return key


def _rows_to_partition(train_ds, cfg: PartitionConfig, key: Optional[str],
                       rows: Optional[np.ndarray], held: Optional[np.ndarray], seed: int):
    """The label, key and row-index (``__idx__``) columns of the rows the partitioner cuts:
    ``partition.select_ids``' rows (or all) less the source's own test users, shuffled with the
    seed for the partitioners that cut contiguously."""
    light = train_ds.select_columns([c for c in ("label", key) if c]).add_column(
        "__idx__", np.arange(len(train_ds)))
    keep = rows  # partition.select_ids' rows, or None for all
    if held is not None:  # they never reach the partitioner: the training users do
        keep = np.setdiff1d(np.arange(len(train_ds)) if keep is None else keep, held)
    if keep is not None:
        light = light.select(keep)
    if cfg.kind in IN_ORDER:  # these partitioners cut contiguously: shuffle first, with the seed
        light = light.shuffle(seed=seed)
    return light


def _run_partitioner(light, cfg: PartitionConfig, card: DatasetCard, seed: int,
                     key: Optional[str], mixed: int) -> tuple[list[np.ndarray], list]:
    """Each partition's rows and first key value (:func:`_load_partitions`), Flower Datasets'
    notes logged and its refusals in the config's words; a partition left empty refused (but
    for natural and domain partitions)."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            partitioner = _partitioner(cfg, card, seed, mixed, n=len(light))
            partitioner.dataset = light
            indices, firsts = ([], []) if len(light) == 0 else _load_partitions(partitioner, key)
    except ValueError as err:
        raise _refused(cfg, err) from err
    _log_notes([str(w.message) for w in caught
                if not issubclass(w.category, (DeprecationWarning, FutureWarning))], cfg)
    empty = [i for i, idx in enumerate(indices) if len(idx) == 0]
    if empty and cfg.kind not in ("natural", "domain"):
        raise ConfigError(f"partition={cfg.kind} with partition.num_clients={cfg.num_clients} "
                          f"is invalid for dataset={card.name}: client(s) {empty[:5]} get no "
                          f"sample; use fewer clients")
    return indices, firsts


def _named_partitions(indices: list[np.ndarray], firsts: list, cfg: PartitionConfig,
                      key: Optional[str], mixed: list) -> tuple[list[np.ndarray], list[str]]:
    """The partitions with the superclass partition's mixed clients first, and each client's
    name: its key value for a keyed partition, ``client-<i>`` otherwise."""
    if cfg.kind == "superclass":  # the mixed clients take the first partition ids
        indices = [column(p, "__idx__", np.int64) for p in mixed] + indices
        names = [f"client-{i}" for i in range(len(indices))]
    elif key is None:
        names = [f"client-{i}" for i in range(len(indices))]
    else:
        names = [str(first) if len(idx) else f"empty-{i}"
                 for i, (idx, first) in enumerate(zip(indices, firsts))]
    return indices, names


def _add_test_users(train_ds, held: np.ndarray, clients: list[ClientSplit],
                    indices: list[np.ndarray], names: list[str]) -> None:
    """The source's own test users appended as unseen clients (``test:<user>``) holding test
    data only, in the order of their ids' text (ids of any type)."""
    users = column(train_ds.select(held), "client")
    for uid in sorted(np.unique(users).tolist(), key=str):
        whole = np.sort(held[users == uid]).astype(np.int64)
        clients.append(ClientSplit(train=whole[:0], val=whole[:0], test=whole))
        indices.append(whole)
        names.append(f"test:{uid}")


def _hold_out_test_clients(clients: list[ClientSplit], indices: list[np.ndarray],
                           cfg: PartitionConfig, seed: int) -> None:
    """``partition.test_clients``: that fraction of the clients, drawn with the seed, made
    unseen clients whose whole partition is test data."""
    k = int(round(cfg.test_clients * len(clients)))
    if not 0 < k < len(clients):
        raise ConfigError(f"partition.test_clients={cfg.test_clients} is invalid: with "
                          f"{len(clients)} clients it holds out {k}; keep some on both sides")
    held = np.random.default_rng([seed, 0x7E57]).choice(len(clients), k, replace=False)
    for j in held:
        whole = np.sort(np.asarray(indices[j], dtype=np.int64))
        clients[j] = ClientSplit(train=whole[:0], val=whole[:0], test=whole)


def _load_partitions(partitioner, key: Optional[str]) -> tuple[list[np.ndarray], list]:
    """Each partition's rows of the training split (its ``__idx__``, in the partitioner's
    order) and its first ``key`` value (None without a key).

    Not through ``load_partition(i)`` for every client where :func:`_positions` knows the
    partitioner: each call builds a ``Dataset`` (a ``select``) whose column numpy then reads
    row by row, 4.5 s for Fashion-MNIST in 1,000 clients. ``load_partition(0)`` runs first all
    the same, so every partitioner checks its settings and draws exactly as before.
    """
    k = partitioner.num_partitions
    first = partitioner.load_partition(0)
    positions = _positions(partitioner, k)
    if positions is None:
        parts = [first] + [partitioner.load_partition(i) for i in range(1, k)]
        return ([column(p, "__idx__", np.int64) for p in parts],
                [p[key][0] if key and len(p) else None for p in parts])
    ds = partitioner.dataset  # read after the draw: the shard partitioner sorts its dataset
    rows = column(ds, "__idx__", np.int64)
    keys = ds.with_format("arrow")[key].to_pylist() if key else None
    return ([rows[p] for p in positions],
            [keys[p[0]] if keys is not None and len(p) else None for p in positions])


def _positions(partitioner, k: int) -> Optional[list[np.ndarray]]:
    """The rows of ``partitioner.dataset`` that ``load_partition(i)`` selects, for each of the
    ``k`` partitions, read off a partitioner that has drawn: the map of those whose
    ``load_partition`` selects ``_partition_id_to_indices[i]``, IID's contiguous shards cut as
    ``Dataset.shard`` cuts them. None for any other partitioner (tests/test_partition_cache.py
    checks every kind against ``load_partition``)."""
    from flwr_datasets import partitioner as fp

    method = type(partitioner).load_partition
    if method is fp.IidPartitioner.load_partition:  # Dataset.shard(k, i, contiguous=True)
        return np.array_split(np.arange(len(partitioner.dataset), dtype=np.int64), k)
    selecting = (fp.DirichletPartitioner, fp.ShardPartitioner, fp.PathologicalPartitioner,
                 fp.InnerDirichletPartitioner, fp.NaturalIdPartitioner,
                 fp.GroupedNaturalIdPartitioner, fp.SizePartitioner, fp.IdToSizeFncPartitioner)
    if not any(method is cls.load_partition for cls in selecting):
        return None
    mapping = partitioner._partition_id_to_indices
    return [np.asarray(mapping[i], dtype=np.int64) for i in range(k)]


#: Bump when partitioning changes what it returns, so stale cached partitions are not reused.
_CACHE_VERSION = 1
#: The libraries whose random draws and cuts make the partition.
_DRAWN_BY = ("flwr-datasets", "datasets", "numpy")


def partition_key(fingerprint: str, cfg: PartitionConfig, card: DatasetCard, seed: int) -> str:
    """The cache key of a partition: everything :func:`partition_dataset` reads."""
    from importlib.metadata import version

    blob = json.dumps({"v": _CACHE_VERSION, "data": fingerprint,
                       "partition": dataclasses.asdict(cfg),
                       "card": {k: getattr(card, k)
                                for k in ("name", "client_key", "default_holdout")},
                       "seed": seed, "libraries": {lib: version(lib) for lib in _DRAWN_BY}},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_partition(prepared, cfg: PartitionConfig, card: DatasetCard, seed: int,
                     cache_dir: str) -> Partition:
    """:func:`partition_dataset` of ``prepared``'s training split, computed once per key
    (:func:`partition_key`) and loaded from ``<cache_dir>/partitions/`` by later runs: 1,000
    clients take seconds to draw, milliseconds to load. A cache file that fails its digest or
    cannot be read is recomputed (one log line)."""
    from fedadapt.data.integrity import remove, valid_or_removed

    key = partition_key(prepared.fingerprint, cfg, card, seed)
    path = Path(cache_dir).expanduser() / "partitions" / f"{prepared.name}-{cfg.kind}-{key}.npz"
    if valid_or_removed(path):
        try:
            return _load_cached(path, key)
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as err:
            log(f"[cache] partition {path}: unreadable ({type(err).__name__}: {err}); "
                f"recomputing it")
            remove(path)
    part = partition_dataset(prepared.load()["train"], cfg, card, seed)
    _save_cached(path, key, part)
    return part


def _save_cached(path: Path, key: str, part: Partition) -> None:
    """One ``.npz``: every client's train, val and test rows end to end, their lengths, the
    unseen rows and a JSON record (key, names, statistics); written under a temporary name,
    sealed with its SHA-256 and renamed. A failed write costs the next run a recomputation,
    not this run."""
    from fedadapt.data.integrity import seal_and_rename

    splits = [s for c in part.clients for s in (c.train, c.val, c.test)]
    meta = {"key": key, "names": part.names, "unseen_name": part.unseen_name,
            "stats": part.stats}
    arrays = {"rows": np.concatenate(splits).astype(np.int64),
              "lengths": np.array([len(s) for s in splits], dtype=np.int64),
              "meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    if part.unseen is not None:
        arrays["unseen"] = np.asarray(part.unseen, dtype=np.int64)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as fh:
            np.savez(fh, **arrays)
        seal_and_rename(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):  # absent, or its folder is not one
            tmp.unlink()
        log(f"[cache] partition {path}: not saved ({err}); the next run recomputes it")


def _load_cached(path: Path, key: str) -> Partition:
    """The partition :func:`_save_cached` wrote (ValueError if it is not the one for ``key``)."""
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        rows, lengths = z["rows"], z["lengths"]
        unseen = z["unseen"] if "unseen" in z.files else None
    names = meta["names"]
    if (meta["key"] != key or lengths.sum() != len(rows) or len(lengths) != 3 * len(names)
            or not names):
        raise ValueError("its content does not match its key")
    splits = np.split(rows, np.cumsum(lengths)[:-1])
    clients = [ClientSplit(*splits[i:i + 3]) for i in range(0, len(splits), 3)]
    return Partition(clients=clients, names=names, unseen=unseen,
                     unseen_name=meta["unseen_name"], stats=meta["stats"])


def _selected_rows(train_ds, cfg: PartitionConfig, card: DatasetCard, seed: int
                   ) -> Optional[np.ndarray]:
    """``partition.select_ids``: the rows of the selected natural ids (None: every row)."""
    if cfg.select_ids is None:
        return None
    if cfg.kind not in ("natural", "iid", "dirichlet"):
        raise ConfigError(f"partition.select_ids={cfg.select_ids} is invalid for "
                          f"partition={cfg.kind}: it selects natural ids for the natural, "
                          f"iid and dirichlet partitions")
    if "client" not in train_ds.column_names:
        raise ConfigError(f"partition.select_ids={cfg.select_ids} is invalid for "
                          f"dataset={card.name}: it has no natural id ('client') column "
                          f"(the card maps none)")
    return select_ids(column(train_ds, "client"), cfg.select_ids, seed, card)


def _check_enough(cfg: PartitionConfig, card: DatasetCard, n: int) -> None:
    """Enough samples for the clients a sample-based partitioner makes."""
    if cfg.kind not in ("iid", *BY_LABEL, *IN_ORDER):
        return
    if cfg.num_clients > n:
        raise ConfigError(f"partition.num_clients={cfg.num_clients} is invalid: the training "
                          f"split of dataset={card.name} has only {n} samples")
    if cfg.kind == "dirichlet" and cfg.num_clients * cfg.min_partition_size > n:
        raise ConfigError(
            f"partition.num_clients={cfg.num_clients} is invalid: with "
            f"partition.min_partition_size={cfg.min_partition_size} it needs "
            f"{cfg.num_clients * cfg.min_partition_size} samples, dataset={card.name} has {n}")


def _hold_out_or_sample(indices: list, names: list, cfg: PartitionConfig, card: DatasetCard,
                        seed: int, held):
    """The domain partition's held-out domain (the unseen client), or the natural partition's
    seeded ``num_clients`` of its ids: ``(indices, names, unseen, unseen_name)``."""
    unseen = unseen_name = None
    if cfg.kind == "domain":
        holdout = cfg.holdout or card.default_holdout
        if holdout is not None and holdout.lower() != "none":  # "none": every domain a client
            if holdout not in names:
                raise ConfigError(f"partition.holdout={holdout!r} is invalid: domains are {names}")
            j = names.index(holdout)
            unseen, unseen_name = indices.pop(j), names.pop(j)
    elif cfg.kind == "natural" and cfg.num_clients < len(indices):
        keep = np.sort(np.random.default_rng(seed).choice(len(indices), cfg.num_clients,
                                                          replace=False))
        indices, names = [indices[k] for k in keep], [names[k] for k in keep]
    elif cfg.kind == "natural" and cfg.num_clients > len(indices):
        also = "" if held is None else " (its test users come on top, from its test split)"
        raise ConfigError(f"partition.num_clients={cfg.num_clients} is invalid: dataset="
                          f"{card.name} has {len(indices)} natural ids "
                          f"({card.client_key or 'client'}) to train on{also}")
    return indices, names, unseen, unseen_name

def test_user_rows(train_ds, cfg: PartitionConfig, card: DatasetCard) -> Optional[np.ndarray]:
    """Rows of the source's own test users (the ``test_client`` column that
    :func:`fedadapt.data.loading.standardise` adds for a card with ``test_split_clients``,
    e.g. FedScale's iNaturalist test users), or None when the data set has none."""
    if "test_client" not in train_ds.column_names:
        return None
    if cfg.kind != "natural":
        raise ConfigError(f"partition={cfg.kind} is invalid for dataset={card.name}: its test "
                          f"split holds its own users (the unseen test clients); partition it "
                          f"by user with partition=natural")
    if cfg.test_clients > 0:
        raise ConfigError(f"partition.test_clients={cfg.test_clients} is invalid for "
                          f"dataset={card.name}: its test users (its test split) are the unseen "
                          f"test clients; set it to 0")
    return np.flatnonzero(column(train_ds, "test_client", bool))


def _hold_out_validation_clients(clients: list[ClientSplit], indices: list[np.ndarray],
                                 cfg: PartitionConfig, seed: int) -> None:
    """Make a seeded ``cfg.val_clients`` of the training clients validation clients: all their
    data becomes validation data (ICIIA: "we leave out 20% of the users originally for training
    now for validation"). In place."""
    k = int(round(cfg.val_clients * len(clients)))
    if not 0 < k < len(clients):
        raise ConfigError(f"partition.val_clients={cfg.val_clients} is invalid: with "
                          f"{len(clients)} training clients it holds out {k}; keep some on both "
                          f"sides")
    for j in np.random.default_rng([seed, 0x7A11]).choice(len(clients), k, replace=False):
        whole = np.sort(np.asarray(indices[j], dtype=np.int64))
        clients[j] = ClientSplit(train=whole[:0], val=whole, test=whole[:0])


def _mixed_clients(light, cfg: PartitionConfig, seed: int):
    """Set aside ``mixed_fraction`` of the data for ``mixed_fraction`` of the clients, who draw
    from all classes (an IID split of it); the rest goes to the one-superclass partitioner."""
    from flwr_datasets.partitioner import IidPartitioner

    k = int(round(cfg.mixed_fraction * cfg.num_clients))
    if k == 0:
        return light, []
    shuffled = light.shuffle(seed=seed)
    cut = int(round(len(shuffled) * k / cfg.num_clients))
    iid = IidPartitioner(num_partitions=k)
    iid.dataset = shuffled.select(range(cut))
    mixed = [iid.load_partition(i) for i in range(k)]
    if k == cfg.num_clients:
        return shuffled.select(range(0)), mixed
    return shuffled.select(range(cut, len(shuffled))), mixed


def partition_stats(part: Partition, labels: np.ndarray) -> dict:
    """Samples per client and classes per client (mean and std, as ICIIA's Table 3)."""
    sizes = np.array([len(c) for c in part.clients])
    classes = np.array([len(np.unique(labels[np.concatenate([c.train, c.val, c.test])]))
                        for c in part.clients])
    stats = {
        "num_clients": len(part.clients),
        "samples_per_client": {"mean": float(sizes.mean()), "std": float(sizes.std()),
                               "min": int(sizes.min()), "max": int(sizes.max())},
        "classes_per_client": {"mean": float(classes.mean()), "std": float(classes.std()),
                               "min": int(classes.min()), "max": int(classes.max())},
        "train_samples": int(sum(len(c.train) for c in part.clients)),
        # "by client" splits: clients holding only validation / only test data
        "val_clients": sum(1 for c in part.clients if len(c.val) and not len(c) - len(c.val)),
        "test_clients": sum(1 for c in part.clients if len(c.test) and not len(c) - len(c.test)),
        "per_client": [{"name": nm, "samples": int(s), "classes": int(k)}
                       for nm, s, k in zip(part.names, sizes, classes)],
    }
    if part.unseen is not None:
        stats["unseen"] = {"name": part.unseen_name, "samples": int(len(part.unseen))}
    return stats


def format_stats(stats: dict) -> str:
    s, c = stats["samples_per_client"], stats["classes_per_client"]
    line = (f"{stats['num_clients']} clients | samples/client {s['mean']:.1f} ± {s['std']:.1f} "
            f"(min {s['min']}, max {s['max']}) | classes/client {c['mean']:.2f} ± {c['std']:.2f}")
    if "selected_ids" in stats:
        line += (f" | {stats['selected_ids']['ids']} natural ids selected "
                 f"({stats['selected_ids']['samples']} samples)")
    if stats.get("val_clients") or stats.get("test_clients"):
        line += (f" | by client: {stats.get('val_clients', 0)} validation, "
                 f"{stats.get('test_clients', 0)} test clients")
    if "unseen" in stats:
        line += f" | unseen: {stats['unseen']['name']} ({stats['unseen']['samples']} samples)"
    return line
