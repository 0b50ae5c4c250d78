"""Simulated devices (fleet=tiers|lognormal|trace, fedadapt/federation/simulation/fleet.py): seeded
profiles, availability, a client's simulated time, the round's deadline, over-selection and
offline clients, FLOPs counted by torch's flop counter, the clock in metrics.jsonl and across a
resume; fleet=none changes nothing; bad input in one line naming the key."""

import math

import numpy as np
import pytest

from fedadapt.config import ConfigError
from fedadapt.federation.simulation.fleet import (
    Fleet,
    LognormalFleet,
    TiersFleet,
    TraceFleet,
    profiles,
    read_trace,
)
from fedadapt.results.store import read_jsonl

TINY = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
        "dataset.max_samples=300", "partition.num_clients=6", "rounds=4"]


def test_tiers_and_lognormal_profiles_are_seeded_and_shared_as_configured():
    cfg = TiersFleet(compute=[1e9, 1e10], fractions=[0.25, 0.75])
    got = profiles(cfg, 8, seed=3)
    assert [p.tier for p in got].count(0) == 2 and got == profiles(cfg, 8, seed=3)
    assert {p.compute for p in got if p.tier == 1} == {1e10}
    assert got != profiles(cfg, 8, seed=4)
    logn = profiles(LognormalFleet(compute_median=2e9, compute_sigma=0.5), 4000, 0)
    assert np.median([p.compute for p in logn]) == pytest.approx(2e9, rel=0.05)
    assert np.std(np.log([p.compute for p in logn])) == pytest.approx(0.5, rel=0.05)


def _fleet(work, deadline=None, **kw):
    return Fleet(TiersFleet(compute=[1.0, 10.0], downlink=100.0, uplink=50.0,
                             **kw), len(work), 0, work, deadline=deadline)


def test_a_clients_time_is_flops_over_speed_plus_bytes_over_bandwidth():
    fleet = _fleet([20.0, 20.0, 20.0, 20.0])
    for cid, p in enumerate(fleet.profiles):
        assert fleet.seconds(cid, 300, 100) == pytest.approx(20 / p.compute + 3 + 2)


def test_the_round_drops_late_clients_at_the_deadline_and_keeps_the_first_n():
    fleet = _fleet([20.0] * 4, deadline=10.0)  # tier 0: 20 s, tier 1: 2 s
    slow = [c for c, p in enumerate(fleet.profiles) if p.tier == 0]
    dropped, seconds = fleet.round(0.0, [0, 1, 2, 3], {}, {})
    assert dropped == {c: "late" for c in slow} and seconds == 10.0  # waited to the deadline
    fast = [c for c in range(4) if c not in slow]
    dropped, seconds = fleet.round(0.0, fast, {}, {})
    assert dropped == {} and seconds == pytest.approx(2.0)  # ends with the last arrival
    keep = Fleet(TiersFleet(compute=[1.0, 10.0], keep_first=1), 4, 0, [20.0] * 4,
                 deadline=None)
    dropped, seconds = keep.round(0.0, [0, 1, 2, 3], {}, {})
    assert len(dropped) == 3 and set(dropped.values()) == {"discarded"}
    assert seconds == pytest.approx(2.0)  # the first arrival; the others are not waited for
    with pytest.raises(ConfigError, match="federation.round_timeout=1.0 is invalid"):
        _fleet([20.0] * 4, deadline=1.0)  # no client can meet it


def test_on_off_availability_is_seeded_stationary_and_drops_clients_going_offline(tmp_path):
    cfg = TiersFleet(compute=[1.0], mean_on=30.0, mean_off=10.0)
    fleet = Fleet(cfg, 400, 0, [1.0] * 400)
    shares = [len(fleet.available(t)) / 400 for t in np.linspace(0, 2000, 41)]
    assert np.mean(shares) == pytest.approx(0.75, abs=0.05)  # mean_on / (mean_on + mean_off)
    again = Fleet(cfg, 400, 0, [1.0] * 400)
    assert [again.available(t) for t in (500.0, 5.0)] == [fleet.available(t) for t in (500.0, 5.0)]
    cid = fleet.available(0.0)[0]
    until = fleet.online_until(cid, 0.0)
    work = [until * 2] * 400  # this client would need twice its remaining time online
    slow = Fleet(cfg, 400, 0, work)
    dropped, seconds = slow.round(0.0, [cid], {}, {})
    assert dropped == {cid: "offline"} and seconds == pytest.approx(until)


