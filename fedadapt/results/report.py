"""``fedadapt-report DIR...``: aggregate run directories (a sweep, several seeds) into one table.

Every run directory below the given folders that has a ``summary.json`` (a complete run) becomes
one row; rows whose resolved configs differ only in ``seed`` are grouped and reported as mean
± sample std over seeds (ddof = 1), with the 95% confidence interval of the mean from 3 seeds on
(:mod:`fedadapt.results.stats`; the header of every report says so). The columns that
identify a group are the config keys that vary across the runs (e.g. ``method`` and
``partition.alpha`` for a sweep). Writes ``report.md`` and
``report.csv`` (atomically) into ``--out`` (default: the first folder) and prints the table.

``--provenance`` adds, under any layout's table, where each of its runs came from: the run
directory, the git commit of the fedadapt that ran it (``+dirty``: with uncommitted changes;
``wheel``: an installed package) and the hash of its resolved config (:func:`config_hash`: the
same experiment and seed, the same hash), in the table's row order; a docs table carries it as its
footer (``fedadapt-evidence``).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import statistics
import sys
from pathlib import Path

import yaml

from fedadapt.ending import console
from fedadapt.files import atomic_write
from fedadapt.results.domain_tables import domain_tables
from fedadapt.results.stats import CONVENTION, describe, fmt, fmt_values
from fedadapt.results.store import SUMMARY
from fedadapt.results.tables import (
    at_chance,
    delay_markdown,
    delay_table,
    fmt_bytes,
    fmt_count,
    fmt_gain,
    markdown,
)

IGNORED = ("seed", "output_dir", "cache_dir", "compare", "hydra")
#: MLflow's stores (``tracking.mlflow``) hold copies of run directories as artifacts, and
#: W&B's folder (``tracking.wandb``) links to their files: not runs.
TRACKING_STORES = ("mlartifacts", "mlruns", "wandb")
METRICS = [("final global acc", ("final", "global_acc"), 100.0),
           ("best global acc", ("best", "global_acc"), 100.0),
           ("final client-mean acc", ("final", "client_acc"), 100.0),
           ("total bytes", ("total_bytes",), None),
           ("s/round", ("seconds_per_round",), None)]
#: Shown when a run has it: the privacy spent (``dp=`` with accounting).
EPSILON = ("epsilon", ("privacy", "epsilon"), None)
#: Shown when a run dropped clients (failures, late replies: ``faults.*``).
DROPPED = ("clients dropped", ("client_failures",), None)
#: Shown when a run had a simulated fleet (``fleet=``): its simulated duration.
SIMULATED = ("simulated hours", ("simulated_s",), 1 / 3600)
#: The optional columns, in order.
OPTIONAL = (EPSILON, DROPPED, SIMULATED)


def metrics_of(runs: list[dict]) -> list[tuple]:
    """The report's metric columns: :data:`METRICS`, epsilon when a run reports one, and the
    clients dropped when a run dropped some."""
    return METRICS + [m for m in OPTIONAL if any(_get(r["summary"], m[1]) not in (None, 0)
                                                 for r in runs)]


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if not isinstance(v, list) else tuple(v)
    return out


def find_runs(folders: list[str]) -> list[dict]:
    runs = []
    for folder in folders:
        for summary_path in sorted(Path(folder).rglob(SUMMARY)):
            run_dir = summary_path.parent
            cfg_path = run_dir / "config.yaml"
            inside = run_dir.relative_to(folder).parts
            if not cfg_path.is_file() or any(part in TRACKING_STORES for part in inside):
                continue
            summary = json.loads(summary_path.read_text())  # JSON (YAML reads 1e-05 as text)
            config = flatten(yaml.safe_load(cfg_path.read_text()) or {})
            config = {k: v for k, v in config.items() if k.split(".")[0] not in IGNORED}
            if summary.get("method"):  # the method's config name (accumulator_pa), not its
                config["method.name"] = summary["method"]  # schema's (accumulator)
            runs.append({"dir": str(run_dir), "summary": summary, "config": config})
    return runs


def _get(summary: dict, path: tuple):
    for p in path:
        summary = summary.get(p) if isinstance(summary, dict) else None
    return summary


#: Machine-local keys of a config.yaml, left out of its hash.
LOCAL_KEYS = ("output_dir", "cache_dir", "hydra")


def config_hash(run_dir: str) -> str:
    """The first 12 hex digits of the SHA-256 of a run directory's resolved config (its
    ``config.yaml`` as sorted JSON, without the machine-local :data:`LOCAL_KEYS`): the same
    experiment and seed give the same hash on any machine."""
    import hashlib

    config = yaml.safe_load((Path(run_dir) / "config.yaml").read_text()) or {}
    kept = {k: v for k, v in config.items() if k not in LOCAL_KEYS}
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=str).encode()).hexdigest()[:12]


def provenance(runs: list[dict]) -> str:
    """Markdown: each run's row label (the keys that vary, seed included), run directory, git
    commit, config hash and backbone weights (a hash of the weights the run read: the same
    config over weights pretrained again shows here); the commits in one line when all runs
    share one."""
    varying = varying_keys(runs) or ["method.name"]
    if "seed" not in varying and any("seed" in r["summary"] for r in runs):
        varying = [*varying, "seed"]

    def values(run: dict) -> list:
        known = {**run["config"], "seed": run["summary"].get("seed")}
        return [known.get(k) for k in varying]

    def commit(run: dict) -> str:
        return str(run["summary"].get("git_commit") or "wheel")

    lines = [f"Provenance (`fedadapt-report --provenance`): {len(runs)} run(s), fedadapt commit "
             f"{', '.join(sorted({commit(r) for r in runs}))}.", "",
             "| run | run directory | git commit | config hash | backbone weights |",
             "|---|---|---|---|---|"]
    for run in sorted(runs, key=lambda r: [repr(v) for v in values(r)]):
        label = ", ".join(f"{k}={v}" for k, v in zip(varying, values(run)))
        where = Path(run["dir"]).resolve()
        shown = where.relative_to(Path.cwd()) if where.is_relative_to(Path.cwd()) else where
        weights = run["summary"].get("backbone_weights") or "—"  # not recorded before 2026-11-27
        lines.append(f"| {label} | {shown} | {commit(run)[:12]} | {config_hash(run['dir'])} "
                     f"| {weights} |")
    return "\n".join(lines) + "\n"


def varying_keys(runs: list[dict]) -> list[str]:
    """Config keys on which the runs disagree, sorted. A key varies when the runs that have it
    disagree (method-specific keys are absent in other methods' configs, which alone does not
    make them vary)."""
    keys = sorted({k for r in runs for k in r["config"]})
    return [k for k in keys
            if len({repr(r["config"][k]) for r in runs if k in r["config"]}) > 1]


def aggregate(runs: list[dict]) -> tuple[list[str], list[dict]]:
    """Group runs by the config keys that vary (except seed); mean and std of each metric."""
    varying = varying_keys(runs)
    metrics = metrics_of(runs)
    if "method.name" not in varying:
        varying = ["method.name", *varying]
    # the strategy that ran, when it is not FedAvg (a custom one by its class's import path)
    shown = [k for k in ("strategy.name", "strategy.target") if k not in varying and any(
        r["config"].get(k) not in (None, "fedavg") for r in runs)]
    varying = [varying[0], *shown, *varying[1:]]
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault(tuple(repr(r["config"].get(k)) for k in varying), []).append(r)
    rows = []
    for members in groups.values():
        row = {k: members[0]["config"].get(k) for k in varying}
        row["seeds"] = len(members)
        row["trainable"] = members[0]["summary"]["params"]["trainable_params"]
        row["communicated"] = members[0]["summary"]["params"]["communicated_params"]
        for name, path, scale in metrics:
            vals = [v for v in (_get(m["summary"], path) for m in members) if v is not None]
            row[name] = describe([v * scale for v in vals] if scale else vals)
        if EPSILON in metrics:  # its delta beside it, and whether accuracy stayed at chance
            row["delta"] = sorted({d for m in members
                                   if (d := _get(m["summary"], ("privacy", "delta"))) is not None})
            row["at chance"] = all(at_chance(m["summary"]) for m in members)
        row["runs"] = members
        rows.append(row)
    rows.sort(key=lambda r: [repr(r[k]) for k in varying])
    return varying, rows


def paired_deltas(varying: list[str], rows: list[dict], against: str) -> str:
    """Add to each row its final global accuracy minus method ``against``'s, paired by seed
    (the same seed gives both methods the same partition, so the pair removes the partition's
    share of the spread) under the same non-method settings; mean ± std over the pairs. Returns
    the column's name."""
    column = f"Δ vs {against} (paired by seed)"
    context = [k for k in varying if not k.startswith("method.")]

    def key(run: dict) -> tuple:
        return (*(repr(run["config"].get(k)) for k in context), run["summary"].get("seed"))

    def acc(run: dict):
        return _get(run["summary"], ("final", "global_acc"))

    base = {key(r): acc(r) for row in rows if row.get("method.name") == against
            for r in row["runs"]}
    if not base:
        raise ValueError(f"--against {against}: no run of method {against!r} among these runs")
    for row in rows:
        diffs = [100.0 * (acc(r) - base[key(r)]) for r in row["runs"]
                 if row.get("method.name") != against and base.get(key(r)) is not None
                 and acc(r) is not None]
        row[column] = describe(diffs) if diffs else None
    return column


