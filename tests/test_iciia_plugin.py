"""ICIIA as a server-trained plug-in: trained once on the server, delivered in one Flower round,
used by the clients for recognition only; the counts that fedadapt-inspect prints."""

import numpy as np
import pytest
import torch
from conftest import needs_efficientnet_weights, tiny_run

from fedadapt.config import ConfigError, PartitionConfig, validate
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.methods.plugin.iciia import IciiaConfig
from fedadapt.methods.plugin.train import client_arrays, sequences, train_on_server


def iciia_run(cache_dir, **method):
    small = dict(images=4, min_history=1, max_epochs=2, patience=2, classifier_epochs=2,
                 finetune_epochs=1, lr=0.05, sequences_per_step=4)
    cfg = tiny_run(cache_dir, IciiaConfig(**{**small, **method}),
                   partition=PartitionConfig(kind="dirichlet", num_clients=4, alpha=0.3,
                                             min_partition_size=20, val_fraction=0.2,
                                             test_fraction=0.2))
    return validate(cfg)


def test_training_sequences_come_from_one_client():
    rng = np.random.default_rng(0)
    seqs = sequences(np.arange(10, 33), 4, rng)
    assert [len(s) for s in seqs] == [4, 4, 4, 4, 4, 3]
    assert sorted(np.concatenate(seqs).tolist()) == list(range(10, 33))


def test_server_training_then_delivery_end_to_end(cache_dir, tmp_path):
    cfg = iciia_run(cache_dir, history_sweep=[0, 2])
    prep = prepare_run(cfg, quiet=True)
    summary = run_experiment(cfg, tmp_path / "iciia", config_yaml="iciia\n", prepared=prep,
                             execute=run_in_process)
    rec = summary["recognition"]
    assert set(rec) == {"acc_original", "acc_finetune", "acc_prompt", "acc_batch", "acc_stream",
                        "acc_h0", "acc_h2"}
    for r in rec.values():
        assert 0.0 <= r["images"] <= 1.0 and r["clients"] == 4
    assert summary["server_training"]["iciia"]["epochs_run"] <= 2
    # one round down, nothing up: what each client receives is the module, the original
    # classifier and its own prompt token
    from flwr.app import ArrayRecord

    trained = train_on_server(prep.spec)  # seeded: the same module the run delivered
    sent = sum(ArrayRecord(client_arrays(trained, c)).count_bytes() for c in range(4))
    assert summary["bytes_up"] == 0 and summary["total_bytes"] == sent
    token0, token1 = (client_arrays(trained, c)["prompt.token"] for c in (0, 1))
    assert not torch.equal(token0, token1)
    assert (tmp_path / "iciia" / "summary.json").is_file()
    assert (tmp_path / "iciia" / "partition.png").is_file()  # server-trained runs too
    table = (tmp_path / "iciia" / "table.md").read_text()
    assert "module, one by one" in table and "2 cached" in table


def test_server_training_is_seeded(cache_dir):
    prep = prepare_run(iciia_run(cache_dir, groups=4), quiet=True)
    a, b = train_on_server(prep.spec), train_on_server(prep.spec)
    for k, v in a["module"].state_dict().items():
        torch.testing.assert_close(v, b["module"].state_dict()[k])


def test_bad_values_name_the_setting(cache_dir):
    with pytest.raises(ConfigError, match="method.min_history"):
        prepare_run(iciia_run(cache_dir, min_history=9), quiet=True)
    with pytest.raises(ConfigError, match="method.groups"):
        prepare_run(iciia_run(cache_dir, groups=3), quiet=True)


@needs_efficientnet_weights
@pytest.mark.parametrize("preset,dim,params_m,flops", [
    ("iciia_b", 1280, 30, 0.47e9), ("iciia_t", 1280, 0.14, 3.8e6),
    ("iciia_b", 2048, 76, 1.2e9), ("iciia_t", 2048, 0.33, 7.9e6),
    ("iciia_b", 1024, 19, 0.30e9), ("iciia_t", 1024, 0.09, 2.8e6)])
def test_inspect_reproduces_table_1(preset, dim, params_m, flops):
    """Table 1 (N = 3, B = 16) as printed: parameters and FLOPs within the paper's rounding."""
    from fedadapt.counts import inspect_run
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config([f"method={preset}", "backbone=efficientnet_lite0",
                                        "dataset=fashion_mnist", f"method.feature_dim={dim}"]))
    counts = inspect_run(run)["iciia"]
    assert counts["feature_dim"] == dim and counts["images"] == 16 and counts["layers"] == 3
    assert counts["projection_params"] / 1e6 == pytest.approx(params_m, rel=0.05)
    assert counts["paper_flops"] == pytest.approx(flops, rel=0.05)
    assert counts["paper_params"] == 6 * dim * dim * 3 // (1 if preset == "iciia_b" else 256)


def test_superclass_clients_and_unseen_test_clients():
    """ICIIA's data: clients drawing from one superclass (a mixed fraction from all classes,
    Figure 7), and unseen test clients holding test data only (the "by client" split)."""
    from datasets import Dataset
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.partition import partition_dataset

    fine = np.random.default_rng(0).integers(0, 20, 400)
    ds = Dataset.from_dict({"label": fine.tolist(), "coarse_label": (fine // 4).tolist()})
    coarse = fine // 4
    for mixed, expected in ((0.0, [1] * 10), (0.5, [5] * 5 + [1] * 5)):
        part = partition_dataset(ds, PartitionConfig(kind="superclass", num_clients=10,
                                                     mixed_fraction=mixed, test_clients=0.2),
                                 load_card("cifar100"), seed=0)
        held = [c for c in part.clients if len(c.train) == 0]
        assert len(held) == 2 and all(len(c.val) == 0 and len(c.test) > 0 for c in held)
        everything = np.concatenate([np.concatenate([c.train, c.val, c.test])
                                     for c in part.clients])
        assert sorted(everything.tolist()) == list(range(400))  # each sample once
        assert [len(np.unique(coarse[np.concatenate([c.train, c.val, c.test])]))
                for c in part.clients] == expected


def test_unseen_test_clients_need_a_server_trained_method(cache_dir):
    from fedadapt.adapters.heads import LinearHeadConfig

    cfg = validate(tiny_run(cache_dir, LinearHeadConfig(),
                            partition=PartitionConfig(kind="iid", num_clients=3,
                                                      test_clients=0.34)))
    with pytest.raises(ConfigError, match="partition.test_clients"):
        prepare_run(cfg, quiet=True)


def test_baselines_do_not_depend_on_the_module_trained(cache_dir):
    """The original classifier and prompt tuning draw from their own seeded streams: ICIIA-B and
    ICIIA-T runs of one seed report the same baselines."""
    a = train_on_server(prepare_run(iciia_run(cache_dir, groups=1), quiet=True).spec)
    b = train_on_server(prepare_run(iciia_run(cache_dir, groups=4), quiet=True).spec)
    for part in ("original", "prompt"):
        for k, v in a[part].state_dict().items():
            torch.testing.assert_close(v, b[part].state_dict()[k])
