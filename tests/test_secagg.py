"""``secagg=secaggplus``: Flower's SecAgg+ (its SecAggPlusWorkflow and secaggplus_mod) on the
rounds of a linear head, against plain FedAvg.

The same seeded clients train the same global model in round 1, so SecAgg+'s aggregate must be
FedAvg's weighted mean of their parameters within the quantisation bound the protocol implies
(fedadapt.federation.server.secagg.quantisation_bound); a client that drops out after sharing its
keys leaves the mean of the others; and what cannot compose with it is refused in one line naming
the key."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import final_checkpoint, tiny_run
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage

from fedadapt.adapters.heads import LinearHeadConfig
from fedadapt.config import (
    ConfigError,
    FaultConfig,
    FederationConfig,
    PartitionConfig,
    SecAggConfig,
    StrategyConfig,
    validate,
)
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.server.secagg import quantisation_bound
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.federation.wire import records
from fedadapt.results.store import read_jsonl

CLIENTS = 4
#: float32's relative rounding of the arrays the round returns (the global model's dtype).
F32 = 2.0 ** -24


def _cfg(cache_dir, secagg: str = "none", **overrides):
    return tiny_run(cache_dir, LinearHeadConfig(), rounds=1,
                    partition=PartitionConfig(kind="iid", num_clients=CLIENTS, fraction_fit=1.0),
                    secagg=SecAggConfig(name=secagg), **overrides)


@pytest.fixture(scope="module")
def plain(cache_dir, tmp_path_factory):
    """Plain FedAvg, one round, one node per client: each client's trained parameters and
    examples (read off its reply) and the global model after the round."""
    trained: dict[int, dict] = {}

    def on_reply(sent, reply, context):
        for cid, content in records.unpack(reply.content).items():
            arrays = content.array_records.get("arrays")
            if arrays is not None and "metrics" in content.metric_records:
                trained[cid] = {"examples": int(content.metric_records["metrics"]
                                                ["num-examples"]),
                                **{n: a.numpy().copy() for n, a in arrays.items()}}

    run_dir = tmp_path_factory.mktemp("plain") / "run"
    run_experiment(_cfg(cache_dir), run_dir, config_yaml="plain",
                   execute=lambda plan, app: run_in_process(plan, app, on_reply=on_reply))
    return trained, final_checkpoint(run_dir)


def _fedavg(trained: dict[int, dict], cids) -> dict[str, np.ndarray]:
    total = sum(trained[c]["examples"] for c in cids)
    names = [n for n in trained[cids[0]] if n != "examples"]
    return {n: sum(trained[c]["examples"] * trained[c][n].astype(np.float64) for c in cids)
            / total for n in names}


def _bound(cfg, trained, cids) -> float:
    """SecAgg+'s quantisation bound for these clients, plus float32's rounding."""
    max_abs = max(float(np.abs(v).max()) for c in cids for n, v in trained[c].items()
                  if n != "examples")
    weights = [trained[c]["examples"] for c in cids]
    return quantisation_bound(weights, max_abs, cfg.secagg,
                              max(t["examples"] for t in trained.values())) + max_abs * F32


def test_secaggplus_equals_fedavg_within_quantisation(cache_dir, plain, tmp_path):
    trained, plain_final = plain
    assert sorted(trained) == list(range(CLIENTS))
    cfg = _cfg(cache_dir, "secaggplus")
    run_experiment(cfg, tmp_path / "run", config_yaml="secagg", execute=run_in_process)
    got = final_checkpoint(tmp_path / "run")
    expected = _fedavg(trained, list(range(CLIENTS)))
    bound = _bound(cfg, trained, list(range(CLIENTS)))
    assert 1e-7 < bound < 1e-5  # 2**22 levels over [-8, 8], 4 clients of equal size
    worst = 0.0
    for name, want in expected.items():
        have = np.asarray(got[name])
        assert have.dtype == np.float32 and have.shape == want.shape
        worst = max(worst, float(np.abs(have - want).max()))
        # plain FedAvg's own result is the same mean (float32 arithmetic)
        assert np.abs(np.asarray(plain_final[name]) - want).max() <= 1e-6
    assert worst <= bound
    assert worst > 0  # quantised: not FedAvg's arrays copied through
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert row["clients_sampled"] == row["clients_trained"] == CLIENTS
    assert row["clients_failed"] == 0 and len(row["secagg_stage_s"]) == 4
    assert row["secagg_stage_replies"] == [CLIENTS] * 4
    # the masked upload of 4 x 170 float32 weights as uint64 words, keys and shares: more
    # bytes than the plain float32 arrays
    assert row["bytes_up"] > CLIENTS * 170 * 4 and row["train_loss"] > 0


class _DropAt:
    """A ClientApp whose client ``cid`` fails at SecAgg+'s ``stage`` (after sharing its keys,
    for the collect-masked-vectors stage): it drops out mid-protocol."""

    def __init__(self, app, cid: int, stage: str) -> None:
        self.app, self.cid, self.stage = app, cid, stage

    def __call__(self, msg, context):
        configs = msg.content.config_records.get(RECORD_KEY_CONFIGS) \
            if msg.has_content() else None
        if (configs is not None and configs.get(Key.STAGE) == self.stage
                and int(context.node_config["partition-id"]) == self.cid):
            raise ConnectionError(f"client {self.cid} went away at {self.stage}")
        return self.app(msg, context)


def test_secaggplus_client_dropping_mid_protocol(cache_dir, plain, tmp_path):
    trained, _ = plain
    cfg = _cfg(cache_dir, "secaggplus")
    run_experiment(cfg, tmp_path / "run", config_yaml="secagg",
                   execute=lambda plan, app: run_in_process(
                       plan, _DropAt(app, 1, Stage.COLLECT_MASKED_VECTORS)))
    [row] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert (row["clients_sampled"], row["clients_trained"], row["clients_failed"]) == \
        (CLIENTS, CLIENTS - 1, 1)
    assert row["secagg_stage_replies"] == [CLIENTS, CLIENTS, CLIENTS - 1, CLIENTS - 1]
    survivors = [0, 2, 3]
    expected = _fedavg(trained, survivors)
    got = final_checkpoint(tmp_path / "run")
    bound = _bound(cfg, trained, survivors)
    for name, want in expected.items():
        assert np.abs(np.asarray(got[name]) - want).max() <= bound
    # and not the mean of all four: the dropped client's masks were removed, not its update
    every = _fedavg(trained, list(range(CLIENTS)))
    assert max(np.abs(np.asarray(got[n]) - every[n]).max() for n in every) > 10 * bound


def test_secaggplus_halts_when_too_few_clients_remain(cache_dir, tmp_path):
    from fedadapt.federation.server.faults import RoundFailed

    cfg = _cfg(cache_dir, "secaggplus")
    cfg.secagg.reconstruction_threshold = 1.0  # every share needed: no client may drop

    with pytest.raises(RoundFailed, match=r"SecAgg\+ halted at stage 3 of 4: 3 of 4 "):
        run_experiment(cfg, tmp_path / "run", config_yaml="secagg",
                       execute=lambda plan, app: run_in_process(
                           plan, _DropAt(app, 2, Stage.COLLECT_MASKED_VECTORS)))


def test_secaggplus_by_config_on_the_inprocess_backend(cache_dir, tmp_path):
    """No ``execute``: the simulation's own launcher, one node per client under secagg."""
    cfg = _cfg(cache_dir, "secaggplus", federation=FederationConfig(backend="inprocess"))
    cfg.rounds = 2
    run_experiment(cfg, tmp_path / "run", config_yaml="secagg")
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["clients_trained"] for r in rows] == [CLIENTS, CLIENTS]
    assert [r["secagg_stage_replies"] for r in rows] == [[CLIENTS] * 4] * 2
    assert rows[-1]["global_acc"] is not None and rows[-1]["client_acc"] is not None


