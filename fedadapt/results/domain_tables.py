"""The FedCLIP paper's leave-one-domain-out layouts (Tables 1-4) from run summaries.

Each domain of PACS / Office-Home / VLCS is one client and one domain is held out as the unseen
client. A run's ``summary.json`` carries a ``"domains"`` dict: the held-out domain, the
participating clients, the selected round (best mean validation accuracy), the accuracy on the
held-out domain (``generalization``), each client's test-split accuracy (``personalization``)
and their joint mean (``overall``). Summaries without it (other experiments) are skipped with a
note.

Runs that differ only in ``seed`` form one cell: the mean over seeds, with `` ± std`` (the
sample std, ddof = 1) when there is more than one and the 95% confidence interval of the mean
from 3 seeds on (:mod:`fedadapt.results.stats`). Accuracies are printed in percent with 2
decimals.
"""

from __future__ import annotations

import statistics

from fedadapt.results.stats import CONVENTION, fmt_values
from fedadapt.results.tables import markdown

CLIENT = "client:"  # prefix of the per-client accuracy keys in domain_rows()
ROUND_NOTE = ("Reported round: per run, the one `federation.select` chose (`best_val`: the best "
              "mean validation accuracy, as FedCLIP's authors report; `last`: the last "
              "evaluation); accuracy in %. " + CONVENTION)
STAR_NOTE = ("AVG values marked * are computed over the available cells only "
             "(— = no run for that combination).")


def _overall(d: dict) -> float | None:
    if d.get("overall") is not None:
        return d["overall"]
    vals = [d.get("generalization"), *(d.get("personalization") or {}).values()]
    return statistics.fmean(vals) if vals and None not in vals else None


def domain_rows(summaries: list[dict]) -> list[dict]:
    """One flat row per summary that has ``"domains"`` (accuracies as fractions, 0..1):
    label, method, backbone, dataset, experiment, holdout, seed, selected_round,
    generalization, personalization_mean, overall, and ``"client:<domain>"`` per client.

    The label is the method name, or ``"method (backbone)"`` when that method name appears with
    more than one backbone among the summaries."""
    usable = [s for s in summaries if s.get("domains")]
    backbones: dict[str, set] = {}
    for s in usable:
        backbones.setdefault(str(s.get("method")), set()).add(s.get("backbone"))
    rows = []
    for s in usable:
        d = s["domains"]
        method = str(s.get("method"))
        label = f"{method} ({s.get('backbone')})" if len(backbones[method]) > 1 else method
        personal = d.get("personalization") or {}
        clients = list(d.get("clients") or personal)
        row = {"label": label, "method": method, "backbone": s.get("backbone"),
               "dataset": s.get("dataset"), "experiment": s.get("experiment"),
               "holdout": d["holdout"], "seed": s.get("seed"),
               "selected_round": d.get("selected_round"),
               "generalization": d.get("generalization"),
               "personalization_mean": d.get("personalization_mean"),
               "overall": _overall(d)}
        row.update({f"{CLIENT}{c}": personal.get(c) for c in clients})
        rows.append(row)
    return rows


def _clients(row: dict) -> list[str]:
    return [k[len(CLIENT):] for k in row if k.startswith(CLIENT)]


def _values(rows: list[dict], key: str) -> list[float]:
    """The non-missing values of ``key`` in ``rows``, in percent."""
    return [100 * r[key] for r in rows if r.get(key) is not None]


def _cell(vals: list[float]) -> str:
    if not vals:
        return "—"
    return fmt_values(vals)


def _avg(cell_means: list[float | None]) -> tuple[str, bool]:
    """Mean of the available cell means; marked with * (and True returned) if some are
    missing."""
    present = [m for m in cell_means if m is not None]
    if not present:
        return "—", False
    partial = len(present) < len(cell_means)
    return f"{statistics.fmean(present):.2f}" + (" *" if partial else ""), partial


def _mean(vals: list[float]) -> float | None:
    return statistics.fmean(vals) if vals else None


def _labels(rows: list[dict], order: list[str] | None) -> list[str]:
    """Row labels in order of first appearance; those named in ``order`` (by label or method
    name) first, in that order."""
    order = order or []
    first: dict[str, str] = {}
    for r in rows:
        first.setdefault(r["label"], r["method"])

    def rank(item):
        label, method = item[1]
        for name in (label, method):
            if name in order:
                return (order.index(name), item[0])
        return (len(order), item[0])
    return [label for _, (label, _) in sorted(enumerate(first.items()), key=rank)]


def _notes(*lines: str) -> str:
    return "\n" + "\n\n".join(line for line in lines if line) + "\n"


def _generalization(groups: dict, labels: list[str], holdouts: list[str]) -> str:
    body, partial = [], False
    for label in labels:
        cells = [_values(groups.get((label, h), []), "generalization") for h in holdouts]
        avg, missing = _avg([_mean(v) for v in cells])
        partial |= missing
        body.append([label, *(_cell(v) for v in cells), avg])
    return ("### Generalization (Table 1): accuracy on the held-out domain\n\n"
            + markdown(["method", *holdouts, "AVG"], body)
            + _notes("AVG: mean over the held-out domains of the cells' means.", ROUND_NOTE,
                     STAR_NOTE if partial else ""))


