"""Bad input ends in one line that names the setting or file, a non-zero exit, and nothing
half-written (each fails before any data is prepared; docs/reliability.md gives the times):
seed=-1, a garbled checkpoints/LATEST, a garbled job.json (or one without overrides), an empty
dataset.path or one of non-images, a read-only output_dir, a full disk at the first
checkpoint, a sweep with a bad value at any point, a compare entry that is no method, resume= of
a folder that is neither a job nor a sweep, the hub offline without HF_HUB_OFFLINE,
fedadapt-export / fedadapt-report given what is not a run or not an option, and the
researcher's own code given a key, a signature or a DP wrapper it cannot take; a stopped
loop's last progress line is printed once."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_run

from fedadapt.adapters.heads import LinearHeadConfig
from fedadapt.experiment import run_experiment
from fedadapt.federation.server import checkpoint
from fedadapt.federation.simulation.inprocess import run_in_process


def fedadapt(args, cache_dir, cwd, timeout=120):
    """``fedadapt ARGS`` run from ``cwd`` (where its default output_dir would go)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "FEDADAPT_CACHE": cache_dir}
    out = subprocess.run([sys.executable, "-m", "fedadapt.cli", *args], env=env, cwd=cwd,
                         capture_output=True, text=True, timeout=timeout)
    return out


def main_in_process(args, cwd, monkeypatch, capsys) -> list[str]:
    """``fedadapt ARGS`` as ``cli.main`` runs it (composition, checks, Hydra's job) in this
    process, from ``cwd``: its exit code must be 2; its stderr's non-empty lines.

    What the command sets once per process is this call's alone and undone after it: the plain
    output (:func:`fedadapt.progress.configure_output` wraps the streams, here the capture's,
    and points the loggers' handlers at them) and Hydra's job logging (a handler on this
    capture's stdout). Left in place, the next test that logs writes to a closed capture file
    (``ValueError: I/O operation on closed file``, seen when the tests ran in another order)."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    from fedadapt import progress
    from fedadapt.cli import main

    loggers = [logging.getLogger(name) for name in ("", "flwr", "hydra")]
    saved = [(lg, lg.handlers[:], lg.level, lg.propagate,
              [(h, getattr(h, "stream", None)) for h in lg.handlers]) for lg in loggers]
    monkeypatch.setattr(progress, "_STATE", progress._State())
    monkeypatch.setattr(sys, "argv", ["fedadapt", *args])
    monkeypatch.chdir(cwd)
    try:
        with pytest.raises(SystemExit) as done:
            main()
    finally:
        GlobalHydra.instance().clear()
        for lg, handlers, level, propagate, streams in saved:
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate = propagate
            for handler, stream in streams:
                if stream is not None:
                    handler.setStream(stream)
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert done.value.code == 2, err
    return err


def one_line(out, needle: str) -> str:
    err = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode != 0 and len(err) == 1, out.stderr[-3000:]
    assert err[0].startswith("fedadapt: error: ") and needle in err[0], err[0]
    return err[0]


def job_folder(tmp_path: Path) -> Path:
    """A one-method job folder as `fedadapt` wrote it before 2026-11-28 (the run directory
    too; such a folder still resumes in place), with a checkpoint."""
    job = tmp_path / "job"
    (job / "checkpoints" / "round-000002").mkdir(parents=True)
    (job / "config.yaml").write_text("x: 1\n")
    overrides = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
                 "dataset.max_samples=100", "partition.num_clients=3", "rounds=2"]
    (job / "job.json").write_text(json.dumps({"overrides": overrides, "argv": []}))
    return job


#: Each case as a user meets it: ``fedadapt ARGS`` ({tmp}: the test's folder) and what its one
#: line says. In this process (``cli.main``, Hydra included); one through the command below.
COMMAND_CASES = [
    (["seed=-1"], "seed=-1 is invalid"),
    (["dataset.path={tmp}/empty"], "dataset.path='{tmp}/empty' is invalid: no image files"),
    (["dataset.path={tmp}/texts"], "a.jpg is not a readable image"),
    (["resume={tmp}/no_overrides"], "job.json is unreadable (no key 'overrides')"),
    (["resume={tmp}/garbled_job"], "job.json is unreadable (Expecting value"),
    (["output_dir=/proc/fedadapt/out"], "output_dir='/proc/fedadapt/out' is not writable"),
    # a sweep is checked whole: point 1's value, before point 0 runs
    (["-m", "rounds=2", "partition.alpha=0.1,0"],
     "sweep point 1 (partition.alpha=0): partition.alpha=0.0 is invalid"),
]


@pytest.fixture
def bad_inputs(tmp_path) -> Path:
    """The folders the cases name: an empty one, one of non-images, two job folders a resume
    cannot read; and ``cwd``, where the command runs (its default output_dir)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "texts" / "cat").mkdir(parents=True)
    (tmp_path / "texts" / "cat" / "a.jpg").write_text("not an image")
    (tmp_path / "no_overrides").mkdir()
    (tmp_path / "no_overrides" / "job.json").write_text(json.dumps({"argv": ["fedadapt"]}))
    (tmp_path / "garbled_job").mkdir()
    (tmp_path / "garbled_job" / "job.json").write_text('{"overrides": [')
    (tmp_path / "cwd").mkdir()
    return tmp_path


