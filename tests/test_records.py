"""Benchmark and evidence results kept as data (``benchmarks/records/*.json``): every docs table
between ``<!-- table: NAME -->`` markers is what its record renders, every record is shown,
and a changed record is found and re-rendered."""

from __future__ import annotations

import json

import pytest

from fedadapt.results import records


def test_every_docs_table_is_what_its_record_renders():
    assert records.stale() == []


def test_every_record_is_shown_in_the_docs_and_says_where_it_came_from():
    shown = {name for doc in records.docs() for name, _ in records.blocks(doc.read_text())}
    kept = records.load_all()
    assert len(kept) >= 40 and set(kept) <= shown, sorted(set(kept) - shown)
    for name, record in kept.items():
        assert record.command and record.machine and record.date and record.source, name
        assert record.rows, name


def test_a_table_round_trips_through_its_markdown():
    record = records.Record(name="t", columns=["a|b", "c", "empty"],
                            rows=[["1", "x | y", ""], ["2", "**3**", "4"]],
                            command="cmd", machine="m", date="2026-11-28")
    text = records.render(record)
    assert text.splitlines()[0] == "| a\\|b | c | empty |"
    assert text.splitlines()[2] == "| 1 | x \\| y | |"
    assert records.parse_table(text) == (record.columns, record.rows)


def test_a_changed_record_is_found_and_the_doc_re_rendered(tmp_path):
    (tmp_path / "docs").mkdir()
    folder = tmp_path / "records"
    record = records.Record(name="speed", columns=["side", "s"], rows=[["ours", "1.0"]],
                            command="fedadapt-bench", machine="m", date="2026-11-28",
                            footer="Made on m.")
    records.save(record, folder)
    doc = tmp_path / "docs" / "speed.md"
    doc.write_text("Before.\n\n<!-- table: speed -->\n" + records.render(record)
                   + "<!-- /table: speed -->\n\nAfter.\n")
    assert records.stale(tmp_path, folder) == []
    record.rows[0][1] = "0.5"
    records.save(record, folder)
    assert records.stale(tmp_path, folder) == [
        "docs/speed.md: table 'speed' differs from its record (python -m "
        "fedadapt.results.records re-renders it)"]
    assert records.render_docs(tmp_path, folder) == [doc]
    assert "| ours | 0.5 |" in doc.read_text() and doc.read_text().startswith("Before.")
    assert doc.read_text().endswith("Made on m.\n<!-- /table: speed -->\n\nAfter.\n")
    assert records.stale(tmp_path, folder) == []
    doc.write_text(doc.read_text() + "<!-- table: gone -->\n| a |\n|---|\n<!-- /table: gone -->\n")
    assert records.stale(tmp_path, folder)[-1].startswith("docs/speed.md: table 'gone' has no "
                                                          "record")


def test_a_bad_record_is_one_line_naming_it(tmp_path):
    with pytest.raises(ValueError, match="record x: row 0 has 1 cells, the table 2 columns"):
        records.Record(name="x", columns=["a", "b"], rows=[["1"]], command="c", machine="m",
                       date="d")
    with pytest.raises(ValueError, match="record name 'Bad Name'"):
        records.Record(name="Bad Name", columns=[], rows=[], command="c", machine="m", date="d")
    path = tmp_path / "y.json"
    path.write_text(json.dumps({"name": "z", "columns": [], "rows": [], "command": "c",
                                "machine": "m", "date": "d"}))
    with pytest.raises(ValueError, match=r"y.json: its name is 'z', the file 'y'"):
        records.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match=r"^record .*y.json: "):
        records.load(path)


def test_a_reports_table_is_kept_as_a_record_by_the_command(tmp_path):
    """What an evidence script calls at its end: the first table of fedadapt-report's
    report.md becomes the record, with the command and the machine."""
    report = tmp_path / "report.md"
    report.write_text("# Report\n\n| method | acc |\n|---|---|\n| lora | 81.9 |\n\n| other |\n"
                      "|---|\n| x |\n")
    records.main(["--write", "fleet-x", "--table", str(report), "--command", "bash s.sh",
                  "--backbone", "small ViT sha256:abc", "--dir", str(tmp_path / "rec")])
    record = records.load(tmp_path / "rec" / "fleet-x.json")
    assert (record.columns, record.rows) == (["method", "acc"], [["lora", "81.9"]])
    assert record.command == "bash s.sh" and record.backbone == "small ViT sha256:abc"
    assert record.machine and record.date == records.today()
    with pytest.raises(SystemExit):
        records.main(["--write", "y", "--dir", str(tmp_path / "rec")])  # no table, no command


