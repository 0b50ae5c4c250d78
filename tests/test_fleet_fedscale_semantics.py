"""fleet.fedscale_semantics=exact (fedadapt/federation/simulation/fleet.py): FedScale's
simulator to the letter, checked query by query against FedScale's own functions, transcribed
below with their source named (SymbioticLab/FedScale, the repository's master). The default
(``fedadapt``) reading is left as it was (tests/test_fleet_fedscale.py)."""

import pickle
import random

import numpy as np
import pytest

from fedadapt.config import ConfigError
from fedadapt.federation.simulation.fleet import (
    FEDSCALE_MISSING_SPEEDS,
    FedScaleFleet,
    FedScaleTrace,
    Fleet,
    charged_samples,
    read_behaviour,
)

# -- FedScale's functions, transcribed as its reference ------------------------------------


class FedScaleClientMetadata:
    """Transcribed from SymbioticLab/FedScale, fedscale/cloud/internal/client_metadata.py
    (``ClientMetadata.__init__``, ``is_active``, ``get_completion_time``), unchanged but for
    the fields not used here."""

    def __init__(self, host_id, client_id, speed, traces=None):
        self.host_id = host_id
        self.client_id = client_id
        self.compute_speed = speed['computation']
        self.bandwidth = speed['communication']
        self.traces = traces
        self.behavior_index = 0

    def is_active(self, cur_time):
        if self.traces is None:
            return True

        norm_time = cur_time % self.traces['finish_time']

        if norm_time > self.traces['inactive'][self.behavior_index]:
            self.behavior_index += 1

        self.behavior_index %= len(self.traces['active'])

        if (self.traces['active'][self.behavior_index] <= norm_time
                <= self.traces['inactive'][self.behavior_index]):
            return True

        return False

    def get_completion_time(self, batch_size, local_steps, upload_size, download_size,
                            augmentation_factor=3.0):
        return {'computation': augmentation_factor * batch_size * local_steps
                * float(self.compute_speed) / 1000.,
                'communication': (upload_size + download_size) / float(self.bandwidth)}


class FedScaleSimulator:
    """Transcribed from SymbioticLab/FedScale: fedscale/cloud/client_manager.py
    (``ClientManager.__init__``'s sampler and trace keys, ``register_client``,
    ``getFeasibleClients``, ``select_participants`` in its random mode) and
    fedscale/cloud/aggregation/aggregator.py (``client_register_handler``'s mapping,
    ``select_participants``, ``tictak_client_tasks`` in simulation mode,
    ``round_completion_handler``'s clock), without the filters, logging and Oort."""

    def __init__(self, num_clients, client_profiles, user_trace, sample_seed, batch_size,
                 local_steps, model_update_size, overcommitment=1.3):
        self.rng = random.Random()
        self.rng.seed(sample_seed)
        self.user_trace = user_trace
        self.user_trace_keys = None if user_trace is None else list(user_trace.keys())
        self.client_metadata = {}
        self.feasibleClients = []
        self.batch_size, self.local_steps = batch_size, local_steps
        self.model_update_size = model_update_size
        self.overcommitment = overcommitment
        self.global_virtual_clock = 0.0
        self.num_of_clients = 0
        for _ in range(num_clients):  # Aggregator.client_register_handler
            mapped_id = ((self.num_of_clients + 1) % len(client_profiles)
                         if len(client_profiles) > 0 else 1)
            systemProfile = client_profiles.get(mapped_id, {"computation": 1.0,
                                                            "communication": 1.0})
            client_id = self.num_of_clients + 1
            self.register_client(0, client_id, systemProfile)
            self.num_of_clients += 1

    def register_client(self, host_id, client_id, speed):  # ClientManager.register_client
        user_trace = None if self.user_trace is None else self.user_trace[
            self.user_trace_keys[int(client_id) % len(self.user_trace)]]
        self.client_metadata[str(client_id)] = FedScaleClientMetadata(host_id, client_id,
                                                                      speed, user_trace)
        self.feasibleClients.append(client_id)

    def getFeasibleClients(self, cur_time):  # ClientManager.getFeasibleClients
        if self.user_trace is None:
            return self.feasibleClients
        return [client_id for client_id in self.feasibleClients
                if self.client_metadata[str(client_id)].is_active(cur_time)]

    def manager_select_participants(self, num_of_clients, cur_time=0):
        clients_online = self.getFeasibleClients(cur_time)
        if len(clients_online) <= num_of_clients:
            return clients_online
        self.rng.shuffle(clients_online)
        client_len = min(num_of_clients, len(clients_online) - 1)
        return clients_online[:client_len]

    def select_participants(self, select_num_participants):  # Aggregator
        return sorted(self.manager_select_participants(
            int(select_num_participants * self.overcommitment),
            cur_time=self.global_virtual_clock))

    def tictak_client_tasks(self, sampled_clients, num_clients_to_collect):
        sampledClientsReal = []
        completionTimes = []
        for client_to_run in sampled_clients:
            exe_cost = self.client_metadata[str(client_to_run)].get_completion_time(
                batch_size=self.batch_size, local_steps=self.local_steps,
                upload_size=self.model_update_size, download_size=self.model_update_size)
            roundDuration = exe_cost["computation"] + exe_cost["communication"]
            if self.client_metadata[str(client_to_run)].is_active(
                    roundDuration + self.global_virtual_clock):
                sampledClientsReal.append(client_to_run)
                completionTimes.append(roundDuration)
        num_clients_to_collect = min(num_clients_to_collect, len(completionTimes))
        workers_sorted_by_completion_time = sorted(range(len(completionTimes)),
                                                   key=lambda k: completionTimes[k])
        top_k_index = workers_sorted_by_completion_time[:num_clients_to_collect]
        clients_to_run = [sampledClientsReal[k] for k in top_k_index]
        stragglers = [sampledClientsReal[k]
                      for k in workers_sorted_by_completion_time[num_clients_to_collect:]]
        round_duration = completionTimes[top_k_index[-1]]
        return clients_to_run, stragglers, round_duration