@pytest.mark.parametrize("args,needle", COMMAND_CASES, ids=[" ".join(a) for a, _ in COMMAND_CASES])
def test_bad_inputs_fail_with_one_line(args, needle, bad_inputs, cache_dir, monkeypatch, capsys):
    """In this process (:func:`main_in_process`): exit code 2, one line, nothing written where
    it ran."""
    cwd = bad_inputs / "cwd"
    err = main_in_process([a.format(tmp=bad_inputs) for a in args], cwd, monkeypatch, capsys)
    assert len(err) == 1, err
    assert err[0].startswith("fedadapt: error: ") and needle.format(tmp=bad_inputs) in err[0]
    assert not any(p.is_file() for p in cwd.rglob("*"))


@pytest.mark.slow
def test_a_bad_input_through_the_command_is_one_line(bad_inputs, cache_dir):
    """The same as a user meets it, through the ``fedadapt`` command (a process of its own):
    its exit code, its stderr, nothing written where it ran."""
    res = fedadapt([f"dataset.path={bad_inputs}/texts"], cache_dir, bad_inputs / "cwd")
    one_line(res, "a.jpg is not a readable image")
    assert not any(p.is_file() for p in (bad_inputs / "cwd").rglob("*"))


def test_garbled_latest_is_refused_naming_it(tmp_path, cache_dir, monkeypatch, capsys):
    job = job_folder(tmp_path)
    latest = job / "checkpoints" / "LATEST"
    latest.write_bytes(b"\x00\xffround-??")
    [line] = main_in_process([f"resume={job}"], tmp_path, monkeypatch, capsys)
    assert line.startswith("fedadapt: error: ") and f"{latest} is garbled" in line
    assert "checkpoints there: round-000002" in line


def test_read_only_output_dir_as_a_user_meets_it(tmp_path, cache_dir, monkeypatch, capsys):
    """A folder without write permission (for root, whom permissions do not bind, a path
    through a file is as unwritable)."""
    if os.geteuid() == 0:
        blocker = tmp_path / "file"
        blocker.write_text("")
        target, needle = blocker / "out", "is not writable: Not a directory"
    else:
        target = tmp_path / "ro"
        target.mkdir(mode=0o555)
        needle = "is not writable: Permission denied"
    [line] = main_in_process([f"output_dir={target}"], tmp_path, monkeypatch, capsys)
    assert line.startswith("fedadapt: error: ") and needle in line


def test_full_disk_at_the_first_checkpoint_leaves_nothing_half_written(tmp_path, cache_dir,
                                                                       monkeypatch):
    from fedadapt.cli import os_error_line

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(checkpoint, "_fsync_write", full)
    run_dir = tmp_path / "run"
    with pytest.raises(OSError) as err:
        run_experiment(tiny_run(cache_dir, LinearHeadConfig()), run_dir, config_yaml="x\n",
                       execute=run_in_process)
    line = os_error_line(err.value, run_dir)
    assert line.startswith("No space left on device: ") and "arrays.safetensors" in line
    assert "fedadapt resume=" in line and "\n" not in line
    assert not (run_dir / "summary.json").exists()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == []  # no partial folder


