"""The console scripts: config errors name the key and leave nothing behind; a -m sweep writes
one run directory per value (tests/test_sweep_resume.py, with fedadapt-report's aggregation);
fedadapt-inspect counts."""

import json
import os
import subprocess
import sys

import pytest

TINY = ["backbone=small_cnn", "backbone.image_size=16", "dataset.max_samples=300",
        "partition.num_clients=3", "rounds=2", "federation.eval_every=1"]


def assert_only_fedadapts(stderr: str, expected: str) -> None:
    """Every line on standard error is fedadapt's (``[data]``, ``[job]``, ``[federation]``,
    ``[<method>] round``, ``[ray]``, and the data preparation's progress: ``images
    digits/train 300/300 ...``, ``input <store> 300/300 ...`` where the cache has not yet
    resized the images to the model's input): no Flower deprecation banner, no ``Manually
    terminating ClientAppActor``, no Ray IP probe warning, no progress bar's carriage returns,
    no traceback, and no line broken by another thread's."""
    lines = stderr.splitlines()
    strangers = [ln for ln in lines if not ln.startswith(("[", "images ", "features ", "input "))]
    assert lines and not strangers, strangers
    for noise in ("DEPRECATED", "Manually terminating", "8.8.8.8", "\r", "Traceback",
                  "hashed properly", "WARNING"):
        assert noise not in stderr, noise
    assert any(ln.startswith(expected) for ln in lines), expected


def run(args, tmp_path, cache_dir, timeout=300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    return subprocess.run([sys.executable, "-m", "fedadapt.cli", *args,
                           f"output_dir={tmp_path}/out"],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("override,needle", [
    ("dataset=no_such_dataset", "dataset=no_such_dataset is not an option of dataset"),
    ("method.hiden_dim=3", "hiden_dim"),
    ("train.lr=fast", "train.lr"),
    ("method=linear_head_schema", "method=linear_head_schema is not an option of method"),
    ("strategy.etaa=0.1", "strategy.etaa is not a key of strategy=fedavg"),
])
def test_a_command_line_that_does_not_compose_is_refused_in_one_line(override, needle,
                                                                      tmp_path):
    """In process: the check ``fedadapt`` runs on its command line before Hydra starts (one
    line, then exit 2; the command itself: the subprocess cases below)."""
    from fedadapt.argv import config_problem, missing_launcher, sweep_problem

    argv = [override, f"output_dir={tmp_path}/out"]
    problem = missing_launcher(argv) or config_problem(argv) or sweep_problem(argv)
    assert problem is not None and needle in problem and "\n" not in problem
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv,line", [
    (["--rounds", "5"], "--rounds 5: settings are key=value overrides, not flags: write rounds=5"),
    (["--train.lr=0.1"], "--train.lr=0.1: settings are key=value overrides, not flags: write "
                         "train.lr=0.1"),
    (["-m", "seed=0,1", "--rounds"], "--rounds: settings are key=value overrides, not flags: "
                                     "write rounds=<value>"),
    (["--multi", "seed=0,1"], None),  # Hydra's own flags (argparse takes a flag's start too)
    (["--cfg", "job"], None),
])
def test_a_flag_hydra_does_not_have_gets_the_override_to_write(argv, line):
    from fedadapt.argv import config_problem

    assert config_problem(argv) == line


@pytest.mark.parametrize("override,needle", [
    ("partition.alpha=0", "partition.alpha=0.0 is invalid"),
    ("rounds=-1", "rounds=-1 is invalid"),
    ("partition.num_clients=100000", "partition.num_clients=100000 is invalid"),
    ("partition.fraction_fit=1.5", "partition.fraction_fit"),
    ("partition=size", "partition.sizes=None is invalid"),
    ("objective=val_acc", "needs one method per job"),  # the quickstart compares four
    ("method.hiden_dim=3", "hiden_dim"),  # one of the above, through the command too
])
@pytest.mark.slow
def test_bad_input_fails_fast_naming_the_key(override, needle, tmp_path, cache_dir):
    out = run([override], tmp_path, cache_dir, timeout=600)  # a guard, not a timing
    assert out.returncode != 0
    assert needle in out.stderr + out.stdout
    assert "Traceback" not in out.stderr
    assert needle in out.stderr.strip().splitlines()[-1]  # one line says it
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*"))


