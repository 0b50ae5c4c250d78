"""The cells of an evidence table, from its runs (``fedadapt-evidence`` keeps them as a record).
Three kinds of table:

* :func:`columns_table`: one row per sweep folder (or part of one), one column per measure of
  :data:`COLUMNS`. A row is ``FOLDER[+FOLDER...][?KEY=VALUE...]:LABEL``: the complete runs under
  those ``OUT/FOLDER``s whose config has each ``KEY`` (a dotted key of ``config.yaml``) at
  ``VALUE``. A column is ``NAME[?KEY=VALUE...][:HEADING]``, its cell over the row's runs that
  have each ``KEY`` at ``VALUE`` (empty where none). Cells over seeds are mean ± sample std, or
  each seed's value in seed order (the same seed: the same partition, devices and sampling, so
  the rows are paired by seed).
* :func:`layout_table`: a ``fedadapt-report`` layout's table (the same cells as
  ``fedadapt-report DIRS --layout LAYOUT``), its rows and columns picked, ordered and named.
* :func:`lora_ranks_table`: per aggregator (and the two homogeneous baselines) and Dirichlet
  alpha, the final global accuracy and the clients' mean accuracy (mean ± std over seeds), the
  bytes a run sends, and each row's difference to homogeneous rank-8 LoRA and to every client at
  rank 2 (both at the ranks runs' scale alpha / r = 2), paired by seed. FedSA-LoRA's global model
  has no B (each client keeps its own): its row is compared on the clients' accuracy.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from fedadapt.results import records, report
from fedadapt.results.report import find_runs, first_reaching, history_of
from fedadapt.results.tables import fmt_bytes, fmt_count


def spread(values: list[float]) -> str:
    """One value as is, several as mean ± sample std; "—" for none."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def _final(key: str):
    """The final value of ``key`` over the runs that have one (a local-only run has no global
    model: "—")."""
    return lambda runs, _: spread([100 * r["summary"]["final"][key] for r in runs
                                   if r["summary"]["final"].get(key) is not None])


def _sim_minutes(runs, _) -> str:
    return ", ".join([f"{history_of(r)[-1]['sim_time_s'] / 60:.2f}" for r in runs])


def _dropped(runs, _) -> str:
    return ", ".join([str(sum(h.get("sim_late", 0) + h.get("sim_offline", 0)
                          for h in history_of(r))) for r in runs])


def _to_target(runs, target) -> str:
    hits = [first_reaching(history_of(r), target) for r in runs]
    return ", ".join(["—" if h is None else f"{h['sim_time_s'] / 60:.2f}" for h in hits])


def _config(key: str, missing: str = "—"):
    def cell(runs, _) -> str:
        values = {str(r["config"].get(key)) for r in runs}
        return missing if values == {"None"} else ", ".join(sorted(values))
    return cell


def _pair(runs, _) -> str:
    """Final global accuracy at alpha 0.1 / alpha 1000 (one run each), "" for one missing."""
    by_alpha = {float(r["config"].get("partition.alpha")): 100 * r["summary"]["final"]["global_acc"]
                for r in runs}
    return " / ".join("" if a not in by_alpha else f"{by_alpha[a]:.2f}" for a in (0.1, 1000.0))


def _epsilon(runs, _) -> str:
    values = {f"{h['epsilon']:.1f}" for r in runs for h in history_of(r)[-1:]
              if h.get("epsilon") is not None}
    return ", ".join(sorted(values)) or "—"


def _tuned(runs, _) -> str:
    """The clients' mean accuracy after the personalization step (``setting=local_finetune``,
    FedBABU's fine-tune), "—" for runs without one."""
    return spread([100 * r["summary"]["personalization"]["after"] for r in runs
                   if (r["summary"].get("personalization") or {}).get("after") is not None])


