"""DUET and CDC-MMPG served over Flower: the generator is trained once on the server, each client
uploads its sessions, the server answers every session with generated layers, the client
predicts; the payloads are measured."""

import json

import numpy as np
import pytest
import torch
from conftest import tiny_run
from flwr.app import ArrayRecord

from fedadapt.config import PartitionConfig, validate
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.methods.sessions.cdc_mmpg import CdcMmpgConfig
from fedadapt.methods.sessions.duet import DuetConfig, apply_dynamic, dynamic_layers, layer_shapes
from fedadapt.methods.sessions.train import (
    SessionServer,
    _finetune,
    client_sessions,
    device_sessions,
    finetuning_labels,
    session_upload,
    train_generator,
)

SMALL = dict(max_epochs=2, patience=2, classifier_epochs=2, finetune_steps=2, lr=1e-3)


def session_run(cache_dir, method):
    return validate(tiny_run(cache_dir, method, partition=PartitionConfig(
        kind="dirichlet", num_clients=4, alpha=0.3, min_partition_size=20, val_fraction=0.2,
        test_fraction=0.2)))


def _answered(prep, trained):
    """Every client's uploads and the server's answers, computed outside Flower."""
    server = SessionServer(prep.spec, trained)
    out = {}
    for cid in range(prep.spec.num_clients):
        uploads, _ = session_upload(prep.spec, cid)
        sizes = {k: ArrayRecord(v).count_bytes() for k, v in uploads.items()}
        out[cid] = (uploads, server.answer(cid, uploads, sizes))
    return out


def _expected_rows(spec, cid, answers):
    """A client's accuracies recomputed from what it holds: every row on the samples the
    generator did not see (``device_sessions``' scored part), the generated row with the
    session's answer (the original model where there is none), fine-tuning on the labels of
    the context (``context=session``: of the previous session)."""
    original = torch.nn.Linear(spec.embed_dim, spec.num_classes)
    original.load_state_dict(answers["original"])
    sessions = device_sessions(spec, cid)
    hits = {"generated": 0, "original": 0, "finetune": 0}
    n = 0
    with torch.no_grad():
        for i, (_, scored) in enumerate(sessions):
            if not len(scored):
                continue
            x, y = spec.train_source.get(scored)
            layers = answers.get(f"session.{i}")
            generated = original(x) if layers is None else apply_dynamic(
                dynamic_layers(layers), x)
            labeled = finetuning_labels(spec.method, sessions, i)
            tuned = _finetune(original, *spec.train_source.get(labeled), spec.method) \
                if len(labeled) else original
            for key, logits in (("generated", generated), ("original", original(x)),
                                ("finetune", tuned(x))):
                hits[key] += int((logits.argmax(-1) == y).sum())
            n += len(y)
    return n, {k: v / n for k, v in hits.items()}