@pytest.mark.slow  # a run on Flower's Ray simulation engine
def test_secaggplus_on_rays_simulation_engine_is_fedavg_within_its_quantisation(cache_dir,
                                                                               tmp_path):
    """``federation.backend=simulation``: Flower's Ray engine, one SuperNode per client under
    SecAgg+; round 2's training loss (the clients train from round 1's aggregate) is plain
    FedAvg's within the protocol's quantisation (docs/federation.md). Plain FedAvg runs in
    process: Ray and in process give the same metrics to the bit
    (tests/test_simulation.py)."""
    losses = {}
    for name, backend in (("none", "inprocess"), ("secaggplus", "simulation")):
        cfg = _cfg(cache_dir, name, federation=FederationConfig(backend=backend))
        cfg.rounds = 2
        run_experiment(cfg, tmp_path / name, config_yaml=name)
        rows = read_jsonl(tmp_path / name / "metrics.jsonl")
        assert [r["clients_trained"] for r in rows] == [CLIENTS, CLIENTS]
        losses[name] = rows[-1]["train_loss"]
    assert read_jsonl(tmp_path / "secaggplus" / "metrics.jsonl")[-1][
        "secagg_stage_replies"] == [CLIENTS] * 4
    assert losses["secaggplus"] == pytest.approx(losses["none"], rel=1e-5)


