"""The ``sessions`` family's run: train the generator on the server, then serve every session
of every client over Flower's Message API (uploads up, generated parameters down, metrics
back); and the client's side of the conversation."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict

from fedadapt.config import RunConfig
from fedadapt.federation.client.training import RunSpec
from fedadapt.federation.client.worker import client_fault, fault_of, for_each_client
from fedadapt.federation.server.faults import TENSOR_FAULTS, Screened, corrupt, require_enough
from fedadapt.federation.server.loop import exchange, record_phase
from fedadapt.federation.wire.grid import node_id
from fedadapt.log import log
from fedadapt.methods.run import PreparedRun
from fedadapt.methods.server_trained import finish_server_run, serve_clients

if TYPE_CHECKING:  # pragma: no cover
    from flwr.clientapp import ClientApp


def run_sessions(cfg: RunConfig, run_dir: Path, prep: PreparedRun, *, config_yaml: str,
                 label: str, client_app: "ClientApp", execute: Optional[Callable] = None,
                 resume: bool = False, t0: Optional[float] = None) -> dict:
    """A session plug-in (DUET, CDC-MMPG): train the generator on the server from the clients'
    cached features, then converse with every client (uploads up, generated parameters down,
    metrics back); write the run directory like any run (``summary.json`` last)."""
    from fedadapt.methods.sessions.train import (
        SessionServer,
        generator_summary,
        summarize_sessions,
        train_generator,
    )
    from fedadapt.results.store import write_json, write_jsonl

    t0 = time.time() if t0 is None else t0
    spec = prep.spec
    log(f"[{label}] training on the server from {spec.num_clients} clients' cached features")
    trained = train_generator(spec)
    server = SessionServer(spec, trained)
    log(f"[{label}] serving every test session of {spec.num_clients} clients")
    state = serve_clients(cfg, run_dir, prep, config_yaml, execute, client_app,
                          phases=[converse(server)])
    rows = sorted(state.delivered, key=lambda r: r["client"])
    scores = [r.pop("scores") for r in rows if "scores" in r]
    write_json(run_dir / "sessions.json", rows)
    write_jsonl(run_dir / "session_payloads.jsonl", server.records)
    sessions = summarize_sessions(rows, server.records, scores)
    sessions.update(generator_summary(spec.method, trained["generator"]))
    generator_params = sum(p.numel() for p in trained["generator"].parameters())
    return finish_server_run(
        cfg, run_dir, prep, state, label=label, t0=t0,
        setting="server-trained session plug-in",
        results={"sessions": sessions, "server_training": trained["log"]},
        params={"generator_params": generator_params},
        client_acc=sessions.get("acc_generated"))


def converse(server, chunk: int = 32) -> Callable:
    """The phase that serves every client's sessions with ``server`` (a
    :class:`~fedadapt.methods.sessions.train.SessionServer`), a chunk of clients at a time:
    each client uploads what its sessions hold (QUERY, phase ``session-upload``: one
    ArrayRecord per session), the server answers each session with generated parameters
    (EVALUATE, phase ``session-predict``), the client predicts and replies with metrics (and,
    for a binary task, its scores). A client whose upload is malformed (names, width,
    non-finite values) gets no answer. One row per client that answered both lands in
    ``state.delivered``."""
    return lambda grid, state, plan: _converse(server, grid, state, plan, chunk)


def _converse(server, grid, state, plan, chunk: int) -> None:
    grid.trained = None
    rows, dropped, down, up, answered = [], Screened(), 0, 0, 0
    cids = list(range(plan.num_clients))
    upload_config = ConfigRecord({"phase": "session-upload"})
    predict_config = ConfigRecord({"phase": "session-predict"})
    for start in range(0, len(cids), chunk):
        part = cids[start:start + chunk]
        uploads = [Message(RecordDict({"config": upload_config}), dst_node_id=node_id(cid),
                           message_type=MessageType.QUERY) for cid in part]
        _, _, first = exchange(grid, uploads, plan.timeout, None, "session", 1)
        got_down, got_up = grid.take_bytes()
        down, up = down + sum(got_down.values()), up + sum(got_up.values())
        dropped.dropped += first.dropped
        answers = {}
        for cid, content in first.good:
            sessions = {k: v for k, v in content.array_records.items()
                        if k.startswith("session.")}
            arrays = {k: v.to_torch_state_dict() for k, v in sessions.items()}
            problem = server.check_uploads(arrays)
            if problem:
                dropped.dropped.append((cid, "bad_upload", problem))
                continue
            answers[cid] = server.answer(cid, arrays,
                                         {k: v.count_bytes() for k, v in sessions.items()})

        def content_for(cid: int, answers=answers) -> RecordDict:
            content = RecordDict()
            for name, arrays in answers[cid].items():
                content[name] = ArrayRecord(arrays)
            server.note_download(cid, {k: v.count_bytes() for k, v in
                                       content.array_records.items() if k.startswith("session.")})
            return content

        if not answers:
            continue
        predict = [Message(RecordDict({"config": predict_config,
                                       **dict(content_for(cid).items())}),
                           dst_node_id=node_id(cid), message_type=MessageType.EVALUATE)
                   for cid in sorted(answers)]
        _, _, second = exchange(grid, predict, plan.timeout, None, "session", 1)
        got_down, got_up = grid.take_bytes()
        down, up = down + sum(got_down.values()), up + sum(got_up.values())
        answered += len(second.good)
        dropped.dropped += second.dropped
        for cid, content in second.good:
            scores = content.array_records.get("scores")
            rows.append({"client": cid, **dict(content.metric_records["metrics"]),
                         **({"scores": scores.to_torch_state_dict()} if scores else {})})
    # payload figures only for the clients that completed the conversation
    server.keep_clients({r["client"] for r in rows})
    dropped.good = [(r["client"], None) for r in rows]
    require_enough(dropped, len(cids), plan.min_reply_fraction, 1)
    record_phase(state, down, up)
    state.delivered = rows


def upload(spec: RunSpec, msg, context) -> RecordDict:
    """A client's first message (QUERY, phase ``session-upload``): one ArrayRecord per test
    session."""
    from fedadapt.methods.sessions.train import session_upload

    def one(cid: int, _) -> RecordDict:
        fault = client_fault(spec, 1, cid, "in its session upload")
        uploads, metrics = session_upload(spec, cid)
        if fault in TENSOR_FAULTS:
            uploads = {name: corrupt(arrays, fault) for name, arrays in uploads.items()}
        content = RecordDict({"metrics": MetricRecord(metrics)})
        for name, arrays in uploads.items():
            content[name] = ArrayRecord(arrays)
        return content

    return for_each_client(msg.content, one, lambda cid: fault_of(spec, 1, cid),
                           spec.faults.delay_s)


def predict(spec: RunSpec, msg, context) -> RecordDict:
    """A client's second message (EVALUATE, phase ``session-predict``): every session
    predicted with its generated layers."""
    from fedadapt.methods.sessions.train import session_predict

    def one(cid: int, mine: RecordDict) -> RecordDict:
        arrays = {k: dict(v.to_torch_state_dict()) for k, v in mine.array_records.items()}
        metrics, scores = session_predict(spec, cid, arrays)
        content = RecordDict({"metrics": MetricRecord(metrics)})
        if scores is not None:
            content["scores"] = ArrayRecord(scores)
        return content

    return for_each_client(msg.content, one)
