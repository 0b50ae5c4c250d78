"""The simulated fleet to the word and to the boundary: each trace refusal's whole line, the
bounds an interval or a cycle may touch, the optimiser's state count that sizes a client's
memory. Written for fleet.py's mutation survivors (docs/reliability.md): each docstring names
the bugs it pins."""

import pickle

import numpy as np
import pytest

from fedadapt.config import ConfigError, TrainConfig
from fedadapt.federation.simulation import fleet as F
from fedadapt.federation.simulation.fleet import (
    FEDSCALE_TRACES,
    FedScaleFleet,
    LognormalFleet,
    TiersFleet,
    TraceFleet,
    costs,
    traces,
)

BEHAVE = ("a pickled dict of client id -> {'active': [s], 'inactive': [s], 'finish_time': s, "
          "...} (FedScale's client_behave_trace)")
CAPACITY = ("a pickled dict of client id -> {'computation': ms per sample, 'communication': "
            "kbit/s} (FedScale's client_device_capacity)")


def pickled(tmp_path, data, name="trace.pkl") -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data))
    return str(path)


def refusal(call, *args) -> str:
    with pytest.raises(ConfigError) as err:
        call(*args)
    return str(err.value)


@pytest.mark.parametrize("optimizer,momentum,states", [
    ("sgd", 0.0, 0), ("sgd", 0.9, 1), ("adam", 0.0, 2), ("adamw", 0.9, 2)])
def test_optimizer_states_are_adams_two_moments_or_sgds_momentum(optimizer, momentum, states):
    """The optimiser tensors held per trainable tensor (the memory a client needs): Adam and
    AdamW two, SGD with momentum one, plain SGD none. Pins every branch of it."""
    assert F.optimizer_states(TrainConfig(optimizer=optimizer, momentum=momentum)) == states


def test_each_behaviour_refusal_is_its_whole_line(tmp_path):
    """Every way a client_behave_trace entry is refused, in its words, naming the key, the
    client and what is needed: pins each message lost or changed, the shape's description lost,
    and the checks joined by ``or`` where they need ``and``."""
    where = lambda p: f"fleet.behaviour={p!r} is invalid"  # noqa: E731

    def says(entry):
        path = pickled(tmp_path, {7: entry})
        return refusal(F.read_behaviour, path), where(path)

    msg, w = says([1, 2])
    assert msg == f"{w}: client 7's entry is list, not a dict ({BEHAVE})"
    msg, w = says({"finish_time": 0, "active": [], "inactive": []})
    assert msg == f"{w}: client 7's 'finish_time' is 0: a cycle of > 0 seconds is needed ({BEHAVE})"
    msg, w = says({"finish_time": 10, "active": "0", "inactive": [1]})
    assert msg == f"{w}: client 7's 'active' is not a list of numbers ({BEHAVE})"
    msg, w = says({"finish_time": 10, "active": [0], "inactive": [float("nan")]})
    assert msg == f"{w}: client 7's 'inactive' is not a list of numbers ({BEHAVE})"
    msg, w = says({"finish_time": 10, "active": [0], "inactive": ["1"]})
    assert msg == f"{w}: client 7's 'inactive' is not a list of numbers ({BEHAVE})"
    msg, w = says({"finish_time": 10, "active": [0, 1], "inactive": [2]})
    assert msg == (f"{w}: client 7 has 2 'active' and 1 'inactive' times: one of each per "
                   f"interval")
    msg, w = says({"finish_time": 10, "active": [5], "inactive": [4]})
    assert msg == (f"{w}: client 7's interval 0 has 'active' 5 and 'inactive' 4: it needs "
                   f"0 <= active <= inactive")


def test_a_behaviour_cycle_keeps_only_what_lies_inside_it(tmp_path):
    """A cycle shorter than a second is a cycle (> 0, not > 1); an empty interval (active ==
    inactive) is allowed and dropped; an interval from the cycle's end on is never reached and
    dropped, one across it cut at it: pins ``<`` for ``<=`` (and back) in those bounds, and
    ``or`` for ``and``."""
    path = pickled(tmp_path, {1: {"finish_time": 0.5, "active": [0.1], "inactive": [0.3]},
                              2: {"finish_time": 10, "active": [2, 4, 10, 8],
                                  "inactive": [2, 6, 12, 15]}})
    trace = F.read_behaviour(path)
    assert trace[1] == (0.5, [(0.1, 0.3)])
    assert trace[2] == (10.0, [(4.0, 6.0), (8.0, 10.0)])


