"""Launch a run on Flower's simulation engine (Ray backend)."""

from __future__ import annotations

import logging
import os

import torch

from fedadapt.config import FederationConfig
from fedadapt.federation.server import ServerPlan, ServerState, make_server_app
from fedadapt.progress import quiet_flower_banner


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
    quiet_flower_banner()  # run_simulation's deprecation notice: once per process, one line
    backend_config = {
        "client_resources": client_resources(fed),
        "init_args": {"logging_level": level, "log_to_driver": True,
                      "include_dashboard": False},
    }
    flwr_run_simulation(server_app=make_server_app(plan), client_app=client_app,
                        num_supernodes=plan.num_clients, backend_config=backend_config,
                        verbose_logging=fed.verbose)
    if plan.error is not None:
        raise plan.error
    if plan.result is None:
        raise RuntimeError("the simulation ended without a result (see the log above)")
    return plan.result