def _epsilon_cell(row: dict) -> str:
    """``ε 11.67 at δ 1e-05``, and ``; at chance`` when every run of the group stayed there."""
    value = row["epsilon"]
    if value is None:
        return "—"
    delta = " at δ " + " / ".join(f"{d:g}" for d in row["delta"]) if row.get("delta") else ""
    return f"ε {value.mean:.2f}{delta}" + ("; accuracy at chance" if row.get("at chance") else "")


def _cell(name: str, value) -> str:
    if value is None:
        return "—"
    if isinstance(value, str):  # composed by its column (time to accuracy)
        return value
    if name == "total bytes":
        return fmt_bytes(value.mean)
    if name == "s/round":
        return f"{value.mean:.2f}"
    if name == "epsilon":
        return f"{value.mean:.2f}"
    if name == "clients dropped":  # a count: its mean over seeds, ± its spread
        return f"{value.mean:g}" + (f" ± {value.std:.1f}" if value.std else "")
    return fmt(value)


def _csv_cells(value) -> list:
    """mean, sample std, CI low, CI high (empty where undefined)."""
    if value is None:
        return ["", "", "", ""]
    if isinstance(value, str):
        return [value, "", "", ""]
    lo, hi = value.ci if value.ci is not None else ("", "")
    return [value.mean, "" if value.std is None else value.std, lo, hi]


