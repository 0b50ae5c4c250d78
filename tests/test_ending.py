"""How a command ends (:mod:`fedadapt.ending`): what Python's own exit would have done still
happens (exit status, ``atexit`` handlers, threads joined, files flushed), without the
interpreter's teardown; and ``curves.png`` is drawn only for a curve."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from fedadapt.results.plots import has_curve

SCRIPT = """
import atexit, sys, threading, time
from pathlib import Path
from fedadapt.ending import console

out = Path(sys.argv[1])

def main():
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    left_open = open(out / "left_open", "w")  # never closed: its buffer holds the text
    left_open.write("buffered")
    def late():
        time.sleep(0.3)
        (out / "thread").write_text("done")
    threading.Thread(target=late).start()  # not a daemon: Python waits for it
    {body}

console(main)()
"""


def run(tmp_path, body: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(SCRIPT).replace("{body}", body)
    return subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("body,status,stderr", [
    ("return None", 0, ""),
    ("sys.exit(3)", 3, ""),
    ("sys.exit('fedadapt: error: a reason')", 1, "fedadapt: error: a reason"),
])
def test_a_command_ends_as_python_would(tmp_path, body, status, stderr):
    out = run(tmp_path, body)
    assert out.returncode == status, out.stderr
    assert out.stderr.strip() == stderr
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "left_open").read_text() == "buffered"
    assert (tmp_path / "thread").read_text() == "done"


def test_an_error_keeps_its_traceback(tmp_path):
    out = run(tmp_path, "raise ValueError('deep inside')")
    assert out.returncode == 1
    assert "Traceback" in out.stderr and "ValueError: deep inside" in out.stderr
    assert (tmp_path / "atexit").read_text() == "ran"


def test_the_console_commands_end_this_way():
    from importlib.metadata import entry_points

    scripts = {e.name: e.value for e in entry_points(group="console_scripts")
               if e.name.startswith("fedadapt")}
    for name, module in (("fedadapt", "fedadapt.cli"), ("fedadapt-bench", "fedadapt.bench"),
                         ("fedadapt-evidence", "fedadapt.evidence"),
                         ("fedadapt-report", "fedadapt.results.report")):
        assert scripts[name] == f"{module}:command", name


def test_curves_are_drawn_for_two_points_or_more():
    one = [{"round": 1}, {"round": 2, "global_acc": 0.5}]
    assert not has_curve(one) and not has_curve([])
    assert has_curve([{"round": 1, "global_acc": 0.4}, {"round": 2, "global_acc": 0.5}])
    assert has_curve([{"round": 1, "client_acc": 0.4}, {"round": 2, "client_acc": 0.5,
                                                        "global_acc": 0.5}])


def test_a_profiled_command_ends_as_usual_so_the_profile_is_written(tmp_path):
    """``python -m cProfile -o FILE``: the profile is written after the command returns,
    which the ending without teardown would skip."""
    script = tmp_path / "cmd.py"
    script.write_text("from fedadapt.ending import console\n"
                      "console(lambda: print('worked'))()\n")
    out = subprocess.run([sys.executable, "-m", "cProfile", "-o", str(tmp_path / "p.prof"),
                          str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "worked" in out.stdout, out.stderr
    assert (tmp_path / "p.prof").stat().st_size > 0


def test_an_executor_left_open_ends_as_at_pythons_exit(tmp_path):
    """A ``concurrent.futures`` executor never shut down (joblib's loky workers in a Hydra
    sweep): its threads end on the threading module's exit hook, which Python runs before it
    joins them; joining them first waited forever (a sweep through the joblib launcher hung)."""
    script = tmp_path / "cmd.py"
    script.write_text("from concurrent.futures import ThreadPoolExecutor\n"
                      "from fedadapt.ending import console\n"
                      "pool = ThreadPoolExecutor(1)\n"
                      "console(lambda: print(pool.submit(sum, [1, 2]).result()))()\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
