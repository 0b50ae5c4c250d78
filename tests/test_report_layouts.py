"""fedadapt-report's paper layouts on hand-made run directories (the table logic, not results)."""

import json

import pytest
import yaml

from fedadapt.results.report import (
    aggregate,
    communication_table,
    find_runs,
    paired_deltas,
    paper_table,
    personalization_layout,
    rounds_to,
)


def make_run(root, name, *, label, alpha, seed, accs, params=1_000_000, part=None):
    d = root / name
    d.mkdir(parents=True)
    cfg = {"method": {"name": label}, "partition": {"alpha": alpha}, "seed": seed}
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    history = [{"round": r + 1, "global_acc": a, "cum_bytes": 100 * (r + 1)}
               for r, a in enumerate(accs)]
    (d / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    summary = {"method": label, "seed": seed, "final": {"global_acc": accs[-1]},
               "best": {"global_acc": max(accs)},
               "params": {"trainable_params": params, "communicated_params": params},
               "personalization": None if part is None else {
                   "part": part, "before": 0.2, "after": accs[-1], "gain": accs[-1] - 0.2}}
    (d / "summary.json").write_text(json.dumps(summary))


def test_rounds_to_target():
    hist = [{"round": 1, "global_acc": None, "cum_bytes": 5},
            {"round": 2, "global_acc": 0.4, "cum_bytes": 10},
            {"round": 3, "global_acc": 0.6, "cum_bytes": 15}]
    assert rounds_to(hist, 0.5) == (3, 15)
    assert rounds_to(hist, 0.4) == (2, 10)
    assert rounds_to(hist, 0.7) is None


def test_paper_and_communication_layouts(tmp_path):
    make_run(tmp_path, "a", label="lw_linear", alpha=0.1, seed=0, accs=[0.2, 0.5, 0.4],
             params=460_000)
    make_run(tmp_path, "b", label="lw_linear", alpha=0.1, seed=1, accs=[0.3, 0.3, 0.3],
             params=460_000)
    make_run(tmp_path, "c", label="accumulator", alpha=0.1, seed=0, accs=[0.45, 0.6, 0.7],
             params=3_000_000)
    make_run(tmp_path, "d", label="accumulator", alpha=1000, seed=0, accs=[0.8, 0.9, 0.9])
    runs = find_runs([str(tmp_path)])
    table = paper_table(runs)
    lines = table.splitlines()
    assert "partition.alpha=0.1" in lines[0] and "partition.alpha=1000" in lines[0]
    # final acc, mean ± sample std (ddof = 1) over 2 seeds: 40 and 30
    assert "| lw_linear | 35.00 ± 7.07 | — |" in table
    assert "| accumulator | 70.00 | 90.00 |" in table  # one seed: its value alone
    comm = communication_table(runs, "lw_linear")
    # target = mean of lw_linear's best (0.5, 0.3) = 0.4; the accumulator reaches it in round 1
    assert "target 40.00%" in comm
    assert "| accumulator | 1 x 3.00M | 3.00M | 100 B |" in comm
    # seed 1 of lw_linear (best 0.3) never reaches the seed mean: said, not averaged away
    assert "| lw_linear | not reached in 1 of 2 seeds | — | — |" in comm
    assert "no complete lw_linear run" in comm  # the alpha=1000 column has no target


def test_personalization_layout(tmp_path):
    make_run(tmp_path, "a", label="accumulator_pa", alpha=0.1, seed=0, accs=[0.5],
             part="client_token")
    make_run(tmp_path, "b", label="accumulator_pa", alpha=0.1, seed=0, accs=[0.4],
             part="adapters")
    table = personalization_layout(find_runs([str(tmp_path)]))
    assert "| accumulator_pa [client_token] | 50.00 (+30.00) |" in table
    assert "| accumulator_pa [adapters] | 40.00 (+20.00) |" in table


def test_seed_statistics_sample_std_and_t_interval():
    from fedadapt.results.stats import CONVENTION, describe, fmt

    s = describe([1.0, 2.0, 3.0])  # s = 1; t(0.975, 2) = 4.3027; half = 4.3027 / sqrt(3)
    assert s.std == 1.0 and s.ci == pytest.approx((2 - 2.48414, 2 + 2.48414), abs=1e-4)
    assert fmt(s) == "2.00 ± 1.00 [-0.48, 4.48]"
    assert fmt(describe([40.0, 30.0])) == "35.00 ± 7.07"  # ddof = 1; no interval below 3
    assert fmt(describe([70.0])) == "70.00" and fmt(describe([])) == "—"
    assert "ddof = 1" in CONVENTION


@pytest.mark.slow
def test_runs_report_states_the_convention_and_writes_intervals(tmp_path):
    import csv
    import subprocess
    import sys

    for seed, acc in enumerate([0.5, 0.6, 0.7]):
        make_run(tmp_path, f"s{seed}", label="linear_head", alpha=0.5, seed=seed, accs=[acc])
    out = subprocess.run([sys.executable, "-m", "fedadapt.results.report", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "report.md").read_text()
    assert "sample standard deviation over seeds (ddof = 1" in md
    assert "| 60.00 ± 10.00 [35.16, 84.84] |" in md
    row = next(csv.DictReader(open(tmp_path / "report.csv")))
    assert float(row["final global acc std"]) == pytest.approx(10.0)
    assert float(row["final global acc ci95 low"]) == pytest.approx(60 - 24.8414, abs=1e-3)


def test_mlflow_artifact_copies_are_not_runs(tmp_path):
    make_run(tmp_path, "quickstart/run", label="linear_head", alpha=0.5, seed=0, accs=[0.5])
    make_run(tmp_path, "mlartifacts/1/abc/artifacts", label="linear_head", alpha=0.5, seed=0,
             accs=[0.5])  # what tracking.mlflow copies of the run directory
    assert [r["dir"] for r in find_runs([str(tmp_path)])] == [str(tmp_path / "quickstart/run")]


def test_against_pairs_each_seed_with_the_baseline_under_the_same_settings(tmp_path):
    # seed s: the baseline at 0.40 + s / 10 (a partition effect shared by both methods), lora
    # 0.05 above it at alpha 0.1 and 0.01 below at alpha 1000
    for alpha, gap in ((0.1, 0.05), (1000, -0.01)):
        for seed in range(3):
            base = 0.40 + seed / 10
            make_run(tmp_path, f"b{alpha}{seed}", label="linear_head", alpha=alpha, seed=seed,
                     accs=[base])
            make_run(tmp_path, f"l{alpha}{seed}", label="lora", alpha=alpha, seed=seed,
                     accs=[base + gap])
    varying, rows = aggregate(find_runs([str(tmp_path)]))
    column = paired_deltas(varying, rows, "linear_head")
    by = {(r["method.name"], r["partition.alpha"]): r[column] for r in rows}
    assert by[("linear_head", 0.1)] is None
    assert by[("lora", 0.1)].mean == pytest.approx(5.0)
    assert by[("lora", 0.1)].std == pytest.approx(0.0, abs=1e-9)  # the seeds' spread cancels
    assert by[("lora", 1000)].mean == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="--against dora: no run of method 'dora'"):
        paired_deltas(varying, rows, "dora")


def test_provenance_names_each_runs_directory_commit_and_config_hash(tmp_path):
    """One row per run, in the table's order, with its directory, commit (``wheel`` without
    one), config hash and backbone weights (``—`` where the summary predates them);
    machine-local keys (output_dir, cache_dir) do not change the hash, the seed does."""
    from fedadapt.results.report import config_hash, provenance

    for name, seed in (("a0", 0), ("a1", 1), ("b0", 0)):
        make_run(tmp_path, name, label="lw_linear", alpha=0.1 if name[0] == "a" else 1000.0,
                 seed=seed, accs=[0.5])
    cfg = yaml.safe_load((tmp_path / "a0" / "config.yaml").read_text())
    (tmp_path / "a0" / "config.yaml").write_text(yaml.safe_dump(
        {**cfg, "output_dir": "/elsewhere", "cache_dir": "/cache"}))
    summary = json.loads((tmp_path / "a0" / "summary.json").read_text())
    (tmp_path / "a0" / "summary.json").write_text(json.dumps({
        **summary, "git_commit": "abc123+dirty", "backbone_weights": "ViTBackbone:40321b41"}))
    text = provenance(find_runs([str(tmp_path)]))
    rows = [ln for ln in text.splitlines() if ln.startswith("| partition")]
    assert [r.split(" | ")[0] for r in rows] == ["| partition.alpha=0.1, seed=0",
                                                 "| partition.alpha=0.1, seed=1",
                                                 "| partition.alpha=1000.0, seed=0"]
    assert "abc123+dirty" in rows[0] and rows[1].split(" | ")[2] == "wheel"
    assert rows[0].endswith("| ViTBackbone:40321b41 |") and rows[1].endswith("| — |")
    assert "fedadapt commit abc123+dirty, wheel." in text
    bare = tmp_path / "bare"
    make_run(tmp_path, "bare", label="lw_linear", alpha=0.1, seed=0, accs=[0.5])
    assert config_hash(str(tmp_path / "a0")) == config_hash(str(bare))  # local keys ignored
    assert config_hash(str(tmp_path / "a0")) != config_hash(str(tmp_path / "a1"))  # seed counts
    assert all(config_hash(str(tmp_path / n)) in text for n in ("a0", "a1", "b0"))


def test_a_run_is_labelled_by_its_methods_config_name(tmp_path):
    """``method=accumulator_pa`` composes the accumulator schema (``method.name:
    accumulator``): the report's row says accumulator_pa, the name the run was given."""
    make_run(tmp_path, "a", label="accumulator", alpha=0.1, seed=0, accs=[0.5])
    make_run(tmp_path, "b", label="accumulator", alpha=0.1, seed=0, accs=[0.6])
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    (tmp_path / "b" / "summary.json").write_text(json.dumps({**summary,
                                                             "method": "accumulator_pa"}))
    config = yaml.safe_load((tmp_path / "b" / "config.yaml").read_text())
    config["method"]["parallel_adapter"] = True
    (tmp_path / "b" / "config.yaml").write_text(yaml.safe_dump(config))
    _, rows = aggregate(find_runs([str(tmp_path)]))
    assert sorted(r["method.name"] for r in rows) == ["accumulator", "accumulator_pa"]


def _dp_run(root, name, *, acc, epsilon=11.67, delta=0.1, dataset="digits"):
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"method": {"name": "linear_head"},
                                                   "dp": {"name": name}, "seed": 0}))
    (d / "summary.json").write_text(json.dumps({
        "method": "linear_head", "seed": 0, "dataset": dataset,
        "final": {"global_acc": acc}, "best": {"global_acc": acc},
        "params": {"trainable_params": 10, "communicated_params": 10},
        "privacy": {"dp": name, "noise_multiplier": 1.0, "clipping_norm": 1.0,
                    "epsilon": epsilon, "delta": delta, "releases": 12,
                    "accounting": "rdp"}}))


