"""``fedadapt``: the Hydra main.

``fedadapt`` runs the quickstart experiment; ``fedadapt experiment=NAME key=value ...`` any other;
``fedadapt -m partition.alpha=0.1,1000`` sweeps; ``fedadapt resume=DIR`` continues a job that
stopped (methods with a ``summary.json`` are kept, the others continue from their last
checkpoint). An experiment with ``compare: [...]`` runs each
listed method on the same data and seed, each into its own run directory under the job's folder,
and writes a combined ``table.md`` and ``curves.png`` there; naming ``method=`` on the command
line runs just that method. A ``compare`` entry ``method@backbone`` runs that row on another
backbone (FedCLIP's AlexNet baselines beside the CLIP rows).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import fedadapt  # noqa: F401  (torchvision shim first)
from fedadapt.config import ConfigError, FedadaptError, RunConfig
from fedadapt.entry import register_configs, to_run_config, with_method_train
from fedadapt.paths import CONF_PATH

register_configs()


def job_configs(cfg: DictConfig, overrides: list[str]) -> list[tuple[str, RunConfig, str]]:
    """``(method, RunConfig, resolved yaml)`` for each run of this job, all validated up front."""
    from hydra import compose

    chosen = [o.split("=", 1)[1] for o in overrides if o.split("=")[0].lstrip("+~") == "method"]
    names = [] if chosen else list(cfg.compare)
    if not names:  # one run, labelled by the preset named (fedavg_clip, not its schema fedclip)
        run = to_run_config(cfg)
        return [(chosen[-1] if chosen else run.method.name, run,
                 OmegaConf.to_yaml(with_method_train(cfg), resolve=True))]
    out = []
    for entry in names:  # "method" or "method@backbone" (a row on another backbone)
        name, _, backbone = entry.partition("@")
        extra = [f"method={name}"] + ([f"backbone={backbone}"] if backbone else [])
        sub = compose(config_name="config", overrides=overrides + extra)
        out.append((name, to_run_config(sub),
                    OmegaConf.to_yaml(with_method_train(sub), resolve=True)))
    return out


def _remove_if_empty(run_dir: Path, root: Path) -> None:
    """Remove the folder Hydra made for a job that failed before writing anything."""
    d = run_dir
    while d.exists() and d != root and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent


JOB = "job.json"


def resume_target(path: str) -> tuple[Path, list[str]]:
    """The job folder to resume and the overrides it was started with.

    ``path`` is a job folder (it has ``job.json``) or one method's run directory inside it.
    """
    p = Path(path).expanduser().resolve()
    for job_dir in (p, p.parent):
        if (job_dir / JOB).is_file():
            return job_dir, list(json.loads((job_dir / JOB).read_text())["overrides"])
    raise ConfigError(f"resume={path!r} is invalid: neither it nor its parent holds {JOB} "
                      f"(a folder written by `fedadapt`)")


def run_job(cfg: DictConfig, run_dir: Path, overrides: list[str], *,
            resume: bool = False) -> list[dict]:
    from fedadapt.experiment import prepare_run, run_experiment
    from fedadapt.results.plots import plot_curves
    from fedadapt.results.store import SUMMARY, atomic_write, read_jsonl, write_json
    from fedadapt.results.tables import run_tables

    jobs = job_configs(cfg, overrides)
    compare = len(jobs) > 1
    dirs = {name: run_dir / name if compare else run_dir for name, _, _ in jobs}
    done = {name: json.loads((d / SUMMARY).read_text()) for name, d in dirs.items()
            if resume and (d / SUMMARY).is_file()}
    # Everything that can fail on bad input happens before the first file is written.
    prepared = {name: prepare_run(run, quiet=i > 0) for i, (name, run, _) in enumerate(jobs)
                if name not in done}
    if not resume:
        write_json(run_dir / JOB, {"overrides": overrides, "argv": sys.argv})
    summaries = []
    for name, run, yaml in jobs:
        if name in done:
            print(f"[{name}] complete already ({dirs[name] / SUMMARY})", file=sys.stderr)
            summaries.append(done[name])
            continue
        summaries.append(run_experiment(run, dirs[name], config_yaml=yaml, label=name,
                                        prepared=prepared[name], resume=resume))
    if not compare:
        print("\n" + (run_dir / "table.md").read_text())
        print(f"Run directory: {run_dir}")
        return summaries
    first, part = jobs[0][1], summaries[0]["partition"]
    split = (f"domains as clients, held out: {summaries[0]['domains']['holdout']}"
             if summaries[0].get("domains") else f"{part['kind']} alpha={part['alpha']}")
    server_trained = summaries[0].get("recognition") or summaries[0].get("sessions")
    rounds = ("trained once on the server" if not summaries[0]["rounds"] and server_trained
              else f"{first.rounds} rounds")
    title = (f"## {first.experiment}: {first.dataset.name}, {first.backbone.name}, "
             f"{part['num_clients']} clients, {split}, {rounds}, seed {first.seed}")
    table = run_tables(summaries, title=title)
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    curves = {s["method"]: read_jsonl(path) for s in summaries
              if (path := dirs[s["method"]] / "metrics.jsonl").is_file()}
    if any(curves.values()):
        plot_curves(curves, run_dir / "curves.png", title=first.experiment)
    print("\n" + table)
    print(f"Run directory: {run_dir}")
    return summaries


@hydra.main(version_base=None, config_path=CONF_PATH, config_name="config")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    logging.getLogger().setLevel(logging.WARNING)  # Hydra's stdout config says INFO
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    root = Path(cfg.output_dir).resolve().parent  # before resume swaps cfg for the job's config
    overrides = list(HydraConfig.get().overrides.task)
    try:
        if cfg.resume:
            from hydra import compose

            if any(o.split("=")[0] != "resume" for o in overrides):
                raise ConfigError("resume=DIR takes no other overrides: the run continues with "
                                  "the config it was started with")
            _remove_if_empty(run_dir, root)
            job_dir, overrides = resume_target(cfg.resume)
            cfg = compose(config_name="config", overrides=overrides)
            run_job(cfg, job_dir, overrides, resume=True)
        else:
            run_job(cfg, run_dir, overrides)
    except FedadaptError as err:
        print(f"fedadapt: error: {err}", file=sys.stderr)
        _remove_if_empty(run_dir, root)
        sys.exit(2)
    except BaseException:
        # A run that stopped leaves no summary.json, so no result; drop an empty folder.
        _remove_if_empty(run_dir, root)
        raise


def main() -> None:
    """Console-script entry point."""
    _main()


if __name__ == "__main__":
    main()

