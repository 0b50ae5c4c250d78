"""The commands a user with a GPU or a cluster runs, shipped in the wheel (their shell parts are
package data beside this file, run with bash):

    fedadapt-gpu-check [--small] [OUT_DIR]    does every run work on this GPU, and how fast?
    fedadapt-deploy certs OUT --nodes N [--host HOST ...] [--days 30]
                                              a CA, the SuperLink's certificate, SuperNode keys
    fedadapt-deploy nodes NODELIST            fedadapt on Flower's deployment engine across the
                                              machines of a node list, TLS and authentication on
    fedadapt-deploy smoke [N]                 a SuperLink and N SuperNodes on 127.0.0.1, one run

The GPU check runs the checkout's fast tests, and the deployments build and stage the checkout:
they run in the repository fedadapt is installed from (an editable install), else in the
current folder. ``COMMAND --help`` prints what each does and the environment it reads.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEPLOY = {"certs": "deploy_certs.py", "nodes": "deploy_nodes.sh", "smoke": "deployment_smoke.sh"}


def repository() -> Path:
    """The checkout this fedadapt is installed from, else the current folder."""
    root = HERE.parents[1]
    return root if (root / "pyproject.toml").is_file() else Path.cwd()


def usage(script: Path) -> str:
    """A script's own description: its docstring, or its leading comment without the '#'."""
    text = script.read_text()
    if script.suffix == ".py":
        return text.split('"""')[1].strip()
    lines = text.splitlines()[1:]  # after the #! line
    lines = lines[:next(i for i, ln in enumerate(lines) if not ln.startswith("#"))]
    return "\n".join(ln[2:] if ln.startswith("# ") else ln[1:] for ln in lines).strip()


def _run(script: Path, args: list[str]) -> int:
    if args[:1] in (["-h"], ["--help"]):
        print(usage(script))
        return 0
    env = {**os.environ, "FEDADAPT_REPO": str(repository()),  # and this environment's tools first
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    command = [sys.executable, str(script)] if script.suffix == ".py" else ["bash", str(script)]
    return subprocess.run([*command, *args], env=env, close_fds=False).returncode  # <(...) lists


def gpu_check(argv: list[str] | None = None) -> None:
    """``fedadapt-gpu-check``: the GPU check (``gpu_check.sh``)."""
    sys.exit(_run(HERE / "gpu_check.sh", sys.argv[1:] if argv is None else argv))


def deploy(argv: list[str] | None = None) -> None:
    """``fedadapt-deploy certs|nodes|smoke ...``: the deployment helpers."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    if argv[0] not in DEPLOY:
        sys.exit(f"fedadapt-deploy: error: {argv[0]!r} is not one of {', '.join(DEPLOY)}")
    sys.exit(_run(HERE / DEPLOY[argv[0]], argv[1:]))
