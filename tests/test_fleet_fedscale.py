"""fleet=fedscale (fedadapt/federation/simulation/fleet.py): FedScale's two device traces,
pickles in exactly the format FedScale publishes (client_device_capacity: client id ->
{'computation': ms per sample, 'communication': kbit/s}; client_behave_trace: client id ->
{'duration', 'inactive', 'finish_time', 'active', 'model'}), read as FedScale's simulator reads
them; a trace that tries to run code is refused; bad input in one line naming the key."""

import json
import math
import pickle

import numpy as np
import pytest

from fedadapt.config import ConfigError
from fedadapt.federation.simulation.fleet import (
    FedScaleFleet,
    Fleet,
    draw_entries,
    read_behaviour,
    read_capacity,
)
from fedadapt.results.store import read_jsonl

#: Six devices as FedScale's client_device_capacity holds them (ids from 1, floats).
CAPACITY = {1: {"computation": 40.0, "communication": 800.0},
            2: {"computation": 125.5, "communication": 2048.0},
            3: {"computation": 12.0, "communication": 5648.109619499134},
            4: {"computation": 300.0, "communication": 150.0},
            5: {"computation": 80.0, "communication": 1000.0},
            6: {"computation": 20.0, "communication": 12000.0}}
#: Availability as FedScale's client_behave_trace holds it (seconds into a cycle of
#: finish_time).
BEHAVIOUR = {3834: {"duration": 40, "inactive": [30, 90], "finish_time": 100,
                    "active": [10, 60], "model": "CPH1801"},
             17: {"duration": 100, "inactive": [100], "finish_time": 100, "active": [0],
                  "model": "SM-G950F"}}


def _pickle(path, data):
    path.write_bytes(pickle.dumps(data))
    return str(path)


def test_capacity_is_ms_per_sample_times_three_and_kbps_both_ways(tmp_path):
    """A client's time by hand: 3 x its ms per sample x the examples it trains / 1000, plus
    the kbit it receives and sends (bytes / 1024 * 8, as FedScale sizes a model) over its
    kbit/s. The run's reference FLOPs (its model's own training step) scale out."""
    cfg = FedScaleFleet(capacity=_pickle(tmp_path / "cap", CAPACITY))
    reference = 7.5e6  # FLOPs per example of the model's own training step
    examples = [40, 25, 60, 10, 33, 8]
    fleet = Fleet(cfg, 6, 0, [reference * n * 2 for n in examples], reference_flops=reference)
    assert sorted(p.capacity_id for p in fleet.profiles) == [1, 2, 3, 4, 5, 6]
    for cid, p in enumerate(fleet.profiles):
        ms, kbps = (CAPACITY[p.capacity_id][k] for k in ("computation", "communication"))
        by_hand = 3 * ms * examples[cid] * 2 / 1000 + (51200 + 20480) / 1024 * 8 / kbps
        assert fleet.seconds(cid, 51200, 20480) == pytest.approx(by_hand, rel=1e-12)
        assert (p.ms_per_sample, p.kbps) == (ms, kbps)
    # one client by hand, written out: entry 4 (300 ms, 150 kbit/s)
    four = next(c for c, p in enumerate(fleet.profiles) if p.capacity_id == 4)
    n = examples[four] * 2
    # 3 x 300 ms a sample; 70 KiB down and up = 560 kbit at 150 kbit/s
    assert fleet.seconds(four, 51200, 20480) == pytest.approx(0.9 * n + 560 / 150)


def test_availability_cycles_with_finish_time(tmp_path):
    cfg = FedScaleFleet(capacity=_pickle(tmp_path / "cap", CAPACITY),
                      behaviour=_pickle(tmp_path / "beh", BEHAVIOUR))
    fleet = Fleet(cfg, 6, 0, [1.0] * 6)
    on = [c for c, p in enumerate(fleet.profiles) if p.behaviour_id == 3834]
    always = [c for c, p in enumerate(fleet.profiles) if p.behaviour_id == 17]
    assert len(on) == len(always) == 3  # 6 clients, 2 entries: each used 3 times
    c = on[0]
    assert fleet.online_until(c, 5.0) is None and fleet.online_until(c, 15.0) == 30.0
    assert fleet.online_until(c, 45.0) is None and fleet.online_until(c, 60.0) == 90.0
    # the next cycles: the same intervals every 100 s
    assert fleet.online_until(c, 115.0) == 130.0 and fleet.online_until(c, 1075.0) == 1090.0
    assert fleet.online_until(c, 1095.0) is None
    # available through the whole cycle: always on
    assert all(fleet.online_until(always[0], t) == math.inf for t in (0.0, 99.9, 100.0, 1e5))
    assert fleet.available(40.0) == sorted(always)
    assert fleet.offline_before(c, 15.0, 10.0) is None  # 15 + 10 < 30
    assert fleet.offline_before(c, 15.0, 20.0) == 30.0
    only = Fleet(FedScaleFleet(capacity=cfg.capacity,
                             behaviour=_pickle(tmp_path / "one", {3834: BEHAVIOUR[3834]})),
                 6, 0, [1.0] * 6)
    assert only.next_available(40.0) == 60.0 and only.next_available(95.0) == 110.0
    # an interval to the cycle's end joins the next cycle's from 0: one interval, 90 -> 130
    wrap = Fleet(FedScaleFleet(capacity=cfg.capacity, behaviour=_pickle(
        tmp_path / "wrap", {1: {"active": [0, 90], "inactive": [30, 100], "finish_time": 100,
                                "duration": 1, "model": "m"}})), 2, 0, [1.0] * 2)
    assert wrap.online_until(0, 95.0) == 130.0 and wrap.online_until(0, 4995.0) == 5030.0
    assert wrap.offline_before(0, 95.0, 30.0) is None
    assert wrap.offline_before(0, 95.0, 40.0) == 130.0