def test_each_capacity_refusal_is_its_whole_line(tmp_path):
    """Every way a client_device_capacity entry is refused, in its words: pins the messages and
    the shape's description."""
    def says(entry):
        path = pickled(tmp_path, {"a": entry})
        return refusal(F.read_capacity, path), f"fleet.capacity={path!r} is invalid"

    msg, w = says(3.0)
    assert msg == (f"{w}: client 'a''s entry is float, not a dict with 'computation' and "
                   f"'communication' ({CAPACITY})")
    msg, w = says({"communication": 5.0})
    assert msg == f"{w}: client 'a' has no 'computation': a number is needed ({CAPACITY})"
    msg, w = says({"computation": True, "communication": 5.0})
    assert msg == f"{w}: client 'a' has True 'computation': a number is needed ({CAPACITY})"
    msg, w = says({"computation": 5.0, "communication": 0.0})
    assert msg == f"{w}: client 'a''s 'communication' is 0.0: a speed must be > 0"


def test_each_trace_file_refusal_is_its_whole_line(tmp_path):
    """A missing file says where FedScale publishes its traces; a pickle naming a class, a
    foreign file, a list, an empty dict and a client id that is neither an integer nor a string
    each get their line: pins each message and its parts lost."""
    missing = str(tmp_path / "none.pkl")
    assert refusal(F.read_capacity, missing) == (
        f"fleet.capacity={missing!r} is invalid: no such file ({FEDSCALE_TRACES})")
    evil = tmp_path / "evil.pkl"
    evil.write_bytes(pickle.dumps(np.zeros(2)))
    assert refusal(F.read_capacity, str(evil)).startswith(
        f"fleet.capacity={str(evil)!r} is invalid: refused, it names numpy.")
    junk = tmp_path / "junk.pkl"
    junk.write_bytes(b"")
    assert refusal(F.read_behaviour, str(junk)) == (
        f"fleet.behaviour={str(junk)!r} is invalid: not a pickle FedScale's simulator reads "
        f"(EOFError: Ran out of input)")
    for data, holds in (([1], "list"), ({}, "an empty dict")):
        path = pickled(tmp_path, data, f"{holds}.pkl")
        assert refusal(F.read_behaviour, path) == (
            f"fleet.behaviour={path!r} is invalid: {BEHAVE} (it holds {holds})")
    path = pickled(tmp_path, {1.5: {}}, "float-key.pkl")
    assert refusal(F.read_capacity, path) == (
        f"fleet.capacity={path!r} is invalid: client id 1.5 is not an integer or a string "
        f"({CAPACITY})")


def test_numpy_numbers_in_a_trace_are_read_and_nothing_else_of_numpys(tmp_path):
    """A numpy float or integer in a pickle is read as a Python number; a numpy dtype that is
    not a number's, or a scalar whose bytes are not its dtype's size, is refused before it is
    built: pins the checks of ``_numeric_dtype`` and ``_numeric_scalar`` loosened."""
    path = pickled(tmp_path, {np.int64(3): {"computation": np.float64(2.5),
                                            "communication": np.float32(4.0)}})
    assert F.read_capacity(path) == {3: (2.5, 4.0)}
    assert type(next(iter(F.read_capacity(path)))) is int
    with pytest.raises(pickle.UnpicklingError,
                       match=r"^it names numpy\.dtype\('U5'\); only numbers are read$"):
        traces._numeric_dtype("U5")
    with pytest.raises(pickle.UnpicklingError, match="only numbers are read"):
        traces._numeric_dtype(3)
    assert traces._numeric_dtype("f8") == np.dtype("f8")
    for dtype, data in ((np.dtype("f8"), b"\x00" * 4), (np.dtype("U1"), b"\x00" * 4),
                        ("f8", b"\x00" * 8), (np.dtype("f8"), "x" * 8)):
        with pytest.raises(pickle.UnpicklingError,
                           match="^it holds a numpy scalar that is not a number$"):
            traces._numeric_scalar(dtype, data)
    assert traces._numeric_scalar(np.dtype("i2"), (7).to_bytes(2, "little")) == 7


