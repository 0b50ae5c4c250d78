"""The Ray cluster a simulation runs on (fedadapt.federation.simulation.cluster): ray.init
arguments from the config, an unreachable federation.ray_address failing fast with one line, and a
run on a two-node cluster (Ray's test cluster in this process) training clients on both nodes with
the metrics of a one-node run. ``scripts/ray_two_node.sh`` does the same with two ``ray start``
processes, as a user would.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import tiny_run

from fedadapt.config import ConfigError, FederationConfig, PartitionConfig, validate
from fedadapt.federation.simulation import cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_default_is_a_private_local_instance_sized_by_the_config(monkeypatch):
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # ignored: the run starts its own
    args = cluster.init_args(FederationConfig(), logging_level=30)
    assert args["address"] == "local" and "num_cpus" not in args
    fed = FederationConfig(ray_num_cpus=3, ray_num_gpus=0, ray_object_store_memory=10**8)
    args = cluster.init_args(fed, logging_level=30)
    assert (args["address"], args["num_cpus"], args["num_gpus"],
            args["object_store_memory"]) == ("local", 3, 0, 10**8)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")  # inside a Slurm job: the job's CPUs
    assert cluster.init_args(FederationConfig(), logging_level=30)["num_cpus"] == 6


@pytest.mark.parametrize("key,value,needle", [
    ("ray_num_cpus", 4, "federation.ray_num_cpus=4 is invalid: must be null with "
                        "federation.ray_address"),
    ("ray_object_store_memory", 1000, "federation.ray_object_store_memory=1000 is invalid"),
    ("ray_num_cpus", 0, "federation.ray_num_cpus=0 is invalid"),
])
def test_resources_are_checked(key, value, needle, cache_dir):
    from fedadapt.adapters.heads import LinearHeadConfig

    cfg = tiny_run(cache_dir, LinearHeadConfig(name="linear_head"))
    cfg.federation.ray_address = "10.0.0.1:6379" if key == "ray_num_cpus" and value else None
    setattr(cfg.federation, key, value)
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        validate(cfg)


@pytest.mark.parametrize("backend,address,needle", [
    ("ray", None, "federation.backend='ray' is invalid: one of ('auto', 'simulation', "
                  "'inprocess')"),
    ("inprocess", "10.0.0.1:6379", "federation.ray_address='10.0.0.1:6379' is invalid: a Ray "
                                   "cluster needs federation.backend=simulation"),
])
def test_a_backend_is_one_of_two_and_inprocess_joins_no_cluster(backend, address, needle,
                                                                 cache_dir):
    from fedadapt.adapters.heads import LinearHeadConfig

    cfg = tiny_run(cache_dir, LinearHeadConfig(name="linear_head"))
    cfg.federation.backend, cfg.federation.ray_address = backend, address
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg)


@pytest.mark.parametrize("address,needle", [
    ("ray://10.0.0.1:10001", "Ray Client (ray://) is not supported"),
    ("no-port", "HOST:PORT"),
])
def test_bad_addresses_are_refused(address, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        cluster.resolve_address(address)


@pytest.mark.slow
def test_something_that_is_not_a_ray_gcs_is_refused_within_the_timeout():
    """A listener that accepts and never speaks: refused, not waited on forever. The probe's
    time grows with its timeout (1 s, then 3 s: the second takes about 2 s more), measured
    against the 1 s probe on this machine, not against a fixed bound a loaded machine
    misses."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    threading.Thread(target=lambda: [server.accept() for _ in range(6)], daemon=True).start()
    took = {}
    for timeout in (1, 3):
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=f"federation.ray_address='127.0.0.1:{port}'"):
            cluster.probe(f"127.0.0.1:{port}", f"127.0.0.1:{port}", timeout=timeout)
        took[timeout] = time.monotonic() - t0
    server.close()
    assert took[3] >= 3 * 0.9  # it waited for an answer up to its timeout
    assert took[3] < 3 + 2 * took[1]  # and no longer than the timeout and what the 1 s one
    #                                   spent beyond its own


@pytest.mark.slow
def test_unreachable_ray_address_fails_fast_with_one_line(tmp_path, cache_dir):
    """Refused at once (the port is closed), not after Ray's minute of retries: measured
    against a command that fails on a bad value after the same imports and composition
    (``seed=-1``), on this machine and in this test."""
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}

    def fedadapt(*args):
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "fedadapt.cli", *args,
                              f"output_dir={tmp_path}/out"], capture_output=True, text=True,
                             timeout=600, env=env)
        return out, time.monotonic() - t0

    reference, ref_s = fedadapt("seed=-1")
    assert reference.returncode == 2, reference.stderr
    out, took = fedadapt(f"federation.ray_address={address}")
    assert took < 2 * ref_s + cluster.PROBE_TIMEOUT_S, (took, ref_s)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"federation.ray_address='{address}'" in lines[0], out.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


