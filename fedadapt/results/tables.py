"""Markdown tables from run summaries (never typed by hand)."""

from __future__ import annotations


def fmt_pct(x) -> str:
    return "—" if x is None else f"{100 * x:.2f}"


def fmt_gain(points: float) -> str:
    """A change in points, signed, two decimals; one that rounds to zero is "+0.00", not
    "-0.00"."""
    return f"{0.0 if round(points, 2) == 0 else points:+.2f}"


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
        gain = "—" if p["gain"] is None else fmt_gain(100 * p["gain"])
        body.append([s["method"], p["part"], str(p["clients"]), fmt_pct(p["before"]),
                     fmt_pct(p["after"]), gain])
    return ("Personalization on each client's own data (mean over clients of the accuracy on its "
            "test split, corrupted if it has a corruption, at its tier's exit if it has one):"
            "\n\n" + markdown(header, body))


def domains_table(summaries: list[dict]) -> str:
    """Leave-one-domain-out runs: the held-out domain, each client's test split and overall, at
    the reported round (FedCLIP's Tables 1-3 for one held-out domain)."""
    rows = [s for s in summaries if s.get("domains")]
    if not rows:
        return ""
    clients = rows[0]["domains"]["clients"]
    header = ["method", "round", f"held out: {rows[0]['domains']['holdout']}",
              *clients, "clients' mean", "overall"]
    body = [[s["method"], str(d["selected_round"]), fmt_pct(d["generalization"]),
             *(fmt_pct(d["personalization"].get(c)) for c in clients),
             fmt_pct(d["personalization_mean"]), fmt_pct(d["overall"])]
            for s in rows for d in [s["domains"]]]
    how = ("the best mean validation accuracy" if rows[0].get("selection") == "best_val"
           else "the last evaluation")
    return (f"Domains as clients, at the round of {how}: accuracy on the held-out domain "
            f"(generalization), on each client's test split (personalization) and their mean "
            f"(overall):\n\n" + markdown(header, body))


RECOGNITION = (("acc_original", "original"), ("acc_finetune", "fine-tuning (last layer)"),
               ("acc_prompt", "prompt tuning"), ("acc_batch", "module, batch mode"),
               ("acc_stream", "module, one by one"))


def recognition_table(summaries: list[dict]) -> str:
    """Server-trained plug-ins (ICIIA's Table 4): test accuracy over all clients' images of the
    original classifier, the baselines and the module in batch and one-by-one mode."""
    rows = [s for s in summaries if s.get("recognition")]
    if not rows:
        return ""
    header = ["method", "module params", *(name for _, name in RECOGNITION), "server epochs"]
    body = []
    for s in rows:
        r = s["recognition"]
        body.append([s["method"], fmt_count(s["params"].get("module_params")),
                     *(fmt_pct(r[k]["images"]) if k in r else "—" for k, _ in RECOGNITION),
                     str(s["server_training"]["iciia"]["best_epoch"])])
    out = ("Recognition on the clients' test splits (accuracy over all their images; nothing "
           "trained on the clients except the fine-tuning baseline):\n\n"
           + markdown(header, body))
    hs = sorted({int(k[5:]) for s in rows for k in s["recognition"] if k.startswith("acc_h")})
    if hs:
        header = ["method", *(f"{h} cached" for h in hs)]
        body = [[s["method"], *(fmt_pct(s["recognition"][f"acc_h{h}"]["images"])
                                if f"acc_h{h}" in s["recognition"] else "—" for h in hs)]
                for s in rows]
        out += ("\nOne by one with exactly h cached features (Figure 6; the original "
                "classifier: " + fmt_pct(rows[0]["recognition"]["acc_original"]["images"])
                + "):\n\n" + markdown(header, body))
    return out


SESSION_ROWS = (("acc_original", "original model"),
                ("acc_finetune", "fine-tuning (the context's labels)"),
                ("acc_generated", "generated layers"))

#: What each ``method.context`` scores, for the table's caption.
SCORED = {"first": "each session's samples after its first {size} (the generator's context)",
          "previous": "whole sessions, each generated from the client's previous session (a "
                      "client's first session: the original model)",
          "session": "whole sessions, each generated from itself (transductive; fine-tuning "
                     "on the previous session's labels)"}