def test_an_os_error_without_strerror_keeps_its_own_message():
    """numpy's short write (a full disk under the feature cache) and PIL's truncated image raise
    OSError(message) with no strerror: the line keeps the message, not the type's name."""
    from fedadapt.cli import os_error_line

    assert os_error_line(OSError("1839360 requested and 262112 written")) == \
        "1839360 requested and 262112 written"
    assert os_error_line(OSError("image file is truncated")) == "image file is truncated"
    assert os_error_line(OSError()) == "OSError"


def test_resume_of_a_run_folder_that_does_not_exist_is_refused(tmp_path):
    """``resume=<job>/finetune`` where no finetune run exists must not resume the whole job."""
    import json

    from fedadapt.cli import resume_target
    from fedadapt.config import ConfigError

    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text(json.dumps({"overrides": ["experiment=quickstart"]}))
    assert resume_target(str(job))[0] == job.resolve()
    with pytest.raises(ConfigError, match="resume=.*finetune.* is invalid: no such folder"):
        resume_target(str(job / "finetune"))
    (tmp_path / "plain").mkdir()  # neither a job nor a sweep: both named
    with pytest.raises(ConfigError, match=r"neither it nor its parent holds job.json .*nor "
                                          r"does it hold multirun.yaml \(a sweep's folder"):
        resume_target(str(tmp_path / "plain"))


@pytest.mark.parametrize("argv,says", [
    (["trian.lr=0.1"], "trian is not a key of the config (did you mean train?)"),
    (["+trian.lr=0.1"], "trian is not a key of the config (did you mean train?)"),
    (["++trian.lr=0.1"], "trian is not a key of the config (did you mean train?)"),
    (["train.lr=abc"], "train.lr: Value 'abc' of type 'str' could not be converted to Float"),
    (["rounds=1.5"], "rounds: Value '1.5' of type 'float' could not be converted to Integer"),
    (["train.lr=0.1", "0.2"], "'0.2' is not KEY=VALUE: a value with spaces needs quotes"),
    (["seed=1", "2"], "'2' is not KEY=VALUE"),
    (["seed=ü"], "seed=ü: Hydra cannot parse this value; quote it"),
    (["train.lr==0.1"], "train.lr==0.1: Hydra cannot parse this value"),
    (["train="], "train is a group of settings, not a value: set its keys"),
    (["~train"], "~train: deleting a setting is not supported"),
    (["hydra.run.dir="], "hydra.run.dir is empty"),
    (["output_dir= "], "output_dir is empty"),
    (["train.lr=0.1,0.2"], "train.lr=0.1,0.2: several values sweep a setting only with -m"),
    (["faults.kinds=melt"], "faults.kinds=melt is invalid: a list is expected"),
    (["method.rank=4"],
     "method.rank is not a key of method=linear_head (it is a key of method=dora, lora)"),
    (["method=lora", "method.rnak=4"], "method.rnak is not a key of method=lora (did you mean"),
])
def test_a_command_line_that_does_not_compose_is_one_line_naming_the_setting(argv, says):
    from fedadapt.argv import config_problem

    problem = config_problem(argv)
    assert problem is not None and problem.startswith(says), problem
    assert "\n" not in problem and "Exception" not in problem


