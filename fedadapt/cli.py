"""``fedadapt``: federated adaptation of frozen models on Flower (the Hydra main).

``fedadapt`` runs the quickstart experiment; ``fedadapt experiment=NAME key=value ...`` any other;
``fedadapt -m partition.alpha=0.1,1000`` sweeps; ``fedadapt resume=DIR`` continues a job that
stopped (methods with a ``summary.json`` are kept, the others continue from their last
checkpoint). An experiment with ``compare: [...]`` runs each
listed method on the same data and seed, each into its own run directory under the job's folder,
and writes a combined ``table.md`` and ``curves.png`` there; naming ``method=`` on the command
line runs just that method. A ``compare`` entry ``method@backbone`` runs that row on another
backbone (FedCLIP's AlexNet baselines beside the CLIP rows).

This module runs the job; a mistyped command line is refused in one line by
:mod:`fedadapt.argv` before Hydra starts, and the job's time estimate is :mod:`fedadapt.estimate`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import hydra
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

import fedadapt  # noqa: F401  (torchvision shim first)
from fedadapt import rundir
from fedadapt.argv import config_problem, missing_launcher, sweep_problem
from fedadapt.config import ConfigError, FedadaptError
from fedadapt.ending import console
from fedadapt.entry import job_configs, register_configs
from fedadapt.federation.server.interrupt import (
    RunInterrupted,
    exit_stopped,
    last_words,
    stop_on_signals,
)
from fedadapt.paths import CONF_PATH
from fedadapt.userimport import recorded_files

register_configs()


def _remove_if_empty(run_dir: Path, root: Path) -> None:
    """Remove the folder Hydra made for a job that failed before writing anything."""
    d = run_dir
    while d.exists() and d != root and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


JOB = rundir.JOB
#: What Hydra writes into a sweep's folder (``fedadapt -m``) before its first point runs.
SWEEP = "multirun.yaml"
#: Set (through ``hydra.job.env_set``) in every point of a resumed sweep: a point whose folder
#: holds a job continues it, the others start.
RESUMING_SWEEP = "FEDADAPT_RESUMING_SWEEP"


def hydra_value(text: str) -> str:
    """``text`` as one Hydra override value, whatever it holds (``=``, ``,``, spaces, quotes):
    single-quoted, with its quotes, the backslashes before them and ``${`` escaped."""
    import re

    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\'" if m.group(2) else ""),
                     text)
    return "'" + escaped.replace("${", "\\${") + "'"


def quote_resume(argv: list[str]) -> list[str]:
    """``resume=PATH`` as typed or pasted (a sweep point's folder holds ``=`` and ``,``, which
    Hydra would read as syntax) made one Hydra value; a value quoted already is kept."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key.lstrip("+") == "resume" and value and value[0] not in "'\"":
            arg = f"{key}={hydra_value(value)}"
        out.append(arg)
    return out


def sweep_resume_argv(argv: list[str]) -> Optional[list[str]]:
    """For ``resume=<a sweep's folder>`` alone: the sweep's own command line again (its
    overrides and its Hydra settings, the launcher included), into the same folder, with
    :data:`RESUMING_SWEEP` set in every point; None for any other command line."""
    if len(argv) != 1 or argv[0].partition("=")[0].lstrip("+") != "resume":
        return None
    value = argv[0].partition("=")[2]
    if value[:1] in ("'", '"'):  # quoted for Hydra already (quote_resume's form)
        from hydra.core.override_parser.overrides_parser import OverridesParser

        value = str(OverridesParser.create().parse_override(f"resume={value}").value())
    folder = Path(value).expanduser().resolve()
    if not (folder / SWEEP).is_file() or (folder / JOB).is_file():
        return None
    try:
        saved = OmegaConf.load(folder / SWEEP).hydra.overrides
        task, own = list(saved.task), list(saved.hydra)
    except Exception as err:  # noqa: BLE001 - a garbled file is named, whatever failed
        raise ConfigError(f"resume={str(folder)!r} is invalid: {folder / SWEEP} is unreadable "
                          f"({str(err).splitlines()[0]})") from err
    kept = [o for o in own if o.split("=")[0].lstrip("+") not in
            ("hydra.mode", "hydra.sweep.dir", f"hydra.job.env_set.{RESUMING_SWEEP}")]
    return ["-m", *task, *kept, f"hydra.sweep.dir={hydra_value(str(folder))}",
            f"+hydra.job.env_set.{RESUMING_SWEEP}=1"]


def resume_target(path: str) -> tuple[Path, list[str]]:
    """The job folder to resume and the overrides it was started with.

    ``path`` is a job folder (it has ``job.json``) or one method's run directory inside it.
    """
    p = Path(path).expanduser().resolve()
    if not p.is_dir():  # <job>/finetune that does not exist must not resume the whole job
        raise ConfigError(f"resume={path!r} is invalid: no such folder")
    for job_dir in (p, p.parent):
        if (job_dir / JOB).is_file():
            return job_dir, read_job(job_dir / JOB, path)
    raise ConfigError(f"resume={path!r} is invalid: neither it nor its parent holds {JOB} (a "
                      f"job folder written by `fedadapt`), nor does it hold {SWEEP} (a sweep's "
                      f"folder, written by `fedadapt -m`)")


def read_job(job: Path, resume: str) -> list[str]:
    """The ``overrides`` of a ``job.json``; a garbled file is refused with one line."""
    try:
        overrides = json.loads(job.read_text())["overrides"]
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise ValueError(f"'overrides' is {type(overrides).__name__}, not a list of strings")
    except (OSError, ValueError, KeyError, TypeError) as err:
        why = f"no key {err}" if isinstance(err, KeyError) else str(err).splitlines()[0]
        raise ConfigError(f"resume={resume!r} is invalid: {job} is unreadable ({why}); it holds "
                          f'{{"overrides": [...]}} as `fedadapt` wrote it') from err
    return overrides


def user_files(folder: Path) -> list[dict]:
    """The user's files recorded by the runs under ``folder`` (a job's, or a sweep's points':
    :data:`fedadapt.userimport.USER_FILES`)."""
    from fedadapt.userimport import USER_FILES, read_records

    return read_records(sorted({p.parent for p in Path(folder).rglob(USER_FILES)}))


def read_summary(path: Path) -> dict:
    """A finished run's ``summary.json`` (resume keeps it); a garbled one is refused."""
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError(f"a JSON {type(summary).__name__}, not an object")
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path} is unreadable ({str(err).splitlines()[0]}): delete it to run "
                          f"that method again on resume") from err
    return summary