def test_each_availability_trace_refusal_is_its_whole_line(tmp_path):
    """``fleet.trace``'s CSV: a missing file, no header, a row that is not numbers, a client
    outside the run, an interval that ends before it starts; each in its words: pins each
    message lost or changed."""
    def says(text, clients=3):
        path = tmp_path / "trace.csv"
        path.write_text(text)
        return refusal(F.read_trace, str(path), clients), f"fleet.trace={str(path)!r} is invalid"

    missing = str(tmp_path / "no.csv")
    assert refusal(F.read_trace, missing, 3) == (
        f"fleet.trace={missing!r} is invalid: No such file or directory")
    msg, w = says("a,b\n1,2\n")
    assert msg == (f"{w}: a CSV with the header client,start,end and one row per available "
                   f"interval is needed")
    msg, w = says("client,start,end\n0,x,2\n")
    assert msg == (f"{w}: line 2 ({{'client': '0', 'start': 'x', 'end': '2'}}) is not an "
                   f"integer client and two numbers")
    msg, w = says("client,start,end\n0,0,1\n3,0,1\n")
    assert msg == f"{w}: line 3 names client 3, but the run has clients 0..2"
    msg, w = says("client,start,end\n1,5,5\n")
    assert msg == f"{w}: line 2: an interval needs 0 <= start < end (got 5.0, 5.0)"
    msg, w = says("client,start,end\n")
    assert msg.startswith(f"{w}: a CSV with the header")


def test_tiers_from_the_fleet_cost_an_anytime_cap_at_its_exits_mean(cache_dir):
    """``setting.tiers_from=fleet``: a multi-tier client's exit costs that exit's FLOPs, an
    anytime client's cap the mean of the exits up to it (its steps draw any of them); so a
    deadline between the two costs gives the slow devices exit 1 when anytime and exit 0 when
    multi-tier. ``setting.tiers`` limits a multi-tier client to those exits (the shallowest
    where none fits). On FedScale's devices an exit's time is its share of the whole model's
    FLOPs at 3 x the device's ms per sample. Pins the anytime branch lost or turned round, the
    cost of one exit used for both, ``setting.tiers`` ignored, and FedScale's reference FLOPs
    lost or taken from another model."""
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    base = ["method=lw_linear", "backbone=tiny_vit", "dataset.max_samples=300", "partition=iid",
            "partition.num_clients=6", "setting.tiers_from=fleet", "fleet=tiers",
            "fleet.compute=[1e6,1e9]", f"cache_dir={cache_dir}"]

    def config(*more):  # another fleet kind: tiers' keys are not its keys
        kept = base if not any(m.startswith("fleet=") for m in more) else base[:-3] + base[-1:]
        return to_run_config(compose_config([*kept, *more]))

    prep = prepare_run(config("setting=anytime", "federation.round_timeout=1e9"), quiet=True)
    spec, model = prep.spec, prep.model
    one, both = costs._flops_at(spec, model, [1]), costs._flops_at(spec, model, [0, 1])
    sizes = [len(c.train) for c in spec.clients]
    assert both * max(sizes) * 1.02 < one * min(sizes)  # room for a deadline between them
    deadline = both * max(sizes) / 1e6 * 1.01
    tiers = [p.tier for p in prep.fleet.profiles]
    assert 0 in tiers and 1 in tiers
    for setting, slow_exit in (("anytime", 1), ("multitier", 0)):
        cfg = config(f"setting={setting}", f"federation.round_timeout={deadline}")
        assert F.tiers_from_fleet(cfg, spec, model) == [1 if t else slow_exit for t in tiers]
    cfg = config("setting=multitier", "setting.tiers=[1]", f"federation.round_timeout={deadline}")
    assert F.tiers_from_fleet(cfg, spec, model) == [1] * 6
    # FedScale's devices: an example of the whole model takes 3 x its ms per sample, so an
    # exit's share of that; a deadline between exit 0's and exit 1's time on the slow device
    import pickle as pk

    cap = cache_dir + "/fedscale-capacity.pkl"
    with open(cap, "wb") as fh:
        pk.dump({1: {"computation": 1.0, "communication": 1e6},
                 2: {"computation": 1000.0, "communication": 1e6}}, fh)
    whole = costs._flops_at(spec, model, None)
    n, epochs = max(sizes), spec.train.local_epochs
    f0, f1 = costs._flops_at(spec, model, [0]), one
    slow = lambda flops: flops * n * epochs * 3 * 1000.0 / 1000.0 / whole  # noqa: E731
    assert slow(f0) < slow(f1)
    cfg = config("setting=multitier", "fleet=fedscale", f"fleet.capacity={cap}",
                 f"federation.round_timeout={(slow(f0) + slow(f1)) / 2}")
    ids = [p.capacity_id for p in F.profiles(cfg.fleet, 6, cfg.seed, whole)]
    assert set(ids) == {1, 2}
    assert F.tiers_from_fleet(cfg, spec, model) == [1 if i == 1 else 0 for i in ids]
    # a client's memory at an exit: fixed + per example x its batch, as measured
    from fedadapt.federation.client.worker import first_train_index

    fixed, per = F.train_memory_bytes(model, spec.train_source, first_train_index(spec), 1,
                                      device=spec.device, precision=spec.precision,
                                      optimizer_states=F.optimizer_states(spec.train))
    assert per > 0 and costs._memory_at(spec, model, [1], 7) == fixed + 7 * per


