"""fedadapt from Python: run one method and get Flower's ``Result``, or read one back.

>>> from fedadapt.api import run, load_result
>>> outcome = run(["method=linear_head", "strategy=fedadam"], "outputs/mine")
>>> outcome.result.evaluate_metrics_serverapp[outcome.summary["rounds"]]

``Result`` is what Flower's ``Strategy.start`` returns: the final arrays, the strategy's
aggregated train and evaluate metrics per round, and the server-side evaluation per round
(fedadapt's global evaluation and a ``federation.evaluate_fn``'s, round 0 included with
``federation.eval_round0=true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from flwr.serverapp.strategy import Result

from fedadapt.config import ConfigError

__all__ = ["Outcome", "load_result", "run"]


@dataclass
class Outcome:
    """A finished run: its directory, its summary (``summary.json``) and Flower's ``Result``."""

    run_dir: Path
    summary: dict
    result: Result


def run(overrides: list[str], run_dir: str | Path, *, execute=None) -> Outcome:
    """Compose ``overrides`` as the ``fedadapt`` command does (the quickstart experiment unless
    they name another; ``method=NAME`` runs that method of an experiment that compares several,
    and one that compares several without it is refused), run it into ``run_dir`` and return
    its :class:`Outcome`. ``execute``: the federation's launcher (default: Flower's simulation
    engine, or ``federation.backend``'s)."""
    from fedadapt.cli import job_configs
    from fedadapt.entry import compose_config
    from fedadapt.experiment import run_experiment

    overrides = list(overrides)
    composed = compose_config(overrides, default_experiment="quickstart")
    named = any(o.split("=")[0].lstrip("+~") == "method" for o in overrides)
    if composed.get("compare") and not named:
        raise ConfigError(f"experiment={composed.experiment} compares "
                          f"{list(composed.compare)}: fedadapt.api.run runs one method, name it "
                          f"with method=NAME")
    [(label, cfg, yaml)] = job_configs(composed, overrides)
    run_dir = Path(run_dir)
    summary = run_experiment(cfg, run_dir, config_yaml=yaml, label=label, execute=execute)
    return Outcome(run_dir, summary, load_result(run_dir))


def load_result(run_dir: str | Path) -> Result:
    """Flower's ``Result`` of a finished run in rounds, from its ``metrics.jsonl`` and its last
    checkpoint's arrays."""
    from flwr.app import ArrayRecord

    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
    from fedadapt.federation.server.loop import flower_result
    from fedadapt.results.store import METRICS, read_jsonl

    run_dir = Path(run_dir)
    if not (run_dir / METRICS).is_file():
        raise ConfigError(f"{run_dir} is not a run directory of a run in rounds (no {METRICS})")
    folder: Optional[Path] = latest_checkpoint(run_dir)
    arrays = (ArrayRecord(torch_state_dict=load_checkpoint(folder)[0]) if folder is not None
              else ArrayRecord())
    return flower_result(read_jsonl(run_dir / METRICS), arrays)
