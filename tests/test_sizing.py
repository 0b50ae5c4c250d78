"""Workers and clients per worker (fedadapt.federation.simulation.sizing), by what they let run:
every planned worker fits on a node as Flower's actor pool counts it, every node is used, a
request no node can hold is refused naming the key, and K never exceeds what a worker gets."""

from dataclasses import replace

import pytest

from fedadapt.config import ConfigError, FederationConfig
from fedadapt.federation.simulation.sizing import actors_that_fit, plan_workers, size_simulation

#: Node layouts: one machine (2, 3, 16 cores), a loopback pair of one-CPU nodes, an uneven pair.
CPU_CLUSTERS = [[(2.0, 0.0)], [(3.0, 0.0)], [(16.0, 0.0)], [(1.0, 0.0), (1.0, 0.0)],
                [(1.0, 0.0), (8.0, 0.0)]]
GPU_CLUSTERS = [[(16.0, 1.0)], [(16.0, 2.0), (8.0, 1.0)], [(32.0, 8.0)], [(16.0, 1.0), (4.0, 0.0)]]


def fed(**kw) -> FederationConfig:
    return FederationConfig(**kw)


@pytest.mark.parametrize("device,nodes", [("cpu", n) for n in CPU_CLUSTERS]
                         + [("cuda", n) for n in GPU_CLUSTERS])
@pytest.mark.parametrize("workers", ["auto", "1", "3", "5"])
def test_every_planned_worker_fits_on_a_node_and_no_node_is_left_idle(device, nodes, workers):
    n, cpus, gpus, _ = plan_workers(fed(workers=workers), device, nodes)
    assert n == (int(workers) if workers != "auto" else n) >= 1
    assert any(cpus <= c and gpus <= g for c, g in nodes)  # one worker fits on some node
    assert actors_that_fit(nodes, cpus, gpus) >= n  # all of them, at once
    if workers == "auto":  # every node that can host one does (a GPU each on the GPU)
        hosts = [actors_that_fit([node], cpus, gpus) for node in nodes]
        assert all(h >= 1 for h, (c, g) in zip(hosts, nodes) if g or device == "cpu")
        if device == "cuda":
            assert n == sum(int(g) for _, g in nodes) and gpus == 1.0


def test_two_one_cpu_nodes_get_one_worker_each_not_one_that_fits_nowhere():
    n, cpus, gpus, _ = plan_workers(fed(), "cpu", [(1.0, 0.0), (1.0, 0.0)])
    assert (n, cpus, gpus) == (2, 1.0, 0.0)
    assert [actors_that_fit([node], cpus, gpus) for node in [(1.0, 0.0)] * 2] == [1, 1]


@pytest.mark.parametrize("device,nodes,kw,key", [
    ("cpu", [(1.0, 0.0), (1.0, 0.0)], {"num_cpus": 2.0}, "federation.num_cpus"),
    ("cuda", [(8.0, 1.0), (8.0, 1.0)], {"num_gpus": 2.0}, "federation.num_gpus"),
    ("cuda", [(8.0, 0.0)], {}, "no node of the cluster has one"),
])
def test_a_worker_no_node_can_hold_is_refused_naming_the_key(device, nodes, kw, key):
    with pytest.raises(ConfigError, match=key) as err:
        plan_workers(fed(**kw), device, nodes)
    assert "\n" not in str(err.value)


def test_more_workers_than_fit_at_once_run_with_a_note():
    n, cpus, _, note = plan_workers(fed(workers="4", num_cpus=1.0), "cpu", [(2.0, 0.0)])
    assert n == 4 and cpus == 1.0 and "2 fit on the nodes at once" in note


def test_auto_k_fills_a_worker_and_a_model_that_trains_whole_trains_one_at_a_time():
    s = size_simulation(fed(), "cpu", sampled=10, batch_size=32, nodes=[(2.0, 0.0)])
    assert s.workers == 1 and s.group_size == 10  # the round's 10 clients in one step
    whole = size_simulation(fed(), "cpu", sampled=10, batch_size=32, trains_whole=True,
                            nodes=[(2.0, 0.0)])
    assert whole.group_size == 1 and "trains whole" in whole.note
    forced = size_simulation(fed(clients_per_worker="3"), "cpu", sampled=10, batch_size=32,
                             trains_whole=True, nodes=[(2.0, 0.0)])
    assert forced.group_size == 3  # an explicit K is kept