@pytest.mark.parametrize("change, key", [
    (dict(strategy=StrategyConfig(name="fedprox")), "strategy="),
    (dict(faults=FaultConfig(fraction=0.25)), "faults.fraction="),
    (dict(secagg=SecAggConfig(name="secagg")), "secagg="),
    (dict(secagg=SecAggConfig(name="secaggplus", num_shares=2)), "secagg.num_shares="),
    # Flower's workflow tells the clients 20 shares and gives them 21 neighbours (IndexError)
    (dict(secagg=SecAggConfig(name="secaggplus", num_shares=20)), "secagg.num_shares="),
    (dict(secagg=SecAggConfig(name="secaggplus", modulus_range=3 * 2 ** 22)),
     "secagg.modulus_range="),
    (dict(secagg=SecAggConfig(name="secaggplus", clipping_range=8.0, max_weight=-1.0)),
     "secagg.max_weight="),
])
def test_secaggplus_refusals_name_the_key(cache_dir, change, key):
    cfg = _cfg(cache_dir, "secaggplus")
    for name, value in change.items():
        setattr(cfg, name, value)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    line = str(err.value)
    assert line.startswith(key) and "\n" not in line


def test_secaggplus_refusals_from_the_command_line():
    """The ``secagg=`` group composed as the ``fedadapt`` command composes it."""
    from fedadapt.entry import compose_config, to_run_config

    assert to_run_config(compose_config([])).secagg.name == "none"
    run = to_run_config(compose_config(["secagg=secaggplus"]))
    assert run.secagg.name == "secaggplus" and run.secagg.quantization_range == 2 ** 22
    for args, key in ((["secagg=secaggplus", "dp=client_fixed", "method.weighting=uniform"],
                       "dp="),
                      (["secagg=secaggplus", "method.weighting=uniform"], "method.weighting="),
                      (["secagg=secaggplus", "strategy=fedmedian"], "strategy=")):
        with pytest.raises(ConfigError) as err:
            to_run_config(compose_config(args))
        assert str(err.value).startswith(key) and "secagg=secaggplus" in str(err.value)


def test_secaggplus_refuses_wrapping_around_the_modulus(cache_dir, tmp_path):
    cfg = _cfg(cache_dir, "secaggplus")
    cfg.secagg.quantization_range = 2 ** 30  # 4 clients x 2**30 = the modulus 2**32
    with pytest.raises(ConfigError, match=r"^secagg.quantization_range=1073741824 is invalid "
                                          r"with 4 clients a round"):
        run_experiment(cfg, tmp_path / "run", config_yaml="secagg", execute=run_in_process)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_secagg_none_changes_nothing(cache_dir, plain, tmp_path):
    """``secagg=none`` (the default) runs the strategy's own hooks: the same arrays to the
    bit as before the key existed (the plain run), and the plan carries no SecAgg+ round."""
    _, plain_final = plain
    cfg = _cfg(cache_dir)
    prep = prepare_run(cfg, quiet=True)
    assert prep.spec.num_clients == CLIENTS and cfg.secagg.name == "none"
    run_experiment(cfg, tmp_path / "run", config_yaml="plain", prepared=prep,
                   execute=run_in_process)
    again = final_checkpoint(tmp_path / "run")
    for name, value in plain_final.items():
        assert np.array_equal(np.asarray(again[name]), np.asarray(value))
    assert not any(k.startswith("secagg") for r in read_jsonl(tmp_path / "run" /
                                                              "metrics.jsonl") for k in r)