def _descendants() -> set[int]:
    """Every live process below this one (a Ray head's GCS, raylet, agents and workers)."""
    ps = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
    children: dict[int, list[int]] = {}
    for line in ps.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    out, todo = set(), [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def startup_timed_out(err: BaseException) -> bool:
    """Whether ``err`` is one of the start-up time-outs Ray raises on a loaded machine: a
    raylet that did not register in 30 s (a bare ``Exception``: "timed out during startup"),
    a GCS port file that did not appear ("Timed out waiting for file .../gcs_server_port"),
    a node that did not join (``TimeoutError``)."""
    return isinstance(err, TimeoutError) or "timed out" in str(err).lower()


def test_every_start_up_time_out_ray_raises_is_retried_and_nothing_else():
    assert startup_timed_out(Exception("The current node timed out during startup. This could"))
    assert startup_timed_out(RuntimeError("Timed out waiting for file /tmp/ray/session_x/"
                                          "gcs_server_port_abc.json. ..."))
    assert startup_timed_out(TimeoutError("Timed out while waiting for nodes to join."))
    assert not startup_timed_out(ValueError("num_cpus must be >= 0"))


def _retried(start, what: str):
    """``start()``; one more try when it raises a start-up time-out (:func:`startup_timed_out`;
    a loaded 2-core machine missed Ray's limits in CI). What the failed try left running is
    ended by process id: only the processes it started below this one (``ray stop --force``
    would end every Ray process on the machine, others' too)."""
    before = _descendants()
    try:
        return start()
    except Exception as err:  # noqa: BLE001  (Ray raises a bare Exception for one of them)
        if not startup_timed_out(err):
            raise
        import ray

        print(f"{what}: Ray's start-up timed out ({str(err).splitlines()[0]}); once more")
        if what == "head":
            ray.shutdown()
        for pid in _descendants() - before:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return start()


def _started(cluster_cls, **kwargs):
    """A Ray test cluster whose head is retried once on a start-up time-out."""
    return _retried(lambda: cluster_cls(initialize_head=True, **kwargs), "head")


@pytest.mark.slow
def test_a_run_on_two_nodes_trains_clients_on_both_and_matches_one_node(cache_dir, tmp_path):
    """A two-node loopback cluster (one CPU each) runs the current worker design: the workers
    are sized per node (two workers of one CPU, not one of two that no node has), Flower's actor
    pool puts one on each node, both nodes train clients in every round (the rows'
    ``trained_on``), and the metrics equal a one-node run's with the same two workers (in
    process: the two backends give the same run to the last bit,
    ``test_simulation.py::test_same_seed_same_metrics_on_ray_and_in_process``; a second Ray
    start here cost 15-20 s)."""
    import ray
    from ray.cluster_utils import Cluster

    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.sizing import size_simulation
    from fedadapt.results.store import read_jsonl

    assert not ray.is_initialized()
    two = _started(Cluster, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    try:
        # a node whose start timed out is not in the cluster's list: it is started anew
        _retried(lambda: two.add_node(num_cpus=1, object_store_memory=80 * 2**20),
                 "second node")
        two.wait_for_nodes(timeout=120)  # Ray's 30 s, which a loaded machine can miss
        fed = FederationConfig(ray_address=two.address, eval_every=1)
        assert cluster.cluster_nodes(fed) == [{"CPU": 1.0, "GPU": 0.0}] * 2
        sizing = size_simulation(fed, "cpu", sampled=4, batch_size=16)
        assert (sizing.workers, sizing.num_cpus) == (2, 1.0)
        cfg = tiny_run(cache_dir, LinearHeadConfig(), federation=fed,
                       partition=PartitionConfig(kind="iid", num_clients=4, fraction_fit=1.0))
        run_experiment(cfg, tmp_path / "two", config_yaml="two\n")
    finally:
        ray.shutdown()
        two.shutdown()
    local = tiny_run(cache_dir, LinearHeadConfig(), partition=cfg.partition,
                     federation=FederationConfig(eval_every=1, workers="2", backend="inprocess"))
    run_experiment(local, tmp_path / "one", config_yaml="one\n")
    on_two, on_one = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("two", "one"))
    for row in on_two:
        assert len(row["trained_on"]) == 2 and sum(row["trained_on"].values()) == 4, row
    assert all("trained_on" not in row for row in on_one)  # one node: nothing to tell
    skip = {"round_s", "wall_s", "trained_on"}
    assert [{k: v for k, v in r.items() if k not in skip} for r in on_two] == \
        [{k: v for k, v in r.items() if k not in skip} for r in on_one]