def render(varying: list[str], rows: list[dict], extra: tuple[str, ...] = ()
           ) -> tuple[str, str]:
    metrics = METRICS + [m for m in OPTIONAL if rows and m[0] in rows[0]]
    metrics += [(name, None, None) for name in extra]
    header = [*varying, "seeds", "trainable", "communicated", *(m[0] for m in metrics)]
    md_rows = [[str(r[k]) for k in varying] + [str(r["seeds"]), fmt_count(r["trainable"]),
                                               fmt_count(r["communicated"])]
               + [_epsilon_cell(r) if m is EPSILON else _cell(m[0], r[m[0]]) for m in metrics]
               for r in rows]
    buf = io.StringIO()
    writer = csv.writer(buf)
    csv_header = [*varying, "seeds", "trainable", "communicated"]
    for m in metrics:
        csv_header += [f"{m[0]} mean", f"{m[0]} std", f"{m[0]} ci95 low", f"{m[0]} ci95 high"]
    writer.writerow(csv_header)
    for r in rows:
        writer.writerow([r[k] for k in varying] + [r["seeds"], r["trainable"], r["communicated"]]
                        + [x for m in metrics for x in _csv_cells(r[m[0]])])
    return markdown(header, md_rows), buf.getvalue()


# -- the papers' layouts: one row per method (run label), one column per data setting --------

def _label(run: dict) -> str:
    return str(run["summary"]["method"])


def _columns(runs: list[dict], exclude: tuple[str, ...] = ()
             ) -> tuple[list[str], dict[str, list[dict]]]:
    """Column keys (config keys that vary, other than the method's and ``exclude``, which the
    row labels carry) and the runs per column."""
    varying = [k for k in varying_keys(runs) if not k.startswith("method.") and k not in exclude]
    cols: dict[str, list[dict]] = {}
    for r in runs:
        name = ", ".join(f"{k}={r['config'].get(k)}" for k in varying) or "all"
        cols.setdefault(name, []).append(r)
    return varying, cols


def _mean_std(vals: list[float]) -> str:
    """A report cell over seeds (:func:`fedadapt.results.stats.fmt_values`)."""
    return fmt_values(vals)


def _pivot(runs: list[dict], cell, exclude: tuple[str, ...] = ()) -> str:
    _, cols = _columns(runs, exclude)
    labels = list(dict.fromkeys(_label(r) for r in runs))
    body = []
    for label in labels:
        body.append([label] + [cell([r for r in members if _label(r) == label])
                               for members in cols.values()])
    return markdown(["method", *cols], body)


