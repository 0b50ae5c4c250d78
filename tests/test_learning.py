"""Each family of methods learns, end to end through the real server and ClientApp (in
process): the server-trained plug-in (ICIIA) and the served sessions (DUET, CDC-MMPG; the
client-trained rounds' run is test_simulation's ten-client run), on digits with a small random
CNN whose features a classifier can learn from (``conftest.LEARNING_CNN``). Chance is 10%; each
bound sits far above it and far below what the run reaches (measured, seed 0), so a family that
stops learning fails here."""

import pytest
from conftest import learning_run

from fedadapt.config import PartitionConfig, validate
from fedadapt.experiment import run_experiment
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.methods.plugin.iciia import IciiaConfig
from fedadapt.methods.sessions.cdc_mmpg import CdcMmpgConfig
from fedadapt.methods.sessions.duet import DuetConfig

pytestmark = pytest.mark.slow  # whole runs: 3-5 s each


def skewed_run(cache_dir, method):
    """All of digits over 10 clients with Dirichlet 0.1 label skew, each client's data split
    60/20/20: what a server-trained method adapts to."""
    cfg = learning_run(cache_dir, method, partition=PartitionConfig(
        kind="dirichlet", num_clients=10, alpha=0.1, min_partition_size=20, val_fraction=0.2,
        test_fraction=0.2))
    cfg.dataset.max_samples = None
    return validate(cfg)


def test_the_server_trained_plugin_learns_and_adapts(cache_dir, tmp_path):
    method = IciiaConfig(images=4, min_history=1, finetune_epochs=1, sequences_per_step=4,
                         max_epochs=10, patience=2, classifier_epochs=20, lr=0.01)
    summary = run_experiment(skewed_run(cache_dir, method), tmp_path / "run",
                             config_yaml="x\n", execute=run_in_process)
    rec = summary["recognition"]
    # measured: the server's classifier 54.5%, with the module over each client's batch 83.9%
    assert rec["acc_original"]["images"] > 0.3
    assert rec["acc_batch"]["images"] > rec["acc_original"]["images"] + 0.1


@pytest.mark.parametrize("method", [
    DuetConfig(session=4, generators=2, finetune_steps=2, max_epochs=30, patience=2,
               classifier_epochs=20, classifier_lr=0.5, lr=1e-2),
    CdcMmpgConfig(adr_epochs=2, adr_lr=1e-3, finetune_steps=2, max_epochs=30, patience=2,
                  classifier_epochs=20, classifier_lr=0.5, lr=1e-2),
], ids=["duet", "cdc_mmpg"])
def test_the_served_sessions_learn(cache_dir, tmp_path, method):
    summary = run_experiment(skewed_run(cache_dir, method), tmp_path / "run",
                             config_yaml="x\n", execute=run_in_process)
    s = summary["sessions"]
    # measured: generated layers 71.3% (DUET) and 74.8% (CDC-MMPG); the original model 82.8%
    assert s["acc_original"]["images"] > 0.5
    assert s["acc_generated"]["images"] > 0.4