def _personalization(groups: dict, labels: list[str], holdouts: list[str]) -> str:
    out, partial = ["### Personalization (Table 2): accuracy on each participating client's "
                    "test split\n"], False
    for h in holdouts:
        runs = [r for label in labels for r in groups.get((label, h), [])]
        clients = sorted({c for r in runs for c in _clients(r)})
        body = []
        for label in labels:
            rs = groups.get((label, h), [])
            cells = [_values(rs, CLIENT + c) for c in clients]
            # AVG: each run's mean over its clients, then mean ± std over seeds
            per_run = [m for m in (_mean([v for c in clients for v in _values([r], CLIENT + c)])
                                   for r in rs) if m is not None]
            missing = any(r.get(CLIENT + c) is None for r in rs for c in clients)
            avg = _cell(per_run) + (" *" if missing and per_run else "")
            partial |= missing and bool(per_run)
            body.append([label, *(_cell(v) for v in cells), avg])
        out.append(f"Target (held out): {h}\n\n"
                   + markdown(["method", *clients, "AVG"], body))
    return "\n".join(out) + _notes("AVG: each run's mean over its clients, then over seeds.",
                                   ROUND_NOTE, STAR_NOTE if partial else "")


def _overall_table(groups: dict, labels: list[str], holdouts: list[str]) -> str:
    body = [[h, *(_cell(_values(groups.get((label, h), []), "overall")) for label in labels)]
            for h in holdouts]
    avgs = [_avg([_mean(_values(groups.get((label, h), []), "overall")) for h in holdouts])
            for label in labels]
    body.append(["AVG", *(a for a, _ in avgs)])
    partial = any(p for _, p in avgs)
    return ("### Overall (Tables 3/4): mean of the held-out and the participating clients' "
            "accuracies\n\n" + markdown(["held out", *labels], body)
            + _notes("AVG row: mean over the held-out domains of the cells' means.",
                     ROUND_NOTE, STAR_NOTE if partial else ""))


def _seed_note(groups: dict, labels: list[str], holdouts: list[str]) -> str:
    counts = {(label, h): len(groups[(label, h)]) for label in labels for h in holdouts
              if (label, h) in groups}
    notes = []
    if len(set(counts.values())) > 1:
        parts = []
        for label in labels:
            by_n: dict[int, list[str]] = {}
            for h in holdouts:
                if (label, h) in counts:
                    by_n.setdefault(counts[(label, h)], []).append(h)
            parts.append(f"{label}: " + ", ".join(
                f"{n} seed{'s' if n > 1 else ''} ({', '.join(hs)})" for n, hs in by_n.items()))
        notes.append("Seeds per cell differ: " + "; ".join(parts) + ".")
    elif counts:
        n = next(iter(counts.values()))
        notes.append(f"Every cell: {n} seed{'s' if n > 1 else ''}.")
    for key, rs in groups.items():
        seeds = [r["seed"] for r in rs]
        if len(set(seeds)) < len(seeds):
            notes.append(f"Warning: {key[0]} / {key[1]} has several runs with the same seed "
                         f"({sorted(seeds, key=repr)}); all are averaged.")
    return _notes(*notes)


def domain_tables(summaries: list[dict], *, order: list[str] | None = None) -> str:
    """Markdown: the generalization (Table 1), personalization (Table 2) and overall (Tables
    3/4) tables of each dataset, from run summaries with a ``"domains"`` entry. ``order``: the
    methods' row (column) order (labels or method names); the rest follow in order of first
    appearance."""
    rows = domain_rows(summaries)
    skipped = [s for s in summaries if not s.get("domains")]
    skip_note = ""
    if skipped:
        names = ", ".join(f"{s.get('method')} ({s.get('experiment')})" for s in skipped)
        skip_note = (f"Skipped {len(skipped)} summar{'ies' if len(skipped) > 1 else 'y'} "
                     f"without per-domain results (\"domains\"): {names}.\n")
    if not rows:
        return "No summary with per-domain results (\"domains\").\n" + skip_note
    sections = []
    for dataset in dict.fromkeys(r["dataset"] for r in rows):
        ds_rows = [r for r in rows if r["dataset"] == dataset]
        labels = _labels(ds_rows, order)
        holdouts = sorted({r["holdout"] for r in ds_rows})
        groups: dict[tuple[str, str], list[dict]] = {}
        for r in ds_rows:
            groups.setdefault((r["label"], r["holdout"]), []).append(r)
        sections.append("\n".join([
            f"## {dataset}: leave-one-domain-out\n",
            _generalization(groups, labels, holdouts),
            _personalization(groups, labels, holdouts),
            _overall_table(groups, labels, holdouts),
        ]) + _seed_note(groups, labels, holdouts))
    return "\n".join(sections) + ("\n" + skip_note if skip_note else "")