def paper_table(runs: list[dict]) -> str:
    """Tables 1-3 and 5 of the Accumulator paper: final global accuracy (the mean over exits in
    the anytime / multi-tier settings), mean ± std over seeds."""
    def cell(rs):
        return _mean_std([100 * r["summary"]["final"]["global_acc"] for r in rs
                          if r["summary"]["final"].get("global_acc") is not None])
    return _pivot(runs, cell)


def personalization_layout(runs: list[dict]) -> str:
    """Table 4: accuracy on the clients' corrupted test data after personalization (gain)."""
    runs = [r for r in runs if r["summary"].get("personalization")]
    relabeled = [{**r, "summary": {**r["summary"], "method": f"{_label(r)} "
                                   f"[{r['summary']['personalization']['part']}]"}}
                 for r in runs]

    def cell(rs):
        ps = [r["summary"]["personalization"] for r in rs
              if r["summary"]["personalization"]["after"] is not None]
        if not ps:
            return "—"
        gain = statistics.fmean(100 * p["gain"] for p in ps)
        return f"{_mean_std([100 * p['after'] for p in ps])} ({fmt_gain(gain)})"
    return _pivot(relabeled, cell, exclude=("setting.personalize", "setting.init_from"))


def history_of(run: dict) -> list[dict]:
    """A run's ``metrics.jsonl`` rows, read once (the time-to-accuracy column and the plot
    both ask)."""
    from fedadapt.results.store import read_jsonl

    if "history" not in run:
        path = Path(run["dir"]) / "metrics.jsonl"
        run["history"] = read_jsonl(path) if path.is_file() else []
    return run["history"]


def first_reaching(history: list[dict], target: float) -> dict | None:
    """The first round of ``history`` evaluated at or above ``target`` (a fraction) that has
    a simulated time, or None."""
    return next((r for r in history if r.get("global_acc") is not None
                 and r["global_acc"] >= target and r.get("sim_time_s") is not None), None)


def time_to_accuracy(rows: list[dict], target: float) -> str:
    """A column of simulated hours to the first evaluation at or above ``target`` (a
    fraction): per group, the mean ± std over the seeds that reached it, and how many did."""
    column = f"sim hours to {100 * target:g}%"
    for row in rows:
        hours = []
        for run in row["runs"]:
            hit = first_reaching(history_of(run), target)
            if hit is not None:
                hours.append(hit["sim_time_s"] / 3600)
        n = len(row["runs"])
        row[column] = (f"{fmt(describe(hours))} ({len(hours)}/{n})" if hours
                       else f"not reached (0/{n})")
    return column


#: What a plot's legend names first: the method, the setting and the strategy.
PRIMARY_KEYS = ("method.name", "setting.name", "strategy.name")


def legend_keys(varying: list[str], rows: list[dict]) -> list[str]:
    """The fewest varying keys that tell the groups apart, the primary ones first
    (:data:`PRIMARY_KEYS`): a method's own settings (its head, dropout, ...) vary with it and
    would make every label a line of the table."""
    def distinct(keys: list[str]) -> int:
        return len({tuple(str(row[key]) for key in keys) for row in rows})

    keys = [k for k in PRIMARY_KEYS if k in varying]
    for k in [k for k in varying if k not in keys]:
        if distinct(keys) == len(rows):
            break
        if distinct(keys + [k]) > distinct(keys):
            keys.append(k)
    return [k for k in varying if k in keys] or list(varying)


def accuracy_time_plot(varying: list[str], rows: list[dict], path: Path) -> bool:
    """``accuracy_vs_time.png`` of the groups whose runs ran on a simulated clock; False when
    none did."""
    from fedadapt.results.plots import plot_accuracy_vs_time

    keys = legend_keys(varying, rows)
    groups = {", ".join(f"{k.removesuffix('.name')}={row[k]}" for k in keys):
              [history_of(r) for r in row["runs"] if "simulated_s" in r["summary"]]
              for row in rows}  # a run without a fleet is not read
    groups = {k: v for k, v in groups.items() if v}
    if groups:
        plot_accuracy_vs_time(groups, path)
    return bool(groups)