# -- the fixture --------------------------------------------------------------------------

#: client_behave_trace entries, in a file order that is not the keys' sorted order; each
#: covers one case of FedScale's stateful reading.
BEHAVIOUR = {
    # a cycle that wraps: the last interval ends before finish_time, the first starts at 0
    3834: {"active": [0, 40, 75], "inactive": [20, 55, 90], "finish_time": 100,
           "duration": 50, "model": "CPH1801"},
    # short intervals that a query can jump over (skipped intervals)
    17: {"active": [2, 12, 22, 32, 42], "inactive": [6, 16, 26, 36, 46], "finish_time": 50,
         "duration": 20, "model": "SM-G950F"},
    # the last interval ends at finish_time: the cursor never passes it
    905: {"active": [10, 60], "inactive": [30, 120], "finish_time": 120, "duration": 80,
          "model": "Pixel 3"},
    # [t, t]: online at one instant of the cycle only, then a longer interval
    5: {"active": [25, 30, 70], "inactive": [25, 50, 80], "finish_time": 90, "duration": 30,
        "model": "iPhone 11"},
    # available all through its cycle (both ends)
    42: {"active": [0], "inactive": [60], "finish_time": 60, "duration": 60,
         "model": "Redmi Note 8"},
    # one interval in the middle of a long cycle, float times
    7: {"active": [33.5], "inactive": [171.25], "finish_time": 200.0, "duration": 137,
        "model": "CPH1801"},
}
#: client_device_capacity, keyed from 1 as FedScale's file is (so client k = n maps to the key
#: 0 it lacks, and gets FedScale's fallback speeds).
CAPACITY = {1: {"computation": 40.0, "communication": 800.0},
            2: {"computation": 125.5, "communication": 2048.0},
            3: {"computation": 12.0, "communication": 5648.109619499134},
            4: {"computation": 300.0, "communication": 150.0},
            5: {"computation": 80.0, "communication": 1000.0},
            6: {"computation": 20.0, "communication": 12000.0},
            7: {"computation": 55.0, "communication": 3000.0}}


def _pickle(path, data) -> str:
    path.write_bytes(pickle.dumps(data))
    return str(path)


