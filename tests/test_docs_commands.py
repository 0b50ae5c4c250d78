"""Every ``fedadapt`` command of the docs and the README composes as written (each point of a
sweep: no placeholders), and docs/federation.md's single runs run: one round each, in process,
on a tiny backbone and 300 images (the keys the command sets are left as written)."""

import itertools
import re
import shlex
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_user_code import docs_example

ROOT = Path(__file__).resolve().parents[1]
#: What makes a documented single run cheap enough for the suite.
CHEAP = ["backbone=small_cnn", "backbone.image_size=16", "dataset.max_samples=300", "rounds=1"]


def documented_commands(page: str = "federation.md") -> list[tuple[bool, list[str]]]:
    """``(sweep, overrides)`` of each ``fedadapt`` line of the page's bash blocks (continued
    lines joined, comments dropped)."""
    text = (ROOT / "docs" / page).resolve().read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                words = words[1:]  # an environment variable set for the command
            if words[:1] != ["fedadapt"]:
                continue
            sweep = "-m" in words
            out.append((sweep, [w for w in words[1:] if w != "-m"]))
    return out


def _split_values(value: str) -> list[str]:
    """``a,b,c`` -> its values; a list or mapping (``[a,b]``, ``{a: 1}``) is one value."""
    if value.startswith(("[", "{")):
        return [value]
    return value.split(",")


def sweep_points(overrides: list[str]) -> list[list[str]]:
    choices = []
    for item in overrides:
        key, _, value = item.partition("=")
        choices.append([f"{key}={v}" for v in _split_values(value)])
    return [list(point) for point in itertools.product(*choices)]


def covering_points(overrides: list[str]) -> list[list[str]]:
    """Points of a sweep that hold each value of each key at least once (the i-th value of
    every key, the last where a key has fewer)."""
    choices = [sweep_points([item]) for item in overrides]  # each key: its one-key points
    return [[c[min(i, len(c) - 1)][0] for c in choices]
            for i in range(max((len(c) for c in choices), default=1))]


COMMANDS = documented_commands()
#: Every page with a ``fedadapt`` command, the README included.
PAGES = [p for p in sorted(str(f.relative_to(ROOT / "docs")) for f in (ROOT / "docs").rglob("*.md"))
         + ["../README.md"] if documented_commands(p)]


def test_the_page_has_its_commands():
    assert len(COMMANDS) >= 8 and any(sweep for sweep, _ in COMMANDS)
    assert any("strategy=custom" in args for _, args in COMMANDS)


#: Keys that name a file of the user's, which the config check finds (or refuses) at once.
FILE_KEYS = ("fleet.trace", "fleet.capacity", "fleet.behaviour")


def user_files(args: list[str], folder) -> None:
    """The files a documented command names by a relative path (``fleet.trace=avail.csv``), as
    the user who runs it has them (their content is the run's to read, not the check's)."""
    for arg in args:
        key, _, value = arg.partition("=")
        if key.lstrip("+") in FILE_KEYS and value and not value.startswith(("/", "$", "<")):
            (folder / value).parent.mkdir(parents=True, exist_ok=True)
            (folder / value).touch()


@pytest.mark.parametrize("page", PAGES)
def test_every_documented_command_composes_as_written(page, tmp_path, monkeypatch):
    """A user pastes the command: it composes, every value checked, each value of a sweep in
    a point (a ``...`` placeholder or a misspelt key fails here)."""
    from fedadapt.entry import compose_config, to_run_config

    monkeypatch.chdir(tmp_path)  # the user's folder, with federation.md's own strategy in it
    (tmp_path / "halfstep.py").write_text(docs_example("halfstep.py"))
    for sweep, args in documented_commands(page):
        user_files(args, tmp_path)
        for point in covering_points(args) if sweep else [args]:
            to_run_config(compose_config(point))


@pytest.mark.slow  # a run each
@pytest.mark.parametrize("sweep,args", COMMANDS, ids=[" ".join(a)[:60] for _, a in COMMANDS])
def test_each_documented_command_composes_and_the_single_runs_run(sweep, args, tmp_path,
                                                                   monkeypatch, cache_dir):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    monkeypatch.chdir(tmp_path)  # the user's folder, with the page's own strategy in it
    (tmp_path / "halfstep.py").write_text(docs_example("halfstep.py"))
    user_files(args, tmp_path)
    for point in sweep_points(args) if sweep else [args]:
        to_run_config(compose_config(point))  # composes, every value checked
    if sweep:
        return
    composed = compose_config([*args, *CHEAP, f"cache_dir={cache_dir}"])
    summary = run_experiment(to_run_config(composed), tmp_path / "run",
                             config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                             execute=in_process("workers"))
    assert summary["rounds"] == 1 and (tmp_path / "run" / "summary.json").is_file()