@pytest.mark.slow
def test_compare_runs_each_method_into_its_own_dir(tmp_path, cache_dir):
    """Two methods of one job, each in its own run directory, through Flower's simulation
    engine (Ray); the job's log holds fedadapt's lines only (:func:`assert_only_fedadapts`)."""
    out = run(["compare=[linear_head,local_only]", *TINY], tmp_path, cache_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_only_fedadapts(out.stderr, "[linear_head] round 2/2")
    job = next((tmp_path / "out").glob("quickstart/*"))
    assert (job / "table.md").is_file() and (job / "curves.png").is_file()
    for m in ("linear_head", "local_only"):
        assert (job / m / "summary.json").is_file()
    table = (job / "table.md").read_text()
    assert "| linear_head |" in table and "| local_only |" in table


@pytest.mark.slow
def test_a_job_of_one_method_is_laid_out_as_a_job_of_several(tmp_path, cache_dir):
    """``fedadapt method=X`` writes ``<job>/X/`` beside ``job.json`` and the job's
    ``table.md`` (it once wrote the run's files into the job folder itself, unlike the
    README's job folder); a one-method job made that way still resumes in place."""
    from fedadapt.cli import method_dirs

    out = run(["method=linear_head", *TINY, "federation.backend=inprocess"], tmp_path, cache_dir)
    assert out.returncode == 0, out.stderr[-3000:]
    (folder,) = (tmp_path / "out").glob("quickstart/*")
    assert f"Run directory: {folder / 'linear_head'}" in out.stdout
    assert (folder / "job.json").is_file() and (folder / "linear_head" / "summary.json").is_file()
    assert (folder / "table.md").read_text() == (folder / "linear_head" / "table.md").read_text()
    assert not (folder / "summary.json").exists()
    assert method_dirs(folder, ["linear_head"], resume=True) == {
        "linear_head": folder / "linear_head"}
    legacy = tmp_path / "legacy"
    (legacy / "checkpoints").mkdir(parents=True)
    assert method_dirs(legacy, ["linear_head"], resume=True) == {"linear_head": legacy}
    assert method_dirs(legacy, ["linear_head"], resume=False) == {
        "linear_head": legacy / "linear_head"}


@pytest.mark.slow
def test_report_needs_complete_runs(tmp_path):
    (tmp_path / "stopped").mkdir()
    (tmp_path / "stopped" / "metrics.jsonl").write_text("{}\n")
    rep = subprocess.run([sys.executable, "-m", "fedadapt.results.report", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert rep.returncode == 2 and "no complete run" in rep.stderr


@pytest.mark.slow
def test_inspect_counts_from_architecture_alone():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", "from fedadapt.counts import main; main()",
                          "method=linear_head", "backbone=deit_small", "dataset=cifar100"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout)
    assert info["backbone_params"] == 21_665_664  # DeiT-S without head (REFERENCE.md)
    assert info["trainable_params"] == info["communicated_params"] == 384 * 100 + 100
    exits = info["per_exit"]
    assert [e["exit"] for e in exits] == list(range(12))
    assert exits[-1]["params"] == 21_665_664
    assert exits[1]["params"] - exits[0]["params"] == 1_774_464  # one DeiT-S block
    assert all(a["flops"] < b["flops"] for a, b in zip(exits, exits[1:]))


def test_group_options_are_the_presets_only():
    """An unknown value lists the real options (no internal schema) and a schema cannot be
    chosen; every preset of a typed group extends its schema."""
    from pathlib import Path

    from hydra.errors import MissingConfigException

    from fedadapt.entry import compose_config

    for group, real in (("method", "linear_head"), ("dataset", "digits"),
                        ("partition", "shard"), ("backbone", "small_cnn")):
        with pytest.raises(MissingConfigException) as err:
            compose_config([f"{group}=nope"])
        listed = str(err.value).split(f"Available options in '{group}':")[1]
        listed = listed.split("Config search path")[0].split()
        assert real in listed and not any("schema" in o for o in listed), listed
    conf = Path(__file__).resolve().parents[1] / "conf"
    for group in ("method", "dataset", "partition", "backbone", "setting"):
        for preset in (conf / group).glob("*.yaml"):
            head = preset.read_text().split("_self_")[0]
            assert f"- /schema/{group}" in head, preset


@pytest.mark.parametrize("script", ["fedadapt", "fedadapt-report", "fedadapt-inspect",
                                    "fedadapt-prefetch", "fedadapt-bench", "fedadapt-budget",
                                    "fedadapt-pretrain", "fedadapt-export"])
def test_every_tool_answers_help_with_what_it_does(script, monkeypatch, capsys):
    """``--help`` describes the tool (no Hydra grammar error); the Hydra-configured ones list
    the groups users choose from, without the internal schema groups."""
    import importlib
    from pathlib import Path

    import tomllib

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())[
        "project"]["scripts"]
    module, func = scripts[script].split(":")
    func = "main" if func == "command" else func  # command(): main, then the process ends
    monkeypatch.setattr("sys.argv", [script, "--help"])
    with pytest.raises(SystemExit) as done:
        getattr(importlib.import_module(module), func)()
    out = capsys.readouterr().out
    assert done.value.code == 0 and "Exception" not in out
    assert len(out.splitlines()) > 3
    if script in ("fedadapt", "fedadapt-inspect", "fedadapt-prefetch"):
        assert "\n  method: " in out and "schema" not in out