def test_a_trace_gives_availability_and_its_bad_input_is_one_line(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,start,end\n0,0,10\n0,5,20\n2,30,40\n")
    spans = read_trace(str(trace), 3)
    assert spans == [[(0.0, 20.0)], [], [(30.0, 40.0)]]
    fleet = Fleet(TraceFleet(compute=[1.0], trace=str(trace)), 3, 0, [1.0] * 3)
    assert fleet.available(10.0) == [0] and fleet.available(25.0) == []
    assert fleet.next_available(25.0) == 30.0 and fleet.next_available(45.0) is None
    for text, says in (("client,start,end\n7,0,1\n", "names client 7, but the run has clients"),
                       ("who,when\n0,1\n", "header client,start,end"),
                       ("client,start,end\n0,5,1\n", "0 <= start < end"),
                       ("client,start,end\nx,0,1\n", "is not an integer client")):
        trace.write_text(text)
        with pytest.raises(ConfigError) as err:
            read_trace(str(trace), 3)
        assert str(err.value).startswith("fleet.trace=") and says in str(err.value)
        assert "\n" not in str(err.value)


def test_a_missing_trace_file_is_refused_by_the_config_with_its_resolved_path(tmp_path,
                                                                            monkeypatch):
    """A ``fleet.trace`` (or FedScale file) that is not there is refused when the config is
    checked, before any data is read, in one line that shows where it was looked for."""
    from fedadapt.entry import compose_config, to_run_config

    monkeypatch.chdir(tmp_path)
    for overrides, key in ((["fleet=trace", "fleet.trace=traces/avail.csv"], "fleet.trace"),
                           (["fleet=fedscale", "fleet.capacity=cap.pkl"], "fleet.capacity"),
                           (["fleet=fedscale", f"fleet.capacity={__file__}",
                             "fleet.behaviour=beh.pkl"], "fleet.behaviour")):
        with pytest.raises(ConfigError) as err:
            to_run_config(compose_config(["method=linear_head", "backbone=small_cnn",
                                          *overrides]))
        wanted = tmp_path / overrides[-1].split("=")[1]
        assert str(err.value).startswith(f"{key}={overrides[-1].split('=')[1]!r} is invalid: "
                                         f"no such file: {wanted}"), str(err.value)
        assert "\n" not in str(err.value)


def test_each_fleet_kind_says_what_it_simulates():
    """The capabilities the code asks instead of a kind's name."""
    from fedadapt.federation.simulation.fleet import fleet_kinds

    kinds = fleet_kinds()
    assert list(kinds) == ["none", "tiers", "lognormal", "trace", "fedscale"]
    assert [k for k, c in kinds.items() if not c.simulated] == ["none"]
    assert [k for k, c in kinds.items() if c.fedscale_traces] == ["fedscale"]
    assert [k for k, c in kinds.items() if c.availability_csv] == ["trace"]
    assert not any(c().exact for c in kinds.values())
    assert kinds["fedscale"](fedscale_semantics="exact").exact


def test_a_run_directorys_config_types_its_fleet_by_its_kind():
    """``config.yaml`` read back (export): the fleet typed by its kind; one written before the
    kinds had their own keys (every kind's keys in one node), or with no fleet, still reads."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, run_config_from, to_run_config

    cfg = to_run_config(compose_config(["method=linear_head", "backbone=small_cnn",
                                        "fleet=lognormal", "fleet.compute_sigma=0.3"]))
    saved = OmegaConf.to_container(OmegaConf.structured(cfg))
    assert run_config_from(saved).fleet == LognormalFleet(compute_sigma=0.3)
    saved["fleet"] = {"name": "tiers", "compute": [1.0, 2.0], "trace": None, "capacity": None,
                      "fedscale_semantics": "fedadapt", "compute_median": 3e9}
    assert run_config_from(saved).fleet == TiersFleet(compute=[1.0, 2.0])
    del saved["fleet"]
    assert not run_config_from(saved).fleet.simulated


def test_training_flops_are_counted_by_torchs_flop_counter():
    """A linear head on D features, C classes: 2DC forward and 2DC for its weight's gradient
    per example (no gradient flows into the cached features)."""
    import torch

    from fedadapt.federation.simulation.fleet import train_flops_per_example

    class Source:
        def get(self, idx, device):
            return torch.randn(len(idx), 16), torch.zeros(len(idx), dtype=torch.long)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 10)

        def training_loss(self, x, y):
            return torch.nn.functional.cross_entropy(self.fc(x), y)

    assert train_flops_per_example(Head(), Source(), 0, None, device="cpu",
                                   precision="fp32") == 4 * 16 * 10


def _run(run_dir, overrides, cache_dir, stop_after=None):
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*TINY, *overrides, f"cache_dir={cache_dir}"])
    execute = in_process("workers")
    if stop_after is not None:
        from test_resume import _stopping_after

        execute = _stopping_after(stop_after)
    return run_experiment(to_run_config(composed), run_dir, execute=execute,
                          config_yaml=OmegaConf.to_yaml(composed, resolve=True))


def test_fleet_none_adds_nothing_and_a_bad_fleet_is_refused_before_writing(tmp_path,
                                                                           cache_dir):
    _run(tmp_path / "none", [], cache_dir)
    assert not any(k.startswith("sim_") for r in read_jsonl(tmp_path / "none" / "metrics.jsonl")
                   for k in r)
    assert not (tmp_path / "none" / "fleet.json").exists()
    for overrides, says in (
            (["fleet=tiers", "fleet.uplink=-1"], "fleet.uplink=-1.0 is invalid"),
            (["fleet=tiers", "federation.round_timeout=1e-9"],
             "federation.round_timeout=1e-09 is invalid with fleet=tiers: no client can meet"),
            (["fleet=tiers", "dp=server_fixed", "method.weighting=uniform"],
             "dp=server_fixed is invalid with fleet=tiers")):
        with pytest.raises(ConfigError) as err:
            _run(tmp_path / "bad", overrides, cache_dir)
        assert str(err.value).startswith(says) and "\n" not in str(err.value)
        assert not (tmp_path / "bad").exists()


@pytest.mark.slow  # three short runs, in process
def test_the_clock_samples_available_clients_drops_late_ones_and_resumes(tmp_path, cache_dir):
    import json

    trace = tmp_path / "trace.csv"  # clients 0-3 always there, 4 and 5 never
    trace.write_text("client,start,end\n" + "".join(f"{c},0,1e12\n" for c in range(4)))
    fleet = ["fleet=trace", f"fleet.trace={trace}", "fleet.compute=[1e3,1e6]",
             "partition.fraction_fit=1.0"]
    _run(tmp_path / "trace", fleet, cache_dir)
    rows = read_jsonl(tmp_path / "trace" / "metrics.jsonl")
    described = json.loads((tmp_path / "trace" / "fleet.json").read_text())["clients"]
    slow = {c["client"] for c in described if c["tier"] == 0 and c["client"] < 4}
    assert all(r["sim_unavailable"] == 2 and r["clients_sampled"] == 4 for r in rows)
    assert all(r["sim_late"] == 0 for r in rows)
    times = [r["sim_time_s"] for r in rows]
    assert times == sorted(times) and times[0] > 0
    assert sum(r["sim_round_s"] for r in rows) == pytest.approx(times[-1])

    # a deadline between the tiers' times: every slow client is late, every round
    fast_s = max(c["train_flops"] / c["compute"] for c in described if c["tier"] == 1)
    slow_s = min(c["train_flops"] / c["compute"] for c in described if c["tier"] == 0)
    assert fast_s * 10 < slow_s
    deadline = math.sqrt(fast_s * slow_s)
    _run(tmp_path / "late", [*fleet, f"federation.round_timeout={deadline}"], cache_dir)
    late = read_jsonl(tmp_path / "late" / "metrics.jsonl")
    assert all(r["sim_late"] == len(slow) and r["clients_trained"] == 4 - len(slow)
               and r["sim_round_s"] == pytest.approx(deadline) for r in late)

    # stopped after round 2 and resumed: the same clock
    from test_resume import _Killed

    with pytest.raises(_Killed):
        _run(tmp_path / "resumed", fleet, cache_dir, stop_after=2)
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*TINY, *fleet, f"cache_dir={cache_dir}"])
    run_experiment(to_run_config(composed), tmp_path / "resumed", execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True), resume=True)
    again = read_jsonl(tmp_path / "resumed" / "metrics.jsonl")
    assert [r["sim_time_s"] for r in again] == pytest.approx(times)

    # fedadapt-report: the simulated hours, the time to a target accuracy, the plot
    from fedadapt.results.report import main as report

    report([str(tmp_path / "trace"), str(tmp_path / "late"), "--target", "1",
            "--out", str(tmp_path / "report")])
    text = (tmp_path / "report" / "report.md").read_text()
    assert "simulated hours" in text and "sim hours to 1%" in text and "(1/1)" in text
    assert (tmp_path / "report" / "accuracy_vs_time.png").stat().st_size > 0


def test_tiers_and_lora_ranks_follow_the_devices(cache_dir):
    """setting.tiers_from=fleet: the deepest exit a device trains by the deadline (faster:
    deeper); method.ranks with a fleet: the slowest devices the smallest rank."""
    from fedadapt.adapters.lora import LoraMethodConfig, assign_ranks
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.simulation.fleet import train_flops_per_example

    ranks = assign_ranks(LoraMethodConfig(ranks=[2, 8]), 4, [], 0, speeds=[5.0, 1.0, 9.0, 2.0])
    assert ranks == [8, 2, 8, 2]

    base = ["method=lw_linear", "backbone=tiny_vit", "dataset.max_samples=300",
            "partition.num_clients=6", "setting=multitier", "setting.tiers_from=fleet",
            "fleet=tiers", "fleet.compute=[1e6,1e9]", f"cache_dir={cache_dir}"]
    with pytest.raises(ConfigError, match="setting.tiers_from='fleet' is invalid"):
        to_run_config(compose_config([*base[:-3], f"cache_dir={cache_dir}"]))
    prep = prepare_run(to_run_config(compose_config([*base, "federation.round_timeout=1e9"])),
                       quiet=True)
    spec = prep.spec
    assert set(spec.client_exits) == {spec.num_exits - 1}  # all the way, everyone in time
    # a deadline the slow tier meets at the first exit at most (tiny_vit: 2 exits)
    assert spec.num_exits == 2
    at = dict(device=spec.device, precision=spec.precision)
    first = train_flops_per_example(prep.model, spec.train_source, 0, [0], **at)
    assert train_flops_per_example(prep.model, spec.train_source, 0, [1], **at) > first
    n = min(len(c.train) for c in spec.clients)
    deadline = first * n / 1e6 * 1.01
    prep = prepare_run(to_run_config(compose_config([*base,
                                                     f"federation.round_timeout={deadline}"])),
                       quiet=True)
    tiers = [p.tier for p in prep.fleet.profiles]
    assert 0 < sum(tiers) < len(tiers)
    assert prep.spec.client_exits == [1 if t == 1 else 0 for t in tiers]


def test_fedbuff_applies_the_earliest_arrivals_weighted_by_staleness(flower_task):
    from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

    from fedadapt.federation.wire.grid import NODE_BASE
    from fedadapt.strategies.fedbuff import FedBuff

    class Grid:
        def get_node_ids(self):
            return [NODE_BASE + c for c in range(4)]

    strategy = FedBuff(buffer_size=2, concurrency=3, server_lr=0.5, weighted_by_key="n")

    def replies(messages, values, weights):
        out = []
        for msg, v, w in zip(messages, values, weights):
            content = RecordDict({"arrays": ArrayRecord({"w": Array(np.array([v], np.float32))}),
                                  "metrics": MetricRecord({"n": w, "train_loss": 1.0})})
            msg.metadata.__dict__["_message_id"] = f"m{msg.metadata.dst_node_id}"
            out.append(Message(content, reply_to=msg))
        return out

    x0 = ArrayRecord({"w": Array(np.array([1.0], np.float32))})
    started = list(strategy.configure_train(1, x0, ConfigRecord({}), Grid()))
    assert len(started) == 3
    cids = [m.metadata.dst_node_id - NODE_BASE for m in started]
    strategy.arrive({NODE_BASE + c: (0.0, s) for c, s in zip(cids, (5.0, 1.0, 3.0))})
    new, metrics = strategy.aggregate_train(1, replies(started, [3.0, 2.0, 5.0], [1, 1, 3]))
    # the two earliest (1 s: 2.0, weight 1; 3 s: 5.0, weight 3), fresh (tau 0)
    step = (1 * (2.0 - 1.0) + 3 * (5.0 - 1.0)) / 4
    assert new["w"].numpy()[0] == pytest.approx(1.0 + 0.5 * step)
    assert strategy.now == 3.0 and strategy.version == 1 and len(strategy.in_flight) == 1
    assert metrics["staleness_max"] == 0.0

    x1 = new
    more = list(strategy.configure_train(2, x1, ConfigRecord({}), Grid()))
    assert len(more) == 2 and cids[0] not in {m.metadata.dst_node_id - NODE_BASE for m in more}
    strategy.arrive({m.metadata.dst_node_id: (3.0, 10.0) for m in more})
    x1v = float(x1["w"].numpy()[0])
    new, metrics = strategy.aggregate_train(2, replies(more, [x1v + 1.0, x1v + 1.0], [1, 1]))
    # the stale one (started at version 0, arrives at 5 s: change 2.0, tau 1), then one of the
    # fresh ones (13 s: change 1.0, tau 0)
    step = (1 * 2.0 / math.sqrt(2) + 1 * 1.0) / 2
    assert new["w"].numpy()[0] == pytest.approx(x1v + 0.5 * step, rel=1e-6)
    assert metrics["staleness_max"] == 1.0 and strategy.now == 13.0


@pytest.mark.slow  # four short runs, in process
def test_fedbuff_with_one_buffer_of_every_client_is_fedavg_and_resumes(tmp_path, cache_dir):
    """buffer_size = concurrency = the clients a round samples, server_lr 1, constant
    staleness: every update averages clients that all started from it: FedAvg, on the same
    fleet, sampling the same clients."""
    fleet = ["fleet=tiers", "fleet.compute=[1e6,1e7]", "partition.fraction_fit=0.5"]
    _run(tmp_path / "fedavg", fleet, cache_dir)
    buff = [*fleet, "strategy=fedbuff", "strategy.buffer_size=3", "strategy.concurrency=3",
            "strategy.staleness=constant"]
    _run(tmp_path / "fedbuff", buff, cache_dir)
    ref = read_jsonl(tmp_path / "fedavg" / "metrics.jsonl")
    got = read_jsonl(tmp_path / "fedbuff" / "metrics.jsonl")
    for a, b in zip(ref, got):
        assert b["global_loss"] == pytest.approx(a["global_loss"], rel=1e-5)
        assert b["sim_time_s"] == pytest.approx(a["sim_time_s"])
    # the asynchronous case stopped after round 2 and resumed: the clients in flight, their
    # changes and the clock come back from the checkpoint
    from test_resume import _Killed

    async_ = [*fleet, "strategy=fedbuff", "strategy.buffer_size=2", "strategy.concurrency=3",
              "federation.checkpoint_every=1"]
    _run(tmp_path / "straight", async_, cache_dir)
    with pytest.raises(_Killed):
        _run(tmp_path / "stopped", async_, cache_dir, stop_after=2)
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*TINY, *async_, f"cache_dir={cache_dir}"])
    run_experiment(to_run_config(composed), tmp_path / "stopped", execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True), resume=True)
    keys = ("global_loss", "sim_time_s", "strategy/train/staleness_max", "clients_sampled")
    straight = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    resumed = read_jsonl(tmp_path / "stopped" / "metrics.jsonl")
    assert max(r["strategy/train/staleness_max"] for r in straight) >= 1  # truly asynchronous
    assert [[r[k] for k in keys] for r in resumed] == [[r[k] for k in keys] for r in straight]


def test_an_anytime_clients_exits_are_capped_by_its_device(tmp_path, cache_dir):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.client.worker import client_exits
    from fedadapt.federation.simulation.fleet import train_flops_per_example

    base = ["method=lw_linear", "backbone=tiny_vit", "dataset.max_samples=300",
            "partition.num_clients=6", "setting=anytime", "setting.tiers_from=fleet",
            "fleet=tiers", "fleet.compute=[1e6,1e9]", f"cache_dir={cache_dir}"]
    prep = prepare_run(to_run_config(compose_config([*base, "federation.round_timeout=1e9"])),
                       quiet=True)
    first = train_flops_per_example(prep.model, prep.spec.train_source, 0, [0],
                                    device=prep.spec.device, precision=prep.spec.precision)
    deadline = first * min(len(c.train) for c in prep.spec.clients) / 1e6 * 1.01
    overrides = [*base, f"federation.round_timeout={deadline}"]
    prep = prepare_run(to_run_config(compose_config(overrides)), quiet=True)
    tiers = [p.tier for p in prep.fleet.profiles]
    assert [client_exits(prep.spec, c) for c in range(6)] == [[0, 1] if t else [0]
                                                              for t in tiers]
    _run(tmp_path / "anytime", [*overrides[3:], "method=lw_linear", "backbone=tiny_vit",
                                "rounds=1", "partition.fraction_fit=1.0"], cache_dir)
    (row,) = read_jsonl(tmp_path / "anytime" / "metrics.jsonl")
    assert row["clients_trained"] + row["sim_late"] == 6 and row["global_acc"] is not None


def test_keep_first_ends_the_round_at_the_nth_of_distinct_arrivals():
    """Pins the fleet's ``keep_first`` off by one (the round ending at the (N+1)-th arrival, or
    keeping N+1): four clients of one speed with works 10, 20, 30, 40 arrive at 1, 2, 3, 4 s;
    ``keep_first=2`` keeps the first two and the round lasts 2 s."""
    fleet = Fleet(TiersFleet(compute=[10.0], keep_first=2), 4, 0,
                  [30.0, 10.0, 40.0, 20.0])
    dropped, seconds = fleet.round(0.0, [0, 1, 2, 3], {}, {})
    assert dropped == {0: "discarded", 2: "discarded"}
    assert seconds == pytest.approx(2.0)
    dropped, seconds = fleet.round(5.0, [0, 3], {}, {})  # no more than N: all kept
    assert dropped == {} and seconds == pytest.approx(3.0)


def test_a_client_going_offline_ends_the_round_at_its_time_online_after_the_start():
    """Pins an offline period ending at ``until`` (an absolute time) instead of ``until -
    start`` (seconds into the round): a round that starts at t > 0 with a client that goes
    offline before it finishes lasts ``until - start``."""
    cfg = TiersFleet(compute=[1.0], mean_on=30.0, mean_off=10.0)
    probe = Fleet(cfg, 50, 0, [1.0] * 50)
    start = 100.0
    cid = probe.available(start)[0]
    until = probe.online_until(cid, start)
    assert until > start
    slow = Fleet(cfg, 50, 0, [2 * (until - start)] * 50)  # twice its time left online
    dropped, seconds = slow.round(start, [cid], {}, {})
    assert dropped == {cid: "offline"}
    assert seconds == pytest.approx(until - start)
    assert seconds < until - 1  # seconds into the round, not the clock's time


def test_a_client_late_at_the_simulated_deadline_is_in_late_clients_and_sends_nothing(
        tmp_path, cache_dir):
    """A client the fleet's clock drops at the deadline is listed in ``late_clients`` (as a real
    timeout's is) and its upload, which never arrives, is not in ``bytes_up``; it did download
    the model (``bytes_down``)."""
    import json

    fleet = ["fleet=tiers", "fleet.compute=[1e3,1e6]", "partition.fraction_fit=1.0", "rounds=1"]
    _run(tmp_path / "all", fleet, cache_dir)
    (ref,) = read_jsonl(tmp_path / "all" / "metrics.jsonl")
    described = json.loads((tmp_path / "all" / "fleet.json").read_text())["clients"]
    assert ref["clients_trained"] == 6 and ref["sim_late"] == 0
    up = ref["bytes_up"] / 6  # each client sends the same tensors
    fast_s = max(c["train_flops"] / c["compute"] for c in described if c["tier"] == 1)
    slow_s = min(c["train_flops"] / c["compute"] for c in described if c["tier"] == 0)
    _run(tmp_path / "late", [*fleet, f"federation.round_timeout={math.sqrt(fast_s * slow_s)}"],
         cache_dir)
    (row,) = read_jsonl(tmp_path / "late" / "metrics.jsonl")
    slow = sorted(c["client"] for c in described if c["tier"] == 0)
    assert row["sim_late"] == len(slow) > 0 and row["late_clients"] == slow
    assert row["clients_trained"] == 6 - len(slow)
    assert row["bytes_up"] == up * (6 - len(slow))  # the late clients' uploads never arrive
    assert row["bytes_down"] == ref["bytes_down"]  # every sampled client downloaded the model


def test_fedbuffs_train_loss_is_the_buffer_it_applied(tmp_path, cache_dir):
    """With more clients in flight than a buffer holds, a round's ``train_loss`` is the mean
    loss of the updates the server applied (``strategy/train/train_loss``), not of the clients
    that started in that round."""
    buff = ["fleet=tiers", "fleet.compute=[1e6,1e7]", "partition.fraction_fit=0.5",
            "strategy=fedbuff", "strategy.buffer_size=2", "strategy.concurrency=3", "rounds=3",
            "federation.eval_every=3"]
    _run(tmp_path / "buff", buff, cache_dir)
    rows = read_jsonl(tmp_path / "buff" / "metrics.jsonl")
    assert all(r["clients_sampled"] > 0 for r in rows)
    assert [r["train_loss"] for r in rows] == [r["strategy/train/train_loss"] for r in rows]


# -- fleet.partial_work ------------------------------------------------------------------------

def test_a_client_that_cannot_finish_trains_the_examples_it_can_by_the_deadline():
    """Worked by hand: 20 examples, 1 FLOP each, 300 bytes down at 100 B/s and 100 up at
    50 B/s (5 s), a deadline of 10 s. The 1 FLOP/s device has 5 s left to train: 5 examples,
    arriving at 10 s. The 10 FLOP/s device trains all 20 (2 s + 5 s)."""
    cfg = TiersFleet(compute=[1.0, 10.0], downlink=100.0, uplink=50.0,
                      partial_work=True)
    fleet = Fleet(cfg, 4, 0, [20.0] * 4, deadline=10.0, examples=[20] * 4)
    slow = [c for c, p in enumerate(fleet.profiles) if p.tier == 0]
    fast = [c for c in range(4) if c not in slow]
    assert [fleet.partial_examples(c, 300, 100) for c in slow] == [5] * len(slow)
    assert [fleet.partial_examples(c, 300, 100) for c in fast] == [20] * len(fast)
    assert fleet.partial_examples(slow[0], 1000, 0) == 0  # its bytes alone take the deadline
    trained = {c: 5 for c in slow}
    dropped, seconds = fleet.round(0.0, [0, 1, 2, 3], {c: 300 for c in range(4)},
                                   {c: 100 for c in range(4)}, trained)
    assert dropped == {} and seconds == pytest.approx(10.0)
    assert fleet.seconds(slow[0], 300, 100, 5) == pytest.approx(10.0)
    without = _fleet([20.0] * 4, deadline=10.0)
    assert without.round(0.0, [0, 1, 2, 3], {c: 300 for c in range(4)},
                         {c: 100 for c in range(4)})[0] == {c: "late" for c in slow}
    # partial work: a deadline is met when one example fits in it
    Fleet(cfg, 4, 0, [20.0] * 4, deadline=1.5, examples=[20] * 4)
    with pytest.raises(ConfigError, match="fastest needs 0.1 simulated seconds to train one"):
        Fleet(cfg, 4, 0, [20.0] * 4, deadline=0.05, examples=[20] * 4)


#: (client, train-examples in its config, num-examples and unit-weight in its reply) per
#: trained client, recorded by :func:`recording_mod`.
SEEN: list[tuple] = []


def recording_mod(msg, context, call_next):
    reply = call_next(msg, context)
    metrics = reply.content["metrics"]
    SEEN.append((int(context.node_config["partition-id"]),
                 msg.content["config"].get("train-examples"), int(metrics["num-examples"]),
                 float(metrics["unit-weight"])))
    return reply


def test_partial_work_sends_what_was_trained_by_the_deadline_weighted_by_it(tmp_path,
                                                                           cache_dir):
    """fleet.partial_work=true with a deadline between the tiers: the slow clients train a
    share of their examples and arrive in time (``sim_partial``, none late), their replies
    weighted by the examples they trained; with a generous deadline nothing is cut and the run
    is the run without partial work, to the digit."""
    import json

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    fleet = ["fleet=tiers", "fleet.compute=[1e3,1e6]", "partition.fraction_fit=1.0", "rounds=2",
             "federation.train_mods=[test_fleet:recording_mod]"]
    _run(tmp_path / "ref", [*fleet, "federation.round_timeout=1e9"], cache_dir)
    SEEN.clear()
    _run(tmp_path / "generous", [*fleet, "federation.round_timeout=1e9", "fleet.partial_work=true"],
         cache_dir)
    ref, generous = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("ref", "generous"))
    keys = ("global_loss", "global_acc", "train_loss", "sim_time_s", "bytes_up", "client_acc")
    assert [[r[k] for k in keys] for r in generous] == [[r[k] for k in keys] for r in ref]
    assert [r["sim_partial"] for r in generous] == [0, 0] and "sim_partial" not in ref[0]
    assert all(cut is None and share == 1.0 for _, cut, _, share in SEEN)

    described = json.loads((tmp_path / "ref" / "fleet.json").read_text())["clients"]
    slow = sorted(c["client"] for c in described if c["tier"] == 0)
    fast_s = max(c["train_flops"] / c["compute"] for c in described if c["tier"] == 1)
    slow_s = min(c["train_flops"] / c["compute"] for c in described if c["tier"] == 0)
    deadline = math.sqrt(fast_s * slow_s)
    SEEN.clear()
    overrides = [*fleet, f"federation.round_timeout={deadline}", "fleet.partial_work=true"]
    _run(tmp_path / "cut", overrides, cache_dir)
    rows = read_jsonl(tmp_path / "cut" / "metrics.jsonl")
    assert all(r["sim_partial"] == len(slow) and r["sim_late"] == 0 and r["late_clients"] == []
               and r["clients_trained"] == 6 and r["sim_round_s"] <= deadline for r in rows)
    assert rows[0]["bytes_up"] == ref[0]["bytes_up"]  # every client's update arrived
    sizes = [len(c.train) for c in prepare_run(to_run_config(compose_config(
        [*TINY, *overrides, f"cache_dir={cache_dir}"])), quiet=True).spec.clients]
    assert len(SEEN) == 12
    for cid, cut, sent, share in SEEN:
        if cid in slow:  # trained the examples it could: so many in its reply, and its share
            assert 0 < cut < sizes[cid] and sent == cut and share == cut / sizes[cid]
        else:
            assert cut is None and sent == sizes[cid] and share == 1.0


# -- fleet.memory ------------------------------------------------------------------------------

def test_training_memory_is_weights_gradients_optimizer_state_and_activations():
    """By hand. A linear head on 16 features, 10 classes (680 bytes of fp32 weights), SGD with
    momentum: the weights, their gradients and momentum (3 x 680), the 0-d total weight
    cross-entropy keeps (4); per example the features the weight's gradient needs (16 x 4),
    the log-softmax output (10 x 4) and the label (8). A frozen first layer adds its weights
    only, and the step keeps its ReLU's output (32 x 4) instead of the input."""
    import torch

    from fedadapt.federation.simulation.fleet import train_memory_bytes

    class Source:
        def get(self, idx, device):
            return torch.randn(len(idx), 16), torch.zeros(len(idx), dtype=torch.long)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(16, 10)

        def training_loss(self, x, y):
            return torch.nn.functional.cross_entropy(self.fc(x), y)

    class Frozen(Head):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16).requires_grad_(False)

        def training_loss(self, x, y):
            return super().training_loss(torch.relu(self.a(x)), y)

    at = dict(device="cpu", precision="fp32")
    head = 4 * (16 * 10 + 10)
    assert train_memory_bytes(Head(), Source(), 0, None, optimizer_states=1, **at) == (
        3 * head + 4, 4 * 16 + 4 * 10 + 8)
    assert train_memory_bytes(Head(), Source(), 0, None, optimizer_states=2, **at)[0] == (
        4 * head + 4)  # Adam: two moments
    frozen = 4 * (16 * 16 + 16)
    assert train_memory_bytes(Frozen(), Source(), 0, None, optimizer_states=0, **at) == (
        frozen + 2 * head + 4, 4 * 16 + 4 * 10 + 8)
    # a step that trains nothing reads its weights and saves nothing for a backward: its
    # weights alone, none per example (pins a floor of 1 byte per example; fleet.py's mutants)
    assert train_memory_bytes(Head().requires_grad_(False), Source(), 0, None,
                              optimizer_states=1, **at) == (head, 0.0)


