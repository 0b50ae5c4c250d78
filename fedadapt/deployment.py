"""The ServerApp and ClientApp that ``flwr run`` loads (Flower's deployment engine).

``pyproject.toml`` names them (``[tool.flwr.app.components]``); docs/deployment.md shows how to
start a SuperLink and one SuperNode per client. Both sides compose the same Hydra config from the
run config key ``overrides`` (the ``fedadapt`` command line as one string), so the server and
every client prepare identical data, partition and seeded initial weights.

Differences from the ``fedadapt`` command: one run per ``flwr run`` (an experiment's ``compare``
list is ignored; only ``method`` runs), into ``<output_dir>/<experiment>/deploy_<timestamp>``
(``output_dir`` resolved in the ServerApp's working directory, i.e. the SuperLink's). The
SuperNodes started must number exactly ``partition.num_clients``, each with
``--node-config "partition-id=<i> num-partitions=<num_clients>"``.
"""

from __future__ import annotations

import shlex
import time
from functools import lru_cache
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from omegaconf import DictConfig, OmegaConf

from fedadapt.clients.app import make_client_app
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.client.training import RunSpec
from fedadapt.federation.server.loop import execute_plan
from fedadapt.log import log
from fedadapt.methods.run import PreparedRun
from fedadapt.rundir import claim_new_dir

#: Run config keys (``[tool.flwr.app.config]``; ``flwr run --run-config 'overrides="..."'``).
OVERRIDES_KEY = "overrides"
OUTPUT_DIR_KEY = "output-dir"


def hydra_overrides(context: Context) -> list[str]:
    """The run's Hydra overrides: ``overrides`` split like a shell, plus ``output-dir``."""
    overrides = shlex.split(str(context.run_config.get(OVERRIDES_KEY, "")))
    output_dir = context.run_config.get(OUTPUT_DIR_KEY)
    if output_dir:
        overrides.append(f"output_dir={output_dir}")
    return overrides


def compose_config(overrides: list[str]) -> DictConfig:
    """Compose the config as the ``fedadapt`` command does (quickstart unless overridden)."""
    from fedadapt.entry import compose_config as compose

    return compose(overrides, default_experiment="quickstart")


@lru_cache(maxsize=2)
def _prepared(overrides: tuple[str, ...]) -> PreparedRun:
    """The client side's prepared run, once per process and overrides."""
    from fedadapt.entry import to_run_config

    return prepare_run(to_run_config(compose_config(list(overrides))), quiet=True)


def client_spec(context: Context) -> RunSpec:
    """The :class:`RunSpec` of the run ``context`` belongs to, checked against the node."""
    spec = _prepared(tuple(hydra_overrides(context))).spec
    num_partitions = context.node_config.get("num-partitions")
    if num_partitions is not None and int(num_partitions) != spec.num_clients:
        raise ValueError(f"SuperNode has num-partitions={num_partitions} but the run has "
                         f"partition.num_clients={spec.num_clients}")
    return spec


server_app = ServerApp()
# Plain assignments: `flwr run` finds the components by a static (AST) check that skips
# annotated ones.
client_app = make_client_app(client_spec)


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """Prepare the run, federate it over the SuperNodes on ``grid``, write its run directory."""
    from fedadapt.entry import to_run_config

    composed = compose_config(hydra_overrides(context))
    cfg = to_run_config(composed)
    if cfg.compare:
        log(f"[deploy] ignoring compare={cfg.compare}: deployment runs method={cfg.method.name}")
    prep = prepare_run(cfg)
    # claimed (exclusive mkdir; `_2`, ... if another run took the name in the same second)
    run_dir = Path(claim_new_dir(Path(cfg.output_dir).resolve() / cfg.experiment
                                 / f"deploy_{time.strftime('%Y-%m-%d_%H-%M-%S')}"))
    log(f"[deploy] Flower run {context.run_id}: {cfg.method.name}, {cfg.rounds} rounds, "
        f"waiting for {cfg.partition.num_clients} SuperNodes; run directory {run_dir}")
    run_experiment(cfg, run_dir, config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                   prepared=prep, execute=lambda plan, _client_app: execute_plan(grid, plan))
    log(f"[deploy] Run directory: {run_dir}")
