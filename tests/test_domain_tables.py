"""The FedCLIP leave-one-domain-out layouts (Tables 1-4) on hand-made summaries."""

import statistics

import pytest

from fedadapt.results.domain_tables import domain_rows, domain_tables

PACS = ["art_painting", "cartoon", "photo", "sketch"]
# accuracy on the held-out domain (fedclip: the paper's Table 1 "Ours" row)
GEN = {"fedclip": {"art_painting": 0.9634, "cartoon": 0.9791, "photo": 0.9976, "sketch": 0.8559},
       "fedavg": {"art_painting": 0.5308, "cartoon": 0.8008, "photo": 0.90}}  # no sketch run
# each client's test-split accuracy, whichever domain is held out
PERS = {"fedclip": {"art_painting": 0.95, "cartoon": 0.97, "photo": 0.99, "sketch": 0.87},
        "fedavg": {"art_painting": 0.80, "cartoon": 0.85, "photo": 0.90, "sketch": 0.75}}


def make_summary(method, holdout, seed=0, delta=0.0, backbone="clip", dataset="pacs"):
    clients = [d for d in PACS if d != holdout]
    gen = GEN[method][holdout] + delta
    pers = {c: PERS[method][c] + delta for c in clients}
    return {"method": method, "backbone": backbone, "dataset": dataset, "seed": seed,
            "experiment": "fedclip_pacs",
            "domains": {"holdout": holdout, "clients": clients, "selected_round": 7,
                        "generalization": gen, "personalization": pers,
                        "personalization_mean": statistics.fmean(pers.values()),
                        "overall": statistics.fmean([gen, *pers.values()])}}


def make_summaries():
    """fedclip: four holdouts x two seeds (± 0.2 points); fedavg: one seed, no sketch run."""
    out = [make_summary("fedclip", h, seed, delta)
           for h in PACS for seed, delta in ((0, -0.002), (1, 0.002))]
    out += [make_summary("fedavg", h) for h in PACS if h in GEN["fedavg"]]
    return out


def table(md, heading, target=None):
    """The Markdown table after the line starting with ``heading`` (and, for Table 2, after
    ``Target (held out): target``) as {first cell: {column: cell}}."""
    lines = md.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(heading))
    if target is not None:
        i = lines.index(f"Target (held out): {target}", i)
    while not lines[i].startswith("|"):
        i += 1
    rows = []
    while i < len(lines) and lines[i].startswith("|"):
        rows.append([c.strip() for c in lines[i].strip("|").split("|")])
        i += 1
    header, body = rows[0], rows[2:]  # rows[1] is the |---| separator
    return {r[0]: dict(zip(header[1:], r[1:])) for r in body}


def number(cell):
    return float(cell.split()[0])


def test_generalization_table():
    md = domain_tables(make_summaries())
    t1 = table(md, "### Generalization")
    assert list(t1) == ["fedclip", "fedavg"]  # order of first appearance
    assert "| method | art_painting | cartoon | photo | sketch | AVG |" in md
    # fedclip: mean ± sample std (ddof = 1) over two seeds 0.4 apart (population std 0.20)
    assert t1["fedclip"] == {"art_painting": "96.34 ± 0.28", "cartoon": "97.91 ± 0.28",
                             "photo": "99.76 ± 0.28", "sketch": "85.59 ± 0.28", "AVG": "94.90"}
    # fedavg: one seed (no std), no sketch run: "—", AVG over the three others, marked *
    assert "| fedavg | 53.08 | 80.08 | 90.00 | — | 74.39 * |" in md
    assert "AVG values marked * are computed over the available cells only" in md
    assert "the one `federation.select` chose" in md