def test_memory_goes_with_compute_and_a_device_too_small_is_never_sampled():
    from fedadapt.federation.simulation.fleet import assign_memory

    cfg = TiersFleet(compute=[1.0, 10.0], memory=[1e3, 5e3, 9e3],
                      memory_fractions=[0.25, 0.5, 0.25])
    assert assign_memory(cfg, [5.0, 1.0, 9.0, 2.0]) == [5e3, 1e3, 9e3, 5e3]
    cfg = TiersFleet(compute=[1.0, 10.0], memory=[1e3, 9e3])
    fleet = Fleet(cfg, 4, 0, [1.0] * 4, train_memory=[2e3] * 4)
    slow = [c for c, p in enumerate(fleet.profiles) if p.tier == 0]
    assert [p.memory for p in fleet.profiles] == [1e3 if c in slow else 9e3 for c in range(4)]
    assert fleet.fits == [c not in slow for c in range(4)]
    assert fleet.describe()["clients"][slow[0]]["fits"] is False
    with pytest.raises(ConfigError) as err:
        Fleet(cfg, 4, 0, [1.0] * 4, train_memory=[1e4] * 4)
    text = str(err.value)
    assert text.startswith("fleet.memory=[1000.0, 9000.0] is invalid: no device can hold")
    assert "\n" not in text
    # a client that does not fit is not waited for: the next start is a fitting one's
    trace = TiersFleet(compute=[1.0, 10.0], memory=[1e3, 9e3], mean_on=30.0,
                        mean_off=10.0)
    onoff = Fleet(trace, 40, 0, [1.0] * 40, train_memory=[2e3] * 40)
    t = onoff.next_available(0.0)
    assert any(onoff.fits[c] for c in onoff.available(t))


