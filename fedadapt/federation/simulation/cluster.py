"""The Ray cluster a simulation runs on: a private local instance, or a running cluster.

Flower's simulation engine (Ray backend) calls ``ray.init(**init_args)``; this module builds
those arguments from :class:`fedadapt.config.FederationConfig`:

* ``federation.ray_address=null`` (default): a **private local instance** for this run
  (``address="local"``), sized by ``federation.ray_num_cpus`` / ``ray_num_gpus`` /
  ``ray_object_store_memory`` (null: Ray's detection; inside a Slurm job the CPUs default to
  ``$SLURM_CPUS_PER_TASK``). It ignores ``$RAY_ADDRESS`` and any
  cluster a ``ray start`` left on the machine, so parallel runs never capture each other.
* ``federation.ray_address=HOST:PORT``: the GCS address of a running cluster (``ray start
  --head --port PORT`` prints it). Its resources are set by each node's ``ray start``, so the
  ``ray_*`` resources must stay null. Before Ray is asked to connect, the address is probed
  (TCP, then Ray's own ``GetClusterId`` RPC) for at most :data:`PROBE_TIMEOUT_S` seconds:
  ``ray.init`` itself retries an unreachable address for minutes.
* ``federation.ray_address=auto``: Ray's own discovery (``$RAY_ADDRESS``, else the last
  ``ray start`` on this machine), probed the same way.

Placement across nodes: Flower sizes its actor pool from every node's resources
(``pool_size_from_resources``: per node, ``CPU // federation.num_cpus``, capped by GPUs) and
creates all the actors at once, so the pool fills the whole cluster and the clients a round
samples are served by actors on every node. The workers are sized per node to match
(:mod:`fedadapt.federation.simulation.sizing`): a worker never asks for more than one node has.
:func:`log_placement` logs where this run's actors ran. Every node needs the same Python
environment (fedadapt installed) and ``cache_dir`` at the same path (the actors read the
prepared data and feature cache by path).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections import Counter
from typing import Any, Iterator, Optional

from fedadapt.config import ConfigError, FederationConfig
from fedadapt.log import log

#: Seconds allowed to find a cluster's GCS at ``federation.ray_address`` before giving up.
PROBE_TIMEOUT_S = 10.0
#: Ray's class name of Flower's simulated-client actors.
ACTOR_CLASS = "ClientAppActor"


def _unreachable(shown: str, why: str) -> ConfigError:
    return ConfigError(f"federation.ray_address={shown!r}: no Ray cluster there ({why}); start "
                       f"one with `ray start --head --port PORT` and pass the HOST:PORT it "
                       f"prints, or leave federation.ray_address=null for a private local "
                       f"instance")


def resolve_address(address: Optional[str]) -> Optional[str]:
    """``host:port`` of the cluster to join, or None for a private local instance.

    ``auto`` is resolved as Ray does (``$RAY_ADDRESS``, then the last ``ray start`` here).
    """
    if address is None or address == "local":
        return None
    if address.startswith("ray://"):
        raise ConfigError(f"federation.ray_address={address!r} is invalid: Ray Client "
                          f"(ray://) is not supported; use the cluster's GCS address HOST:PORT "
                          f"(what `ray start --head` prints)")
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            found = canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError) as err:
            raise ConfigError(f"federation.ray_address='auto' found no running Ray cluster "
                              f"({err}); start one with `ray start --head`, set RAY_ADDRESS, "
                              f"or leave federation.ray_address=null") from None
        if found is None:
            raise _unreachable(address, "nothing found")
        return found
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"federation.ray_address={address!r} is invalid: HOST:PORT (the GCS "
                          f"address `ray start --head` prints), 'auto', or null")
    return address


def probe(address: str, shown: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Check that a Ray GCS answers at ``address`` within ``timeout`` s; else raise one line.

    ``shown`` is the address as the user wrote it (named in the error).
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise _unreachable(shown, f"{address}: {err.strerror or err}") from None
    try:
        import grpc
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # Ray's generated stubs moved: the TCP check above must do
        return
    with grpc.insecure_channel(address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                              timeout=max(1.0, deadline - time.monotonic()))
        except grpc.RpcError as err:
            raise _unreachable(shown, f"{address} answers, but not as a Ray GCS: "
                                      f"{err.code().name}") from None


def check_reachable(fed: FederationConfig) -> None:
    """Fail now, with one line, when ``federation.ray_address`` names no running cluster
    (called before a run writes anything; a no-op for a private local instance)."""
    address = resolve_address(fed.ray_address)
    if address is not None:
        probe(address, fed.ray_address or address)


def cluster_nodes(fed: FederationConfig) -> Optional[list[dict[str, float]]]:
    """``[{"CPU": c, "GPU": g}, ...]``, one entry per live node of the cluster at
    ``federation.ray_address``; None for a private local instance (then this machine's
    resources, or ``federation.ray_*``, are what there is). For sizing a run's workers to a
    cluster before the simulation starts; connects briefly when Ray is not connected yet."""
    import logging

    address = resolve_address(fed.ray_address)
    if address is None:
        return None
    import ray

    connected = ray.is_initialized()
    if not connected:
        probe(address, fed.ray_address or address)
        ray.init(address=address, logging_level=logging.ERROR, log_to_driver=False,
                 include_dashboard=False)
    try:
        return [{"CPU": float(n["Resources"].get("CPU", 0)),
                 "GPU": float(n["Resources"].get("GPU", 0))}
                for n in ray.nodes() if n.get("Alive") and n.get("Resources")]
    finally:
        if not connected:
            ray.shutdown()


def _local_cpus(fed: FederationConfig) -> Optional[int]:
    """The CPUs of a private local instance: ``federation.ray_num_cpus``, else a Slurm job's
    ``$SLURM_CPUS_PER_TASK`` (its CPUs, not the node's), else None (Ray counts them)."""
    if fed.ray_num_cpus is not None:
        return fed.ray_num_cpus
    slurm = os.environ.get("SLURM_CPUS_PER_TASK", "")
    return int(slurm) if slurm.isdigit() else None


def node_resources(fed: FederationConfig, device: str) -> list[tuple[float, float]]:
    """``(cpus, gpus)`` of each node the run's workers are placed on: the live nodes of the
    cluster at ``federation.ray_address``, else this machine (or ``federation.ray_num_*``), as
    one node. GPUs count only on the ``cuda`` device."""
    import torch

    nodes = cluster_nodes(fed)
    if nodes is not None:
        return [(n["CPU"], n["GPU"] if device == "cuda" else 0.0) for n in nodes]
    cpus = _local_cpus(fed) or os.cpu_count() or 1
    gpus = 0
    if device == "cuda":
        gpus = (int(fed.ray_num_gpus) if fed.ray_num_gpus is not None
                else torch.cuda.device_count())
    return [(float(cpus), float(gpus))]


def init_args(fed: FederationConfig, *, logging_level: int) -> dict[str, Any]:
    """The ``ray.init`` keyword arguments for ``fed`` (Flower's ``backend_config["init_args"]``).

    Joining a cluster probes it first (see :func:`probe`).
    """
    args: dict[str, Any] = {"logging_level": logging_level, "log_to_driver": True,
                            "include_dashboard": False}
    address = resolve_address(fed.ray_address)
    if address is None:
        args["address"] = "local"
        for key, value in (("num_cpus", _local_cpus(fed)), ("num_gpus", fed.ray_num_gpus),
                           ("object_store_memory", fed.ray_object_store_memory)):
            if value is not None:
                args[key] = value
        return args
    probe(address, fed.ray_address or address)
    args["address"] = address
    return args


def _routes_out() -> bool:
    """Whether this machine has a route to the internet (a UDP connect sends nothing)."""
    for family, target in ((socket.AF_INET, ("8.8.8.8", 53)),
                           (socket.AF_INET6, ("2001:4860:4860::8888", 53))):
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect(target)
                return True
        except OSError:
            continue
    return False


@contextlib.contextmanager
def no_ip_probe(fed: FederationConfig) -> Iterator[None]:
    """Within: a private local instance on a machine with no route out gets its node address
    by hostname resolution directly, which is where Ray ends up, without Ray first probing
    8.8.8.8 and logging ``Failed to determine local IP via external connectivity`` (a warning
    in every run on an offline machine). A cluster, or a machine with a route, is untouched."""
    if fed.ray_address is not None or _routes_out():
        yield
        return
    import ray.util
    from ray._private import services, worker

    original = services.get_node_ip_address

    def by_hostname(address=None):
        if address is None and getattr(worker, "_global_node", None) is None:
            try:
                return socket.gethostbyname(socket.gethostname())
            except OSError:
                return "127.0.0.1"
        return original(address)

    services.get_node_ip_address = ray.util.get_node_ip_address = by_hostname
    try:
        yield
    finally:
        services.get_node_ip_address = ray.util.get_node_ip_address = original


def describe_cluster() -> str:
    """One line on the connected cluster: nodes, CPUs, GPUs."""
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources")]
    cpus = sum(n["Resources"].get("CPU", 0) for n in nodes)
    gpus = sum(n["Resources"].get("GPU", 0) for n in nodes)
    return f"{len(nodes)} node(s), {cpus:g} CPUs, {gpus:g} GPUs"


def actor_placement() -> dict[str, int]:
    """``{node id: client actors}`` of this driver's job (Flower's ``ClientAppActor`` s)."""
    import ray
    from ray._private import state

    job = ray.get_runtime_context().get_job_id()
    table = state.actors()
    nodes = Counter(a["Address"]["NodeID"] for a in table.values()
                    if a.get("ActorClassName") == ACTOR_CLASS and a.get("JobID") == job
                    and a.get("Address", {}).get("NodeID"))
    return dict(nodes)


def log_placement(label: str, address: Optional[str]) -> None:
    """Log the cluster and where this run's client actors were placed (best effort)."""
    try:
        where = f"cluster at {address}" if address else "private local instance"
        placed = actor_placement()
        per_node = ", ".join(f"{node[:8]}: {n}" for node, n in sorted(placed.items()))
        log(f"[{label}] Ray {where}: {describe_cluster()}; {sum(placed.values())} client "
            f"actor(s) on {len(placed)} node(s) ({per_node})")
    except Exception as err:  # informational only: never fail a finished run over it
        log(f"[{label}] Ray placement unavailable: {err}")
