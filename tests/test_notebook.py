"""The notebook quickstart (docs/quickstart.py, jupytext's percent format) runs offline from top
to bottom in a Jupyter kernel (nbclient) and shows what its text says: the main job's first row,
a two-point alpha sweep, the report's table and its plot; and fedadapt.api.report's bad input."""

import base64
import os
import time
from pathlib import Path

import pytest

from fedadapt.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "docs" / "quickstart.py"


def outputs(cell, kind: str) -> list:
    """The cell's displayed outputs of one MIME type."""
    return [o["data"][kind] for o in cell.get("outputs", [])
            if o.get("output_type") in ("display_data", "execute_result") and kind in o["data"]]


@pytest.mark.slow
def test_the_notebook_quickstart_runs_and_shows_its_results(tmp_path, cache_dir):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    from fedadapt.results.records import parse_table

    notebook = jupytext.read(NOTEBOOK)
    assert notebook.metadata["kernelspec"]["name"] == "python3"
    # the kernel inherits this process's environment: offline, the session's cache
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["FEDADAPT_CACHE"] == cache_dir
    t0 = time.time()
    nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    seconds = time.time() - t0
    code = [c for c in notebook.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors

    # the main job's first row: the linear head on the quickstart experiment, 12 rounds
    [row_md] = outputs(code[1], "text/markdown")
    columns, rows = parse_table(row_md)
    assert columns[0] == "method" and [r[0] for r in rows] == ["linear_head"]
    [run_dir] = (tmp_path / "outputs" / "notebook").glob("*/linear_head")
    assert (run_dir / "summary.json").is_file()
    printed = "".join(o.get("text", "") for o in code[2]["outputs"])
    assert "global accuracy after round 12:" in printed
    [result] = outputs(code[2], "text/plain")
    assert result.startswith("{") and "12:" in result  # Flower's Result, round by round
    assert rows[0][columns.index("global acc (final)")] in printed

    # the sweep and its report: one row per alpha, alpha 1000 above alpha 0.1
    sweep_text = "".join(o.get("text", "") for o in code[3]["outputs"])
    assert "partition.alpha=0.1:" in sweep_text and "partition.alpha=1000:" in sweep_text
    [table_md] = outputs(code[4], "text/markdown")
    columns, rows = parse_table(table_md)
    alpha = columns.index("partition.alpha")
    acc = {r[alpha]: float(r[columns.index("final global acc")]) for r in rows}
    assert set(acc) == {"0.1", "1000.0"} and acc["1000.0"] > acc["0.1"] + 20
    [png] = outputs(code[4], "image/png")  # the plot, inline
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    [sweep] = (tmp_path / "outputs" / "notebook").glob("*/alpha")
    assert {p.name for p in sweep.iterdir()} >= {"report.md", "report.csv", "curves.png"}
    print(f"the notebook ran in {seconds:.0f} s")


def test_report_refuses_a_missing_folder_or_one_without_runs(tmp_path):
    from fedadapt.api import report

    with pytest.raises(ConfigError, match=r"^fedadapt.api.report: no such folder: .*nowhere$"):
        report([tmp_path / "nowhere"])
    with pytest.raises(ConfigError, match=r"^fedadapt.api.report: no complete run "
                                          r"\(summary.json\) under "):
        report([tmp_path])
    with pytest.raises(ConfigError, match="at least one folder"):
        report([])