def test_a_client_whose_training_does_not_fit_is_not_sampled(tmp_path, cache_dir):
    import json

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    fleet = ["fleet=tiers", "fleet.compute=[1e6,1e7]", "partition.fraction_fit=1.0",
             "rounds=1"]
    prep = prepare_run(to_run_config(compose_config(
        [*TINY, *fleet, "fleet.memory=[1e12]", f"cache_dir={cache_dir}"])), quiet=True)
    need = prep.fleet.train_memory
    assert len(set(need)) >= 1 and min(need) > 0
    cap = min(need) / 2
    _run(tmp_path / "cap", [*fleet, f"fleet.memory=[{cap},1e12]"], cache_dir)
    (row,) = read_jsonl(tmp_path / "cap" / "metrics.jsonl")
    described = json.loads((tmp_path / "cap" / "fleet.json").read_text())["clients"]
    small = [c["client"] for c in described if c["memory"] == cap]
    assert small == [c["client"] for c in described if c["tier"] == 0]  # the slowest
    assert all(not c["fits"] for c in described if c["client"] in small)
    assert row["sim_no_memory"] == len(small) == 3 and row["clients_sampled"] == 3
    with pytest.raises(ConfigError) as err:
        prepare_run(to_run_config(compose_config([*TINY, *fleet, f"fleet.memory=[{cap}]",
                                                  f"cache_dir={cache_dir}"])), quiet=True)
    assert str(err.value).startswith(f"fleet.memory=[{cap}] is invalid: no device can hold")