def rounds_to(history: list[dict], target: float) -> tuple[int, int] | None:
    """(round, cumulative bytes) of the first evaluation at or above ``target``."""
    for row in history:
        if row.get("global_acc") is not None and row["global_acc"] >= target:
            return int(row["round"]), int(row["cum_bytes"])
    return None


def communication_table(runs: list[dict], target_method: str) -> str:
    """Table 6: rounds x communicated parameters (M) to reach the best accuracy of
    ``target_method`` (per column, the mean over its seeds of their best global accuracy),
    and the bytes actually transmitted until then (mean over seeds)."""
    from fedadapt.results.store import read_jsonl

    _, cols = _columns(runs)
    out = []
    for col, members in cols.items():
        ref = [r["summary"]["best"]["global_acc"] for r in members
               if _label(r) == target_method and r["summary"]["best"]["global_acc"] is not None]
        if not ref:
            out.append(f"{col}: no complete {target_method} run, no target\n")
            continue
        target = statistics.fmean(ref)
        body = []
        for label in dict.fromkeys(_label(r) for r in members):
            rs = [r for r in members if _label(r) == label]
            params = rs[0]["summary"]["params"]["communicated_params"] / 1e6
            hits = [rounds_to(read_jsonl(Path(r["dir"]) / "metrics.jsonl"), target) for r in rs]
            reached = [h for h in hits if h is not None]
            if len(reached) < len(hits):
                cell = f"not reached in {len(hits) - len(reached)} of {len(hits)} seeds"
                body.append([label, cell, "—", "—"])
                continue
            rounds = statistics.fmean(h[0] for h in reached)
            sent = statistics.fmean(h[1] for h in reached)
            body.append([label, f"{rounds:.0f} x {params:.2f}M", f"{rounds * params:.2f}M",
                         fmt_bytes(sent)])
        out.append(f"{col}: target {100 * target:.2f}% (best of {target_method})\n\n"
                   + markdown(["method", "rounds x params", "parameters sent",
                               "bytes transmitted (measured)"], body))
    return "\n".join(out)


LAYOUTS = ("runs", "paper", "personalization", "communication", "domains", "sessions")