def test_personalization_blocks():
    md = domain_tables(make_summaries())
    a = table(md, "### Personalization", target="art_painting")
    assert list(a["fedclip"]) == ["cartoon", "photo", "sketch", "AVG"]  # the clients, sorted
    assert a["fedclip"] == {"cartoon": "97.00 ± 0.28", "photo": "99.00 ± 0.28",
                            "sketch": "87.00 ± 0.28", "AVG": "94.33 ± 0.28"}
    assert a["fedavg"] == {"cartoon": "85.00", "photo": "90.00", "sketch": "75.00",
                           "AVG": "83.33"}
    s = table(md, "### Personalization", target="sketch")
    assert list(s["fedclip"]) == ["art_painting", "cartoon", "photo", "AVG"]
    assert set(s["fedavg"].values()) == {"—"}  # no fedavg run holds out sketch


def test_overall_table_and_avg_row():
    summaries = make_summaries()
    md = domain_tables(summaries)
    t3 = table(md, "### Overall")
    assert list(t3) == [*PACS, "AVG"]
    # fedavg, art_painting held out: mean of 53.08 and the clients' 85, 90, 75
    assert t3["art_painting"]["fedavg"] == "75.77"
    assert t3["sketch"]["fedavg"] == "—"
    for method in ("fedclip", "fedavg"):
        cells = [number(t3[h][method]) for h in PACS if t3[h][method] != "—"]
        assert number(t3["AVG"][method]) == pytest.approx(statistics.fmean(cells), abs=0.006)
        # and against the summaries themselves
        expect = statistics.fmean(
            statistics.fmean(100 * s["domains"]["overall"] for s in summaries
                             if s["method"] == method and s["domains"]["holdout"] == h)
            for h in GEN[method])
        assert number(t3["AVG"][method]) == pytest.approx(expect, abs=0.005)
    assert t3["AVG"]["fedavg"].endswith("*") and not t3["AVG"]["fedclip"].endswith("*")


def test_seed_counts_and_skipped_summaries():
    others = [{"method": "accumulator", "experiment": "cifar100", "seed": 0},
              {"method": "fedavg", "experiment": "cifar100", "seed": 0, "domains": None}]
    md = domain_tables(make_summaries() + others)
    assert ("Seeds per cell differ: fedclip: 2 seeds (art_painting, cartoon, photo, sketch); "
            "fedavg: 1 seed (art_painting, cartoon, photo).") in md
    assert "Skipped 2 summaries without per-domain results" in md
    assert "accumulator (cifar100)" in md
    assert len(domain_rows(make_summaries() + others)) == 11
    # same number of seeds everywhere: said once, no "differ"
    even = domain_tables([make_summary("fedclip", h) for h in PACS])
    assert "Every cell: 1 seed." in even and "differ" not in even
    assert "AVG values marked *" not in even
    assert domain_tables(others).startswith("No summary with per-domain results")


def test_order_and_backbone_labels():
    summaries = make_summaries() + [make_summary("fedavg", "art_painting", backbone="alexnet")]
    t1 = table(domain_tables(summaries, order=["fedavg"]), "### Generalization")
    # fedavg with two backbones: labelled by backbone, both ahead of fedclip
    assert list(t1) == ["fedavg (clip)", "fedavg (alexnet)", "fedclip"]
    t3 = table(domain_tables(summaries, order=["fedclip", "fedavg (alexnet)"]), "### Overall")
    assert list(t3["AVG"]) == ["fedclip", "fedavg (alexnet)", "fedavg (clip)"]


def test_domain_rows_are_flat():
    rows = domain_rows([make_summary("fedavg", "cartoon", seed=3)])
    assert rows == [{"label": "fedavg", "method": "fedavg", "backbone": "clip",
                     "dataset": "pacs", "experiment": "fedclip_pacs", "holdout": "cartoon",
                     "seed": 3, "selected_round": 7, "generalization": 0.8008,
                     "personalization_mean": pytest.approx(0.8166667),
                     "overall": pytest.approx(0.8127),
                     "client:art_painting": 0.80, "client:photo": 0.90, "client:sketch": 0.75}]
    assert all(not isinstance(v, (dict, list)) for v in rows[0].values())
