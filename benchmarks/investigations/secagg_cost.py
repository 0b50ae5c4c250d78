"""What SecAgg+ costs on adapter payloads: bytes and seconds per round, ``secagg=secaggplus``
against plain FedAvg (``secagg=none``), on the linear head, every client sampled each round,
with and without clients dropping out mid-protocol.

Both run in this process with one Flower node per client (``run_in_process``, as on the
deployment engine), so the two count the same messages: every training exchange's payload both
ways (arrays, config and metric values, record names; fedadapt.federation.server.secagg's
counter), and the seconds of the rounds that do not evaluate (``round_s``). A dropped client
fails at SecAgg+'s collect-masked-vectors stage, after it has shared its keys (plain FedAvg:
its training fails), so the server must unmask it from its neighbours' shares.

    nice -n 19 python benchmarks/investigations/secagg_cost.py --clients 10 100 --drop 0 0.1 \\
        --json secagg_cost.json
    (--num-shares 20: each client's secrets shared with 20 neighbours, not every other client)

prints one Markdown table (docs/federation.md has the numbers) and, with ``--json``, writes
the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")


def _config(args, clients: int, secagg: str):
    from fedadapt.adapters.heads import LinearHeadConfig
    from fedadapt.config import (
        BackboneConfig,
        DatasetConfig,
        FederationConfig,
        PartitionConfig,
        RunConfig,
        SecAggConfig,
        TrainConfig,
    )

    if args.backbone == "small_cnn":
        backbone = BackboneConfig(name="small_cnn", family="small_cnn", image_size=16,
                                  arch={"width": 8})
    else:  # a preset of conf/backbone (its keys, without the schema's defaults list)
        from omegaconf import OmegaConf

        preset = OmegaConf.to_container(OmegaConf.load(
            Path(__file__).resolve().parents[2] / "conf" / "backbone" / f"{args.backbone}.yaml"))
        preset.pop("defaults", None)
        backbone = BackboneConfig(**preset)
    return RunConfig(dataset=DatasetConfig(name="digits"), backbone=backbone,
                     method=LinearHeadConfig(),
                     partition=PartitionConfig(kind="iid", num_clients=clients,
                                               fraction_fit=1.0),
                     train=TrainConfig(lr=0.05, batch_size=16, precision="fp32"),
                     federation=FederationConfig(eval_every=10 ** 6, global_eval=False),
                     secagg=SecAggConfig(name=secagg, num_shares=args.num_shares),
                     rounds=args.rounds,
                     cache_dir=args.cache_dir)


class _Dropping:
    """The ClientApp, with the clients in ``drop`` failing: at SecAgg+'s collect-masked-vectors
    stage (after sharing their keys), or, without SecAgg+, when asked to train."""

    def __init__(self, app, drop: set[int]) -> None:
        self.app, self.drop = app, drop

    def __call__(self, msg, context):
        from flwr.common.secure_aggregation.secaggplus_constants import (
            RECORD_KEY_CONFIGS,
            Key,
            Stage,
        )

        if int(context.node_config["partition-id"]) in self.drop and msg.has_content() \
                and msg.metadata.message_type == "train":
            configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
            if configs is None or configs.get(Key.STAGE) == Stage.COLLECT_MASKED_VECTORS:
                raise ConnectionError("dropped out")
        return self.app(msg, context)


def measure(args, clients: int, secagg: str, drop: float) -> dict:
    """One run; the mean bytes and seconds of its rounds that do not evaluate."""
    from fedadapt.experiment import prepare_run, run_experiment
    from fedadapt.federation.server.secagg import _bytes
    from fedadapt.federation.simulation.inprocess import run_in_process
    from fedadapt.results.store import read_jsonl

    cfg = _config(args, clients, secagg)
    prep = prepare_run(cfg, quiet=True)
    dropped = set(range(0, clients, max(1, round(1 / drop)))) if drop > 0 else set()
    payload = {"down": 0, "up": 0}

    def on_reply(sent, reply, context):
        if sent.metadata.message_type == "train":
            payload["down"] += _bytes(sent.content)
            if not reply.has_error():
                payload["up"] += _bytes(reply.content)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.perf_counter()
        run_experiment(cfg, run_dir, config_yaml=secagg, prepared=prep,
                       execute=lambda plan, app: run_in_process(
                           plan, _Dropping(app, dropped), on_reply=on_reply))
        wall = time.perf_counter() - t0
        rows = read_jsonl(run_dir / "metrics.jsonl")
    timed = rows[:-1]  # the last round also evaluates
    return {"clients": clients, "secagg": secagg, "dropped": len(dropped),
            "rounds": len(rows), "params": prep.counts["communicated_params"],
            "bytes_per_round": (payload["down"] + payload["up"]) / len(rows),
            "bytes_down_per_round": payload["down"] / len(rows),
            "bytes_up_per_round": payload["up"] / len(rows),
            "round_s": [round(r["round_s"], 3) for r in timed],
            "mean_round_s": sum(r["round_s"] for r in timed) / len(timed),
            "trained": [r["clients_trained"] for r in rows],
            "stage_s": [r.get("secagg_stage_s") for r in timed], "wall_s": round(wall, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--drop", type=float, nargs="+", default=[0.0, 0.1],
                        help="share of the clients that drop out mid-protocol")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds per run (all but the last, which evaluates, are timed)")
    parser.add_argument("--backbone", default="efficientnet_lite0",
                        help="a preset of conf/backbone (efficientnet_lite0: the main job's, "
                             "a head of 12,810 parameters) or small_cnn (a tiny random CNN, "
                             "a head of 170)")
    parser.add_argument("--num-shares", type=float, default=1.0,
                        help="secagg.num_shares: each client's neighbours (an int > 2) or that "
                             "share of the round's clients (1.0: every other client)")
    parser.add_argument("--cache-dir", default=os.environ.get(
        "FEDADAPT_CACHE", str(Path.home() / ".cache" / "fedadapt")))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (the last round evaluates and is not timed)")
    rows = []
    print("| clients a round | dropped | aggregation | bytes a round | s a round | x plain bytes "
          "| x plain s |")
    print("|---|---|---|---|---|---|---|")
    for clients in args.clients:
        for drop in args.drop:
            plain = measure(args, clients, "none", drop)
            secure = measure(args, clients, "secaggplus", drop)
            rows += [plain, secure]
            for r in (plain, secure):
                print(f"| {clients} | {r['dropped']} | {r['secagg']} | "
                      f"{r['bytes_per_round']:,.0f} | {r['mean_round_s']:.3f} | "
                      f"{r['bytes_per_round'] / plain['bytes_per_round']:.1f} | "
                      f"{r['mean_round_s'] / plain['mean_round_s']:.1f} |", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