def test_dp_at_chance_says_so_beside_epsilon_at_its_delta(tmp_path):
    from fedadapt.results.report import render
    from fedadapt.results.tables import privacy_table

    _dp_run(tmp_path, "server_fixed", acc=0.1000000015)  # digits: 10 classes, chance 10%
    _dp_run(tmp_path, "client_fixed", acc=0.71, epsilon=3.2, delta=1e-5)
    runs = find_runs([str(tmp_path)])
    md, _ = render(*aggregate(runs))
    assert "| ε 11.67 at δ 0.1; accuracy at chance |" in md
    assert "| ε 3.20 at δ 1e-05 |" in md
    table = privacy_table([r["summary"] for r in runs])
    chance = next(ln for ln in table.splitlines() if "| server_fixed |" in ln)
    assert "11.670; accuracy at chance (10.00% final, 10 classes)" in chance
    learned = next(ln for ln in table.splitlines() if "| client_fixed |" in ln)
    assert "at chance" not in learned


def test_chance_comes_from_the_card_or_the_partition():
    from fedadapt.results.tables import at_chance, num_classes

    assert num_classes({"dataset": "cifar100"}) == 100
    assert num_classes({"num_classes": 7, "dataset": "digits"}) == 7
    assert num_classes({"dataset": "my_folder", "partition_stats": {
        "classes_per_client": {"max": 4}}}) == 4
    assert num_classes({"dataset": "my_folder"}) is None
    assert at_chance({"dataset": "digits", "final": {"global_acc": 0.105}})
    assert not at_chance({"dataset": "digits", "final": {"global_acc": 0.2}})
    assert at_chance({"dataset": "digits", "final": {"global_acc": None, "client_acc": 0.09}})
    assert not at_chance({"dataset": "my_folder", "final": {"global_acc": 0.0}})


