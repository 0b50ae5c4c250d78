"""The ``plugin`` family's run: train the module on the server, deliver it to every client in
one Flower round (phase ``plugin``), collect their recognition accuracies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from flwr.app import ConfigRecord, MessageType, RecordDict

from fedadapt.config import RunConfig
from fedadapt.federation.server.loop import ask_every_client, record_phase
from fedadapt.log import log
from fedadapt.methods.run import PreparedRun
from fedadapt.methods.server_trained import finish_server_run, serve_clients

if TYPE_CHECKING:  # pragma: no cover
    from flwr.clientapp import ClientApp


def deliver(arrays_for: Callable) -> Callable:
    """The phase that sends every client its plug-in arrays (``arrays_for(client)``, an
    ArrayRecord) in one round; it recognises its test split with them and replies with metrics
    only. One row per client that answered lands in ``state.delivered``."""
    def phase(grid, state, plan) -> None:
        grid.trained = None
        rows, down, up = ask_every_client(
            grid, plan, RecordDict({"config": ConfigRecord({"phase": "plugin"})}),
            MessageType.EVALUATE, "plug-in", 1,
            per_client=lambda cid: RecordDict({"arrays": arrays_for(cid)}))
        record_phase(state, down, up)
        state.delivered = rows

    return phase


def recognize(spec, msg, context) -> RecordDict:
    """A client's side of the phase: recognise its test split with the arrays it received."""
    from flwr.app import MetricRecord

    from fedadapt.federation.client.worker import for_each_client
    from fedadapt.methods.plugin.train import recognize as recognize_one

    def one(cid: int, mine: RecordDict) -> RecordDict:
        arrays = dict(mine.array_records["arrays"].to_torch_state_dict())
        return RecordDict({"metrics": MetricRecord(recognize_one(spec, cid, arrays))})

    return for_each_client(msg.content, one)


def run_plugin(cfg: RunConfig, run_dir: Path, prep: PreparedRun, *, config_yaml: str,
               label: str, client_app: "ClientApp", execute: Optional[Callable] = None,
               resume: bool = False, t0: Optional[float] = None) -> dict:
    """A server-trained plug-in (ICIIA): train it on the server from the clients' cached
    features, deliver it to every client in one Flower round, collect their recognition
    accuracies; write the run directory like any run (``summary.json`` last)."""
    from flwr.app import ArrayRecord

    from fedadapt.methods.plugin.train import client_arrays, summarize_recognition, train_on_server
    from fedadapt.results.store import write_json

    t0 = time.time() if t0 is None else t0
    spec = prep.spec  # cached features: the method's builder refused method.use_cache=false
    log(f"[{label}] training on the server from {spec.num_clients} clients' cached features")
    trained = train_on_server(spec)
    log(f"[{label}] delivering the module to {spec.num_clients} clients (one Flower round)")
    state = serve_clients(cfg, run_dir, prep, config_yaml, execute, client_app, phases=[deliver(
        lambda cid: ArrayRecord(client_arrays(trained, cid)))])
    rows = sorted(state.delivered, key=lambda r: r["client"])
    write_json(run_dir / "recognition.json", rows)
    module_params = sum(t.numel() for t in trained["module"].parameters())
    layer_params = module_params - sum(t.numel() for t in trained["module"].classifier.parameters())
    recognition = summarize_recognition(rows)
    return finish_server_run(
        cfg, run_dir, prep, state, label=label, t0=t0, setting="server-trained plug-in",
        results={"recognition": recognition, "server_training": trained["log"]},
        params={"module_params": layer_params}, client_acc=recognition.get("acc_stream"))