def test_partial_work_is_the_most_examples_that_arrive_by_the_deadline():
    """``fleet.partial_work``: a client trains the largest number of its examples whose
    training plus both transfers ends at or before the deadline, checked against every count
    by brute force over devices, work, bytes and deadlines (exactly at the deadline counts);
    all of them when it finishes, none when its bytes alone miss it. Pins each term of the
    time left, the examples it buys, and the bounds of the loop that trims a rounding. (It found
    one short: 0.8 s left at 7.5 FLOP/s and 1 FLOP an example is 5.999... examples in floating
    point, and the sixth, ending at 4.0 s of a 4.0 s deadline, was not trained.)"""
    rng = np.random.default_rng(0)
    for trial in range(200):
        compute = float(rng.choice([1.0, 3.0, 7.5]))
        n = int(rng.integers(1, 30))
        work = float(rng.choice([1.0, 2.5, 4.0])) * n
        cfg = TiersFleet(compute=[compute], downlink=float(rng.choice([50, 100])),
                          uplink=float(rng.choice([20, 50])), partial_work=True)
        deadline = float(rng.choice([0.5, 2.0, 4.0, 8.0, 12.0, work / compute + 3.0]))
        down, up = int(rng.integers(0, 300)), int(rng.integers(0, 100))
        fleet = Fleet(cfg, 1, 0, [work], deadline=deadline, examples=[n]) \
            if work / n / compute <= deadline else None
        if fleet is None:
            continue
        want = max([k for k in range(n + 1)
                    if fleet.seconds(0, down, up, k) <= deadline] or [0])
        if fleet.seconds(0, down, up, 0) > deadline:
            want = 0
        assert fleet.partial_examples(0, down, up) == want, (trial, compute, n, work, deadline,
                                                            down, up)


Fleet = F.Fleet


def test_a_cycle_that_ends_available_joins_the_next_from_every_start(tmp_path):
    """FedScale's cycles: a client on for [0, 30) and [90, 100) of every 100 s is online at
    ``t`` exactly when ``t mod 100`` is in one of them, until 30 s into that cycle, or until 30 s
    into the next one from [90, 100) (the two join across the cycle's end), for any order of
    questions (each question draws cycles on from the ones drawn before). Pins the join
    written to another interval than the last or from another interval's start."""
    cap = pickled(tmp_path, {1: {"computation": 1.0, "communication": 1.0}}, "cap.pkl")
    beh = pickled(tmp_path, {1: {"active": [0, 90], "inactive": [30, 100], "finish_time": 100,
                                 "duration": 1, "model": "m"}}, "beh.pkl")

    def want(t):
        k, r = divmod(t, 100.0)
        return 100 * k + 30 if r < 30 else 100 * k + 130 if r >= 90 else None

    times = [0.0, 10.0, 29.9, 30.0, 50.0, 89.9, 90.0, 95.0, 100.0, 110.0, 129.9, 130.0, 190.0,
             205.0, 229.0, 230.0, 395.0, 410.0]
    for order in (times, times[::-1], times[::3] + times[1::3] + times[2::3]):
        fleet = Fleet(FedScaleFleet(capacity=cap, behaviour=beh), 1, 0, [1.0])
        assert [fleet.online_until(0, t) for t in order] == [want(t) for t in order]