def sessions_table(summaries: list[dict]) -> str:
    """Session plug-ins (DUET Tables 2-4, CDC-MMPG Tables 1-6): accuracy over every test
    session, the measured payload per session and the delay at each link speed."""
    rows = [s for s in summaries if s.get("sessions")]
    if not rows:
        return ""
    header = ["method", *(name for _, name in SESSION_ROWS), "generator params",
              "up / session", "down / session", "generation ms"]
    body = []
    for s in rows:
        r = s["sessions"]
        p = r.get("payload", {})
        body.append([s["method"], *(fmt_pct(r[k]["images"]) if k in r else "—"
                                    for k, _ in SESSION_ROWS),
                     fmt_count(s["params"].get("generator_params")),
                     fmt_bytes(p.get("up_bytes_median")), fmt_bytes(p.get("down_bytes_median")),
                     f"{p['generate_ms_median']:.2f}" if p else "—"])
    scored = sorted({SCORED[c].format(size=s["sessions"].get("context_size"))
                     for s in rows if (c := s["sessions"].get("context")) in SCORED})
    out = ("Every client's test split in sessions (accuracy over the samples the generator did "
           "not see, the same for every row" + (f": {'; '.join(scored)}" if scored else "")
           + "; nothing trained on the devices except the fine-tuning baseline):\n\n"
           + markdown(header, body))
    swa = [(s["method"], s["sessions"]["swa"]) for s in rows if s["sessions"].get("swa")]
    if swa:
        out += ("\nSWA's weights p per dynamic layer (Eq. 8; they depend only on the generators, "
                "so every session uses the same):\n\n" + markdown(
                    ["method", "tau", "p"],
                    [[name, f"{w['temperature']:g}", " / ".join(
                        "[" + ", ".join(f"{v:.4f}" for v in layer) + "]" for layer in w["p"])]
                     for name, w in swa]))
    if any("auc" in s["sessions"] for s in rows):
        body = [[s["method"], *("—" if (v := s["sessions"]["auc"].get(k)) is None
                                else f"{v:.4f}" for k in ("original", "finetune", "generated"))]
                for s in rows if "auc" in s["sessions"]]
        out += "\nAUC (binary task; the mean of the clients' own AUCs):\n\n" + markdown(
            ["method", "original model", "fine-tuning", "generated layers"], body)
    if any("auc_pooled" in s["sessions"] for s in rows):
        body = [[s["method"], *("—" if (v := s["sessions"]["auc_pooled"].get(k)) is None else
                                f"{v:.4f} ± {s['sessions']['auc_tie_bound'][k]:.4f}"
                                for k in ("original", "finetune", "generated"))]
                for s in rows if "auc_pooled" in s["sessions"]]
        out += ("\nAUC over all clients' samples, from their score histograms (± the bound on "
                "the binning's error):\n\n" + markdown(
                    ["method", "original model", "fine-tuning", "generated layers"], body))
    delays = [(s["method"], s["sessions"]["delay"]) for s in rows if s["sessions"].get("delay")]
    return out + ("\n" + delay_markdown(delays) if delays else "")


#: Link speeds of DUET's Table 3 and CDC-MMPG's Table 6, in MB/s (1 MB = 10^6 bytes).
RATES_MB_S = (5, 15, 50, 100)


def delay_table(payload: dict) -> list[dict]:
    """Per link speed: upload and download time of the median session's measured payload (the
    serialized ArrayRecord, as Flower counts it), and the total with the server's median
    generation time (ms)."""
    rows = []
    for rate in RATES_MB_S:
        up_ms = 1000 * payload["up_bytes_median"] / (rate * 1e6)
        down_ms = 1000 * (payload["down_bytes_median"] or 0) / (rate * 1e6)
        rows.append({"rate_MB_s": rate, "up_ms": up_ms, "down_ms": down_ms,
                     "total_ms": up_ms + payload["generate_ms_median"] + down_ms})
    return rows


