"""The Ray cluster a simulation runs on (fedadapt.federation.cluster): ray.init arguments from
the config, an unreachable federation.ray_address failing fast with one line, and Flower's
actor pool spreading over every node of a cluster.

The end-to-end two-node check (``ray start --head`` + ``ray start --address``, a simulation
compared with a local one) takes minutes here: it is ``scripts/ray_two_node.sh``, not a test.
"""

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import tiny_run

from fedadapt.config import ConfigError, FederationConfig, validate
from fedadapt.federation import cluster


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


@pytest.mark.parametrize("address,needle", [
    ("ray://10.0.0.1:10001", "Ray Client (ray://) is not supported"),
    ("no-port", "HOST:PORT"),
])
def test_bad_addresses_are_refused(address, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        cluster.resolve_address(address)


@pytest.mark.slow
def test_something_that_is_not_a_ray_gcs_is_refused_within_the_timeout():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    threading.Thread(target=lambda: [server.accept() for _ in range(3)], daemon=True).start()
    t0 = time.time()
    with pytest.raises(ConfigError, match=f"federation.ray_address='127.0.0.1:{port}'"):
        cluster.probe(f"127.0.0.1:{port}", f"127.0.0.1:{port}", timeout=3)
    assert time.time() - t0 < 10
    server.close()


@pytest.mark.slow
def test_unreachable_ray_address_fails_fast_with_one_line(tmp_path, cache_dir):
    address = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    t0 = time.time()
    out = subprocess.run([sys.executable, "-m", "fedadapt.cli", f"federation.ray_address={address}",
                          f"output_dir={tmp_path}/out"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert time.time() - t0 < 30
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"federation.ray_address='{address}'" in lines[0], out.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


def _started(cluster_cls, **kwargs):
    """A Ray test cluster; one more try when its head does not come up (Ray gives a raylet 30 s
    to register with its GCS, which a loaded 2-core machine once missed in CI)."""
    try:
        return cluster_cls(initialize_head=True, **kwargs)
    except Exception as err:  # noqa: BLE001  (Ray raises a bare Exception for it)
        if "timed out during startup" not in str(err):
            raise
        import ray

        ray.shutdown()  # and what the failed head left running
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                       capture_output=True, timeout=120)
        return cluster_cls(initialize_head=True, **kwargs)


@pytest.mark.slow
def test_flower_actor_pool_spreads_over_every_node():
    """Flower sizes its actor pool from every node's resources: on a two-node cluster (one
    CPU each) the two client actors land one per node, and actor_placement sees that."""
    import ray
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool, ClientAppActor
    from ray.cluster_utils import Cluster

    assert not ray.is_initialized()
    two = _started(Cluster, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False})
    try:
        two.add_node(num_cpus=1, object_store_memory=80 * 2**20)
        two.wait_for_nodes()
        fed = FederationConfig(ray_address=two.address)
        assert cluster.cluster_nodes(fed) == [{"CPU": 1.0, "GPU": 0.0}] * 2  # for sizing
        assert not ray.is_initialized()
        ray.init(address=two.address, logging_level="ERROR", include_dashboard=False)
        pool = BasicActorPool(actor_type=ClientAppActor,
                              client_resources={"num_cpus": 1, "num_gpus": 0.0},
                              actor_kwargs={})
        assert pool.actors_capacity == 2
        pool.add_actors_to_pool(pool.actors_capacity)
        ray.get([a.__ray_ready__.remote() for a in pool.pool], timeout=120)
        placed = cluster.actor_placement()
        assert sorted(placed.values()) == [1, 1] and len(placed) == 2
        assert cluster.describe_cluster().startswith("2 node(s), 2 CPUs")
    finally:
        ray.shutdown()
        two.shutdown()