def sessions_layout(runs: list[dict]) -> str:
    """Session plug-ins (DUET Tables 2-4, CDC-MMPG Tables 1-2 and 6): accuracy of the original
    model, the fine-tuning baseline and the generated layers, mean ± std over seeds; the
    measured payload per session, the generation time and the delay at each link speed."""
    runs = [r for r in runs if r["summary"].get("sessions")]
    if not runs:
        return ""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        label = _label(r)
        same = [o for o in runs if _label(o) == label]
        keys = [k for k in varying_keys(same) if k.startswith("method.")]
        extra = ", ".join(f"{k.split('.', 1)[1]}={r['config'].get(k)}" for k in keys)
        groups.setdefault(f"{label} ({extra})" if extra else label, []).append(r)

    def acc(rs, key):
        return _mean_std([100 * r["summary"]["sessions"][key]["images"] for r in rs
                          if key in r["summary"]["sessions"]])

    def median(rs, key):
        vals = [r["summary"]["sessions"]["payload"][key] for r in rs
                if r["summary"]["sessions"].get("payload")]
        return statistics.median(vals) if vals else None

    body, delays, aucs = [], [], []
    for label, rs in groups.items():
        gen_ms = median(rs, "generate_ms_median")
        body.append([label, str(len(rs)), acc(rs, "acc_original"), acc(rs, "acc_finetune"),
                     acc(rs, "acc_generated"),
                     fmt_count(rs[0]["summary"]["params"].get("generator_params")),
                     fmt_bytes(median(rs, "up_bytes_median")),
                     fmt_bytes(median(rs, "down_bytes_median")),
                     "—" if gen_ms is None else f"{gen_ms:.2f}"])
        if gen_ms is not None:
            delays.append((label, delay_table({
                "up_bytes_median": median(rs, "up_bytes_median"),
                "down_bytes_median": median(rs, "down_bytes_median"),
                "generate_ms_median": gen_ms})))
        if any("auc" in r["summary"]["sessions"] for r in rs):
            aucs.append([label, *(_mean_std([r["summary"]["sessions"]["auc"][k] for r in rs
                                             if k in r["summary"]["sessions"].get("auc", {})])
                                  for k in ("original", "finetune", "generated"))])
    out = markdown(["method", "seeds", "original model", "fine-tuning (labels)",
                    "generated layers", "generator params", "up / session",
                    "down / session", "generation ms"], body)
    if aucs:
        out += ("\nAUC (binary task; the mean of the clients' own AUCs), mean ± std over "
                "seeds:\n\n") + markdown(
            ["method", "original model", "fine-tuning (labels)", "generated layers"], aucs)
    return out + ("\n" + delay_markdown(delays) if delays else "")


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (``fedadapt-report: error: ...``), no usage."""

    def error(self, message: str):
        hint = "" if "choose from" in message else f" ({self.prog} --help says how)"
        print(f"{self.prog}: error: {message}{hint}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> None:
    parser = _Parser(prog="fedadapt-report", description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="+", help="run directories or folders containing them")
    parser.add_argument("--out", help="folder for report.md and report.csv (default: first dir)")
    parser.add_argument("--layout", choices=LAYOUTS, default="runs",
                        help="runs: one row per config group (default); paper: methods x data "
                             "settings (Accumulator Tables 1-3, 5); personalization: Table 4; "
                             "communication: Table 6; domains: FedCLIP's leave-one-domain-out "
                             "Tables 1-4 (generalization, personalization, overall); sessions: "
                             "DUET / CDC-MMPG (accuracy, payloads, delay table)")
    parser.add_argument("--target-method", default="lw_linear",
                        help="communication layout: whose best accuracy is the target")
    parser.add_argument("--provenance", action="store_true",
                        help="add each run's directory, git commit and config hash under the "
                             "table")
    parser.add_argument("--target", type=float, metavar="ACC",
                        help="runs layout: add the simulated hours (fleet=) each group takes to "
                             "reach ACC%% global accuracy")
    parser.add_argument("--against", metavar="METHOD",
                        help="runs layout: add each group's final global accuracy minus "
                             "METHOD's, paired by seed under the same other settings")
    args = parser.parse_args(argv)
    missing = [d for d in args.dirs if not Path(d).is_dir()]
    if missing:
        print(f"fedadapt-report: error: no such folder: {', '.join(missing)}", file=sys.stderr)
        sys.exit(2)
    runs = find_runs(args.dirs)
    if not runs:
        print(f"fedadapt-report: error: no complete run (summary.json) under {args.dirs}",
              file=sys.stderr)
        sys.exit(2)
    out = Path(args.out or args.dirs[0])
    if args.layout != "runs":
        md = {"paper": paper_table, "personalization": personalization_layout,
              "communication": lambda rs: communication_table(rs, args.target_method),
              "domains": lambda rs: domain_tables([r["summary"] for r in rs]),
              "sessions": sessions_layout,
              }[args.layout](runs)
        title = (f"# fedadapt report ({args.layout}): {len(runs)} runs, mean ± std over seeds"
                 f"\n\n{CONVENTION}\n\n")
        if args.provenance:
            md = f"{md}\n{provenance(runs)}"
        atomic_write(out / f"report-{args.layout}.md", lambda fh: fh.write(title + md))
        print(title + md)
        print(f"Wrote {out / f'report-{args.layout}.md'}")
        return
    varying, rows = aggregate(runs)
    extra = ()
    if args.against:
        try:
            extra = (paired_deltas(varying, rows, args.against),)
        except ValueError as err:
            print(f"fedadapt-report: error: {err}", file=sys.stderr)
            sys.exit(2)
    if args.target is not None:
        if not 0 < args.target <= 100:
            print(f"fedadapt-report: error: --target {args.target} is invalid: an accuracy in "
                  f"percent, in (0, 100]", file=sys.stderr)
            sys.exit(2)
        extra = (*extra, time_to_accuracy(rows, args.target / 100))
    md, csv_text = render(varying, rows, extra)
    if accuracy_time_plot(varying, rows, out / "accuracy_vs_time.png"):
        md += "\n![accuracy against simulated time](accuracy_vs_time.png)\n"
    if args.provenance:
        md = f"{md}\n{provenance(runs)}"
    title = (f"# fedadapt report: {len(runs)} runs in {len(rows)} groups (mean ± std over "
             f"seeds)\n\n{CONVENTION}\n\n")
    atomic_write(out / "report.md", lambda fh: fh.write(title + md))
    atomic_write(out / "report.csv", lambda fh: fh.write(csv_text))
    print(title + md)
    print(f"Wrote {out / 'report.md'} and {out / 'report.csv'}")


#: The console command: :func:`main`, then the process ends without the interpreter's
#: teardown (:mod:`fedadapt.ending`).
command = console(main)


if __name__ == "__main__":
    command()