#: name -> (its heading, given the seeds and the target; its cell, given the row's runs)
COLUMNS = {
    "global": (lambda s, t: "final global accuracy", _final("global_acc")),
    "clients": (lambda s, t: "final client-mean accuracy", _final("client_acc")),
    "sim-minutes": (lambda s, t: f"simulated minutes ({s})", _sim_minutes),
    "dropped": (lambda s, t: f"clients dropped, late or offline ({s})", _dropped),
    "to-target": (lambda s, t: f"simulated minutes to {100 * t:g}% ({s}; —: not reached)",
                  _to_target),
    "noise": (lambda s, t: "noise multiplier", _config("dp.noise_multiplier")),
    "epsilon": (lambda s, t: "epsilon at delta 1e-5", _epsilon),
    "lr": (lambda s, t: "lr", _config("train.lr")),
    "trainable": (lambda s, t: "trainable",
                  lambda runs, _: fmt_count(runs[0]["summary"]["params"]["communicated_params"])),
    "bytes": (lambda s, t: "bytes",
              lambda runs, _: fmt_bytes(statistics.median(r["summary"]["total_bytes"]
                                                          for r in runs))),
    "pair": (lambda s, t: "alpha 0.1 / alpha 1000", _pair),
    "tuned": (lambda s, t: "client-mean accuracy after the fine-tune", _tuned),
    "sent": (lambda s, t: "sent params",
             lambda runs, _: fmt_count(runs[0]["summary"]["params"]["communicated_params"])),
    "bytes-round": (lambda s, t: "bytes a round",
                    lambda runs, _: fmt_bytes(statistics.median(
                        r["summary"]["total_bytes"] / r["summary"]["rounds"] for r in runs))),
    "s-round": (lambda s, t: "s a round", lambda runs, _: "{:.2f}".format(
        statistics.median(r["summary"]["seconds_per_round"] for r in runs))),
}


def _where(conditions: list[str]) -> dict[str, str]:
    return dict(c.split("=", 1) for c in conditions)


def _matching(runs: list[dict], wanted: dict[str, str]) -> list[dict]:
    return [r for r in runs if all(str(r["config"].get(k)) == v for k, v in wanted.items())]


def column(spec: str) -> tuple[str, dict[str, str], str | None]:
    """``NAME[?KEY=VALUE...][:HEADING]`` -> (name, its conditions, its heading or None)."""
    where, _, heading = spec.partition(":")
    name, *conditions = where.split("?")
    if name not in COLUMNS:
        raise SystemExit(f"fedadapt-evidence: error: column {name!r} is not one of "
                         f"{sorted(COLUMNS)}")
    return name, _where(conditions), heading or None


def select(out: Path, spec: str) -> tuple[str, list[dict]]:
    """``FOLDER[?KEY=VALUE...]:LABEL`` -> (label, its runs by seed)."""
    where, _, label = spec.partition(":")
    folders, *conditions = where.split("?")
    wanted = _where(conditions)
    paths = [str(out / f) for f in folders.split("+")]
    runs = _matching(find_runs(paths), wanted)
    if not runs:
        raise SystemExit(f"fedadapt-evidence: no complete run under {' '.join(paths)} "
                         f"with {wanted or 'any config'}")
    return label or folders, sorted(runs, key=lambda r: r["summary"]["seed"])


def table(selected: list[tuple[str, list[dict]]], columns, target: float) -> list[list[str]]:
    """Each row's label and its cells (a column's cell over the row's runs that match the
    column's conditions; empty where none do)."""
    def cell(runs, name, wanted):
        runs = _matching(runs, wanted)
        return COLUMNS[name][1](runs, target) if runs else ""
    return [[label] + [cell(runs, name, wanted) for name, wanted, _ in columns]
            for label, runs in selected]


def columns_table(out: Path, rows: list[str], columns: list[str], first: str = "row",
                  target: float = 0.8, bold: bool = False):
    """The columns, rows and runs of a table of ``rows`` x ``columns`` specs over ``out``;
    ``bold``: each accuracy column's best mean in bold."""
    picked = [column(spec) for spec in columns]
    selected = [select(out, spec) for spec in rows]
    every = [r for _, runs in selected for r in runs]
    seeds = "seeds " + ", ".join(map(str, sorted({r["summary"]["seed"] for r in every})))
    cells = table(selected, picked, target)
    if bold:
        cells = records.bold_best(cells, [j + 1 for j, (name, _, _) in enumerate(picked)
                                          if name in ("global", "clients")])
    heads = [first] + [heading or COLUMNS[name][0](seeds, target) for name, _, heading in picked]
    return heads, cells, every