def test_clients_get_entries_by_a_seeded_draw_and_reuse_is_said(tmp_path):
    keys = list(range(1, 11))
    a = draw_entries(keys, 4, np.random.default_rng(0))
    assert len(set(a)) == 4 and a == draw_entries(keys, 4, np.random.default_rng(0))
    assert a != draw_entries(keys, 4, np.random.default_rng(1))
    many = draw_entries(keys, 25, np.random.default_rng(0))  # more clients than entries
    assert sorted(np.unique(many, return_counts=True)[1]) == [2] * 5 + [3] * 5
    cfg = FedScaleFleet(capacity=_pickle(tmp_path / "cap", CAPACITY))
    fleet = Fleet(cfg, 14, 3, [1.0] * 14)
    (note,) = fleet.notes()
    assert "14 clients and 6 entries in fleet.capacity: entries are reused" in note
    assert "at most 3 clients" in note
    described = fleet.describe()
    assert described["notes"] == [note]
    assert [c["capacity_id"] for c in described["clients"]] == [
        p.capacity_id for p in fleet.profiles]
    assert Fleet(cfg, 6, 3, [1.0] * 6).notes() == []


class _RunsCode:
    """A pickle payload: unpickling it calls a function (here one that writes a file)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_trace_that_tries_to_run_code_is_refused(tmp_path):
    target = tmp_path / "written-by-the-pickle"
    bad = {1: {"computation": 1.0, "communication": _RunsCode(str(target))}}
    path = _pickle(tmp_path / "evil", bad)
    with pytest.raises(ConfigError) as err:
        read_capacity(path)
    text = str(err.value)
    assert text.startswith(f"fleet.capacity={path!r} is invalid: refused") and "open" in text
    assert "\n" not in text and not target.exists()
    import os

    evil = tmp_path / "system"
    evil.write_bytes(b"cos\nsystem\n(S'touch " + str(target).encode() + b"'\ntR.")
    with pytest.raises(ConfigError, match="names os.system"):
        read_behaviour(str(evil))
    assert not target.exists() and os.path.exists(evil)
    pickle.loads(open(path, "rb").read())  # what Python's own unpickler does with it
    assert target.exists()


def test_numpy_numbers_are_read_as_numbers(tmp_path):
    cap = {1: {"computation": np.float64(40.0), "communication": np.float32(800.0)},
           np.int64(2).item(): {"computation": np.int32(7), "communication": 12.5}}
    got = read_capacity(_pickle(tmp_path / "cap", cap))
    assert got == {1: (40.0, 800.0), 2: (7.0, 12.5)}
    with pytest.raises(ConfigError, match="refused"):
        read_capacity(_pickle(tmp_path / "arr", {1: {"computation": np.ones(2),
                                                     "communication": 1.0}}))


@pytest.mark.parametrize("data, says", [
    ([1, 2], "it holds list"),
    ({}, "it holds an empty dict"),
    ({1: [40.0, 800.0]}, "client 1's entry is list, not a dict"),
    ({1: {"computation": 40.0}}, "client 1 has no 'communication'"),
    ({1: {"computation": "fast", "communication": 1.0}}, "client 1 has 'fast' 'computation'"),
    ({1: {"computation": -40.0, "communication": 800.0}},
     "client 1's 'computation' is -40.0: a speed must be > 0"),
    ({1: {"computation": 40.0, "communication": 0.0}}, "client 1's 'communication' is 0.0"),
    ({(1, 2): {"computation": 40.0, "communication": 1.0}}, "client id (1, 2) is not"),
])
def test_a_bad_capacity_is_one_line_naming_the_key(tmp_path, data, says):
    path = _pickle(tmp_path / "cap", data)
    with pytest.raises(ConfigError) as err:
        read_capacity(path)
    text = str(err.value)
    assert text.startswith(f"fleet.capacity={path!r} is invalid: ") and says in text, text
    assert "\n" not in text


@pytest.mark.parametrize("entry, says", [
    ({"active": [10], "inactive": [5], "finish_time": 100}, "'active' 10 and 'inactive' 5"),
    ({"active": [10, 20], "inactive": [15], "finish_time": 100}, "2 'active' and 1 'inactive'"),
    ({"active": [10], "inactive": [15], "finish_time": 0}, "'finish_time' is 0"),
    ({"active": "10", "inactive": [15], "finish_time": 100}, "'active' is not a list"),
    ({"active": [-1], "inactive": [15], "finish_time": 100}, "'active' -1 and"),
])
def test_a_bad_behaviour_is_one_line_naming_the_key(tmp_path, entry, says):
    path = _pickle(tmp_path / "beh", {7: entry})
    with pytest.raises(ConfigError) as err:
        read_behaviour(path)
    text = str(err.value)
    assert text.startswith(f"fleet.behaviour={path!r} is invalid: client 7") and says in text
    assert "\n" not in text


def test_intervals_are_sorted_merged_and_cut_at_finish_time(tmp_path):
    path = _pickle(tmp_path / "beh", {1: {"active": [50, 0, 20, 95], "inactive": [60, 25, 30, 140],
                                          "finish_time": 100, "duration": 1, "model": "x"}})
    assert read_behaviour(path) == {1: (100.0, [(0.0, 30.0), (50.0, 60.0), (95.0, 100.0)])}


def test_missing_files_say_where_fedscale_publishes_them(tmp_path):
    from fedadapt.entry import compose_config, to_run_config

    missing = str(tmp_path / "client_device_capacity")
    with pytest.raises(ConfigError) as err:
        read_capacity(missing)
    text = str(err.value)
    assert text.startswith(f"fleet.capacity={missing!r} is invalid: no such file")
    assert "github.com/SymbioticLab/FedScale" in text and "device_info" in text
    assert "\n" not in text
    with pytest.raises(ConfigError) as err:
        to_run_config(compose_config(["method=linear_head", "backbone=small_cnn",
                                      "fleet=fedscale"]))
    assert str(err.value).startswith("fleet.capacity=None is invalid")
    assert "github.com/SymbioticLab/FedScale" in str(err.value)


def test_a_run_on_fedscale_traces_times_each_client_as_fedscale_would(tmp_path, cache_dir):
    """A run on generated files in FedScale's format: fleet.json holds each client's trace
    entries and speeds as the files give them, and the round lasts as long as its slowest
    client's FedScale time, worked out here by hand (3 x ms per sample x its examples / 1000,
    plus its model down and up in kbit over its kbit/s)."""
    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run, run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    behaviour = {i: {"duration": 5000, "inactive": [5000], "finish_time": 10000,
                     "active": [0], "model": f"phone-{i}"} for i in (10, 20)}
    overrides = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
                 "dataset.max_samples=300", "partition.num_clients=6", "rounds=1",
                 "partition.fraction_fit=1.0", "fleet=fedscale",
                 f"fleet.capacity={_pickle(tmp_path / 'client_device_capacity', CAPACITY)}",
                 f"fleet.behaviour={_pickle(tmp_path / 'client_behave_trace', behaviour)}",
                 f"cache_dir={cache_dir}"]
    composed = compose_config(overrides)
    run_experiment(to_run_config(composed), tmp_path / "run", execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True))
    (row,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    described = json.loads((tmp_path / "run" / "fleet.json").read_text())
    clients = described["clients"]
    assert sorted(c["capacity_id"] for c in clients) == [1, 2, 3, 4, 5, 6]  # 6 of 6, distinct
    assert {c["behaviour_id"] for c in clients} == {10, 20}
    for c in clients:
        entry = CAPACITY[c["capacity_id"]]
        assert (c["ms_per_sample"], c["kbps"]) == (entry["computation"],
                                                   entry["communication"])
        assert c["cycle_s"] == 10000 and c["available"] == [[0, 5000]]
    examples = [len(c.train) for c in prepare_run(to_run_config(composed), quiet=True)
                .spec.clients]
    assert row["clients_trained"] == 6 and row["sim_unavailable"] == 0
    kbit = row["bytes_up"] / 6 / 1024 * 8  # a linear head receives what it sends back
    by_hand = [3 * CAPACITY[c["capacity_id"]]["computation"] * examples[c["client"]] / 1000
               + 2 * kbit / CAPACITY[c["capacity_id"]]["communication"] for c in clients]
    assert row["sim_round_s"] == pytest.approx(max(by_hand), rel=1e-9)
    assert row["sim_time_s"] == pytest.approx(max(by_hand), rel=1e-9)