def test_the_backbone_is_named_by_what_made_it_and_its_hash(tmp_path):
    """A record's backbone, from the runs: the pretrained folder's architecture, data, epochs,
    accuracy and the SHA-256 of its file, and the fingerprint the summaries recorded; runs of
    one backbone name it once, two backbones both."""
    import hashlib

    weights = tmp_path / "vit"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"weights")
    (weights / "pretrain.json").write_text(json.dumps(
        {"backbone": "small_vit", "dataset": "fashion_mnist", "epochs": 3,
         "final_test_acc": 0.8288}))
    runs = []
    for i, (folder, fingerprint) in enumerate([(weights, "ViT:aa"), (weights, "ViT:aa"),
                                               ("hub/name", "CNN:bb")]):
        run = tmp_path / f"run{i}"
        run.mkdir()
        (run / "config.yaml").write_text(f"backbone:\n  weights: {folder}\n")
        (run / "summary.json").write_text(json.dumps({"backbone_weights": fingerprint}))
        runs.append(run)
    digest = hashlib.sha256(b"weights").hexdigest()[:16]
    one = records.backbone_of(runs[:2])
    assert one.startswith("small_vit made by fedadapt-pretrain on fashion_mnist, 3 epochs, on ")
    assert one.endswith(f"(82.88% on its test set; model.safetensors SHA-256 {digest}…); "
                        f"weights fingerprint ViT:aa")
    assert records.backbone_of(runs) == one + " | weights fingerprint CNN:bb"
    (runs[2] / "summary.json").write_text("{}")
    (runs[2] / "config.yaml").write_text("seed: 0\n")
    assert records.backbone_of(runs[2:]) is None


def _script(name: str, folder: str = "scripts"):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / folder / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(tmp_path, name: str, method: str, alpha: float, seed: int, acc: float) -> dict:
    run = tmp_path / name
    run.mkdir()
    (run / "config.yaml").write_text(f"partition:\n  alpha: {alpha}\nseed: {seed}\n")
    summary = {"method": method, "seed": seed, "final": {"global_acc": acc},
               "git_commit": "c0ffee"}
    (run / "summary.json").write_text(json.dumps(summary))
    return {"dir": str(run), "summary": summary,
            "config": {"partition.alpha": alpha, "seed": seed, "method.name": method}}


def test_a_report_layout_is_kept_in_the_docs_words(tmp_path):
    """A layout table of ``fedadapt-evidence``: the paper layout's cells, its rows picked,
    ordered and named, its columns named; each column's best mean in bold (ties both, never the
    interval); a row the report lacks is one line naming what it has."""
    from fedadapt.results import evidence_cells as rr

    runs = [_run(tmp_path, f"r{i}", m, a, 0, acc) for i, (m, a, acc) in enumerate(
        [("lora", 0.1, 0.5), ("lora", 1000, 0.9), ("bitfit", 0.1, 0.6), ("bitfit", 1000, 0.9)])]
    columns, rows = rr.layout_table(runs, "paper", {"bitfit": "BitFit", "lora": "LoRA"},
                                    {"partition.alpha=1000": "alpha 1000",
                                     "partition.alpha=0.1": "alpha 0.1"}, bold=True)
    assert columns == ["method", "alpha 1000", "alpha 0.1"]
    assert rows == [["BitFit", "**90.00**", "**60.00**"], ["LoRA", "**90.00**", "50.00"]]
    cells = [["a", "48.26 ± 1.15 [45.41, 51.11]"], ["b", "46.49 ± 1.69 [42.29, 50.69]"]]
    assert records.bold_best(cells, [1]) == [["a", "**48.26 ± 1.15** [45.41, 51.11]"], cells[1]]
    with pytest.raises(SystemExit, match="the report has no \\['ia3'\\]"):
        rr.layout_table(runs, "paper", {"ia3": "(IA)^3"}, {}, bold=False)