LAYOUTS = {"paper": report.paper_table, "personalization": report.personalization_layout,
           "communication": lambda runs: report.communication_table(runs, "lw_linear")}


def layout_table(runs: list[dict], layout: str, rows: dict[str, str], columns: dict[str, str],
                 bold: bool) -> tuple[list[str], list[list[str]]]:
    """The layout's table with the rows (``{METHOD: LABEL}``, METHOD as the report's first
    column says it) and columns (``{REPORT COLUMN: LABEL}``) picked, ordered and named; all of
    them where none are given; ``bold``: each column's best mean in bold."""
    heads, body = records.parse_table(LAYOUTS[layout](runs))
    by_name = {r[0]: r for r in body}
    missing = [m for m in rows if m not in by_name] + [c for c in columns if c not in heads]
    if missing:
        raise SystemExit(f"fedadapt-evidence: error: the report has no {missing}; its rows are "
                         f"{list(by_name)}, its columns {heads}")
    picked = list(columns) or heads[1:]
    index = [heads.index(c) for c in picked]
    out = [[label] + [by_name[m][i] for i in index] for m, label in
           (rows or {r[0]: r[0] for r in body}).items()]
    return ([heads[0]] + [columns.get(c, c) for c in picked],
            records.bold_best(out, range(1, len(picked) + 1)) if bold else out)


def _ranks_row(run: dict) -> tuple:
    cfg = run["config"]
    ranks = cfg.get("method.ranks")
    return (cfg["strategy.name"], tuple(ranks) if ranks else (cfg["method.rank"],),
            cfg["method.alpha"])


def _ranks_label(row: tuple) -> str:
    strategy, ranks, alpha = row
    scale = alpha / max(ranks)
    if len(ranks) == 1:
        return (f"LoRA r = {ranks[0]}, every client, scale {scale:g} (alpha {alpha:g}; "
                f"`strategy={strategy}`)")
    return f"ranks {'/'.join(map(str, ranks))}, scale {scale:g} (`strategy={strategy}`)"


def lora_ranks_table(found: list[dict]) -> tuple[list[str], list[list[str]]]:
    """The LoRA-ranks table of the runs ``found`` (:func:`fedadapt.results.report.find_runs`)."""
    runs = [{"row": _ranks_row(r), "alpha": r["config"]["partition.alpha"],
             "seed": r["summary"]["seed"], "global": 100 * r["summary"]["final"]["global_acc"],
             "client": 100 * r["summary"]["final"]["client_acc"],
             "bytes": r["summary"]["total_bytes"]} for r in found]
    alphas = sorted({r["alpha"] for r in runs})
    from fedadapt.strategies.registry import CAPABILITIES

    by = {(r["row"], r["alpha"], r["seed"]): r for r in runs}
    order = sorted({r["row"] for r in runs}, key=lambda row: (len(row[1]) > 1, -row[1][0],
                                                              row[2], row[0]))
    # the baselines at the ranks runs' scale, 2: rank 8 at alpha 16, rank 2 at alpha 4
    bases = [("fedavg", (8,), 16.0), ("fedavg", (2,), 4.0)]
    head = ["rows", "seeds", "MB sent"]
    for a in alphas:
        head += [f"global, α {a:g}", f"clients, α {a:g}", f"Δ vs r = 8, α {a:g}",
                 f"Δ vs r = 2, α {a:g}"]
    body = []
    for row in order:
        mine = [r for r in runs if r["row"] == row]
        cells = [_ranks_label(row), str(len({r["seed"] for r in mine})),
                 f"{statistics.mean(r['bytes'] for r in mine) / 1e6:.1f}"]
        # a strategy that keeps each client's B at home is judged on the clients' own models
        caps = CAPABILITIES.get(row[0])
        metric = "client" if caps is not None and caps.shares_only_a else "global"
        for a in alphas:
            at = [r for r in mine if r["alpha"] == a]
            cells += [spread([r["global"] for r in at]), spread([r["client"] for r in at])]
            for base in bases:
                pairs = [r[metric] - by[(base, a, r["seed"])][metric] for r in at
                         if (base, a, r["seed"]) in by]
                cells.append("—" if row == base else spread(pairs))
        body.append(cells)
    return head, body