@pytest.mark.parametrize("method", [
    DuetConfig(session=4, generators=3, dynamic_hidden=[8], context_size=2, temperature=0.05,
               **SMALL),
    DuetConfig(session=4, generators=2, context="previous", **SMALL),
    DuetConfig(session=4, generators=2, context="session", **SMALL),
    CdcMmpgConfig(adr_epochs=2, adr_lr=1e-3, context_size=2, **SMALL),
], ids=["duet_first", "duet_previous", "duet_session", "cdc_mmpg_first"])
@pytest.mark.slow
def test_served_end_to_end_with_measured_payloads(cache_dir, tmp_path, method):
    """Through Flower: each session's upload holds only its context (the anchor chosen among
    it for CDC-MMPG), the recorded bytes are those uploads' and answers' ArrayRecord sizes, and
    every row of the run (generated, original, fine-tuning) is scored on the same samples: the
    ones the generator did not see."""
    cfg = session_run(cache_dir, method)
    prep = prepare_run(cfg, quiet=True)
    summary = run_experiment(cfg, tmp_path / "run", config_yaml="x\n", prepared=prep,
                             execute=run_in_process)
    s = summary["sessions"]
    for key in ("acc_original", "acc_finetune", "acc_generated"):
        assert 0.0 <= s[key]["images"] <= 1.0 and s[key]["clients"] == 4
    spec = prep.spec
    plan = {c: device_sessions(spec, c) for c in range(4)}
    answered_sessions = [(c, i) for c in range(4) for i, (ctx, scored) in enumerate(plan[c])
                         if len(ctx) and len(scored)]
    records = [json.loads(line) for line in
               (tmp_path / "run" / "session_payloads.jsonl").read_text().splitlines()]
    assert sorted((r["client"], r["session"]) for r in records) == answered_sessions
    assert len(records) == s["payload"]["sessions"]
    assert s["context"] == method.context

    # per session, the device receives the dynamic layers only: their tensors' bytes (the
    # original classifier for the baseline rows travels once per client, checked below)
    shapes = (layer_shapes(spec.embed_dim, list(method.dynamic_hidden), spec.num_classes)
              if method.name == "duet" else [(spec.num_classes, spec.embed_dim)])
    dynamic = sum(o * i + o for o, i in shapes)
    assert {r["down_tensor_bytes"] for r in records} == {4 * dynamic}
    assert summary["params"]["communicated_params"] == dynamic

    # what was measured in the run equals the ArrayRecords' sizes, recomputed here with the
    # same seeds: each session's upload (its context only) and answer; the messages' totals
    # add up to them plus, down, one original classifier per client
    trained = train_generator(spec)  # seeded: the same generator the run trained
    answered = _answered(prep, trained)
    by_session = {(r["client"], r["session"]): r for r in records}
    rows = {r["client"]: r for r in json.loads((tmp_path / "run" / "sessions.json").read_text())}
    for cid, (uploads, answers) in answered.items():
        for name, upload in uploads.items():
            i = int(name.split(".")[1])
            context, scored = plan[cid][i]
            r = by_session[(cid, i)]
            assert r["up_bytes"] == ArrayRecord(upload).count_bytes()
            assert r["down_bytes"] == ArrayRecord(answers[name]).count_bytes()
            feats = spec.train_source.get(context)[0]
            if method.name == "duet":
                assert set(upload) == {"embeddings"} and torch.equal(upload["embeddings"], feats)
            else:
                assert set(upload) == {"anchor"} and upload["anchor"].shape[0] == 1
                assert any(torch.equal(upload["anchor"][0], f) for f in feats)
            if method.context != "session":
                assert not set(context.tolist()) & set(scored.tolist())
            assert set(answers[name]) == {f"layer{n}.{p}" for n in range(len(shapes))
                                          for p in ("weight", "bias")}
        n, expected = _expected_rows(spec, cid, answers)
        assert rows[cid]["num-examples"] == n == sum(len(sc) for _, sc in plan[cid])
        for key, acc in expected.items():
            assert rows[cid][f"acc_{key}"] == pytest.approx(acc, abs=1e-6), (cid, key)
    original = ArrayRecord(answered[0][1]["original"]).count_bytes()
    assert summary["bytes_up"] == sum(r["up_bytes"] for r in records)
    assert summary["bytes_down"] == sum(r["down_bytes"] for r in records) + 4 * original
    table = (tmp_path / "run" / "table.md").read_text()
    assert "generated layers" in table and "100 MB/s" in table
    _check_context(method, plan, answered, s)
    if method.name == "duet":  # SWA's p, logged once: it does not depend on the session
        assert s["swa"]["depends_on_session"] is False
        p = trained["generator"].swa_weights()
        assert len(s["swa"]["p"]) == len(p) == len(shapes)
        for logged, layer in zip(s["swa"]["p"], p):
            assert len(logged) == method.generators and logged == pytest.approx(layer)


def _check_context(method, plan, answered, summary):
    """The context of each setting: ``first`` uploads the session's first k samples and scores
    the rest; ``previous`` uploads the previous session whole, none for the first session,
    which the original model scores in the generated row too; ``session`` uploads and scores
    the session."""
    fallback = 0
    for cid, (uploads, _) in answered.items():
        sessions = plan[cid]
        if method.context == "first":
            assert all(len(c) == min(method.context_size, len(c) + len(s)) for c, s in sessions)
            assert all(len(c) + len(s) <= method.session for c, s in sessions)
        elif method.context == "previous":
            assert "session.0" not in uploads and len(sessions[0][0]) == 0
            for i in range(1, len(sessions)):
                assert np.array_equal(sessions[i][0], sessions[i - 1][1])
            fallback += len(sessions[0][1])
        else:
            assert all(c is s for c, s in sessions)
    assert summary["original_fallback_images"] == fallback
    assert summary["scored_images"] == sum(len(s) for c in plan for _, s in plan[c])