def test_two_trace_files_of_one_size_and_time_are_two_traces(tmp_path):
    """The traces read are kept by file, size and modification time: two files that agree on
    size and time are still each read (pins the file left out of that key)."""
    import os

    a = pickled(tmp_path, {1: {"computation": 2.0, "communication": 3.0}}, "a.pkl")
    b = pickled(tmp_path, {1: {"computation": 5.0, "communication": 7.0}}, "b.pkl")
    assert os.path.getsize(a) == os.path.getsize(b)
    stat = os.stat(a)
    os.utime(b, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert F.read_capacity(a) == {1: (2.0, 3.0)} and F.read_capacity(b) == {1: (5.0, 7.0)}


def test_trace_entries_are_drawn_from_their_sorted_keys_with_the_seed():
    """``draw_entries``: the keys sorted (numbers before strings, so a trace may mix them), then
    as many distinct ones as clients drawn by ``rng.choice`` without replacement, also when
    there are exactly as many clients as keys; more clients than keys: every key once per
    seeded pass. Pins the sort's key lost and the all-distinct case sent to the passes."""
    keys = ["b", 3, "a", 1]
    ordered = [1, 3, "a", "b"]
    for n in (2, 4):
        pick = np.random.default_rng(5).choice(4, n, replace=False)
        assert F.draw_entries(keys, n, np.random.default_rng(5)) == [ordered[i] for i in pick]
    many = F.draw_entries(keys, 10, np.random.default_rng(5))
    assert sorted(map(str, many[:4])) == sorted(map(str, ordered))
    assert sorted(map(str, many[4:8])) == sorted(map(str, ordered))


def test_interval_ends_are_open_and_touching_intervals_join(tmp_path):
    """An interval ``[a, b)``: a client is online at ``a``, not at ``b``; work ending exactly at
    ``b`` finishes online; ``[0, 1)`` and ``[1, 2)`` in a trace are one interval. Pins ``<=``
    at the end, ``>=`` for the work's end, and touching intervals kept apart."""
    trace = tmp_path / "trace.csv"
    trace.write_text("client,start,end\n0,0,1\n0,1,2\n0,10,30\n")
    fleet = Fleet(TraceFleet(trace=str(trace)), 1, 0, [1.0])
    assert F.read_trace(str(trace), 1) == [[(0.0, 2.0), (10.0, 30.0)]]
    assert fleet.online_until(0, 0.5) == 2.0 and fleet.online_until(0, 10.0) == 30.0
    assert fleet.online_until(0, 30.0) is None and fleet.online_until(0, 2.0) is None
    assert fleet.offline_before(0, 15.0, 15.0) is None
    assert fleet.offline_before(0, 15.0, 15.5) == 30.0


def test_on_off_availability_starts_on_with_the_stationary_share():
    """On/off availability: each client starts on with probability ``mean_on / (mean_on +
    mean_off)`` (the stationary share), so about a quarter of 400 clients at 1 s on, 3 s off
    (seeded: exactly the same clients each time). Pins the share computed otherwise."""
    def on_at_start(seed):
        fleet = Fleet(TiersFleet(compute=[1.0], mean_on=1.0, mean_off=3.0), 400,
                      seed, [1.0] * 400)
        return fleet.available(0.0)

    first = on_at_start(0)
    assert 0.18 < len(first) / 400 < 0.32 and on_at_start(0) == first


def test_fleet_json_names_each_clients_device_and_the_traces_notes(tmp_path):
    """``fleet.json`` (``describe``): every client's tier even where it is None, its memory
    and fit where memory is capped, FedScale's reference FLOPs for a FedScale fleet only; a
    behaviour trace with fewer entries than clients is noted naming its key, with no capacity
    trace too. Pins those keys' names and conditions, and the note skipped."""
    beh = pickled(tmp_path, {1: {"active": [0], "inactive": [5], "finish_time": 10}}, "b.pkl")
    cap = pickled(tmp_path, {i: {"computation": 1.0, "communication": 1.0} for i in range(3)},
                  "c.pkl")
    fleet = Fleet(FedScaleFleet(capacity=cap, behaviour=beh), 3, 0, [1.0] * 3)
    described = fleet.describe()
    assert described["reference_flops"] == 1.0
    assert all("tier" in row for row in described["clients"])
    assert described["notes"] == fleet.notes() == [
        "fleet=fedscale: 3 clients and 1 entries in fleet.behaviour: entries are reused (a "
        "seeded draw; each by at most 3 clients)"]
    tiers = Fleet(TiersFleet(compute=[1.0, 2.0], memory=[1e6, 2e6]), 2, 0,
                  [1.0] * 2, train_memory=[5e5, 3e6])
    rows = tiers.describe()["clients"]
    assert "reference_flops" not in tiers.describe()
    assert [(r["train_memory"], r["fits"]) for r in rows] == [
        (5e5, True), (3e6, rows[1]["memory"] >= 3e6)]


def test_a_client_of_one_example_trains_batches_of_one():
    """The batch a client's memory is sized at: ``train.batch_size``, or all its examples when
    it has fewer, one at the least (pins a floor of two)."""
    from types import SimpleNamespace as NS

    spec = NS(train=NS(batch_size=10))
    assert [costs._batch_of(spec, NS(train=list(range(n)))) for n in (0, 1, 4, 30)] == [1, 1, 4, 10]


def test_a_trace_with_a_persistent_id_is_refused(tmp_path):
    """A pickle that asks for a persistent object (``persistent_load``) is refused in the
    key's line, before anything is built."""
    path = tmp_path / "persistent.pkl"
    path.write_bytes(b"Pabc\n.")  # protocol 0: the persistent id "abc"
    assert refusal(F.read_capacity, str(path)) == (
        f"fleet.capacity={str(path)!r} is invalid: refused, it holds a persistent id")


def test_lognormal_devices_are_the_documented_seeded_draws():
    """``fleet=lognormal``: compute, downlink and uplink are their medians times ``exp(sigma x
    z)``, the z drawn in that order from the profile stream ``[seed, PROFILE_STREAM]`` (one per
    client each). Pins a median divided, and ``sigma / z``."""
    cfg = LognormalFleet(compute_median=2e9, compute_sigma=0.5, downlink=1e6,
                      uplink=5e5, bandwidth_sigma=0.3)
    rng = np.random.default_rng([4, F.PROFILE_STREAM])
    c, d, u = (rng.standard_normal(5) for _ in range(3))
    got = F.profiles(cfg, 5, 4)
    assert [p.compute for p in got] == pytest.approx(list(2e9 * np.exp(0.5 * c)), rel=1e-12)
    assert [p.downlink for p in got] == pytest.approx(list(1e6 * np.exp(0.3 * d)), rel=1e-12)
    assert [p.uplink for p in got] == pytest.approx(list(5e5 * np.exp(0.3 * u)), rel=1e-12)


def test_a_fleet_refuses_what_it_cannot_simulate_in_its_words():
    """A deadline no device meets (whole work, or one example with ``fleet.partial_work``; met
    exactly is met), memory no device holds (in MiB), and the programming errors' words: pins
    the bounds, the numbers' units and each message."""
    tiers = TiersFleet(compute=[1.0, 2.0])
    Fleet(tiers, 2, 0, [10.0, 10.0], deadline=5.0)  # the fast device: 10 / 2 = 5 s, exactly
    with pytest.raises(ConfigError) as err:
        Fleet(tiers, 2, 0, [10.0, 10.0], deadline=4.0)
    assert str(err.value) == ("federation.round_timeout=4.0 is invalid with fleet=tiers: no "
                              "client can meet it (the fastest needs 5 simulated seconds to "
                              "train, before any bytes travel)")
    partial = TiersFleet(compute=[1.0, 2.0], partial_work=True)
    Fleet(partial, 2, 0, [10.0, 10.0], deadline=0.5, examples=[10, 10])  # one example: 0.5 s
    with pytest.raises(ConfigError, match="the fastest needs 0.5 simulated seconds to train "
                                          "one example, before"):
        Fleet(partial, 2, 0, [10.0, 10.0], deadline=0.4, examples=[10, 10])
    capped = TiersFleet(compute=[1.0, 2.0], memory=[2**20, 2**21])
    with pytest.raises(ConfigError) as err:
        Fleet(capped, 2, 0, [1.0, 1.0], train_memory=[3 * 2**20, 4 * 2**20])
    assert str(err.value) == ("fleet.memory=[1048576, 2097152] is invalid: no device can hold "
                              "its client's training (the least a client needs is 3 MiB, the "
                              "largest device has 2 MiB)")
    for kwargs, says in ((dict(work=[1.0]), "work for 1 clients, the run has 2"),
                         (dict(cfg=partial, deadline=1.0),
                          "fleet.partial_work needs each client's examples and a deadline"),
                         (dict(cfg=partial, examples=[1, 1]),
                          "fleet.partial_work needs each client's examples and a deadline"),
                         (dict(cfg=capped), "fleet.memory needs each client's training memory")):
        args = {"cfg": tiers, "num_clients": 2, "seed": 0, "work": [1.0, 1.0], **kwargs}
        with pytest.raises(ValueError) as err:
            Fleet(**args)
        assert str(err.value) == says


def test_partial_work_trims_an_estimate_one_past_the_deadline():
    """The examples the time left buys, ``floor(left x FLOP/s / FLOPs an example)``, can be one
    more than arrive in time: 6.4 s left (15 s less 4.2 s and 4.4 s of bytes) at 7.5 FLOP/s buy
    exactly 4 examples of 12 FLOPs, but the fourth ends at 15.000000000000002 s in floating
    point: 3 are trained; at 48 FLOPs an example, 1 is bought and none arrives in time; a client
    of 3 examples buys all 3, whose round ends at 30.000000000000004 s of a 30 s deadline: 2.
    Pins the loop that trims the estimate down, and what it asks (mutants that stop it at 1,
    turn it round, or ask with other bytes: the brute force above never overshoots)."""
    import math

    for (compute, link, n, per_example, down, up, deadline, bought, trained) in (
            (7.5, 10.0, 48, 12.0, 42, 44, 15.0, 4, 3), (7.5, 10.0, 48, 48.0, 42, 44, 15.0, 1, 0),
            (0.3, 3.0, 3, 1.2, 46, 8, 30.0, 3, 2)):
        cfg = TiersFleet(compute=[compute], downlink=link, uplink=link,
                          partial_work=True)
        fleet = Fleet(cfg, 1, 0, [n * per_example], deadline=deadline, examples=[n])
        left = deadline - down / link - up / link
        assert int(math.floor(left * compute / per_example)) == bought  # it overshoots
        assert fleet.seconds(0, down, up, bought) > deadline >= fleet.seconds(0, down, up,
                                                                              trained)
        assert fleet.partial_examples(0, down, up) == trained


def test_partial_work_by_hand_at_exactly_the_deadline():
    """10 examples of 1 FLOP at 1 FLOP/s, 10 bytes each way at 10 B/s, a 7 s deadline: 5
    examples (5 s + 1 s + 1 s, exactly 7 s); 70 bytes down alone take the deadline: none; 2 s of
    bytes leave all 10 to fit a 12 s deadline. Pins the terms of the time left and the
    bounds at equality."""
    cfg = TiersFleet(compute=[1.0], downlink=10.0, uplink=10.0,
                      partial_work=True)
    exact = Fleet(cfg, 1, 0, [10.0], deadline=7.0, examples=[10])
    assert exact.partial_examples(0, 10, 10) == 5
    assert exact.partial_examples(0, 70, 0) == 0
    assert exact.partial_examples(0, 0, 60) == 1  # 6 s of upload, 1 s of training
    assert Fleet(cfg, 1, 0, [10.0], deadline=12.0, examples=[10]).partial_examples(0, 10, 10) == 10