def _exact(tmp_path, num_clients, seed=0, target=3, batch=20, steps=5, behaviour=True):
    cfg = FedScaleFleet(fedscale_semantics="exact",
                      capacity=_pickle(tmp_path / "client_device_capacity", CAPACITY),
                      behaviour=(_pickle(tmp_path / "client_behave_trace", BEHAVIOUR)
                                 if behaviour else None))
    reference = 4.0e6
    samples = [batch * steps] * num_clients
    return Fleet(cfg, num_clients, seed, [reference * n for n in samples],
                 reference_flops=reference, target=target, samples=samples)


def _fedscale(num_clients, seed=0, batch=20, steps=5, model_kbit=0.0, behaviour=True):
    return FedScaleSimulator(num_clients, CAPACITY, BEHAVIOUR if behaviour else None, seed,
                             batch, steps, model_kbit)


def _queries() -> list[float]:
    """Times at 7 s steps over several cycles, then at every boundary of the fixture (closed
    ends), then seeded jumps forward and back (which skip intervals and wrap cycles)."""
    steps = [7.0 * i for i in range(120)]
    bounds = sorted({float(v + k * e["finish_time"]) for e in BEHAVIOUR.values()
                     for v in e["active"] + e["inactive"] for k in range(3)})
    rng = np.random.default_rng(0)
    jumps = list(np.cumsum(rng.exponential(37.0, 300)))
    back = [float(v) for v in rng.uniform(0, 2000, 200)]
    ints = [float(v) for v in rng.integers(0, 1200, 200)]
    return steps + bounds + jumps + back + ints


# -- availability ---------------------------------------------------------------------------

def test_the_cursor_lags_as_fedscales_does_one_entry_by_hand():
    """FedScale's reading by hand, on the wrap-around entry: the cursor moves on by one
    interval a query, so after a jump over an interval, and after a cycle wraps, a time inside
    an interval is read as offline (fedadapt's default reads it online)."""
    trace = FedScaleTrace(100, [0, 40, 75], [20, 55, 90])
    assert trace.online(10) and trace.cursor == 0  # in interval 0
    # 80 is in interval 2, but past interval 0 the cursor moves to 1 (40-55) only: offline
    assert not trace.online(80) and trace.cursor == 1
    assert trace.online(85) and trace.cursor == 2  # past 1: on to 2 now
    # 5 s into the next cycle lies in interval 0, but 5 is not past 90: the cursor stays on 2
    assert not trace.online(105) and not trace.online(115) and trace.cursor == 2
    assert not trace.online(195) and trace.cursor == 0  # 95 > 90: it wraps, 95 is not in 0-20
    assert trace.online(205)


def test_closed_ends_and_a_point_interval():
    point = FedScaleTrace(90, [25, 30, 70], [25, 50, 80])
    assert point.online(25.0) and point.cursor == 0  # [25, 25]: its one instant
    assert point.online(30.0) and point.cursor == 1  # 30 > 25: the next, at its start
    assert point.online(50.0)  # the end is online too
    assert not point.online(50.5) and point.cursor == 2
    assert point.online(80.0) and not point.online(80.25)
    assert point.cursor == 0  # wrapped past the last interval
    # an entry whose last interval ends at finish_time stays on it
    stuck = FedScaleTrace(120, [10, 60], [30, 120])
    assert stuck.online(65.0) and stuck.cursor == 1
    # from then on it is online only in its last interval, every cycle: 5, 10 and 5 s into
    # later cycles lie in interval 0, but no time of a cycle is past 120
    assert [stuck.online(t) for t in (125.0, 130.0, 245.0, 300.0)] == [False] * 3 + [True]
    assert stuck.cursor == 1
    assert FedScaleTrace(10, [], []).online(3.0) is False


