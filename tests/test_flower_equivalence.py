"""fedadapt computes what Flower itself computes: a tiny task through fedadapt (its grid, one
worker training 1 or 4 clients side by side) and through Flower's own ``Strategy.start()`` on
Flower's ``run_simulation`` with one plain ClientApp per client doing the same local training
(same data, same initial arrays, every client every round) end with the same global arrays, for
FedAvg, FedAdam, Krum and server-side fixed clipping with noise 0."""

from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideFixedClipping,
    FedAdam,
    FedAvg,
    Krum,
)

from fedadapt.entry import compose_config, to_run_config
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.client.training import SpecRef, cached_model, derive_seed, train_local
from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
from fedadapt.federation.simulation.inprocess import in_process

pytestmark = pytest.mark.slow  # Ray: Flower's run_simulation

ROUNDS, CLIENTS, LR = 3, 4, 0.05
TASK = ["experiment=custom", "dataset=digits", "dataset.max_samples=240", "backbone=small_cnn",
        "train.precision=fp32",  # compared exactly: fp32 on any device
        "backbone.image_size=16", "method=linear_head", "partition=iid",
        f"partition.num_clients={CLIENTS}", "partition.fraction_fit=1.0",
        "partition.fraction_evaluate=0.0", f"rounds={ROUNDS}", "train.batch_size=16",
        f"train.lr={LR}", "federation.workers=1", "federation.num_cpus=1",
        "federation.checkpoint_every=0"]
#: name -> (fedadapt overrides, Flower's strategy)
CASES = {
    "fedavg": ([], lambda: FedAvg(fraction_evaluate=0.0, min_train_nodes=CLIENTS,
                                  min_available_nodes=CLIENTS)),
    "fedadam": (["strategy=fedadam", "strategy.eta=0.01"],
                lambda: FedAdam(fraction_evaluate=0.0, min_train_nodes=CLIENTS,
                                min_available_nodes=CLIENTS, eta=0.01, eta_l=LR)),
    "krum": (["strategy=krum"],
             lambda: Krum(fraction_evaluate=0.0, min_train_nodes=CLIENTS,
                          min_available_nodes=CLIENTS)),
    "dp_server_fixed": (["dp=server_fixed", "dp.noise_multiplier=0", "dp.accounting=false",
                         "dp.clipping_norm=0.05", "method.weighting=uniform"],
                        lambda: DifferentialPrivacyServerSideFixedClipping(
                            FedAvg(fraction_evaluate=0.0, min_train_nodes=CLIENTS,
                                   min_available_nodes=CLIENTS, weighted_by_key="unit-weight"),
                            noise_multiplier=0.0, clipping_norm=0.05,
                            num_sampled_clients=CLIENTS)),
}


def plain_client_app(get_spec) -> ClientApp:
    """A plain Flower ClientApp: one client per node, fedadapt's local training."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        spec = get_spec()
        cid = int(context.node_config["partition-id"])
        rnd = int(msg.content["config"]["server-round"])
        model = cached_model(spec)
        model.load_tensors(dict(msg.content["arrays"].to_torch_state_dict()))
        loss, _ = train_local(model, spec.train_source, spec.clients[cid].train, spec.train,
                              lr=float(msg.content["config"]["lr"]),
                              seed=derive_seed(spec.seed, rnd, cid),
                              crop_seed=derive_seed(spec.seed, rnd, cid, 7),
                              precision=spec.precision)
        return Message(RecordDict({
            "arrays": ArrayRecord(model.tensors(model.communicated_names())),
            "metrics": MetricRecord({"num-examples": len(spec.clients[cid].train),
                                     "unit-weight": 1.0, "train_loss": loss})}), reply_to=msg)

    return app


def flowers_own(cache_dir) -> dict[str, dict[str, np.ndarray]]:
    """Every case's final arrays from Flower's Strategy.start() on Flower's simulation."""
    from flwr.simulation import run_simulation

    prep = prepare_run(to_run_config(compose_config(TASK + [f"cache_dir={cache_dir}"])),
                       quiet=True)
    initial = ArrayRecord(prep.model.tensors(prep.model.communicated_names()))
    out, errors = {}, []
    server = ServerApp()

    @server.main()
    def main(grid, context) -> None:
        try:
            for name, (_, make) in CASES.items():
                result = make().start(grid, initial, num_rounds=ROUNDS,
                                      train_config=ConfigRecord({"lr": LR}))
                out[name] = {k: v.numpy() for k, v in result.arrays.items()}
        except BaseException as err:  # noqa: BLE001  (re-raised in the test's thread)
            errors.append(err)

    run_simulation(server_app=server, client_app=plain_client_app(SpecRef(prep.spec)),
                   num_supernodes=CLIENTS, backend_config={
                       "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                       "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False,
                                     "logging_level": 30}})
    if errors:
        raise errors[0]
    return out


def fedadapts(overrides: list[str], k: int, tmp: Path, cache_dir: str) -> dict[str, np.ndarray]:
    cfg = to_run_config(compose_config(TASK + overrides + [
        f"federation.clients_per_worker={k}", f"cache_dir={cache_dir}"]))
    run_experiment(cfg, tmp, config_yaml="eq\n", execute=in_process("workers"))
    arrays, _ = load_checkpoint(latest_checkpoint(tmp))
    return {k: v.numpy() for k, v in arrays.items()}


def test_fedadapt_ends_where_flower_ends(cache_dir, tmp_path, monkeypatch):
    # Flower's simulation calls ray.init() without an address, which joins the last `ray start`
    # cluster on this machine (test_cluster's two-node head, when it runs beside this test:
    # "When connecting to an existing cluster, num_cpus and num_gpus must not be provided");
    # RAY_ADDRESS=local makes it start its own, as fedadapt's runs do (address="local")
    monkeypatch.setenv("RAY_ADDRESS", "local")
    flower = flowers_own(cache_dir)
    for name, (overrides, _) in CASES.items():
        for k in (1, 4):
            ours = fedadapts(overrides, k, tmp_path / f"{name}-{k}", cache_dir)
            assert sorted(ours) == sorted(flower[name])
            for tensor, value in flower[name].items():
                np.testing.assert_allclose(ours[tensor], value, rtol=0, atol=1e-6,
                                           err_msg=f"{name}, clients_per_worker={k}: {tensor}")
    # the cases differ from each other: each strategy did its own aggregation
    heads = {name: flower[name]["head.weight"] for name in CASES}
    assert not np.allclose(heads["fedavg"], heads["fedadam"], atol=1e-4)
    assert not np.allclose(heads["fedavg"], heads["krum"], atol=1e-4)
    assert not np.allclose(heads["fedavg"], heads["dp_server_fixed"], atol=1e-4)