def test_tiers_from_the_fleet_take_the_deepest_exit_that_fits_in_memory(cache_dir):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.simulation.fleet.costs import _batch_of, _memory_at

    base = ["method=lw_linear", "backbone=tiny_vit", "dataset.max_samples=300",
            "partition.num_clients=6", "setting=multitier", "setting.tiers_from=fleet",
            "fleet=tiers", "fleet.compute=[1e6,1e9]", "federation.round_timeout=1e9",
            f"cache_dir={cache_dir}"]
    prep = prepare_run(to_run_config(compose_config(base)), quiet=True)
    spec = prep.spec
    assert set(spec.client_exits) == {1}  # a generous deadline, no cap: all the way
    at = [[_memory_at(spec, prep.model, [e], _batch_of(spec, c)) for c in spec.clients]
          for e in (0, 1)]
    assert max(at[0]) < min(at[1])  # the deeper exit holds more
    prep = prepare_run(to_run_config(compose_config(
        [*base, f"fleet.memory=[{max(at[0])},1e12]"])), quiet=True)
    tiers = [p.tier for p in prep.fleet.profiles]
    assert prep.spec.client_exits == [1 if t == 1 else 0 for t in tiers]
    assert all(prep.fleet.fits)  # each at an exit its device holds
    assert prep.fleet.train_memory == [at[e][c] for c, e in enumerate(prep.spec.client_exits)]