@pytest.mark.parametrize("context", ["first", "previous"])
def test_server_training_scores_only_what_the_generator_did_not_see(cache_dir, context):
    """Server training and validation use the same split: each training pair is one client's
    context and other samples of that client (``first``: the session's first k; ``previous``:
    the client's previous session, whole); the batches' scored labels are exactly those."""
    from fedadapt.methods.plugin.train import ServerData
    from fedadapt.methods.sessions.train import SessionBatches

    method = DuetConfig(session=4, generators=2, context=context, context_size=1, **SMALL)
    spec = prepare_run(session_run(cache_dir, method), quiet=True).spec
    data = ServerData.of(spec)
    batches = SessionBatches(spec, data, data.feats, np.random.default_rng(0))
    owner = {int(i): c for c, split in enumerate(data.clients)
             for i in np.concatenate([split.train, split.val])}
    for part in ("train", "val"):
        pairs = batches.pairs(part)
        per_client = {c: len(getattr(split, part)) for c, split in enumerate(data.clients)}
        for ctx, scored in pairs:
            assert not set(ctx.tolist()) & set(scored.tolist())
            assert len({owner[int(i)] for i in np.concatenate([ctx, scored])}) == 1
            if context == "first":
                assert len(ctx) == 1 and 1 <= len(scored) <= 3
            else:
                assert len(ctx) == 4 and 1 <= len(scored) <= 4
        # first: 3 of every full session, r - 1 of a last one of r; previous: all but the
        # client's first session
        expected = sum(3 * (n // 4) + max(n % 4 - 1, 0) if context == "first"
                       else max(n - 4, 0) for n in per_client.values())
        assert sum(len(s) for _, s in pairs) == expected
    b = batches.val[0]
    assert b.frames.shape[1] == (3 if context == "first" else 4)
    assert b.context.shape[1] == (1 if context == "first" else 4)
    assert int((~b.mask).sum()) == sum(len(s) for _, s in batches.pairs("val")[:256])


def test_generator_training_is_seeded(cache_dir):
    prep = prepare_run(session_run(cache_dir, DuetConfig(session=4, generators=2, **SMALL)),
                       quiet=True)
    a, b = train_generator(prep.spec), train_generator(prep.spec)
    for k, v in a["generator"].state_dict().items():
        torch.testing.assert_close(v, b["generator"].state_dict()[k])


def test_raw_samples_upload_is_embedded_on_the_server(cache_dir):
    """``method.upload=samples``: the device sends its preprocessed images; the server runs the
    frozen backbone, so the answers match the embeddings upload's."""
    emb = prepare_run(session_run(cache_dir, DuetConfig(session=4, generators=2, **SMALL)),
                      quiet=True)
    raw = prepare_run(session_run(cache_dir, DuetConfig(session=4, generators=2, upload="samples",
                                                        **SMALL)), quiet=True)
    trained = train_generator(emb.spec)
    a, b = _answered(emb, trained)[1], _answered(raw, trained)[1]
    assert set(b[0]["session.0"]) == {"samples"} and b[0]["session.0"]["samples"].dim() == 4
    raw_bytes, emb_bytes = (ArrayRecord(x[0]["session.0"]).count_bytes() for x in (b, a))
    assert raw_bytes > emb_bytes
    for name, layers in a[1].items():
        for k, v in layers.items():
            torch.testing.assert_close(b[1][name][k], v, atol=1e-4, rtol=1e-4)


def test_test_sessions_keep_arrival_order_and_cover_the_split(cache_dir):
    prep = prepare_run(session_run(cache_dir, CdcMmpgConfig(session=3, context_size=1,
                                                            **SMALL)), quiet=True)
    for cid in range(4):
        sessions = client_sessions(prep.spec, cid)
        assert all(len(s) == 3 for s in sessions[:-1]) and 1 <= len(sessions[-1]) <= 3
        assert sorted(np.concatenate(sessions).tolist()) == sorted(
            prep.spec.clients[cid].test.tolist())


@pytest.mark.parametrize("experiment", ["duet_offline", "cdc_mmpg_offline", "sessions_cifar100",
                                        "sessions_femnist", "sessions_inaturalist",
                                        "sessions_pacs"])
def test_session_experiments_compose_with_their_rows(experiment):
    from hydra import initialize_config_module

    from fedadapt.entry import compose_config, job_configs
    from fedadapt.paths import CONF_MODULE

    overrides = [f"experiment={experiment}"]
    cfg = compose_config(overrides)
    with initialize_config_module(config_module=CONF_MODULE, version_base=None):
        jobs = {name: run.method for name, run, _ in job_configs(cfg, overrides)}
    if "duet" in jobs:
        assert jobs["duet"].generators == 5 and jobs["duet_no_swa"].generators == 1
    if "cdc_mmpg" in jobs:
        assert jobs["cdc_mmpg"].adr and not jobs["f_hyper"].adr
        assert jobs["cdc_mmpg"].session == 6 and jobs["cdc_mmpg"].context_size == 3
        assert jobs["f_hyper"].context == jobs["cdc_mmpg"].context == "first"


def test_binary_task_reports_auc_without_labels_leaving_the_clients():
    """With two classes each client reports its own AUC (``auc``: their mean) and, with
    ``method.auc_bins``, per-class histograms of its scores; the server pools those into the AUC
    over all clients' samples, which equals the exact pooled AUC when no positive and negative
    share a bin, and is within the reported tie bound otherwise."""
    from fedadapt.methods.sessions.train import (
        binary_auc,
        margin,
        score_histograms,
        summarize_sessions,
    )

    gen = torch.Generator().manual_seed(0)
    clients = []
    for n in (40, 25, 60):
        y = (torch.rand(n, generator=gen) < 0.4).long()
        logits = torch.randn(n, 2, generator=gen) + 1.5 * torch.nn.functional.one_hot(y, 2)
        clients.append((y, logits))
    for bins, exact in ((4096, True), (8, False)):
        rows, scores = [], []
        for cid, (y, logits) in enumerate(clients):
            s_ = margin(logits)
            rows.append({"client": cid, "num-examples": len(y), "acc_generated": 0.5,
                         "auc_generated": binary_auc(s_, y)})
            hist = score_histograms("generated", s_, y, bins)
            assert set(hist) == {"generated.negative", "generated.positive"}
            assert all(h.shape == (bins,) for h in hist.values())  # counts, not samples
            scores.append(hist)
        out = summarize_sessions(rows, [], scores)
        y_all = torch.cat([y for y, _ in clients])
        s_all = torch.cat([margin(lg) for _, lg in clients])
        pooled = binary_auc(s_all, y_all)
        assert out["auc"]["generated"] == pytest.approx(np.mean([r["auc_generated"]
                                                                 for r in rows]))
        bound = out["auc_tie_bound"]["generated"]
        assert abs(out["auc_pooled"]["generated"] - pooled) <= bound + 1e-12
        if exact:  # fine bins: nearly no positive-negative pair shares a bin
            assert bound < 1e-3
        else:
            assert bound > 0.01


def test_unseen_test_clients_are_served_but_never_trained_on(cache_dir):
    cfg = validate(tiny_run(cache_dir, DuetConfig(session=4, generators=2, **SMALL),
                            partition=PartitionConfig(kind="dirichlet", num_clients=4, alpha=0.3,
                                                      min_partition_size=20, val_fraction=0.2,
                                                      test_fraction=0.2, test_clients=0.25)))
    prep = prepare_run(cfg, quiet=True)
    unseen = [c for c, split in enumerate(prep.spec.clients) if len(split.train) == 0]
    assert len(unseen) == 1
    answered = _answered(prep, train_generator(prep.spec))
    uploads, answers = answered[unseen[0]]
    assert len(uploads) == sum(1 for c, s in device_sessions(prep.spec, unseen[0])
                               if len(c) and len(s)) > 0
    assert set(answers) == {"original", *uploads}


def test_text_query_is_fused_into_every_frame(cache_dir):
    """``method.query``: CLIP's text tower encodes it once; the device uploads fused frames and
    receives a layer over [frame; query], which depends on the query."""
    from conftest import TINY_CLIP

    from fedadapt.config import ConfigError

    def answered(query):
        cfg = session_run(cache_dir, CdcMmpgConfig(query=query, adr_epochs=1, **SMALL))
        cfg.backbone = TINY_CLIP
        prep = prepare_run(cfg, quiet=True)
        return prep.spec, _answered(prep, train_generator(prep.spec))[0]

    spec, (uploads, answers) = answered("what is in the picture?")
    d = spec.embed_dim
    assert spec.family.query_feature.shape == (d,)
    assert uploads["session.0"]["anchor"].shape == (1, 2 * d)
    torch.testing.assert_close(uploads["session.0"]["anchor"][0, d:], spec.family.query_feature)
    assert answers["session.0"]["layer0.weight"].shape == (spec.num_classes, 2 * d)
    _, (_, other) = answered("which digit is it?")
    assert not torch.equal(answers["session.0"]["layer0.weight"],
                           other["session.0"]["layer0.weight"])
    with pytest.raises(ConfigError, match="method.query"):
        prepare_run(session_run(cache_dir, CdcMmpgConfig(query="a question", **SMALL)),
                    quiet=True)


def test_malformed_uploads_get_no_answer(cache_dir):
    """The server checks each client's uploads before answering (names, width, rows, values);
    only the clients that complete the conversation count in the payload figures."""
    from fedadapt.methods.sessions.train import build_generator

    prep = prepare_run(session_run(cache_dir, CdcMmpgConfig(**SMALL)), quiet=True)
    spec = prep.spec
    server = SessionServer(spec, {"generator": build_generator(spec),
                                  "original": torch.nn.Linear(spec.embed_dim, spec.num_classes)})
    good, _ = session_upload(spec, 0)
    assert server.check_uploads(good) is None
    d = spec.embed_dim
    bad = {
        "arrays": {"session.0": {"embeddings": torch.zeros(1, d)}},
        "shape": {"session.0": {"anchor": torch.zeros(1, d + 1)}},
        "rows": {"session.0": {"anchor": torch.zeros(2, d)}},
        "non-finite": {"session.0": {"anchor": torch.full((1, d), float("nan"))}},
    }
    for what, uploads in bad.items():
        assert what in server.check_uploads(uploads)
    server.answer(0, good, {k: 1 for k in good})
    server.answer(1, session_upload(spec, 1)[0], {k: 1 for k in session_upload(spec, 1)[0]})
    server.keep_clients({1})
    assert {r["client"] for r in server.records} == {1}


def test_sessions_longer_than_any_client_are_refused(cache_dir):
    from fedadapt.config import ConfigError

    prep = prepare_run(session_run(cache_dir, DuetConfig(session=10_000, **SMALL)), quiet=True)
    with pytest.raises(ConfigError, match="method.session=10000"):
        train_generator(prep.spec)


def test_faulty_clients_are_dropped_from_the_conversation(cache_dir, tmp_path):
    """Injected faults in the session upload (an exception, NaN, a wrong shape): those clients
    get no answer, the run completes with the others, and only they count."""
    from fedadapt.config import FaultConfig
    from fedadapt.federation.server.faults import injected_fault

    cfg = session_run(cache_dir, DuetConfig(session=4, generators=2, **SMALL))
    cfg.faults = FaultConfig(fraction=0.5, kinds=["raise", "nan", "wrong_shape"])
    faulty = {c for c in range(4) if injected_fault(cfg.seed, 1, c, 0.5, cfg.faults.kinds)}
    assert 0 < len(faulty) <= 2  # the seed gives some faults and enough good replies
    summary = run_experiment(cfg, tmp_path / "run", config_yaml="x\n", execute=run_in_process)
    rows = json.loads((tmp_path / "run" / "sessions.json").read_text())
    assert {r["client"] for r in rows} == set(range(4)) - faulty
    records = [json.loads(line) for line in
               (tmp_path / "run" / "session_payloads.jsonl").read_text().splitlines()]
    assert {r["client"] for r in records} == set(range(4)) - faulty
    assert summary["sessions"]["acc_generated"]["clients"] == 4 - len(faulty)
