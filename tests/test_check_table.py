"""scripts/check_table.py, which .ci/run uses to compare the main job's table with the README's:
on fabricated tables (a match, one digit off, a row missing or extra, the skipped and ignored
cells), and on the README's own table."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_table.py"
HEADER = ("| method | global acc (final) | client-mean acc (final) | total bytes | wall s |\n"
          "|---|---|---|---|---|\n")
README = ("# x\n\n<!-- table: quickstart -->\n" + HEADER +
          "| linear_head | 70.83 | 77.09 | 5.77 MB | 11.9 |\n"
          "| finetune | 76.67 | 83.31 | 1.52 GB | 52.8 |\n"
          "| local_only | — | 60.43 | 0 B | 10.3 |\n\n"
          "Provenance: 3 run(s).\n\n| run | dir |\n|---|---|\n| a | b |\n"
          "<!-- /table: quickstart -->\n")


def check(tmp_path, rows: str, *extra: str) -> subprocess.CompletedProcess:
    (tmp_path / "README.md").write_text(README)
    (tmp_path / "table.md").write_text("## quickstart: 3 methods on digits\n\n" + HEADER + rows)
    return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "README.md"),
                           str(tmp_path / "table.md"), *extra], capture_output=True, text=True,
                          timeout=600)


SAME = ("| linear_head | 70.83 | 77.09 | 5.77 MB | 12.4 |\n"  # another wall time: ignored
        "| finetune | 67.78 | 73.07 | 1.52 GB | 50.1 |\n"
        "| local_only | — | 60.43 | 0 B | 9.9 |\n")


def test_the_same_rows_pass_whatever_the_wall_time_and_the_skipped_row(tmp_path):
    out = check(tmp_path, SAME, "--skip", "finetune")
    assert out.returncode == 0, out.stderr
    assert "2 row(s) as in" in out.stdout and "linear_head, local_only" in out.stdout
    failed = check(tmp_path, SAME)  # finetune compared: its cells differ
    assert failed.returncode == 1
    assert "finetune: global acc (final) is 67.78, the README says 76.67" in failed.stderr


@pytest.mark.parametrize("rows,says", [
    (SAME.replace("| 70.83 |", "| 70.84 |"),
     "linear_head: global acc (final) is 70.84, the README says 70.83"),
    (SAME.replace("| 0 B |", "| 1 B |"), "local_only: total bytes is 1 B, the README says 0 B"),
    ("".join(SAME.splitlines(keepends=True)[:2]), "local_only: no such row in the job's table"),
    (SAME + "| mlp_head | 71.39 | 69.37 | 148.13 MB | 10.7 |\n",
     "mlp_head: a row the README's table does not have"),
])
def test_a_digit_off_or_a_row_missing_or_extra_fails_naming_it(tmp_path, rows, says):
    out = check(tmp_path, rows, "--skip", "finetune")
    assert out.returncode == 1 and says in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_other_columns_or_no_table_are_refused(tmp_path):
    check(tmp_path, SAME)
    (tmp_path / "table.md").write_text("no table here\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "README.md"),
                          str(tmp_path / "table.md")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 2 and "no table" in out.stderr
    (tmp_path / "table.md").write_text("| method | global acc (final) |\n|---|---|\n"
                                       "| linear_head | 70.83 |\n")
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "README.md"),
                          str(tmp_path / "table.md")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 1 and "the columns differ" in out.stderr


def test_the_readmes_own_table_is_read():
    """The README's quickstart section parses: the four methods of the main job."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from check_table import readme_table
    finally:
        sys.path.remove(str(SCRIPT.parent))
    header, rows = readme_table((ROOT / "README.md").read_text(), "quickstart")
    assert header[0] == "method" and "wall s" in header
    assert list(rows) == ["linear_head", "mlp_head", "finetune", "local_only"]