def _class_folders(root: Path, classes: int = 10, per_class: int = 10) -> Path:
    """``root/<class>/<i>.png``: 8x8 images, as digits' card declares them."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / str(c)).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)).save(
                root / str(c) / f"{i}.png")
    return root


def _truncated_jpeg(root: Path) -> None:
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 3), dtype=np.uint8)
                    ).save(buf, "JPEG")
    (root / "3" / "bad.jpg").write_bytes(buf.getvalue()[:len(buf.getvalue()) // 2])


def _odd_size(root: Path) -> None:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(root / "5" / "odd.png")


def _empty_class(root: Path) -> None:
    import shutil

    shutil.rmtree(root / "7")
    (root / "7").mkdir()


@pytest.mark.parametrize("spoil,says", [
    (_truncated_jpeg, "bad.jpg (class folder '3', image"),
    (_odd_size, "odd.png (class folder '5', image"),
    (_empty_class, "has no image files"),
])
def test_a_bad_image_folder_names_the_file_or_class_folder(spoil, says, tmp_path):
    """A truncated JPEG passes PIL's verify() and fails only when decoded; an image of another
    size fails against the card's; an empty class folder would make a class fewer. Each names
    the file (or folder) and the cause, not an OSError or an image index."""
    from fedadapt.config import FedadaptError
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    root = _class_folders(tmp_path / "images")
    spoil(root)
    cfg = to_run_config(compose_config([
        "method=linear_head", f"dataset.path={root}", "backbone=small_cnn",
        "backbone.image_size=16", "partition.num_clients=3", f"cache_dir={tmp_path / 'cache'}"]))
    with pytest.raises(FedadaptError) as err:
        prepare_run(cfg, quiet=True)
    line = str(err.value)
    assert says in line and "\n" not in line, line
    if spoil is _truncated_jpeg:
        assert "cannot be decoded: image file is truncated" in line
    if spoil is _odd_size:
        assert "is 30x20, but the dataset card declares image_size 8x8" in line
    if spoil is _empty_class:
        assert str(root / "7") in line


@pytest.mark.parametrize("argv,says", [
    (["-m", "method=linear_head", "partition.alpha=0.1,0"],
     "sweep point 1 (partition.alpha=0): partition.alpha=0.0 is invalid"),
    (["-m", "seed=0,1", "rounds=3,0"], "sweep point 1 (seed=0, rounds=0): rounds=0 is invalid"),
    (["-m", "seed=0,1", "method=linear_head,nope"],
     "sweep point 1 (seed=0, method=nope): method=nope is not an option of method"),
    (["compare=[linear_head,nope]"],
     "compare entry 'nope': method=nope is not an option of method"),
    (["-m", "compare=[linear_head,nope]", "seed=0,1"],
     "sweep point 0 (seed=0): compare entry 'nope': method=nope is not an option"),
])
def test_the_command_refuses_before_hydra_starts_in_one_line(argv, says, tmp_path, monkeypatch,
                                                             capsys):
    """What ``fedadapt`` checks before Hydra runs a point (in this process: no Ray starts)."""
    from fedadapt.cli import main

    monkeypatch.setattr(sys, "argv", ["fedadapt", *argv, f"output_dir={tmp_path}/out"])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main()
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert done.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("fedadapt: error: ") and says in err[0], err[0]
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]  # nothing written anywhere


def test_the_hub_offline_without_hf_hub_offline_is_one_line(monkeypatch, caplog, capsys):
    """No network and no HF_HUB_OFFLINE: no retry lines, Hugging Face's offline mode (the cache
    alone) while the load runs, and load_hub's one line; the settings restored after."""
    import logging
    import socket

    import datasets.config
    import huggingface_hub.constants as hub

    from fedadapt.assets import MissingAssetError
    from fedadapt.data import loading
    from fedadapt.data.catalogue import load_card

    seen = []

    def offline_hub(card):
        seen.append((hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE))
        for _ in range(5):  # what huggingface_hub logs for each try of a request
            logging.getLogger("huggingface_hub.utils._http").warning("Retrying in 1s [Retry 1/5].")
        raise MissingAssetError("Data set 'uoft-cs/cifar100' (dataset=cifar100) is not available")

    def no_dns(*args, **kwargs):
        raise socket.gaierror(-2, "Name or service not known")

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "getaddrinfo", no_dns)
    monkeypatch.setattr(loading, "load_hub", offline_hub)
    with caplog.at_level(logging.WARNING), pytest.raises(MissingAssetError):
        loading.load_source(load_card("cifar100"))
    assert seen == [(True, True)]
    assert "Retrying" not in caplog.text and "Retrying" not in capsys.readouterr().err
    assert (hub.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE) == (False, False)


@pytest.mark.parametrize("folder,says", [
    ("nonexistent", "has no summary.json: no such folder"),
    ("plain", "has no summary.json and no config.yaml: not a run directory"),
])
def test_export_of_what_is_not_a_run_gets_the_right_advice(folder, says, tmp_path, capsys):
    from fedadapt.export import main

    (tmp_path / "plain").mkdir()
    assert main([str(tmp_path / folder)]) == 2
    err = capsys.readouterr().err
    assert says in err and "resume" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv,says", [
    (["NONEXISTENT"], "fedadapt-report: error: no such folder: "),
    (["TMP", "--layout", "papers"], "fedadapt-report: error: argument --layout: invalid choice"),
])
def test_report_bad_input_is_one_line(argv, says, tmp_path, capsys):
    from fedadapt.results.report import main

    argv = [a.replace("NONEXISTENT", str(tmp_path / "no")).replace("TMP", str(tmp_path))
            for a in argv]
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and err.startswith(says) and err.count("\n") == 1, err


