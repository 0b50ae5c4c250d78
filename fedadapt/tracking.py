"""Experiment tracking: TensorBoard event files, MLflow runs and Weights & Biases runs, fed by
the per-round hook.

All are optional extras (``pip install 'fedadapt[tracking]'`` for TensorBoard and MLflow,
``pip install 'fedadapt[wandb]'`` for W&B), off by default, and work offline. What they receive
is what the run directory holds:

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
* W&B: the resolved config as the run's config (nested, as in ``config.yaml``), tags naming the
  method, data set, backbone, seed and commit, the run directory in the notes, and at the end
  the run's table (``table``: ``table.md``'s row as a W&B table) and curves (``curves``:
  ``curves.png``) at the last round's step, and the run directory's files saved with the run.
  W&B's files go under ``<output_dir>/wandb`` (beside MLflow's default store: a run directory
  holds no copy of itself). ``tracking.wandb_mode`` is ``offline`` by default
  (nothing leaves the machine; ``wandb sync <output_dir>/wandb/offline-run-*`` uploads a run
  later) or ``online``; the W&B run id is kept in ``tracking.json``, so ``resume=`` continues
  the same W&B run.
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
    if cfg.wandb and find_spec("wandb") is None:
        raise _missing("wandb", "wandb", extra="wandb")


def _missing(setting: str, package: str, extra: str = "tracking") -> ConfigError:
    return ConfigError(f"tracking.{setting}=true needs the package '{package}': "
                       f"pip install 'fedadapt[{extra}]'")


def _remember(run_dir: Path, **values: str) -> None:
    """Merge ``values`` into ``<run_dir>/tracking.json`` (each tracker keeps its own keys)."""
    from fedadapt.results.store import write_json

    write_json(run_dir / TRACKING_FILE, {**_known(run_dir), **values})


def _known(run_dir: Path) -> dict:
    saved = run_dir / TRACKING_FILE
    return json.loads(saved.read_text()) if saved.is_file() else {}


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
        known = _known(run_dir)
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

        params = [Param(k, v[:6000]) for k, v in
                  flatten_config(yaml.safe_load(config_yaml) or {}).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])
        _remember(run_dir, mlflow_uri=uri, mlflow_run_id=self.run_id,
                  mlflow_experiment=exp_name)

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


class WandbSink:
    """One Weights & Biases run per run directory (its own run object, not ``wandb.run``: the
    round hook runs on the ServerApp's thread, and a notebook may hold a run of its own)."""

    def __init__(self, cfg: TrackingConfig, *, run_dir: Path, config_yaml: str, name: str,
                 experiment: str, output_dir: str, tags: dict[str, str],
                 resume_round: int) -> None:
        try:
            import wandb
        except ImportError as err:
            raise _missing("wandb", "wandb", extra="wandb") from err
        import yaml

        root = Path(output_dir).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        known = _known(run_dir)
        run_id = known.get("wandb_run_id")  # resume: the same W&B run
        self.run = wandb.init(
            project=cfg.wandb_project or experiment, entity=cfg.wandb_entity, name=name,
            id=run_id, resume="allow" if run_id else None, mode=cfg.wandb_mode,
            dir=str(root), config=yaml.safe_load(config_yaml) or {},
            tags=[f"{k.removeprefix('fedadapt.')}={v}"[:64] for k, v in tags.items()
                  if k != "fedadapt.run_dir"],
            notes=f"fedadapt run directory: {run_dir}", reinit="create_new",
            # fedadapt's own console lines stay as they are (no stdout wrapper)
            settings=wandb.Settings(console="off", quiet=True, save_code=False))
        # A W&B step cannot be logged again: the rounds a resumed run repeats (after its
        # checkpoint, up to where the interrupted process got) keep their first values
        self.run_dir = run_dir
        self.last_step = max(resume_round, known.get("wandb_last_round", 0)) if run_id else 0
        self.step = self.last_step
        if not run_id:
            _remember(run_dir, wandb_run_id=self.run.id, wandb_project=self.run.project,
                      wandb_mode=cfg.wandb_mode)

    def log_round(self, step: int, values: dict[str, float]) -> None:
        if step <= self.last_step:
            return
        self.run.log(values, step=step)
        self.step = step
        _remember(self.run_dir, wandb_last_round=step)

    def close(self, run_dir: Path, failed: bool) -> None:
        import wandb

        from fedadapt.results.records import parse_table

        final: dict[str, Any] = {}
        table = run_dir / "table.md"
        if table.is_file():
            columns, rows = parse_table(table.read_text())
            final["table"] = wandb.Table(columns=columns, data=rows)
        curves = run_dir / "curves.png"
        if curves.is_file():
            final["curves"] = wandb.Image(str(curves))
        if final:
            self.run.log(final, step=self.step)
        for path in sorted(run_dir.iterdir()):
            if path.is_file() and not path.name.startswith("."):
                self.run.save(str(path), base_path=str(run_dir), policy="now")
        self.run.finish(exit_code=1 if failed else 0)


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
        """Flush and close; MLflow and W&B also receive the run directory's files."""
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
    if cfg.wandb:
        sinks.append(WandbSink(cfg, run_dir=run_dir, config_yaml=config_yaml, name=name,
                               experiment=experiment, output_dir=output_dir, tags=tags or {},
                               resume_round=resume_round))
    return Tracker(sinks)