@pytest.mark.parametrize("argv,says", [
    (["/nonexistent"], "fedadapt-report: error: no such folder: /nonexistent"),
    (["/tmp", "--layout", "papers"], "argument --layout: invalid choice: 'papers'"),
])
def test_report_bad_input_is_one_line_without_usage(argv, says, capsys):
    from fedadapt.results.report import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and says in err and err.count("\n") == 1, err
    assert "usage" not in err


def test_a_plot_legend_names_the_method_setting_and_strategy_and_only_what_else_it_needs():
    from fedadapt.results.report import legend_keys

    varying = ["method.head", "method.name", "setting.name", "strategy.name", "train.lr"]
    rows = [{"method.head": "linear", "method.name": "lora", "setting.name": "conventional",
             "strategy.name": s, "train.lr": 0.2} for s in ("fedavg", "fedbuff")]
    rows.append({"method.head": "mlp", "method.name": "accumulator_pa",
                 "setting.name": "anytime", "strategy.name": "fedavg", "train.lr": 0.05})
    assert legend_keys(varying, rows) == ["method.name", "setting.name", "strategy.name"]
    # two learning rates of one method: the rate is what tells them apart
    rows = [{**rows[0], "train.lr": lr} for lr in (0.2, 0.05)]
    assert legend_keys(varying, rows) == ["method.name", "setting.name", "strategy.name",
                                          "train.lr"]


def test_a_gain_that_rounds_to_zero_is_plus_zero():
    """Both personalization tables print a gain with its sign and two decimals, and one that
    rounds to zero as "+0.00", never "-0.00"."""
    from fedadapt.results.tables import fmt_gain

    assert [fmt_gain(g) for g in (-0.0001, -0.004, -0.006, 2.857, 0.0)] == [
        "+0.00", "+0.00", "-0.01", "+2.86", "+0.00"]
