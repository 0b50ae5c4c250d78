"""Launch a run on Flower's simulation engine (Ray backend); the Ray cluster part lives in
:mod:`fedadapt.federation.cluster`."""

from __future__ import annotations

import logging
import os

import torch

from fedadapt.config import FederationConfig
from fedadapt.federation import cluster
from fedadapt.federation.server import ServerPlan, ServerState, make_server_app


def client_resources(fed: FederationConfig) -> dict:
    """``num_cpus`` and ``num_gpus`` per client; a GPU is used when present."""
    gpus = fed.num_gpus
    if gpus is None:
        gpus = 0.25 if torch.cuda.is_available() else 0.0
    return {"num_cpus": fed.num_cpus, "num_gpus": gpus}


def run_simulation(plan: ServerPlan, client_app, fed: FederationConfig) -> ServerState:
    """Run ``plan`` against ``plan.num_clients`` simulated nodes; return the final state."""
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    from flwr.simulation import run_simulation as flwr_run_simulation

    level = logging.INFO if fed.verbose else logging.WARNING
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.setLevel(level)
    flwr_logger.propagate = False  # it has its own handler; Hydra's root handler would repeat it
    backend_config = {
        "client_resources": client_resources(fed),
        # the Ray cluster: a private local instance or a running one (federation.ray_*)
        "init_args": cluster.init_args(fed, logging_level=level),
    }
    server_app = make_server_app(plan)

    @server_app.lifespan()
    def _placement(context):  # after the rounds, while the actors still exist
        yield
        cluster.log_placement("ray", fed.ray_address)

    flwr_run_simulation(server_app=server_app, client_app=client_app,
                        num_supernodes=plan.num_clients, backend_config=backend_config,
                        verbose_logging=fed.verbose)
    if plan.error is not None:
        raise plan.error
    if plan.result is None:
        raise RuntimeError("the simulation ended without a result (see the log above)")
    return plan.result