def delay_markdown(rows: list[tuple[str, list[dict]]]) -> str:
    """The delay table (DUET Table 3, CDC-MMPG Table 6): per method, per link speed, upload /
    download / total ms (:func:`delay_table` rows)."""
    rates = [d["rate_MB_s"] for d in rows[0][1]]
    body = [[label, *(f"↑ {d['up_ms']:.3f} / ↓ {d['down_ms']:.3f} / total {d['total_ms']:.2f}"
                      for d in delay)] for label, delay in rows]
    return ("Delay per session in ms (the median session's measured payload at each link speed, "
            "1 MB = 10^6 bytes; total adds the server's median generation time):\n\n"
            + markdown(["method", *(f"{r} MB/s" for r in rates)], body))


#: A run is *at chance* when its final accuracy is at most this factor times 1 / classes.
CHANCE_MARGIN = 1.1


def num_classes(summary: dict):
    """The number of classes of a run's data set, from its summary: ``num_classes`` when it
    holds one, else the catalogue card of its ``dataset``, else the most classes a client
    holds (``partition_stats``); None when none says."""
    if summary.get("num_classes"):
        return int(summary["num_classes"])
    try:
        from fedadapt.data.catalogue import load_card

        return int(load_card(str(summary.get("dataset"))).num_classes)
    except Exception:  # noqa: BLE001 - a data set from dataset.path has no card
        most = ((summary.get("partition_stats") or {}).get("classes_per_client") or {}).get("max")
        return int(most) if most else None


def final_acc(summary: dict):
    """The final global accuracy, or the clients' mean where no global model is evaluated."""
    final = summary.get("final") or {}
    return final.get("global_acc") if final.get("global_acc") is not None \
        else final.get("client_acc")


def at_chance(summary: dict) -> bool:
    """Whether the run's final accuracy is within chance (1 / classes, :data:`CHANCE_MARGIN`)."""
    acc, classes = final_acc(summary), num_classes(summary)
    return acc is not None and bool(classes) and acc <= CHANCE_MARGIN / classes


def chance_note(summary: dict) -> str:
    """``"; accuracy at chance (10.00% final, 10 classes)"`` for a run at chance, else ``""``."""
    if not at_chance(summary):
        return ""
    return (f"; accuracy at chance ({fmt_pct(final_acc(summary))}% final, "
            f"{num_classes(summary)} classes)")


def privacy_table(summaries: list[dict]) -> str:
    """``dp=`` runs: the wrapper, its noise multiplier and final clipping norm, and the privacy
    spent (epsilon at delta, Flower's RDP accountant) where it is accounted; a run whose
    accuracy stayed at chance says so beside its epsilon."""
    rows = [s for s in summaries if s.get("privacy")]
    if not rows:
        return ""
    body = [[s["method"], p["dp"], f"{p['noise_multiplier']:g}", f"{p['clipping_norm']:.4g}",
             ("—" if p.get("epsilon") is None else f"{p['epsilon']:.3f}") + chance_note(s),
             "—" if p.get("delta") is None else f"{p['delta']:g}",
             str(p.get("releases", "—")), p.get("accounting") or "none"]
            for s in rows for p in [s["privacy"]]]
    sample = all(str(s["privacy"].get("accounting", "")).startswith("opacus") for s in rows)
    return (("Differential privacy (sample-level DP-SGD; the largest client epsilon, from "
             "Opacus's accountant):" if sample else
             "Differential privacy (client-level; epsilon from Flower's accountant, no sampling "
             "amplification):") + "\n\n" + markdown(["method", "dp", "noise multiplier",
                                              "clipping norm (final)", "epsilon", "delta",
                                              "releases", "accounting"], body))


def run_tables(summaries: list[dict], title: str = "") -> str:
    """The summary table, then the per-exit / per-tier, domain, personalization and privacy
    tables if any."""
    parts = [summaries_table(summaries, title), exits_table(summaries), domains_table(summaries),
             recognition_table(summaries), sessions_table(summaries),
             personalization_table(summaries), privacy_table(summaries)]
    return "\n".join(p for p in parts if p)