def test_fleet_json_describes_each_clients_device_and_work():
    """``fleet.json``: the config, the seed, the deadline, and per client its profile and its
    training FLOPs, as the fleet uses them."""
    cfg = TiersFleet(compute=[1.0, 10.0], downlink=100.0, uplink=50.0)
    fleet = Fleet(cfg, 3, 7, [5.0, 6.0, 7.0], deadline=9.0)
    got = fleet.describe()
    assert got["seed"] == 7 and got["deadline_s"] == 9.0 and got["config"]["compute"] == [1.0, 10.0]
    assert got["clients"] == [{"client": c, "compute": p.compute, "downlink": 100.0,
                               "uplink": 50.0, "tier": p.tier, "train_flops": w}
                              for c, (p, w) in enumerate(zip(fleet.profiles, [5.0, 6.0, 7.0]))]


def test_a_clients_work_is_its_flops_per_example_times_examples_and_epochs(cache_dir):
    """``build_fleet``: client c's training FLOPs in a round are the FLOPs per example at its
    exit x its training examples x the local epochs (2 here, so a product is told from a
    quotient)."""
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run
    from fedadapt.federation.client.worker import first_train_index
    from fedadapt.federation.simulation.fleet import train_flops_per_example

    prep = prepare_run(to_run_config(compose_config([
        "method=lw_linear", "backbone=tiny_vit", "dataset.max_samples=300",
        "partition.num_clients=6", "setting=multitier", "setting.tiers=[0,1,0,1,0,1]",
        "fleet=tiers", "fleet.compute=[1e6,1e9]", "train.local_epochs=2",
        f"cache_dir={cache_dir}"])), quiet=True)
    spec = prep.spec
    at = dict(device=spec.device, precision=spec.precision)
    per_exit = {e: train_flops_per_example(prep.model, spec.train_source,
                                           first_train_index(spec), [e], **at) for e in (0, 1)}
    assert per_exit[0] < per_exit[1]
    assert prep.fleet.work == pytest.approx(
        [per_exit[spec.client_exits[c]] * len(client.train) * 2
         for c, client in enumerate(spec.clients)], rel=1e-12)
    assert len({len(c.train) for c in spec.clients}) > 1  # sizes differ: per client, not mean