def test_every_query_agrees_with_fedscales_is_active(tmp_path):
    """Each client's answer at every query of :func:`_queries` (about 1,100 of them, in
    order) is FedScale's ``is_active`` for the same entry asked the same questions in the same
    order, on a fleet of 13 clients (client k on entry keys[k % 6])."""
    fleet = _exact(tmp_path, 13)
    ours = {c: FedScaleTrace(*read_fixture(c)) for c in range(13)}
    theirs = _fedscale(13)
    disagree, online = 0, []
    for t in _queries():
        got = fleet.available(t)
        want = [k - 1 for k in theirs.getFeasibleClients(t)]
        disagree += got != want
        online.append(len(got))
        assert [c for c in range(13) if ours[c].online(t)] == got
    assert disagree == 0
    assert min(online) < max(online)  # who is online changes with the queries


def read_fixture(cid: int):
    key = list(BEHAVIOUR)[(cid + 1) % len(BEHAVIOUR)]
    e = BEHAVIOUR[key]
    return e["finish_time"], e["active"], e["inactive"]


def test_fedadapts_default_reading_differs_on_the_same_queries(tmp_path):
    """The two readings of the same files are not the same availability: the default
    (half-open, merged, stateless intervals) disagrees with FedScale's on some queries."""
    cfg = FedScaleFleet(capacity=_pickle(tmp_path / "cap", CAPACITY),
                      behaviour=_pickle(tmp_path / "beh", BEHAVIOUR))
    default = Fleet(cfg, 6, 0, [1.0] * 6)
    exact = _exact(tmp_path, 6)
    entries = read_behaviour(cfg.behaviour)
    assert {p.behaviour_id for p in default.profiles} == set(entries)
    differ = 0
    for t in _queries():
        by_default = {default.profiles[c].behaviour_id for c in default.available(t)}
        by_fedscale = {exact.profiles[c].behaviour_id for c in exact.available(t)}
        differ += by_default != by_fedscale
    assert differ > 0


# -- which entry a client gets ----------------------------------------------------------------

def test_client_k_takes_entry_k_mod_n_as_fedscale_maps_it(tmp_path):
    """Capacity key ``k % n`` (client k = fedadapt's client + 1; FedScale's fallback speeds for
    the key 0 its file lacks), behaviour entry ``keys[k % n]`` in the file's order; no seed
    changes it; fleet.json and the notes say so."""
    theirs = _fedscale(16)
    for seed in (0, 1, 233):
        fleet = _exact(tmp_path, 16, seed=seed)
        for c, p in enumerate(fleet.profiles):
            meta = theirs.client_metadata[str(c + 1)]
            assert (p.ms_per_sample, p.kbps) == (meta.compute_speed, meta.bandwidth)
            assert p.capacity_id == (c + 1) % 7
            assert BEHAVIOUR[p.behaviour_id] is not None
            assert p.behaviour_id == list(BEHAVIOUR)[(c + 1) % 6]
            assert meta.traces is BEHAVIOUR[p.behaviour_id]
    missing = [c for c, p in enumerate(fleet.profiles) if p.capacity_id == 0]
    assert missing == [6, 13]
    assert all((fleet.profiles[c].ms_per_sample, fleet.profiles[c].kbps)
               == FEDSCALE_MISSING_SPEEDS for c in missing)
    notes = fleet.notes()
    assert any("client k (from 1) takes entry k % 7" in n for n in notes)
    assert any("k % 6" in n for n in notes)
    assert any("2 client(s) ([6, 13])" in n and "fallback" in n for n in notes)
    described = fleet.describe()
    assert described["target"] == 3 and described["overcommitment"] == 1.3
    assert described["clients"][0]["samples"] == 100
    assert described["clients"][0]["available"] == list(zip(*read_fixture(0)[1:]))


# -- work and time ----------------------------------------------------------------------------

