"""``fedadapt-bench --throughput --rows``: several rows in one process, one JSON per row, a row
that fails recorded and the others measured, ``--profile`` tables beside them (what
``fedadapt-gpu-check`` reads)."""

from __future__ import annotations

import json

import pytest


def test_rows_are_parsed_and_a_bad_row_is_one_line():
    from fedadapt.bench import parse_rows, row_name
    from fedadapt.config import ConfigError

    assert parse_rows("1:10:bf16:accumulator_pa, 32:10:fp32:lora") == [
        (1, 10, "bf16", "accumulator_pa"), (32, 10, "fp32", "lora")]
    assert row_name(32, 10, "fp32", "lora") == "throughput-lora-k32-b10-fp32.json"
    for bad in ("10:10:bf16", "0:10:bf16:lora", "a:10:bf16:lora", ""):
        with pytest.raises(ConfigError, match="^--rows: ") as err:
            parse_rows(bad)
        assert "\n" not in str(err.value)


def test_rows_in_one_process_write_each_row_and_record_a_failed_one(tmp_path, cache_dir, capsys):
    from fedadapt import bench

    out = tmp_path / "tp"
    with pytest.raises(SystemExit) as ended:
        bench.main(["--throughput", "--rows", "2:4:fp32:accumulator_pa,1:4:fp32:nosuchmethod",
                    "--profile", "--steps", "2", "--repeats", "1", "--out", str(out),
                    "--record", "tp-test", "--record-dir", str(tmp_path / "records"),
                    "dataset=digits", "backbone=tiny_vit", "dataset.max_samples=300",
                    f"cache_dir={cache_dir}"])
    assert "1 row(s) failed: throughput-nosuchmethod-k1-b4-fp32.json" in str(ended.value.code)
    good = json.loads((out / "throughput-accumulator_pa-k2-b4-fp32.json").read_text())
    assert good["clients"] == 2 and good["batch_size"] == 4 and good["precision"] == "fp32"
    assert good["fedadapt_images_per_s"] > 0 and good["bare_images_per_s"] > 0
    assert good["ratio"] == pytest.approx(good["fedadapt_images_per_s"]
                                          / good["bare_images_per_s"])
    bad = json.loads((out / "throughput-nosuchmethod-k1-b4-fp32.json").read_text())
    assert bad["error"].startswith("MissingConfigException") and "nosuchmethod" in bad["error"]
    profile = (out / "throughput-accumulator_pa-k2-b4-fp32.profile.txt").read_text()
    heads = [line for line in profile.splitlines() if line.startswith("## ")]
    assert [h.split(":")[0] for h in heads] == ["## fedadapt", "## bare"]
    assert all("16 images in" in h for h in heads)  # 2 clients x 2 steps x batch 4
    assert "by CPU time" in profile and "aten::" in profile
    printed = capsys.readouterr().out
    assert "row failed: MissingConfigException" in printed
    from fedadapt.results.records import load, render

    record = load(tmp_path / "records" / "tp-test.json")  # the table kept as data, as printed
    assert record.source == "fedadapt-bench" and record.command.startswith(
        "fedadapt-bench --throughput --rows 2:4:fp32:accumulator_pa,1:4:fp32:nosuchmethod")
    assert [row[:3] for row in record.rows] == [["accumulator_pa", "2 x 4", "fp32"],
                                                ["nosuchmethod", "1 x 4", "fp32"]]
    assert record.rows[0][4] == f"{good['fedadapt_images_per_s']:,.0f}"
    assert record.rows[1][4] == "failed"
    assert render(record) in printed
    with pytest.raises(SystemExit) as ended:  # --profile without --rows: one line, exit 2
        bench.main(["--throughput", "--profile", "--out", str(out)])
    assert ended.value.code == 2
    assert "error: --profile writes beside each --rows row's JSON" in capsys.readouterr().err



def test_the_round_timing_shows_each_run_with_an_estimate_and_the_plain_loops_rounds(
        tmp_path, cache_dir, capsys):
    """``fedadapt-bench`` (seconds per round): every run of every repeat is announced with the
    runs left and, from the second, an estimate; the plain loop's rounds have their bar (its
    final line in plain output) and the medians come out as before."""
    from fedadapt import bench

    with pytest.raises(SystemExit) as ended:
        bench.main(["--rounds", "2", "--repeats", "2", "--out", str(tmp_path / "out"),
                    "backbone=small_cnn", "backbone.image_size=16", "dataset.max_samples=300",
                    "partition.num_clients=4", f"cache_dir={cache_dir}"])
    assert ended.value.code == 0
    printed = capsys.readouterr()
    runs = [line for line in printed.out.splitlines() if line.startswith("[bench] ")
            and "repeat" in line]
    assert [line.split("| run ")[1].split(" ")[0] for line in runs] == \
        [f"{i}/6" for i in range(1, 7)]
    assert "left" not in runs[0] and all(line.endswith(" left") for line in runs[1:])
    assert printed.err.count("[bench] plain loop 2/2") == 2  # one bar per plain run, finished
    meta = json.loads(next((tmp_path / "out").glob("bench*.json")).read_text())
    assert set(meta["results"]) == {"flower+cache", "flower-nocache", "plain+cache"}
    assert all(r["median_s_per_round"] > 0 for r in meta["results"].values())
