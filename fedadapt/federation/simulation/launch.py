"""Launch a run on Flower's simulation engine (Ray backend).

The simulated Flower nodes are the run's *workers* (``plan.num_nodes``, see
:mod:`fedadapt.federation.simulation.sizing`), each a Ray actor with ``plan.resources``; the clients
are named in the messages. With no GPU asked for (``federation.num_gpus=0``, or none present) the
GPUs are hidden from the driver's Ray session and its actors, so CUDA is never initialised.
The Ray cluster part lives in :mod:`fedadapt.federation.simulation.cluster`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

from fedadapt.config import FederationConfig
from fedadapt.federation.server.interrupt import (
    STOP,
    filter_flower,
    from_ray_exit,
    ray_keeps_our_handlers,
    reinstall,
)
from fedadapt.federation.server.loop import ServerPlan, ServerState, make_server_app
from fedadapt.federation.simulation import cluster
from fedadapt.progress import quiet_libraries


@contextlib.contextmanager
def _gpus_hidden(hide: bool):
    """``CUDA_VISIBLE_DEVICES=""`` for the Ray session started inside (restored after)."""
    if not hide:
        yield
        return
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


#: How often the simulation engine looks for the ServerApp's new messages (Flower: 0.1 s).
ENGINE_POLL_S = 0.005


def _engine_polls_often() -> None:
    """Flower 1.41's simulation engine moves the ServerApp's messages to its Ray workers in a
    thread that looks every 0.1 s (``vce_api.add_messages_to_queue``), which adds up to a tenth
    of a second to every exchange: with a worker training 10 clients of a linear head in 0.1 s,
    a round took twice that. This puts in its place the same loop looking every
    :data:`ENGINE_POLL_S`; on any other Flower the engine is left as it is."""
    import inspect

    from flwr.server.superlink.fleet.vce import vce_api

    original = vce_api.add_messages_to_queue
    if getattr(original, "_fedadapt", False):
        return
    if list(inspect.signature(original).parameters) != ["state", "queue", "nodes_mapping",
                                                        "f_stop"]:
        return

    def add_messages_to_queue(state, queue, nodes_mapping, f_stop) -> None:
        while not f_stop.is_set():
            for node_id in nodes_mapping.keys():
                for msg in state.get_message_ins(node_id=node_id, limit=1):
                    queue.put(msg)
            f_stop.wait(ENGINE_POLL_S)

    add_messages_to_queue._fedadapt = True
    vce_api.add_messages_to_queue = add_messages_to_queue


def run_simulation(plan: ServerPlan, client_app, fed: FederationConfig) -> ServerState:
    """Run ``plan`` against ``plan.num_nodes`` simulated workers; return the final state."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray's C++ failure handler would catch SIGTERM first: dump a stack, then abort at exit
    # instead of the clean stop of fedadapt.federation.server.interrupt
    os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
    from flwr.simulation import run_simulation as flwr_run_simulation

    _engine_polls_often()

    level = logging.INFO if fed.verbose else logging.WARNING
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.setLevel(level)
    flwr_logger.propagate = False  # it has its own handler; Hydra's root handler would repeat it
    resources = dict(plan.resources)
    quiet_libraries()  # Flower's deprecation notice and progress bars: not in the log
    filter_flower()  # a stop's dead actors are the stop, not errors
    backend_config = {
        "client_resources": resources,
        # the Ray cluster: a private local instance or a running one (federation.ray_*)
        "init_args": cluster.init_args(fed, logging_level=level),
    }
    server_app = make_server_app(plan)

    @server_app.lifespan()
    def _placement(context):  # after the rounds, while the actors still exist
        yield
        if plan.error is None and not STOP.is_set():  # not on the way out of a stop
            cluster.log_placement("ray", fed.ray_address)

    cpu_only = not resources.get("num_gpus")
    try:
        with _gpus_hidden(cpu_only), ray_keeps_our_handlers(), cluster.no_ip_probe(fed), \
                warnings.catch_warnings():
            # Ray's notice that it hides GPUs from actors that ask for none: fedadapt relies
            # on it
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray",
                                    category=FutureWarning)
            flwr_run_simulation(server_app=server_app, client_app=client_app,
                                num_supernodes=plan.num_nodes, backend_config=backend_config,
                                verbose_logging=fed.verbose)
    except SystemExit as err:  # ray.init's SIGTERM handler: a SIGTERM, not an exit request
        if (stop := from_ray_exit(err)) is None:
            raise
        raise stop from None
    finally:
        reinstall()  # ours again (ray.init took SIGTERM's)
    if plan.error is not None:
        raise plan.error
    if plan.result is None:
        raise RuntimeError("the simulation ended without a result (see the log above)")
    return plan.result
