"""Markdown tables from run summaries (never typed by hand)."""

from __future__ import annotations


def fmt_pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def fmt_count(n) -> str:
    if n is None:
        return "—"
    for unit, div in (("M", 1e6), ("K", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f}{unit}"
    return str(int(n))


def fmt_bytes(n) -> str:
    if n is None:
        return "—"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


SUMMARY_HEADER = ["method", "global acc (final)", "global acc (best)", "client-mean acc (final)",
                  "trainable", "communicated", "total bytes", "wall s"]


def summary_row(s: dict) -> list[str]:
    f, b = s["final"], s["best"]
    return [s["method"], fmt_pct(f.get("global_acc")), fmt_pct(b.get("global_acc")),
            fmt_pct(f.get("client_acc")), fmt_count(s["params"]["trainable_params"]),
            fmt_count(s["params"]["communicated_params"]), fmt_bytes(s["total_bytes"]),
            f"{s['wall_s']:.1f}"]


def summaries_table(summaries: list[dict], title: str = "") -> str:
    body = markdown(SUMMARY_HEADER, [summary_row(s) for s in summaries])
    return (f"{title}\n\n" if title else "") + body


def exits_table(summaries: list[dict]) -> str:
    """Accuracy (global test set) at every exit and its mean; clients' accuracy per tier."""
    rows = [s for s in summaries if s["final"].get("exit_acc")]
    if not rows:
        return ""
    n = max(len(s["final"]["exit_acc"]) for s in rows)
    header = ["method", "mean over exits", *(f"exit {e}" for e in range(n))]
    body = [[s["method"], fmt_pct(s["final"]["global_acc"])]
            + [fmt_pct(a) for a in s["final"]["exit_acc"]] for s in rows]
    out = "Global test accuracy at each exit (final round):\n\n" + markdown(header, body)
    tiered = [s for s in rows if s["final"].get("tier_acc")]
    if tiered:
        tiers = sorted({int(t) for s in tiered for t in s["final"]["tier_acc"]})
        header = ["method", *(f"tier {t} ({tiered[0]['tiers'].get(str(t), 0)} clients)"
                              if tiered[0].get("tiers") else f"tier {t}" for t in tiers)]
        body = [[s["method"]] + [fmt_pct(s["final"]["tier_acc"].get(str(t))) for t in tiers]
                for s in tiered]
        out += ("\nClients' accuracy on their own test split at their tier's exit (mean over "
                "the tier's clients):\n\n" + markdown(header, body))
    return out


def personalization_table(summaries: list[dict]) -> str:
    rows = [s for s in summaries if s.get("personalization")]
    if not rows:
        return ""
    header = ["method", "personalized part", "clients", "before", "after", "gain"]
    body = []
    for s in rows:
        p = s["personalization"]
        gain = "—" if p["gain"] is None else f"{100 * p['gain']:+.2f}"
        body.append([s["method"], p["part"], str(p["clients"]), fmt_pct(p["before"]),
                     fmt_pct(p["after"]), gain])
    return ("Personalization on each client's corrupted data (mean over clients of the accuracy "
            "on its corrupted test split, at its tier's exit):\n\n" + markdown(header, body))


def run_tables(summaries: list[dict], title: str = "") -> str:
    """The summary table, then the per-exit / per-tier and personalization tables if any."""
    parts = [summaries_table(summaries, title), exits_table(summaries),
             personalization_table(summaries)]
    return "\n".join(p for p in parts if p)
