"""fedadapt from Python: run one method and get Flower's ``Result``, read one back, or report
on several.

>>> from fedadapt.api import run, load_result, report
>>> outcome = run(["method=linear_head", "strategy=fedadam"], "outputs/mine")
>>> outcome.result.evaluate_metrics_serverapp[outcome.summary["rounds"]]
>>> report(["outputs/mine"]).table  # fedadapt-report's table (a notebook shows it as such)

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

__all__ = ["Outcome", "Report", "load_result", "report", "run"]


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
    from fedadapt.entry import compose_config, job_configs
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


@dataclass
class Report:
    """``fedadapt-report``'s table of some run directories and the curves of its runs; a
    notebook shows it as its table."""

    #: The table (markdown): one row per group of runs that differ only in ``seed``.
    table: str
    #: The same as CSV: mean, sample std and 95% interval of each metric.
    csv: str
    #: ``curves.png``: global (solid) and client-mean (dotted) accuracy against round and
    #: against cumulative bytes, one colour per run.
    plot: Path
    #: Where ``report.md``, ``report.csv`` and ``curves.png`` were written.
    out: Path
    #: How many complete runs (``summary.json``) the table holds.
    runs: int

    def _repr_markdown_(self) -> str:
        return self.table


def report(folders: list[str | Path], out: Optional[str | Path] = None) -> Report:
    """The ``fedadapt-report`` table (its default layout) of every complete run directory below
    ``folders``, and a plot of their curves, each run labelled by the settings that tell the
    groups apart (and its seed where a group has several); ``report.md`` (the table, then the
    plot), ``report.csv`` and ``curves.png`` are written into ``out`` (default: the first
    folder)."""
    from fedadapt.files import atomic_write
    from fedadapt.results.plots import plot_curves
    from fedadapt.results.report import (
        CONVENTION,
        aggregate,
        find_runs,
        history_of,
        legend_keys,
        render,
    )

    folders = [Path(f) for f in folders]
    if not folders:
        raise ConfigError("fedadapt.api.report needs at least one folder of run directories")
    missing = [str(f) for f in folders if not f.is_dir()]
    if missing:
        raise ConfigError(f"fedadapt.api.report: no such folder: {', '.join(missing)}")
    runs = find_runs([str(f) for f in folders])
    if not runs:
        raise ConfigError(f"fedadapt.api.report: no complete run (summary.json) under "
                          f"{', '.join(map(str, folders))}")
    varying, rows = aggregate(runs)
    md, csv_text = render(varying, rows)
    keys = legend_keys(varying, rows)
    curves: dict[str, list[dict]] = {}
    for row in rows:
        label = ", ".join(f"{k.removesuffix('.name')}={row[k]}" for k in keys)
        for run_ in row["runs"]:
            seed = f", seed={run_['summary'].get('seed')}" if len(row["runs"]) > 1 else ""
            curves[label + seed] = history_of(run_)
    out = Path(out) if out is not None else folders[0]
    out.mkdir(parents=True, exist_ok=True)
    plot_curves(curves, out / "curves.png")
    title = (f"# fedadapt report: {len(runs)} runs in {len(rows)} groups (mean ± std over "
             f"seeds)\n\n{CONVENTION}\n\n")
    atomic_write(out / "report.md",
                 lambda fh: fh.write(f"{title}{md}\n![curves](curves.png)\n"))
    atomic_write(out / "report.csv", lambda fh: fh.write(csv_text))
    return Report(table=md, csv=csv_text, plot=out / "curves.png", out=out, runs=len(runs))