@pytest.mark.parametrize("kwargs,says", [
    (dict(buffer_size=0), "strategy.buffer_size=0 is invalid: an integer >= 1"),
    (dict(buffer_size=2.0), "strategy.buffer_size=2.0 is invalid: an integer >= 1"),
    (dict(buffer_size=True), "strategy.buffer_size=True is invalid"),
    (dict(concurrency=-1), "strategy.concurrency=-1 is invalid: an integer >= 0"),
    (dict(concurrency=1.5), "strategy.concurrency=1.5 is invalid"),
    (dict(server_lr=0.0), "strategy.server_lr=0.0 is invalid: must be > 0"),
    (dict(server_lr=float("inf")), "strategy.server_lr=inf is invalid"),
    (dict(server_lr="1"), "strategy.server_lr='1' is invalid"),
    (dict(staleness="hinge"), "strategy.staleness='hinge' is invalid: one of ('sqrt', "
                              "'constant')"),
    (dict(buffer_size=4, concurrency=3), "strategy.concurrency=3 is invalid: below "
                                         "strategy.buffer_size=4"),
])
def test_fedbuffs_settings_are_checked_naming_the_key(kwargs, says):
    from fedadapt.strategies.fedbuff import FedBuff

    with pytest.raises(ConfigError) as err:
        FedBuff(**kwargs)
    assert str(err.value).startswith(says), str(err.value)


