"""``fedadapt-gpu-check`` and ``fedadapt-deploy``: commands of the package, their shell parts
shipped in the wheel as package data, each answering ``--help`` with what it does."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

from fedadapt import tools

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_the_commands_and_their_shell_parts():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = project["project"]["scripts"]
    assert scripts["fedadapt-gpu-check"] == "fedadapt.tools:gpu_check"
    assert scripts["fedadapt-deploy"] == "fedadapt.tools:deploy"
    assert "fedadapt.tools" in project["tool"]["setuptools"]["packages"]
    assert project["tool"]["setuptools"]["package-data"]["fedadapt.tools"] == ["*.sh"]
    for name in ("gpu_check.sh", *tools.DEPLOY.values()):
        assert (tools.HERE / name).is_file(), name
    assert tools.repository() == ROOT  # an editable install runs in its checkout


@pytest.mark.parametrize("argv", [["certs", "--help"], ["nodes", "--help"], ["smoke", "-h"]])
def test_each_command_says_what_it_does(argv, capsys):
    with pytest.raises(SystemExit) as done:
        tools.deploy(argv)
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert len(text.splitlines()) > 3 and not text.startswith(("#", "!"))
    with pytest.raises(SystemExit) as done:
        tools.gpu_check(["--help"])
    assert done.value.code == 0 and "GPU" in capsys.readouterr().out


def test_deploy_certs_writes_a_ca_and_node_keys_and_a_bad_subcommand_is_one_line(tmp_path):
    with pytest.raises(SystemExit) as done:
        tools.deploy(["certs", str(tmp_path), "--nodes", "2"])
    assert done.value.code == 0
    assert {p.name for p in tmp_path.iterdir()} == {
        "ca.crt", "ca.key", "server.pem", "server.key", "node-0", "node-0.pub", "node-1",
        "node-1.pub"}
    with pytest.raises(SystemExit, match="^fedadapt-deploy: error: 'up' is not one of certs, "
                                         "nodes, smoke$"):
        tools.deploy(["up"])
