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