# -- the researcher's own code ----------------------------------------------------------------

USER_CODE_CASES = [
    (["strategy=custom", "strategy.target=halfstep.py:HalfStepFedAvg", "strategy.stepp=0.5"],
     "strategy.stepp is not a parameter of halfstep.py:HalfStepFedAvg: FedAvg.__init__() "
     "got an unexpected keyword argument 'stepp'"),
    (["federation.evaluate_fn=mine.py:evaluate"],
     "federation.evaluate_fn='mine.py:evaluate' takes (server_round, arrays, extra)"),
    (["federation.train_mods=[mine.py:mod]"],
     "federation.train_mods: mine.py:mod takes (msg, context), not a mod's"),
    (["strategy=custom", "strategy.target=halfstep.py:HalfStepFedAvg", "dp=server_fixed",
      "method.weighting=uniform"],
     "(HalfStepFedAvg overrides aggregate_train) or one with the same sensitivity"),
]


@pytest.mark.parametrize("args,needle", USER_CODE_CASES,
                         ids=["misspelt key", "evaluate_fn", "mod", "dp on own aggregate"])
def test_user_code_errors_through_the_command_are_one_line(args, needle, tmp_path, cache_dir,
                                                           monkeypatch, capsys):
    """A misspelt key that a strategy passes on through ``**kwargs``, an ``evaluate_fn`` of
    another signature, a mod that takes two arguments, and ``dp=server_fixed`` with accounting
    on a FedAvg subclass with its own ``aggregate_train``: one line each, naming the key (in
    this process, :func:`main_in_process`; each fails before any data is prepared)."""
    from test_user_code import docs_example

    cwd = tmp_path / "work"
    cwd.mkdir()
    (cwd / "halfstep.py").write_text(docs_example("halfstep.py"))
    (cwd / "mine.py").write_text("def evaluate(server_round, arrays, extra):\n    pass\n\n\n"
                                 "def mod(msg, context):\n    return msg\n")
    err = main_in_process(["method=linear_head", *args, f"output_dir={tmp_path / 'out'}"], cwd,
                          monkeypatch, capsys)
    assert len(err) == 1 and err[0].startswith("fedadapt: error: ") and needle in err[0], err
    assert not list((tmp_path / "out").rglob("job.json"))  # nothing was started


@pytest.mark.parametrize("overrides,says", [
    (["train.crop_scale=[0.3,1.0]"], "train.crop_scale augments images: it needs "
                                     "method.use_cache=false"),
    (["federation.evaluate_fn=mine.py:evaluate"],
     "federation.evaluate_fn='mine.py:evaluate' takes (server_round, arrays, extra)"),
])
def test_the_rounds_familys_config_refusals_come_before_any_data(overrides, says, monkeypatch,
                                                                 tmp_path, cache_dir):
    """Refusals of config values alone (cropping cached features, an ``evaluate_fn`` of
    another signature) are the family's config check's: before the data set is loaded."""
    from fedadapt.config import ConfigError
    from fedadapt.data import loading
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    def no_data(*args, **kwargs):
        raise AssertionError("the data set was loaded before the refusal")

    monkeypatch.setattr(loading, "prepare_dataset", no_data)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.py").write_text("def evaluate(server_round, arrays, extra):\n    pass\n")
    cfg = to_run_config(compose_config(["method=linear_head", *overrides,
                                        f"cache_dir={cache_dir}"]))
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, quiet=True)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


def test_a_stopped_loop_prints_its_last_line_once(monkeypatch, capsys):
    """The round bar of a run stopped after round 2 of 5 (plain lines): each round's line once,
    not round 2's again as the bar closes."""
    from fedadapt import progress

    monkeypatch.setattr(progress._STATE, "interactive", False)
    monkeypatch.setattr(progress._STATE, "job", None)
    with pytest.raises(KeyboardInterrupt):
        with progress.task("[linear_head] round", total=5, interval=0, for_job=True) as bar:
            bar.update(completed=1, info="loss 2.0")
            bar.update(completed=2, info="loss 1.5")
            raise KeyboardInterrupt
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert [ln.split(" | ")[0] for ln in lines] == ["[linear_head] round 1/5",
                                                   "[linear_head] round 2/5"], lines