def test_a_clients_time_is_fedscales_completion_time_to_the_bit(tmp_path):
    """batch x local steps samples for every client whatever its examples; the seconds are
    FedScale's ``get_completion_time`` (computation + communication) exactly, the model's kbit
    (bytes / 1024 x 8) down and up."""
    batch, steps, nbytes = 32, 7, 123_457
    fleet = _exact(tmp_path, 9, batch=batch, steps=steps)
    theirs = _fedscale(9, batch=batch, steps=steps)
    kbit = nbytes / 1024.0 * 8.0
    for c in range(9):
        cost = theirs.client_metadata[str(c + 1)].get_completion_time(batch, steps, kbit, kbit)
        assert fleet.seconds(c, nbytes, nbytes) == cost["computation"] + cost["communication"]
    # an exit costing 40% of the model's step takes 40% of the computation
    share = _exact(tmp_path, 2, batch=batch, steps=steps)
    share.exit_share = [0.4, 1.0]
    cost = theirs.client_metadata["1"].get_completion_time(batch, steps, 0.0, 0.0)
    assert share.seconds(0, 0, 0) == pytest.approx(0.4 * cost["computation"], rel=1e-15)


class _Train:
    batch_size, local_epochs = 32, 2


@pytest.mark.parametrize("local_steps, examples, samples", [
    (20, 5, 640),  # FedScale's --local_steps: the same for every client
    (20, 5000, 640),
    (None, 100, 32 * 4 * 2),  # null: the steps of its own epochs, ceil(100 / 32) x 2
    (None, 5, 32 * 1 * 2),  # a short last batch is charged as a whole one
])
def test_the_samples_charged_are_batch_times_steps(local_steps, examples, samples):
    cfg = FedScaleFleet(fedscale_semantics="exact", capacity="x",
                      local_steps=local_steps)
    assert charged_samples(cfg, _Train, examples) == samples


# -- the round --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed, num_clients, target, model_kbit, seen", [
    (233, 13, 3, 4000.0, {"offline"}),  # FedScale's own sample seed
    (0, 20, 5, 8000.0, {"offline", "discarded"}),
    (1, 30, 4, 400.0, {"offline", "discarded"}),
    (7, 9, 2, 120000.0, {"offline", "FedScale fails"}),  # a round keeps no one
])
def test_rounds_agree_with_fedscales_aggregator(tmp_path, seed, num_clients, target,
                                                 model_kbit, seen):
    """40 rounds in lockstep with FedScale's aggregator on the same files: the clients over-
    selected (1.3x the target among those online at the round's start, shuffled by the same
    seeded generator), those kept (online at completion, the target's fastest), the stragglers
    discarded, the round's duration to the bit and so the clock. Where FedScale's aggregator
    fails (no client kept: an IndexError), fedadapt kept none either."""
    batch, steps = 20, 5
    nbytes = model_kbit / 8.0 * 1024.0
    fleet = _exact(tmp_path, num_clients, seed=seed, target=target, batch=batch, steps=steps)
    theirs = _fedscale(num_clients, seed=seed, batch=batch, steps=steps, model_kbit=model_kbit)
    clock, drops = 0.0, set()
    for _ in range(40):
        start = fleet.next_available(clock)
        assert start == clock == theirs.global_virtual_clock
        selected = fleet.select(fleet.available(start))
        want = theirs.select_participants(target)
        assert [c + 1 for c in selected] == want
        sent = {c: nbytes for c in selected}
        dropped, seconds = fleet.round(start, selected, sent, sent)
        try:
            to_run, stragglers, duration = theirs.tictak_client_tasks(want, target)
        except IndexError:  # FedScale's simulator stops here
            assert set(dropped) == set(selected) and set(dropped.values()) == {"offline"}
            drops.add("FedScale fails")
            break
        assert sorted(c + 1 for c in selected if c not in dropped) == sorted(to_run)
        assert sorted(c + 1 for c, why in dropped.items() if why == "discarded") == \
            sorted(stragglers)
        assert seconds == duration
        drops |= set(dropped.values())
        clock = start + seconds
        theirs.global_virtual_clock += duration
    assert drops == seen  # what these rounds exercised


def test_a_round_without_availability_keeps_the_target_fastest(tmp_path):
    """No behaviour file: every client always online; 1.3 x 3 = 3 over-selected of 10 (int),
    the 3 kept; with 2 online of a wanted 3, both."""
    fleet = _exact(tmp_path, 10, behaviour=False, target=3)
    assert fleet.next_available(5.0) == 5.0 and fleet.available(5.0) == list(range(10))
    chosen = fleet.select(list(range(10)))
    assert len(chosen) == 3 and chosen == sorted(chosen)
    assert fleet.select([4, 1]) == [1, 4]
    big = _exact(tmp_path, 10, behaviour=False, target=5)
    chosen = big.select(list(range(10)))
    assert len(chosen) == 6  # int(5 x 1.3)
    dropped, seconds = big.round(0.0, chosen, {}, {})
    times = sorted((big.seconds(c, 0, 0), c) for c in chosen)
    assert set(dropped) == {c for _, c in times[5:]}
    assert set(dropped.values()) == {"discarded"} and seconds == times[4][0]