def test_fedbuffs_concurrency_defaults_to_the_clients_a_round_samples():
    """``concurrency=0``: the clients a round would sample (``fraction_train`` of them), at
    least ``buffer_size``; FedBuff starts with nothing in flight, version 0, no arrivals."""
    from fedadapt.strategies.fedbuff import FedBuff

    assert FedBuff(buffer_size=2, num_clients=10, fraction_train=0.5).concurrency == 5
    assert FedBuff(buffer_size=3, num_clients=10, fraction_train=0.2).concurrency == 3
    assert FedBuff(buffer_size=2, concurrency=7, num_clients=10).concurrency == 7
    fresh = FedBuff(buffer_size=1)
    assert (fresh.version, fresh.now, fresh.in_flight, fresh.arrivals) == (0, 0.0, [], {})


def test_a_fedbuff_checkpoint_keyed_by_partition_id_is_refused_in_one_line():
    """FedBuff's clients in flight were keyed by partition id (``cid``) before it took its
    arrivals by node id through :class:`AsynchronousStrategy`; such a checkpoint's state is
    refused naming the strategy, not a KeyError from inside it."""
    from flwr.app import ArrayRecord, ConfigRecord

    from fedadapt.strategies.fedbuff import FedBuff
    from fedadapt.strategies.state import StrategyStateError

    old = FedBuff(buffer_size=1)
    old.in_flight = [{"cid": 3, "version": 0, "finish": 1.0, "weight": 1.0, "loss": 0.5,
                      "delta": {}}]
    with pytest.raises(StrategyStateError, match="^strategy=fedbuff: this checkpoint's"):
        old.configure_train(2, ArrayRecord(), ConfigRecord({}), grid=None)
