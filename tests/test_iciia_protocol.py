"""ICIIA's protocols (issue 17, items 10, 11, 13): iNaturalist's user-level splits (the data's
own test users as unseen clients, 20% of the training users for validation), FEMNIST's 72/18/10
within each writer, and the authors' settings (layers per data set, SGD without momentum, the
cold-start thresholds, the fine-tuning baseline's early stopping, the ReLU option)."""

import numpy as np
import pytest
import torch
from conftest import tiny_run

from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value
from fedadapt.config import ConfigError, DatasetConfig, PartitionConfig, validate
from fedadapt.data.catalogue import DatasetCard, load_card
from fedadapt.data.loading import standardise
from fedadapt.data.partition import partition_dataset
from fedadapt.methods.plugin.iciia import Iciia, IciiaConfig

#: A card like iNaturalist's: its test split holds users of its own.
USERS_CARD = DatasetCard(name="users", source="local", hub_id=None,
                         columns={"image": "image", "label": "label", "client": "user_id"},
                         splits={"train": "train", "test": "test"}, num_classes=5,
                         client_key="user_id", test_split_clients=True)


def _split(users: list[int], per_user: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    n = len(users) * per_user
    return Dataset.from_dict(
        {"image": [rng.integers(0, 255, (4, 4), dtype=np.uint8) for _ in range(n)],
         "label": rng.integers(0, 5, n).tolist(),
         "user_id": [u for u in users for _ in range(per_user)]},
        features=Features({"image": Image(), "label": ClassLabel(num_classes=5),
                           "user_id": Value("int64")}))


def _rows(part, kind):
    return [np.concatenate([getattr(c, kind)]) for c in part.clients]


def test_the_datas_own_test_users_are_the_unseen_clients_and_a_fifth_validates():
    """A generated natural partition like FedScale's iNaturalist: 20 training users (ids 0-19)
    and 5 test users in the test split (ids 15-19 again: ids may repeat across splits, users do
    not). After preparation and partition=natural with val_clients 0.2: the 5 test users are
    unseen clients holding exactly their test-split rows, 4 training users hold validation
    data only, 16 training data only; no row is in two clients; nothing is a global test set."""
    raw = DatasetDict(train=_split(list(range(20)), 6, 0), test=_split(list(range(15, 20)), 4, 1))
    prepared = standardise(raw, USERS_CARD, DatasetConfig(name="users", test_fraction=0.0),
                           seed=0)
    assert len(prepared["test"]) == 0 and len(prepared["train"]) == 20 * 6 + 5 * 4
    marker = np.asarray(prepared["train"]["test_client"])
    assert marker.sum() == 20 and (marker[:120] == 0).all()
    cfg = PartitionConfig(kind="natural", num_clients=20, val_clients=0.2, val_fraction=0.0,
                          test_fraction=0.0)
    part = partition_dataset(prepared["train"], cfg, USERS_CARD, seed=0)
    assert len(part.clients) == 25
    test_users = [c for c in part.clients if len(c.test)]
    val_users = [c for c in part.clients if len(c.val)]
    train_users = [c for c in part.clients if len(c.train)]
    assert (len(test_users), len(val_users), len(train_users)) == (5, 4, 16)
    assert all(len(c) == len(c.test) == 4 for c in test_users)  # test data only
    assert all(len(c) == len(c.val) == 6 for c in val_users)  # whole users, validation only
    assert all(len(c) == len(c.train) == 6 for c in train_users)
    held = np.sort(np.concatenate([c.test for c in test_users]))
    np.testing.assert_array_equal(held, np.flatnonzero(marker))  # the test split's rows
    everything = np.concatenate([np.concatenate([c.train, c.val, c.test]) for c in part.clients])
    assert sorted(everything.tolist()) == list(range(140))
    users = np.asarray(prepared["train"]["client"])
    for c in part.clients:  # each client is one user of one split
        rows = np.concatenate([c.train, c.val, c.test])
        assert len(set(users[rows])) == 1 and len(set(marker[rows])) == 1
    assert part.stats["val_clients"] == 4 and part.stats["test_clients"] == 5
    again = partition_dataset(prepared["train"], cfg, USERS_CARD, seed=0)
    assert [len(c.val) for c in again.clients] == [len(c.val) for c in part.clients]  # seeded


def test_user_level_splits_refuse_what_they_cannot_honour():
    raw = DatasetDict(train=_split(list(range(10)), 3, 0), test=_split([50, 51], 2, 1))
    train = standardise(raw, USERS_CARD, DatasetConfig(name="users", test_fraction=0.0),
                        seed=0)["train"]
    with pytest.raises(ConfigError, match="partition.num_clients=12 is invalid.*10 natural ids"):
        partition_dataset(train, PartitionConfig(kind="natural", num_clients=12), USERS_CARD, 0)
    with pytest.raises(ConfigError, match="partition=natural"):
        partition_dataset(train, PartitionConfig(kind="iid", num_clients=3), USERS_CARD, 0)
    with pytest.raises(ConfigError, match="partition.test_clients"):
        partition_dataset(train, PartitionConfig(kind="natural", num_clients=10,
                                                 test_clients=0.2), USERS_CARD, 0)
    with pytest.raises(ConfigError, match="partition.val_clients"):
        partition_dataset(train, PartitionConfig(kind="natural", num_clients=10,
                                                 val_clients=0.01), USERS_CARD, 0)


def test_validation_clients_need_a_server_trained_method(cache_dir):
    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.experiment import prepare_run

    cfg = validate(tiny_run(cache_dir, LinearHeadConfig(),
                            partition=PartitionConfig(kind="iid", num_clients=5,
                                                      val_clients=0.2)))
    with pytest.raises(ConfigError, match="partition.val_clients"):
        prepare_run(cfg, quiet=True)


def _preset(experiment: str, *more: str):
    from fedadapt.entry import compose_config, to_run_config

    return to_run_config(compose_config([f"experiment={experiment}", *more]))


def test_femnist_preset_splits_each_writer_72_18_10_and_keeps_no_global_test_set():
    run = _preset("iciia_femnist")
    assert run.dataset.test_fraction == 0.0 and run.partition.kind == "natural"
    assert run.partition.num_clients == 3597
    writers = [f"w{i % 4}" for i in range(400)]  # 4 writers of 100 samples
    ds = Dataset.from_dict({"label": (np.arange(400) % 62).tolist(), "client": writers})
    cfg = PartitionConfig(**{**vars(run.partition), "num_clients": 4})
    part = partition_dataset(ds, cfg, load_card("femnist"), seed=0)
    assert [(len(c.train), len(c.val), len(c.test)) for c in part.clients] == [(72, 18, 10)] * 4


def test_presets_take_the_authors_settings():
    """N layers per data set (FEMNIST 1, iNaturalist 2, the ImageNet stand-in 3), SGD without
    momentum, the ReLU before the classifier, ICIIA-T's cold start below 5 cached images
    (ICIIA-B: 3), the papers' backbones and the original-model phase."""
    femnist, inat, imagenet = (_preset(e) for e in ("iciia_femnist", "iciia_inaturalist",
                                                    "iciia_cifar100"))
    assert (femnist.method.layers, inat.method.layers, imagenet.method.layers) == (1, 2, 3)
    for run in (femnist, inat, imagenet):
        assert run.method.momentum == 0.0 and run.method.classifier_relu
        assert run.method.lr == 0.01 and run.method.clip == 5.0 and run.method.patience == 10
    assert _preset("iciia_femnist", "method=iciia_t").method.min_history == 5
    assert femnist.method.min_history == 3
    assert femnist.backbone.name == "leaf_cnn" and inat.backbone.name == "efficientnet_b0"
    assert femnist.original.train_backbone and inat.original.train_backbone
    assert inat.original.backbone_lr_scale == 0.1 and inat.original.lr_decay == 0.1
    assert inat.partition.val_clients == 0.2 and inat.partition.test_clients == 0.0
    assert not imagenet.original.train_backbone  # frozen ImageNet backbones, as the paper


def test_relu_before_the_classifier_is_an_option():
    torch.manual_seed(0)
    plain = Iciia(8, 3, layers=1, groups=2, heads=2).eval()
    relu = Iciia(8, 3, layers=1, groups=2, heads=2, classifier_relu=True).eval()
    relu.load_state_dict(plain.state_dict())
    x = torch.randn(5, 8)
    encoded = plain.encode(x[None])[0]
    torch.testing.assert_close(plain(x), plain.classifier(encoded))
    torch.testing.assert_close(relu(x), plain.classifier(torch.relu(encoded)))


def test_finetuning_baseline_keeps_its_best_validation_epoch(cache_dir, monkeypatch):
    """The authors' fine-tuning: each epoch of batches of 16 with clipping 5, early stopping on
    the client's validation split, the epoch before any training (the original classifier)
    counting as epoch 0. The epoch's training is replaced here by one that makes the layer
    answer class k always: with validation rows of class k that epoch wins (the result is the
    test accuracy of "always k"); with rows the original gets all right, epoch 0 is kept."""
    import dataclasses

    from fedadapt.data.partition import ClientSplit
    from fedadapt.experiment import prepare_run
    from fedadapt.methods import server_trained
    from fedadapt.methods.plugin import train as plugin

    prep = prepare_run(validate(tiny_run(cache_dir, IciiaConfig(
        images=4, min_history=1, finetune_epochs=5, patience=2, classifier_epochs=5),
        partition=PartitionConfig(kind="iid", num_clients=2, val_fraction=0.3,
                                  test_fraction=0.2))), quiet=True)
    spec = prep.spec
    original, _ = server_trained.train_original(spec, server_trained.ServerData.of(spec),
                                                np.random.default_rng(0), lr=0.05)
    split = spec.clients[0]
    x, y = spec.train_source.get(split.test)
    k = int(torch.mode(y).values)
    calls = []

    def always_k(layer, opt, xs, ys, batch, clip, gen):
        calls.append((batch, clip))
        with torch.no_grad():
            layer.weight.zero_()
            layer.bias.copy_(torch.nn.functional.one_hot(torch.tensor(k), len(layer.bias)))

    monkeypatch.setattr(plugin, "_sgd_epoch", always_k)
    pool = np.concatenate([c.val for c in spec.clients])
    xv, yv = spec.train_source.get(pool)
    with torch.no_grad():
        right = (original(xv).argmax(-1) == yv).numpy()
        base = server_trained.accuracy(original(x), y)
    assert 0 < right.sum() < len(pool) and base != float((y == k).float().mean())
    for rows, expected in ((pool[(yv == k).numpy() & ~right], float((y == k).float().mean())),
                           (pool[right], base)):
        spec.clients[0] = ClientSplit(train=split.train, val=np.sort(rows), test=split.test)
        with torch.no_grad():
            assert plugin._finetune_last_layer(spec, 0, original, x, y) == pytest.approx(
                expected)
    assert set(calls) == {(16, 5.0)}
    spec.method = dataclasses.replace(spec.method, finetune_epochs=0)
    assert np.isnan(plugin._finetune_last_layer(spec, 0, original, x, y))