def test_no_client_kept_ends_at_the_last_sampled_completion(tmp_path):
    """Where FedScale's aggregator fails (IndexError on an empty round), the round lasts until
    the last sampled client would have completed; a start with no one online has no round."""
    # one entry: k % 1 = 0 for every client, so the capacity key is 0
    cap = _pickle(tmp_path / "cap", {0: {"computation": 1000.0, "communication": 1000.0}})
    beh = _pickle(tmp_path / "beh", {1: {"active": [0], "inactive": [10], "finish_time": 100}})
    cfg = FedScaleFleet(fedscale_semantics="exact", capacity=cap, behaviour=beh)
    fleet = Fleet(cfg, 2, 0, [1.0, 1.0], target=1, samples=[10, 10])  # 30 s each
    assert fleet.next_available(50.0) is None  # 50 is past [0, 10]
    dropped, seconds = fleet.round(100.0, [0, 1], {}, {})
    assert dropped == {0: "offline", 1: "offline"} and seconds == 30.0
    with pytest.raises(RuntimeError, match="stateful"):
        fleet.online_until(0, 1.0)


# -- bad input --------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, says", [
    (["fleet=tiers", "fleet.fedscale_semantics=exact"],
     "fleet.fedscale_semantics is not a key of fleet=tiers"),
    (["fleet.fedscale_semantics=exact"], "fleet.fedscale_semantics is not a key of fleet=none"),
    (["fleet=tiers", "fleet.local_steps=20"], "fleet.local_steps is not a key of fleet=tiers"),
])
def test_a_fedscale_key_on_another_fleet_is_not_its_key(overrides, says):
    """Each fleet kind has its own keys: FedScale's are refused on another kind, in one line."""
    from fedadapt.cli import config_problem

    text = config_problem(["method=linear_head", "backbone=small_cnn", *overrides])
    assert text.startswith(says) and "\n" not in text, text


@pytest.mark.parametrize("overrides, key", [
    (["fleet=fedscale", "fleet.capacity=c", "fleet.fedscale_semantics=stateful"],
     "fleet.fedscale_semantics='stateful'"),
    (["fleet=fedscale", "fleet.capacity=c", "fleet.local_steps=20"], "fleet.local_steps=20"),
    (["fleet=fedscale", "fleet.capacity=c", "fleet.fedscale_semantics=exact",
      "fleet.local_steps=0"], "fleet.local_steps=0"),
    (["fleet=fedscale", "fleet.capacity=c", "fleet.fedscale_semantics=exact",
      "fleet.keep_first=3"], "fleet.keep_first=3"),
    (["fleet=fedscale", "fleet.capacity=c", "fleet.fedscale_semantics=exact",
      "fleet.partial_work=true"], "fleet.partial_work=True"),
    (["fleet=fedscale", "fleet.capacity=c", "fleet.fedscale_semantics=exact",
      "fleet.memory=[1e9]"], "fleet.memory=[1000000000.0]"),
    (["fleet=fedscale", "fleet.capacity=c", "fleet.fedscale_semantics=exact",
      "federation.round_timeout=60"], "federation.round_timeout=60.0"),
    # the fleet's own keys are checked first (its file exists), then the strategy against it
    (["fleet=fedscale", f"fleet.capacity={__file__}", "fleet.fedscale_semantics=exact",
      "strategy=fedbuff"], "fleet.fedscale_semantics='exact'"),
])
def test_an_exact_mode_key_out_of_place_is_one_line_naming_it(overrides, key):
    from fedadapt.entry import compose_config, to_run_config

    with pytest.raises(ConfigError) as err:
        to_run_config(compose_config(["method=linear_head", "backbone=small_cnn", *overrides]))
    text = str(err.value)
    assert text.startswith(f"{key} is invalid: ") and "\n" not in text, text


