"""Experiment tracking: TensorBoard event files and MLflow runs, fed by the per-round hook.

Both are optional extras (``pip install 'fedadapt[tracking]'``), off by default, and work
offline. What they receive is what the run directory holds:

* every round: each number of the round's ``metrics.jsonl`` row (losses, accuracies, per-exit
  ``exit_acc/<exit>``, per-tier ``tier_acc/<exit>``, per-client ``client_accs/<id>``, bytes,
  ``round_s``, failures by kind ``failures/<kind>``, ...) at step = round; nested values are
  flattened with ``/``, missing values (``null``) are left out;
* TensorBoard: the resolved config as text (``config``), events under ``<run dir>/tensorboard``;
* MLflow: the resolved config as params (flattened with ``.``), tags naming the method, data
  set, run directory and commit, and at the end the run directory's files as artifacts
  (``checkpoints/``, ``clients/`` and ``tensorboard/`` folders excluded). The default store is
  MLflow's local database ``<output_dir>/mlflow.db`` with artifacts in
  ``<output_dir>/mlartifacts`` (MLflow 3 refuses its older ``./mlruns`` folder store unless
  ``MLFLOW_ALLOW_FILE_STORE=true``); ``tracking.mlflow_uri`` points elsewhere (a server, another
  database). The MLflow run id is kept in ``<run dir>/tracking.json``, so ``resume=`` continues
  the same MLflow run.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

from fedadapt.config import ConfigError, TrackingConfig

TRACKING_FILE = "tracking.json"
#: Run-directory folders not sent to MLflow as artifacts (large, or tracked otherwise).
NOT_ARTIFACTS = ("checkpoints", "clients", "tensorboard")


def scalars(row: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a metrics row, nested keys joined with ``/`` (``round`` left out:
    it is the step)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if not prefix and key == "round":
            continue
        if isinstance(value, dict):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(scalars({str(i): v for i, v in enumerate(value)}, name + "/"))
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


def flatten_config(node: Any, prefix: str = "") -> dict[str, str]:
    """``{"train.lr": "0.002", ...}`` from a loaded YAML config."""
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(flatten_config(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): json.dumps(node) if isinstance(node, (list, type(None)))
            else str(node)}


def check_available(cfg: TrackingConfig) -> None:
    """Fail before a run starts when a tracker is asked for but its package is missing."""
    from importlib.util import find_spec

    if cfg.tensorboard and find_spec("tensorboard") is None:
        raise _missing("tensorboard", "tensorboard")
    if cfg.mlflow and find_spec("mlflow") is None:
        raise _missing("mlflow", "mlflow-skinny")


def _missing(setting: str, package: str) -> ConfigError:
    return ConfigError(f"tracking.{setting}=true needs the package '{package}': "
                       f"pip install 'fedadapt[tracking]'")


class TensorBoardSink:
    """Scalars per round and the config as text, in ``<run_dir>/tensorboard``."""

    def __init__(self, run_dir: Path, config_yaml: str, resume_round: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise _missing("tensorboard", "tensorboard") from err
        # purge_step drops the events of rounds a resumed run repeats
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"),
                                    purge_step=resume_round + 1 if resume_round else None)
        if not resume_round:
            indented = "\n".join("    " + line for line in config_yaml.splitlines())
            self.writer.add_text("config", indented, global_step=0)

    def log_round(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self, run_dir: Path, failed: bool) -> None:
        self.writer.close()


class MlflowSink:
    """One MLflow run per run directory, through :class:`mlflow.tracking.MlflowClient` (no
    global active run: the round hook runs on the ServerApp's thread)."""

    def __init__(self, cfg: TrackingConfig, *, run_dir: Path, config_yaml: str, name: str,
                 experiment: str, output_dir: str, tags: dict[str, str]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise _missing("mlflow", "mlflow-skinny") from err
        for noisy in ("mlflow", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(noisy).setLevel(logging.WARNING)
        root = Path(output_dir).expanduser().resolve()
        uri = cfg.mlflow_uri or f"sqlite:///{root / 'mlflow.db'}"
        if uri.startswith("sqlite:///") and not cfg.mlflow_uri:
            root.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        saved = run_dir / TRACKING_FILE
        known = json.loads(saved.read_text()) if saved.is_file() else {}
        if known.get("mlflow_uri") == uri and known.get("mlflow_run_id"):
            self.run_id = known["mlflow_run_id"]  # resume: the same MLflow run
            self.client.update_run(self.run_id, status="RUNNING")
            return
        exp_name = cfg.mlflow_experiment or experiment
        exp = self.client.get_experiment_by_name(exp_name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(
            exp_name, artifact_location=None if cfg.mlflow_uri else str(root / "mlartifacts"))
        self.run_id = self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id
        import yaml
        from mlflow.entities import Param

        from fedadapt.results.store import write_json

        params = [Param(k, v[:6000]) for k, v in
                  flatten_config(yaml.safe_load(config_yaml) or {}).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        write_json(saved, {"mlflow_uri": uri, "mlflow_run_id": self.run_id,
                           "mlflow_experiment": exp_name})

    def log_round(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, run_dir: Path, failed: bool) -> None:
        for path in sorted(run_dir.iterdir()):
            if path.is_file() and not path.name.startswith("."):
                self.client.log_artifact(self.run_id, str(path))
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Tracker:
    """The sinks ``tracking.*`` asks for (none: every call is a no-op)."""

    def __init__(self, sinks: list) -> None:
        self.sinks = sinks

    def __bool__(self) -> bool:
        return bool(self.sinks)

    def log_round(self, row: dict) -> None:
        """One ``metrics.jsonl`` row (step = its round)."""
        if not self.sinks:
            return
        values = scalars(row)
        for sink in self.sinks:
            sink.log_round(int(row["round"]), values)

    def close(self, run_dir: Path, *, failed: bool = False) -> None:
        """Flush and close; MLflow also receives the run directory's files."""
        for sink in self.sinks:
            sink.close(run_dir, failed)
        self.sinks = []


def open_tracker(cfg: TrackingConfig, *, run_dir: Path, config_yaml: str, name: str,
                 experiment: str, output_dir: str, tags: Optional[dict[str, str]] = None,
                 resume_round: int = 0) -> Tracker:
    """A :class:`Tracker` for one run directory (``resume_round``: rounds already logged by
    the process that was interrupted)."""
    sinks: list = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir, config_yaml, resume_round))
    if cfg.mlflow:
        sinks.append(MlflowSink(cfg, run_dir=run_dir, config_yaml=config_yaml, name=name,
                                experiment=experiment, output_dir=output_dir,
                                tags={"fedadapt.run_dir": str(run_dir), **(tags or {})}))
    return Tracker(sinks)