def test_the_token_replace_table_bolds_the_best_final_accuracy():
    """``benchmarks/investigations/token_replace.py``'s rows: rounds, final and best accuracy,
    the last round's token change and median gradient norm, the non-finite steps summed; the
    best final in bold."""
    tr = _script("token_replace", "benchmarks/investigations")
    curve = [{"accuracy": 0.2, "token_change": 0.5, "grad_norm_median": 3.0,
              "non_finite_steps": 1},
             {"accuracy": 0.125, "token_change": 0.25, "grad_norm_median": 2.5,
              "non_finite_steps": 2}]
    rows = tr.rows_of({"a": {"curve": curve}, "b": {"curve": curve[:1]}})
    assert rows == [["a", "2", "12.5", "20.0", "0.25", "2.5", "3"],
                    ["b", "1", "**20.0**", "20.0", "0.50", "3", "1"]]


def test_an_evidence_table_picks_its_cells_by_row_and_column_conditions():
    """A columns table of ``fedadapt-evidence``: a column's conditions pick among a row's runs
    (an empty cell where none match); the pair column is alpha 0.1 / alpha 1000; ``bold`` marks
    each accuracy column's best mean; an unknown column is one line naming the known ones."""
    from fedadapt.results import evidence_cells as et

    rows = [("LoRA", [{"config": {"partition.alpha": a, "method.name": "lora"},
                       "summary": {"seed": s, "final": {"global_acc": acc}}}
                      for a, s, acc in [(0.1, 0, 0.5), (0.1, 1, 0.7), (1000.0, 0, 0.9)]]),
            ("BitFit", [{"config": {"partition.alpha": 0.1, "method.name": "bitfit"},
                         "summary": {"seed": 0, "final": {"global_acc": 0.6}}}])]
    columns = [et.column("global?partition.alpha=0.1:alpha 0.1"),
               et.column("global?partition.alpha=1000.0:alpha 1000"), et.column("pair")]
    assert columns[0] == ("global", {"partition.alpha": "0.1"}, "alpha 0.1")
    cells = et.table(rows, columns, 0.8)
    assert cells == [["LoRA", "60.00 ± 14.14", "90.00", "70.00 / 90.00"],
                     ["BitFit", "60.00", "", "60.00 / "]]
    assert records.bold_best(cells, [1, 2]) == [["LoRA", "**60.00 ± 14.14**", "**90.00**",
                                       "70.00 / 90.00"],
                                      ["BitFit", "**60.00**", "", "60.00 / "]]
    with pytest.raises(SystemExit, match="column 'accuracy' is not one of"):
        et.column("accuracy")


def test_a_rerun_of_one_functions_mutants_replaces_only_their_statuses(tmp_path):
    """scripts/mutation_table.py: a module's first run, then a rerun of one function's mutants
    (``MUTANTS=``; the others "not checked"): each mutant takes the last status that checked
    it, a survivor killed by a later test counts as such, and the row names both commits."""
    mt = _script("mutation_table")
    first, rerun = tmp_path / "first", tmp_path / "rerun"
    for out, commit, lines in (
            (first, "a" * 40, ["m.x_f__mutmut_1: killed", "m.x_f__mutmut_2: survived",
                               "m.xǁCǁg__mutmut_1: survived", "m.x_h__mutmut_1: timeout"]),
            (rerun, "b" * 40, ["m.x_f__mutmut_1: not checked", "m.x_f__mutmut_2: not checked",
                               "m.xǁCǁg__mutmut_1: killed", "m.xǁCǁg__mutmut_2: survived",
                               "m.x_h__mutmut_1: not checked"])):
        out.mkdir()
        (out / "commit.txt").write_text(f"mutation: fedadapt {commit}\n")
        (out / "results.txt").write_text("\n".join(f"    {ln}" for ln in lines) + "\n")
    rows = mt.rows_of([first, rerun], {"m.x_f__mutmut_2"})
    # 5 mutants: f_1 and h_1 (a timeout) killed in the first run, g_1 in the rerun; f_2 later
    assert rows == [["`m.py`", "`aaaaaaa` + `bbbbbbb`", "5", "3", "60.0%", "1", "1", "80.0%"]]