def test_the_default_is_fedadapts_reading(tmp_path):
    assert FedScaleFleet().fedscale_semantics == "fedadapt" and FedScaleFleet().local_steps is None
    cfg = FedScaleFleet(capacity=_pickle(tmp_path / "cap", CAPACITY))
    assert not Fleet(cfg, 3, 0, [1.0] * 3).exact


# -- a run, and the generator ------------------------------------------------------------------

def test_a_run_in_exact_mode_trains_the_over_selected_and_keeps_the_fastest(tmp_path,
                                                                          cache_dir):
    """A run end to end: partition.fraction_fit=0.5 of 8 clients is a target of 4, so 5 are
    over-selected (int(4 x 1.3)) by the fleet's generator and trained (the strategy takes every
    client it is offered); the 4 fastest are kept, the fifth discarded, and the round lasts
    FedScale's completion time of the fourth, worked out here from the files."""
    import json

    from omegaconf import OmegaConf

    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl

    overrides = ["method=linear_head", "backbone=small_cnn", "backbone.image_size=16",
                 "dataset.max_samples=300", "partition.num_clients=8", "rounds=2",
                 "partition.fraction_fit=0.5", "fleet=fedscale",
                 "fleet.fedscale_semantics=exact", "fleet.local_steps=3", "train.batch_size=10",
                 f"fleet.capacity={_pickle(tmp_path / 'client_device_capacity', CAPACITY)}",
                 f"cache_dir={cache_dir}"]
    composed = compose_config(overrides)
    run_experiment(to_run_config(composed), tmp_path / "run", execute=in_process("workers"),
                   config_yaml=OmegaConf.to_yaml(composed, resolve=True))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    described = json.loads((tmp_path / "run" / "fleet.json").read_text())
    assert described["target"] == 4 and described["config"]["fedscale_semantics"] == "exact"
    clients = described["clients"]
    assert [c["capacity_id"] for c in clients] == [(c + 1) % 7 for c in range(8)]
    assert all(c["samples"] == 30 for c in clients)
    clock = 0.0
    for row in [r for r in rows if r.get("round")]:
        assert row["clients_sampled"] == 5 and row["clients_trained"] == 4
        assert row["sim_discarded"] == 1 and row["sim_offline"] == 0
        assert row["sim_unavailable"] == 0
        # what each of the 4 kept sent back; a linear head receives what it sends
        kbit = row["bytes_up"] / 4 / 1024 * 8
        times = sorted(3 * c["ms_per_sample"] * 30 / 1000 + 2 * kbit / c["kbps"]
                       for c in clients)
        assert any(row["sim_round_s"] == pytest.approx(t, rel=1e-12) for t in times)
        clock += row["sim_round_s"]
        assert row["sim_time_s"] == pytest.approx(clock)


def test_the_generator_writes_no_interval_ending_at_finish_time_unless_asked(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import fedscale_traces
    finally:
        sys.path.pop(0)
    default = fedscale_traces.write(tmp_path / "default", 300, 0)
    asked = fedscale_traces.write(tmp_path / "asked", 300, 0, to_finish=True)
    assert default[0].read_bytes() == asked[0].read_bytes()  # the same devices' speeds
    plain = pickle.loads(default[1].read_bytes())
    to_finish = pickle.loads(asked[1].read_bytes())
    assert all(e["active"] and all(0 <= a < b < e["finish_time"] for a, b in
                                   zip(e["active"], e["inactive"])) for e in plain.values())
    ends = sum(e["finish_time"] in e["inactive"] for e in to_finish.values())
    assert ends > 50  # about two thirds of the entries reach the cycle's end when asked
    # everywhere else the two files agree
    for key, e in plain.items():
        f = to_finish[key]
        assert e["model"] == f["model"] and e["active"][0] == f["active"][0]
        assert [b for b in e["inactive"] if b < 599] == [b for b in f["inactive"] if b < 599]
