"""``fedadapt-evidence``: a table's description (scripts/tables/NAME.yaml) run, and its record
made from the runs. The lora-dp record is made again, cell for cell, from generated runs that
hold its numbers; every description prints the commands it would run."""

from __future__ import annotations

import json

import pytest
import yaml

from fedadapt import evidence
from fedadapt.results import records


def _values(cell: str) -> list[float | None]:
    """Three seeds' values whose mean ± sample std prints as ``cell`` ("m ± d": m - d, m, m + d)."""
    if cell == "—":
        return [None] * 3
    mean, _, std = cell.partition(" ± ")
    m, d = float(mean), float(std or 0)
    return [m - d, m, m + d]


def _fake_runs(out, record: records.Record, rows: list[str]) -> None:
    """One run per seed of each row of ``record``, in the row's sweep folder, holding its cells
    (noise multiplier, epsilon, final global and client accuracy) as a run would."""
    for spec, cells in zip(rows, record.rows):
        folder, *conditions = spec.split(":")[0].split("?")
        noise, epsilon = cells[1], cells[2]
        for seed, glob, client in zip(range(3), _values(cells[3]), _values(cells[4])):
            run = out / folder / f"{len(conditions)}-{noise}-{seed}"
            run.mkdir(parents=True)
            config = {"seed": seed}
            if noise != "—":
                config["dp"] = {"noise_multiplier": float(noise)}
            (run / "config.yaml").write_text(yaml.safe_dump(config))
            (run / "summary.json").write_text(json.dumps({
                "seed": seed, "git_commit": "c0ffee",
                "final": {"global_acc": glob / 100, "client_acc": client / 100}}))
            last = {"round": 40} if epsilon == "—" else {"round": 40, "epsilon": float(epsilon)}
            (run / "metrics.jsonl").write_text(json.dumps(last) + "\n")


def test_the_lora_dp_record_is_made_again_from_its_runs(tmp_path, capsys):
    kept = records.load(records.path_of("lora-dp"))
    _, spec = evidence.describe("lora_dp")
    out, folder = tmp_path / "out", tmp_path / "records"
    folder.mkdir()
    _fake_runs(out, kept, spec["records"]["lora-dp"]["rows"])
    evidence.main(["lora_dp", str(out), "federation.backend=inprocess", "--records-only",
                   "--folder", str(folder)])
    made = records.load(records.path_of("lora-dp", folder))
    assert made.columns == kept.columns and made.rows == kept.rows
    assert made.command == "fedadapt-evidence lora_dp OUT federation.backend=inprocess"
    assert made.commit == "c0ffee" and made.source == "fedadapt-evidence (lora_dp)"
    assert "fedadapt-evidence: wrote" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(p.stem for p in evidence.TABLES.glob("*.yaml")))
def test_every_description_prints_its_runs_and_runs_nothing_with_dry_run(name, tmp_path, capsys):
    _, spec = evidence.describe(name)
    (tmp_path / "o" / "done_sweep").mkdir(parents=True)
    evidence.main([name, str(tmp_path / "o"), "seed=7", "--dry-run"])
    printed = capsys.readouterr().out
    for sweep in spec.get("sweeps", {}):
        assert f"hydra.sweep.dir={tmp_path / 'o' / sweep}" in printed
    for run in spec.get("runs", {}):
        assert f"output_dir={tmp_path / 'o' / run}" in printed
    for record in spec.get("records", {}):
        assert record in printed
    assert printed.count("seed=7") >= len(spec.get("sweeps", {})) + len(spec.get("runs", {}))
    assert not (tmp_path / "o" / "done_sweep" / ".done").exists()
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["done_sweep"]


def test_a_finished_sweep_is_not_run_again_and_a_bad_description_is_one_line(tmp_path, capsys):
    (tmp_path / "o" / "lora").mkdir(parents=True)
    (tmp_path / "o" / "lora" / ".done").touch()
    evidence.main(["fleet", str(tmp_path / "o"), "--dry-run"])
    printed = capsys.readouterr().out
    assert "# done: lora" in printed and "sweep.dir=" + str(tmp_path / "o" / "lora") \
        not in printed
    bad = tmp_path / "bad.yaml"
    bad.write_text("records:\n  x:\n    columns: [accuracy]\n    rows: ['a:b']\n")
    with pytest.raises(SystemExit, match="column 'accuracy' is not one of"):
        evidence.main([str(bad), "--dry-run"])
    bad.write_text("records:\n  x:\n    kind: plot\n")
    with pytest.raises(SystemExit, match="records.x.kind is 'plot', not one of"):
        evidence.main([str(bad), "--dry-run"])
    with pytest.raises(SystemExit, match="no description .*nosuch.yaml; known: \\["):
        evidence.main(["nosuch"])
