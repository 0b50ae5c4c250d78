"""The ``rounds`` family's summary: after the last round, the accuracy (the selected round, the
per-domain and per-tier figures, personalization), the costs, the strategy and privacy spent,
written to ``summary.json`` (last) with the table and curves.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

from fedadapt.config import RunConfig
from fedadapt.data.partition import Partition
from fedadapt.federation.client.training import RunSpec
from fedadapt.methods.run import PreparedRun, summary_head, summary_tail


def select_round(evals: list[dict], how: str) -> Optional[dict]:
    """The evaluated round the summary reports: the last, or the one with the best mean
    validation accuracy of the clients (ties: the earliest)."""
    if not evals:
        return None
    if how == "best_val":
        scored = [r for r in evals if r.get("val_acc") is not None]
        if scored:
            return max(scored, key=lambda r: r["val_acc"])
    return evals[-1]


def domain_summary(row: Optional[dict], partition: Partition,
                   client_metrics: dict[str, dict[str, dict]]) -> Optional[dict]:
    """FedCLIP's three numbers at the reported round of a domain partition: generalization
    (the held-out domain), personalization (each participating domain's test split) and
    overall (the mean over all four)."""
    if row is None or partition.unseen is None or row.get("unseen_acc") is None:
        return None
    accs = {c: m.get("accuracy") for c, m in client_metrics.get(str(row["round"]), {}).items()}
    pers = {name: accs.get(str(i)) for i, name in enumerate(partition.names)}
    known = [v for v in pers.values() if v is not None]
    return {
        "holdout": partition.unseen_name,
        "clients": list(partition.names),
        "selected_round": row["round"],
        "generalization": row["unseen_acc"],
        "personalization": pers,
        "personalization_mean": sum(known) / len(known) if known else None,
        "overall": (row["unseen_acc"] + sum(known)) / (1 + len(known)),
    }


def _tier_counts(exits: list[int]) -> Optional[dict[str, int]]:
    """``{exit: clients}`` of a multi-tier run (None when every client uses the last exit)."""
    if not exits:
        return None
    return {str(e): exits.count(e) for e in sorted(set(exits))}


def finish_rounds(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state, *, label: str,
                   t0: float, num_rounds: int, resume_state: Optional[dict]) -> dict:
    """The run directory of a client-trained run after its rounds: per-client metrics,
    personalization, the summary and its table and curves (``summary.json`` last)."""
    from fedadapt.results.store import write_jsonl

    write_jsonl(run_dir / CLIENTS_FILE, [{"round": int(r), "client": int(c), **m}
                                         for r, per in state.client_metrics.items()
                                         for c, m in per.items()])
    summary = {
        **summary_head(cfg, label, prep, rounds=num_rounds, setting=cfg.setting.name),
        **_accuracy_summary(cfg, run_dir, prep, state),
        "params": prep.counts,
        "strategy": _strategy_summary(cfg, state.strategy),
        "privacy": _privacy_summary(cfg, state.strategy, state.history, prep.spec.dpsgd),
        **_cost_summary(prep, state, t0, resume_state),
        **summary_tail(prep),
    }
    _write_run_end(cfg, run_dir, label, summary, state.history)
    return summary


def _accuracy_summary(cfg: RunConfig, run_dir: Path, prep: PreparedRun, state) -> dict:
    """The summary's accuracies: the final evaluated round, the reported one
    (``federation.select``), the domains and tiers, personalization (its file written) and
    the best of each accuracy."""
    history = state.history
    evals = [r for r in history if r["global_acc"] is not None or r["client_acc"] is not None]

    def best(key):
        vals = [r[key] for r in evals if r[key] is not None]
        return max(vals) if vals else None

    final = evals[-1] if evals else (history[-1] if history else {})
    selected = select_round(evals, cfg.federation.select)
    return {
        "final": {k: final.get(k) for k in ("round", "global_acc", "client_acc",
                                            "client_acc_weighted", "train_loss",
                                            "global_acc_last", "exit_acc", "tier_acc",
                                            "val_acc")},
        "selection": cfg.federation.select,
        "selected": ({k: selected.get(k) for k in ("round", "val_acc", "global_acc", "client_acc",
                                                   "unseen_acc")} if selected else None),
        "domains": domain_summary(selected, prep.partition, state.client_metrics),
        "tiers": _tier_counts(prep.spec.client_exits),
        "personalization": _personalization(cfg, run_dir, prep.spec, state.personalized),
        "best": {"global_acc": best("global_acc"), "client_acc": best("client_acc")},
    }


def _cost_summary(prep: PreparedRun, state, t0: float, resume_state: Optional[dict]) -> dict:
    """The summary's costs: bytes, the simulated clock, dropped clients, wall time."""
    history = state.history
    trained = [r for r in history if r["round"] >= 1]  # round 0: the initial model's evaluation
    return {
        "total_bytes": state.cum_bytes,
        # a simulated fleet's clock at the end (fleet=): fedadapt-report's "simulated hours"
        **({"simulated_s": state.sim_time} if prep.fleet is not None else {}),
        "client_failures": sum(r.get("clients_failed", 0) for r in history),
        "resumed_after_round": resume_state["round"] if resume_state else None,
        "bytes_up": sum(r["bytes_up"] for r in history),
        "bytes_down": sum(r["bytes_down"] for r in history),
        # this process's time, plus the interrupted process's rounds when resumed
        "wall_s": time.time() - t0 + (resume_state or {}).get("wall_s", 0.0),
        "seconds_per_round": (sum(r["round_s"] for r in trained) / len(trained)
                              if trained else None),
    }


def _write_run_end(cfg: RunConfig, run_dir: Path, label: str, summary: dict,
                   history: list[dict]) -> None:
    """``table.md``, ``curves.png`` (when the run measured an accuracy at two rounds or more:
    :func:`fedadapt.results.plots.has_curve`) and ``summary.json`` (last: it marks the run
    directory complete)."""
    from fedadapt.files import atomic_write
    from fedadapt.results.plots import has_curve, plot_curves
    from fedadapt.results.store import SUMMARY, write_json
    from fedadapt.results.tables import run_tables

    table = run_tables([summary], title=f"## {cfg.experiment}: {label} on {cfg.dataset.name}")
    atomic_write(run_dir / "table.md", lambda fh: fh.write(table))
    if has_curve(history):
        plot_curves({label: history}, run_dir / "curves.png",
                    title=f"{label} | {cfg.dataset.name} | alpha {cfg.partition.alpha}")
    write_json(run_dir / SUMMARY, summary)  # last: marks the run directory complete


def _strategy_summary(cfg: RunConfig, strategy) -> dict:
    """Which Flower strategy ran, with its keys (``strategy=`` / ``dp=``)."""
    from dataclasses import asdict

    from fedadapt.strategies.build import describe

    return {"class": describe(strategy),
            "strategy": {**asdict(cfg.strategy), **getattr(cfg.strategy, "kwargs", {})},
            "dp": asdict(cfg.dp)}


def _privacy_summary(cfg: RunConfig, strategy, history: list[dict], dpsgd=None
                     ) -> Optional[dict]:
    """``dp=``'s guarantee at the end: epsilon at delta (fixed clipping with accounting; with
    ``dp=dpsgd`` the largest a client spent, at the largest client delta), the noise multiplier
    (DP-SGD: the smallest client's) and the final clipping norm; None without DP."""
    from fedadapt.strategies.privacy import privacy_spent

    if dpsgd is not None:
        spent = [r[DPSGD_WORST] for r in history if r.get(DPSGD_WORST) is not None]
        return {"dp": cfg.dp.name, "noise_multiplier": min(dpsgd.noise),
                "clipping_norm": dpsgd.max_grad_norm, "epsilon": max(spent, default=None),
                "delta": max(dpsgd.delta), "accounting": f"opacus {dpsgd.accountant}"}
    if cfg.dp.name == "none" or not hasattr(strategy, "noise_multiplier"):
        return None  # no DP, or a method that is not federated (local_only): nothing released
    return {"dp": cfg.dp.name, "noise_multiplier": float(strategy.noise_multiplier),
            "clipping_norm": float(strategy.clipping_norm),
            **(privacy_spent(strategy) or {"epsilon": None, "accounting": None})}


#: Per-client evaluation results of a run, one line per (round, client), written at its end.
CLIENTS_FILE = "clients.jsonl"
#: The row's largest client epsilon of ``dp=dpsgd`` (its clients' metrics, aggregated).
DPSGD_WORST = "strategy/train/dpsgd_epsilon_max"


def _personalization(cfg: RunConfig, run_dir: Path, spec: RunSpec, rows: list[dict]
                     ) -> Optional[dict]:
    if not rows:
        return None
    from fedadapt.results.store import write_json
    from fedadapt.settings import summarize_personalization

    rows = [{**r, "corruption": (spec.client_corruptions[r["client"]][0]
                                 if spec.client_corruptions else "none")} for r in rows]
    write_json(run_dir / "personalization.json", rows)
    return {"part": cfg.setting.personalize, "epochs": cfg.setting.epochs,
            **summarize_personalization(rows)}