class OutputDirCheck(Callback):
    """Hydra callback (``hydra.callbacks`` in conf/config.yaml): an ``output_dir`` that cannot
    be written is refused with one line before Hydra creates the job folder in it."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self._check(config)

    @staticmethod
    def _check(config: DictConfig) -> None:
        from fedadapt.results.store import check_writable

        try:
            check_writable(str(config.output_dir), "output_dir")
        except FedadaptError as err:
            print(f"fedadapt: error: {err}", file=sys.stderr)
            sys.exit(2)


def method_dirs(job_dir: Path, names: list[str], *, resume: bool) -> dict[str, Path]:
    """Each method's run directory: ``<job>/<method>/``, one method or several (the job folder
    holds ``job.json``, ``table.md``, ``curves.png`` beside them). A job of one method written
    before 2026-11-28 kept its run in the job folder itself: resumed there."""
    from fedadapt.results.store import SUMMARY

    legacy = resume and len(names) == 1 and any(
        (job_dir / f).exists() for f in (SUMMARY, "metrics.jsonl", "checkpoints"))
    return {name: job_dir if legacy else job_dir / name for name in names}


def run_job(cfg: DictConfig, run_dir: Path, overrides: list[str], *,
            resume: bool = False) -> list[dict]:
    from fedadapt import progress
    from fedadapt.estimate import method_costs
    from fedadapt.experiment import prepare_run, run_experiment
    from fedadapt.federation.simulation.cluster import check_reachable
    from fedadapt.files import atomic_write
    from fedadapt.methods import family_of
    from fedadapt.results.plots import has_curve, plot_curves
    from fedadapt.results.store import SUMMARY, read_jsonl, write_json
    from fedadapt.results.tables import run_tables

    jobs = job_configs(cfg, overrides)
    dirs = method_dirs(run_dir, [name for name, _, _ in jobs], resume=resume)
    done = {name: read_summary(d / SUMMARY) for name, d in dirs.items()
            if resume and (d / SUMMARY).is_file()}
    if resume:  # a garbled checkpoint pointer fails now, not after the data is prepared
        from fedadapt.federation.server.checkpoint import latest_checkpoint

        for name, d in dirs.items():
            if name not in done:
                latest_checkpoint(d)
    # Everything that can fail on bad input happens before the first file is written.
    for _, run, _ in jobs:  # a Ray cluster named but not answering: fail in seconds
        check_reachable(run.federation)
    prepared = {name: prepare_run(run, quiet=i > 0) for i, (name, run, _) in enumerate(jobs)
                if name not in done}
    if not resume:
        write_json(run_dir / JOB, {"overrides": overrides, "argv": sys.argv})
    summaries = []
    units = {name: family_of(run.method).units(run) for name, run, _ in jobs}
    measured, extra = method_costs(jobs, prepared, dirs)
    with progress.job(jobs[0][1].experiment, units, measured=measured, extra=extra) as shown:
        for name, run, yaml in jobs:
            if name in done:
                print(f"[{name}] complete already ({dirs[name] / SUMMARY})", file=sys.stderr)
                summaries.append(done[name])
                shown.finish(name, skipped=True)
                continue
            shown.start(name)
            summaries.append(run_experiment(run, dirs[name], config_yaml=yaml, label=name,
                                            prepared=prepared[name], resume=resume))
            shown.finish(name)
    if len(jobs) == 1:  # the job folder shows its one run's table and curves
        one = dirs[jobs[0][0]]
        for name in ("table.md", "curves.png") if one != run_dir else ():
            if (one / name).is_file():
                data = (one / name).read_bytes()
                atomic_write(run_dir / name, lambda fh, data=data: fh.write(data), mode="wb")
        print("\n" + (one / "table.md").read_text())
        print(f"Run directory: {one}")
        return summaries
    first, part = jobs[0][1], summaries[0]["partition"]
    split = (f"domains as clients, held out: {summaries[0]['domains']['holdout']}"
             if summaries[0].get("domains") else f"{part['kind']} alpha={part['alpha']}")
    rounds = ("trained once on the server" if not family_of(first.method).clients_train
              else f"{first.rounds} rounds")
    title = (f"## {first.experiment}: {first.dataset.name}, {first.backbone.name}, "
             f"{part['num_clients']} clients, {split}, {rounds}, seed {first.seed}")
    table = run_tables(summaries, title=title)
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    curves = {s["method"]: read_jsonl(path) for s in summaries
              if (path := dirs[s["method"]] / "metrics.jsonl").is_file()}
    if any(has_curve(rows) for rows in curves.values()):
        plot_curves(curves, run_dir / "curves.png", title=first.experiment)
    print("\n" + table)
    print(f"Run directory: {run_dir}")
    return summaries


@contextmanager
def _holding(run_dir: Path, *, resume: bool = False) -> Iterator[None]:
    """Hold ``run_dir``'s lock for the job (see :mod:`fedadapt.rundir`). A signal
    that lands while the lock is being taken still releases it (unlocking leaves a lock that
    is not this process's)."""
    try:
        rundir.lock_run_dir(run_dir, resume=resume)
        yield
    finally:
        rundir.unlock_run_dir(run_dir)


def objective_value(cfg: DictConfig, summaries: list[dict]) -> Optional[float]:
    """What the task function returns to a sweeper that searches (``objective``): the clients'
    mean validation accuracy at the reported round (``summary["selected"]["val_acc"]``, the
    last evaluated round unless ``federation.select=best_val``); None without an objective."""
    if cfg.get("objective") is None:
        return None
    if len(summaries) != 1:
        raise ConfigError(f"objective={cfg.objective} needs one method per job (it names the "
                          f"value a sweeper optimises); this job runs {len(summaries)}: name one "
                          f"with method=NAME")
    selected = summaries[0].get("selected") or {}
    value = selected.get("val_acc")
    if value is None:
        raise ConfigError(f"objective={cfg.objective}: the run has no validation accuracy "
                          f"(no client evaluated a validation split)")
    return float(value)


@hydra.main(version_base=None, config_path=CONF_PATH, config_name="config")
def _main(cfg: DictConfig) -> Optional[float]:
    """Hydra's task function: runs the job; returns the ``objective`` (None without one)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    logging.getLogger().setLevel(logging.WARNING)  # Hydra's stdout config says INFO
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    root = Path(cfg.output_dir).resolve().parent  # before resume swaps cfg for the job's config
    overrides = list(HydraConfig.get().overrides.task)
    job_dir = run_dir
    sweep_dir = (Path(HydraConfig.get().sweep.dir).resolve()
                 if HydraConfig.get().mode == RunMode.MULTIRUN else None)

    def stop_line(stop: RunInterrupted) -> None:
        """The stop's last words, from the main thread or the watch thread: how to resume,
        the lock released (if it is this process's), an empty job folder removed."""
        print(f"fedadapt: {stop}; {resume_hint(job_dir, sweep_dir)}", file=sys.stderr)
        rundir.unlock_run_dir(job_dir)
        _remove_if_empty(run_dir, root)

    try:
        with stop_on_signals():  # Ctrl-C / SIGTERM: RunInterrupted, handled below
            last_words(stop_line)
            if cfg.resume:
                from hydra import compose

                if any(o.split("=")[0] != "resume" for o in overrides):
                    raise ConfigError("resume=DIR takes no other overrides: the run continues "
                                      "with the config it was started with")
                _remove_if_empty(run_dir, root)
                job_dir, overrides = resume_target(cfg.resume)
                cfg = compose(config_name="config", overrides=overrides)
                # the user's files as the job recorded them, whatever the folder now
                with _holding(job_dir, resume=True), recorded_files(user_files(job_dir)):
                    return objective_value(cfg, run_job(cfg, job_dir, overrides, resume=True))
            # a resumed sweep (sweep_resume_argv): a point that had started continues, and
            # every point reads the user's files the sweep's points recorded
            resuming = bool(os.environ.get(RESUMING_SWEEP))
            with recorded_files(user_files(sweep_dir) if resuming and sweep_dir else []):
                if cfg.get("objective") is not None and len(job_configs(cfg, overrides)) != 1:
                    objective_value(cfg, [])  # refused before anything runs
                resume = resuming and (run_dir / JOB).is_file()
                with _holding(run_dir, resume=resume):  # before anything is written: one run
                    return objective_value(cfg, run_job(cfg, run_dir, overrides, resume=resume))
    except RunInterrupted as stop:
        stop_line(stop)
        exit_stopped(stop)
    except FedadaptError as err:
        print(f"fedadapt: error: {err}", file=sys.stderr)
        _remove_if_empty(run_dir, root)
        sys.exit(2)
    except OSError as err:  # a full disk, a read-only or vanished folder: name the file
        print(f"fedadapt: error: {os_error_line(err, job_dir)}", file=sys.stderr)
        _remove_if_empty(run_dir, root)
        sys.exit(1)
    except BaseException:
        # A run that stopped leaves no summary.json, so no result; drop an empty folder.
        _remove_if_empty(run_dir, root)
        raise


def resume_hint(job_dir: Path, sweep_dir: Optional[Path] = None) -> str:
    """How to continue a stopped job, and from which checkpoint of each of its runs; for a
    point of a sweep (``sweep_dir``), how to continue the whole sweep."""
    from fedadapt.federation.server.checkpoint import CheckpointError, latest_checkpoint
    from fedadapt.results.store import SUMMARY

    runs = sorted({p.parent for p in job_dir.rglob("config.yaml")}) \
        if (job_dir / JOB).is_file() else []
    states = []
    for run in runs:
        name = run.name if run != job_dir else "the run"
        try:
            folder = None if (run / SUMMARY).is_file() else latest_checkpoint(run)
        except CheckpointError:
            folder = None
        states.append(f"{name}: complete" if (run / SUMMARY).is_file() else
                      f"{name}: from its checkpoint of round {int(folder.name[6:])}" if folder
                      else f"{name}: from the start (no checkpoint yet)")
    if sweep_dir is not None:  # its points done are kept, the others continue or start
        point = f"; point {job_dir.name}: {'; '.join(states)}" if states else ""
        return (f"continue the sweep with: {rundir.resume_command(sweep_dir)} (its complete "
                f"points are kept, the others continue or start{point})")
    if not (job_dir / JOB).is_file():
        return "it stopped before writing anything"
    where = f" ({'; '.join(states)})" if states else ""
    return f"continue with: {rundir.resume_command(job_dir)}{where}"


def os_error_line(err: OSError, job_dir: Path | None = None) -> str:
    """One line for an operating-system error: what failed, on which file, what to do."""
    import errno

    where = f": {err.filename}" if err.filename else ""
    started = job_dir is not None and (job_dir / JOB).is_file()
    resume = rundir.resume_command(job_dir) if started else "fedadapt resume=<job folder>"
    hint = {errno.ENOSPC: f" (free some space, then continue with `{resume}`)",
            errno.EROFS: " (point output_dir / FEDADAPT_CACHE at a writable folder)",
            errno.EACCES: " (check the folder's permissions)"}.get(err.errno, "")
    # numpy's short write and PIL's truncated image raise an OSError with no strerror: its own
    # message is the cause ("1839360 requested and 262112 written", "image file is truncated")
    cause = err.strerror or str(err) or type(err).__name__
    return f"{cause}{where}{hint}"


def _unquoted(value: str) -> str:
    """A Hydra override value as :func:`hydra_value` quoted it, unquoted."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return str(OverridesParser.create().parse_override(f"x={value}").value())


def main() -> None:
    """Console-script entry point."""
    if sys.argv[1:2] in (["-h"], ["--help"]):
        from fedadapt.entry import tool_help

        print(tool_help(__doc__)
              + "\nHydra's own flags (-m, --cfg job, --multirun, ...): fedadapt --hydra-help.")
        sys.exit(0)
    sweep = None
    try:  # resume=<a sweep's folder>: the sweep again, its points continued or started
        sys.argv[1:] = (sweep := sweep_resume_argv(sys.argv[1:])) or quote_resume(sys.argv[1:])
    except FedadaptError as err:
        print(f"fedadapt: error: {err}", file=sys.stderr)
        sys.exit(2)
    folder = next((a.partition("=")[2] for a in sweep or [] if a.startswith("hydra.sweep.dir=")),
                  None)
    with recorded_files(user_files(Path(_unquoted(folder))) if folder else []):
        problem = (missing_launcher(sys.argv[1:]) or config_problem(sys.argv[1:])
                   or sweep_problem(sys.argv[1:]))
    if problem:
        print(f"fedadapt: error: {problem}", file=sys.stderr)
        sys.exit(2)

    from importlib.util import find_spec

    from fedadapt.progress import configure_output

    if (any(a.lstrip("+").startswith("search=") for a in sys.argv[1:])
            and find_spec("hydra_plugins.hydra_optuna_sweeper") is None):
        print("fedadapt: error: search=... runs Hydra's Optuna sweeper, which is not installed: "
              "pip install 'fedadapt[search]'", file=sys.stderr)
        sys.exit(2)
    configure_output()  # a live display on a terminal, plain lines (no escape codes) elsewhere
    # Alembic (under the Optuna sweeper's and MLflow's SQLAlchemy) announces every plugin it loads
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        with stop_on_signals():  # a signal while Hydra sets up a job (or after one ends)
            _main()
    except RunInterrupted as stop:
        print(f"fedadapt: {stop} outside a run (while Hydra set up or closed a job); nothing "
              f"was left half-written", file=sys.stderr)
        exit_stopped(stop)


#: The console command: :func:`main`, then the process ends without the interpreter's
#: teardown (:mod:`fedadapt.ending`).
command = console(main)


if __name__ == "__main__":
    command()