def test_a_k_above_what_a_worker_gets_is_clamped_with_a_note():
    s = size_simulation(fed(workers="2", clients_per_worker="50"), "cpu", sampled=10,
                        batch_size=10, nodes=[(2.0, 0.0)])
    assert s.workers == 2 and s.group_size == 5
    assert "more than the 5 clients a worker gets per round" in s.note


@pytest.mark.parametrize("key,value", [("workers", "0"), ("clients_per_worker", "zero"),
                                       ("clients_per_worker", "-2")])
def test_bad_counts_are_named(key, value):
    with pytest.raises(ConfigError, match=f"federation.{key}"):
        size_simulation(fed(**{key: value}), "cpu", sampled=10, batch_size=10,
                        nodes=[(2.0, 0.0)])


@pytest.mark.parametrize("device,nodes", [("cpu", [(2.0, 0.0)]), ("cuda", [(16.0, 1.0)])])
def test_a_sizing_probe_that_raises_gives_one_client_at_a_time_and_names_the_cause(device, nodes):
    def probe():
        raise RuntimeError("LSE is not correctly aligned (strideH)\n  deep in a kernel")

    s = size_simulation(fed(), device, sampled=10, batch_size=10, probe=probe, nodes=nodes)
    assert s.group_size == 1
    assert s.note == ("federation.clients_per_worker=auto: K=1, one client at a time: clients "
                      "side by side failed in the sizing probe (RuntimeError: LSE is not "
                      "correctly aligned (strideH))")
    called = []
    forced = size_simulation(fed(clients_per_worker="4"), device, sampled=10, batch_size=10,
                             probe=lambda: called.append(1), nodes=nodes)
    assert forced.group_size == 4 and not called  # an explicit K is not probed


def test_a_run_whose_grouped_step_fails_finishes_one_client_at_a_time(cache_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """The grouped step broken (as bf16 and attention broke it on a GPU): the sizing probe
    says why in one line and picks K = 1, and the run finishes and records it."""
    import json

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.client import group_vmap, grouped
    from fedadapt.federation.simulation.inprocess import in_process

    def broken(*args, **kwargs):
        raise RuntimeError("Input type (float) and bias type (c10::BFloat16) should be the same")

    monkeypatch.setattr(group_vmap, "_bucket_losses", broken)  # vmap's step
    monkeypatch.setattr(grouped, "train_forms", broken)  # the grouped forms'
    cfg = to_run_config(compose_config([
        "experiment=custom", "dataset=digits", "dataset.max_samples=200", "backbone=tiny_vit",
        "backbone.image_size=32", "method=accumulator", "partition.num_clients=4",
        "partition.fraction_fit=1.0", "rounds=2", "train.batch_size=16",
        "federation.workers=1", "federation.num_cpus=1", f"cache_dir={cache_dir}"]))
    run_experiment(cfg, tmp_path, config_yaml="k\n", execute=in_process("workers"))
    err = capsys.readouterr().err
    line = ("[federation] federation.clients_per_worker=auto: K=1, one client at a time: "
            "clients side by side failed in the sizing probe (RuntimeError: Input type (float) "
            "and bias type (c10::BFloat16) should be the same)")
    assert line in err.splitlines()
    assert "failed side by side" not in err  # no group was tried
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["layout"]["clients_per_worker"] == 1
    assert summary["client_failures"] == 0 and summary["final"]["round"] == 2


def test_the_default_backend_is_in_process_where_one_worker_serves_the_run():
    """``federation.backend=auto``: in process for one worker on the CPU; Flower's simulation
    engine (Ray) for several workers, a GPU or a Ray cluster; an explicit backend as given."""
    from fedadapt.config import FederationConfig
    from fedadapt.methods.run import resolve_backend

    auto = FederationConfig()
    assert auto.backend == "auto"
    assert resolve_backend(replace(auto, workers="1"), "cpu") == (
        "inprocess", "this machine's CPU")
    assert resolve_backend(replace(auto, workers="3"), "cpu") == ("simulation", "3 workers")
    assert resolve_backend(replace(auto, workers="1"), "cuda")[0] == "simulation"
    assert resolve_backend(replace(auto, ray_address="10.0.0.1:6379"), "cpu")[0] == "simulation"
    assert resolve_backend(replace(auto, workers="auto", ray_num_cpus=2), "cpu")[0] == \
        "inprocess"  # one worker per two cores
    assert resolve_backend(replace(auto, workers="auto", ray_num_cpus=8), "cpu") == (
        "simulation", "4 workers")
    assert resolve_backend(replace(auto, backend="simulation", workers="1"), "cpu")[0] == \
        "simulation"
