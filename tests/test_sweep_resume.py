"""A sweep stopped mid-way resumes from its folder: ``fedadapt resume=<sweep folder>``, pasted
through a shell as the stop line prints it, finishes the point that was running from its
checkpoint and runs the point never started, to the metrics of its points run straight through.
The command lines (quoting, the replayed sweep) are checked without a run below."""

import csv
import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_interrupt import started, stop
from test_resume import ROUNDS, TINY, fedadapt, metrics, same, straight_through

from fedadapt.cli import hydra_value, quote_resume, sweep_resume_argv


def point_straight_through(point: Path, run_dir: Path) -> list[dict]:
    """The metrics of ``point``'s job (its ``job.json``) run straight through, in this
    process (:func:`test_resume.straight_through`)."""
    from fedadapt.cli import read_job

    return straight_through(read_job(point / "job.json", str(point)), run_dir)


@pytest.mark.slow
def test_a_stopped_sweep_resumes_pasted_to_the_same_metrics(tmp_path, cache_dir):
    """Two points (partition.alpha 0.1 and 1000): SIGTERM while point 0 runs; point 1 never
    started. Once resumed, the sweep holds one run directory per value, and fedadapt-report
    aggregates them by the swept key."""
    bin_dir = Path(sys.executable).parent  # where the `fedadapt` console script is
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir,
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    sweep_args = ["-m", "method=linear_head", "partition.alpha=0.1,1000", *TINY]
    victim = fedadapt(sweep_args + [f"output_dir={tmp_path}/stopped"], env)
    run = started(tmp_path / "stopped", 5, victim)  # <sweep>/<point>/linear_head
    rc, err = stop(victim, signal.SIGTERM, group=False)
    assert rc == 143, err[-3000:]
    point = run.parent
    sweep = point.parent
    assert point.name.startswith("0_") and not list(sweep.glob("1_*"))  # point 1 never began
    assert not (run / "summary.json").exists()
    line = next(ln for ln in err.splitlines() if ln.startswith("fedadapt: stopped"))
    command = line.split("continue the sweep with: ", 1)[1].split(" (its complete", 1)[0]
    assert shlex.split(command) == ["fedadapt", f"resume={sweep}"]
    assert f"point {point.name}: linear_head: from its checkpoint of round" in line

    pasted = subprocess.run(["bash", "-c", command], env=env, cwd=tmp_path, text=True,
                            capture_output=True, timeout=300)
    assert pasted.returncode == 0, pasted.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.rglob("summary.json"))  # <point>/linear_head
    assert [r.parent.name.split("_")[0] for r in runs] == ["0", "1"]
    for run in runs:  # each point against its config run straight through
        got, folder = metrics(run), run.parent
        assert same(got, point_straight_through(folder, tmp_path / "ref" / folder.name[:1])), \
            folder.name
        assert len(got) == ROUNDS

    alphas = sorted(json.loads((r / "summary.json").read_text())["partition"]["alpha"]
                    for r in runs)
    assert alphas == [0.1, 1000.0]
    from fedadapt.results.report import main as report  # in process: its own command is tested

    report([str(sweep)])                                # in test_report*.py
    rows = list(csv.DictReader(open(sweep / "report.csv")))
    assert sorted(float(r["partition.alpha"]) for r in rows) == [0.1, 1000.0]
    finals = {json.loads((r / "summary.json").read_text())["partition"]["alpha"]:
              json.loads((r / "summary.json").read_text())["final"]["global_acc"] for r in runs}
    for r in rows:  # each point's own final accuracy, in percent
        assert r["seeds"] == "1"
        assert float(r["final global acc mean"]) == pytest.approx(
            100 * finals[float(r["partition.alpha"])], abs=0.005)

    # a point's folder holds "=" and ",": its resume command works pasted as printed too
    again = subprocess.run(["bash", "-c", f"fedadapt resume={shlex.quote(str(point))}"],
                           env=env, cwd=tmp_path, text=True, capture_output=True, timeout=120)
    assert again.returncode == 0 and "complete already" in again.stderr, again.stderr[-3000:]


def test_resume_takes_any_folder_name_as_one_value():
    """``resume=PATH`` (as pasted: the shell removed its quotes) becomes one Hydra value,
    whatever the path holds: a sweep point's ``=`` and ``,``, spaces, quotes, backslashes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for path in ("/out/2_experiment=cdc_mmpg_offline,seed=2", "/my runs/a b", "/it's/here",
                 "/odd\\'name", "/ends\\"):
        printed = f"fedadapt resume={shlex.quote(path)}"
        argv = shlex.split(printed)[1:]  # what a shell hands the command
        (arg,) = quote_resume(argv)
        assert parser.parse_override(arg).value() == path, (path, arg)
        assert parser.parse_override(f"x={hydra_value(path)}").value() == path
    assert quote_resume(["resume='/a=b'", "seed=1"]) == ["resume='/a=b'", "seed=1"]


def test_resume_of_a_sweep_folder_replays_the_sweep_into_it(tmp_path):
    """The sweep's own overrides and Hydra settings (its launcher) from multirun.yaml, its
    folder again, and the flag that makes its started points continue."""
    from omegaconf import OmegaConf

    sweep = tmp_path / "multirun_x"
    sweep.mkdir()
    OmegaConf.save({"hydra": {"overrides": {
        "hydra": ["hydra.mode=MULTIRUN", "hydra/launcher=joblib", "hydra.sweep.dir=/old"],
        "task": ["experiment=quickstart", "seed=0,1,2"]}}}, sweep / "multirun.yaml")
    argv = sweep_resume_argv([f"resume={sweep}"])
    assert argv == ["-m", "experiment=quickstart", "seed=0,1,2", "hydra/launcher=joblib",
                    f"hydra.sweep.dir='{sweep}'", "+hydra.job.env_set.FEDADAPT_RESUMING_SWEEP=1"]
    assert sweep_resume_argv(quote_resume([f"resume={sweep}"])) == argv
    assert sweep_resume_argv([f"resume={tmp_path}"]) is None  # not a sweep: resume as a job
    assert sweep_resume_argv([f"resume={sweep}", "seed=3"]) is None
