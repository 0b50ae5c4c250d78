"""Differential privacy through Flower's own wrappers and mods: epsilon from Flower's accountant
after every round (metrics.jsonl, summary.json, the run's table, fedadapt-report), client-side
clipping by Flower's mod applied per client inside the worker, and ClientApp mods in general."""

import numpy as np
import pytest
from flwr.app import Context, Message, MessageType

from fedadapt.entry import compose_config, to_run_config
from fedadapt.experiment import run_experiment
from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
from fedadapt.federation.simulation.inprocess import in_process
from fedadapt.federation.wire import records
from fedadapt.results.store import read_jsonl

TASK = ["experiment=custom", "dataset=digits", "dataset.max_samples=240", "backbone=small_cnn",
        "train.precision=fp32",  # compared exactly: fp32 on any device
        "backbone.image_size=16", "method=linear_head", "partition=iid",
        "partition.num_clients=4", "partition.fraction_fit=1.0", "rounds=3",
        "train.batch_size=16", "method.weighting=uniform", "federation.workers=1"]

#: What :func:`recording_mod` saw: one entry per call.
SEEN: list[dict] = []


def recording_mod(msg: Message, context: Context, call_next) -> Message:
    """A user's mod: records the client's message and reply as Flower's mods see them."""
    reply = call_next(msg, context)
    SEEN.append({"arrays": len(msg.content.array_records),
                 "configs": len(msg.content.config_records),
                 "sent": sorted(next(iter(msg.content.array_records.values())).keys()),
                 "replied": sorted(reply.content.array_records["arrays"].keys()),
                 "round": int(msg.content["config"]["server-round"])})
    return reply


def run(tmp_path, *overrides, execute=None, cache_dir=None):
    from omegaconf import OmegaConf

    composed = compose_config(TASK + list(overrides) + [f"cache_dir={cache_dir}"])
    summary = run_experiment(to_run_config(composed), tmp_path,
                             config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                             execute=execute or in_process("workers"))
    return summary, read_jsonl(tmp_path / "metrics.jsonl")


@pytest.mark.slow
def test_epsilon_after_every_round_in_metrics_summary_table_and_report(tmp_path, cache_dir):
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    from fedadapt.results import report

    summary, rows = run(tmp_path / "run", "dp=server_fixed", "dp.noise_multiplier=1.5",
                        cache_dir=cache_dir)
    eps = [r["epsilon"] for r in rows]
    assert len(eps) == 3 and eps[0] > 0 and eps[0] < eps[1] < eps[2]
    assert {r["delta"] for r in rows} == {1e-5}  # the default, min(1e-5, N^-1.1), beside it
    reference = RdpAccountant(PrivacyConfig(
        target_delta=1e-5, population_size=4,
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION))
    reference.compose(GaussianPrivacyEvent(1.5, 4, 4), 3)  # three releases
    privacy = summary["privacy"]
    assert privacy["epsilon"] == pytest.approx(reference.get_epsilon(1e-5)) == eps[-1]
    assert (privacy["delta"], privacy["releases"], privacy["dp"]) == (1e-5, 3, "server_fixed")
    assert "DifferentialPrivacyServerSideFixedClipping" in summary["strategy"]["class"]
    assert "| server_fixed | 1.5 |" in (tmp_path / "run" / "table.md").read_text()
    report.main([str(tmp_path), "--out", str(tmp_path)])
    table = (tmp_path / "report.md").read_text()
    assert "epsilon" in table and f"{eps[-1]:.2f}" in table


@pytest.mark.slow
def test_client_side_clipping_is_flowers_mod_per_client_grouped_or_not(tmp_path, cache_dir):
    """dp=client_fixed: Flower's fixedclipping_mod clips each client's update inside the worker;
    four clients side by side end where one at a time does."""
    exchanges = []

    def keep(sent, reply, context):
        exchanges.append((sent, reply))

    clip, finals = 0.05, []
    for k in (1, 4):
        exchanges.clear()
        run(tmp_path / f"k{k}", "dp=client_fixed", f"dp.clipping_norm={clip}",
            "dp.noise_multiplier=0", "dp.accounting=false", f"federation.clients_per_worker={k}",
            execute=in_process("workers", on_reply=keep), cache_dir=cache_dir)
        arrays, _ = load_checkpoint(latest_checkpoint(tmp_path / f"k{k}"))
        finals.append({n: t.numpy() for n, t in arrays.items()})
        norms = []
        for sent, reply in exchanges:
            if sent.metadata.message_type != MessageType.TRAIN:
                continue
            given = sent.content["arrays"]
            for content in records.unpack(reply.content).values():
                got = content["arrays"]
                norms.append(np.sqrt(sum(float(((got[n].numpy() - given[n].numpy()) ** 2).sum())
                                         for n in got.keys())))
        assert len(norms) == 3 * 4 and max(norms) == pytest.approx(clip, rel=1e-4)
    for name in finals[0]:
        np.testing.assert_allclose(finals[0][name], finals[1][name], atol=1e-6)


@pytest.mark.slow
def test_a_mod_sees_one_client_at_a_time(tmp_path, cache_dir):
    SEEN.clear()
    run(tmp_path / "mods", "federation.clients_per_worker=4",
        "federation.train_mods=[test_dp:recording_mod]", cache_dir=cache_dir)
    assert len(SEEN) == 3 * 4  # every client of every round
    assert all(s["arrays"] == 1 and s["configs"] == 1 for s in SEEN)  # no worker's record
    assert all(s["sent"] == s["replied"] == ["head.bias", "head.weight"] for s in SEEN)
    assert sorted({s["round"] for s in SEEN}) == [1, 2, 3]


def test_an_unknown_mod_is_refused_before_the_run(tmp_path, cache_dir):
    from fedadapt.config import ConfigError

    with pytest.raises(ConfigError, match="federation.train_mods='flwr.clientapp.mod:nosuchmod' "
                                          "cannot be loaded"):
        run(tmp_path / "bad", "federation.train_mods=[flwr.clientapp.mod:nosuchmod]",
            cache_dir=cache_dir)
    assert not (tmp_path / "bad").exists()  # refused before anything was written
