"""The aggregation's edge cases, from mutmut's survivors (scripts/mutation.sh, docs/reliability.md):
a reply without a layer, without train_loss or without arrays, zero or small total weights, no
free slot, fewer clients than the buffer, failed replies, malformed factors named in full, the
sent records' dtypes, the documented defaults. Each test's docstring names the mutants it pins
(module.function: what the mutant changed). Fast: hand-built records, no Ray, no subprocess."""

import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

from fedadapt.federation.wire import records
from fedadapt.federation.wire.grid import node_id
from fedadapt.strategies.fedavg import LocalOnly, PerTensorFedAvg, aggregate_client_metrics
from fedadapt.strategies.fedbuff import FedBuff, staleness_weight
from fedadapt.strategies.fedex_lora import FedExLoRA
from fedadapt.strategies.fedsa_lora import FedSALoRA
from fedadapt.strategies.flexlora import FlexLoRA
from fedadapt.strategies.flora import FLoRA
from fedadapt.strategies.hetlora import HetLoRA
from fedadapt.strategies.lora_rank import matrix_b, svd_split
from fedadapt.strategies.registry import keys_of, strategy_schemas
from fedadapt.strategies.state import StrategyStateError

CONF = Path(__file__).resolve().parents[1] / "conf" / "strategy"
A, B, D = "enc.q.lora_A.default.weight", "enc.q.lora_B.default.weight", "enc.q.base_delta"
A2, B2, D2 = "enc.k.lora_A.default.weight", "enc.k.lora_B.default.weight", "enc.k.base_delta"
OUT, IN, R_MAX = 6, 5, 4
TOL = dict(atol=1e-10, rtol=0)


def arr(values, dtype=np.float64) -> Array:
    return Array.from_numpy_ndarray(np.ascontiguousarray(np.asarray(values, dtype=dtype)))


def randn(*shape, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def reply(cid: int, tensors: dict | None, metrics: dict | None = None) -> Message:
    """Client ``cid``'s reply as fedadapt's grid hands it to a strategy (``tensors`` None: a
    reply without an ArrayRecord)."""
    sent = Message(RecordDict(), dst_node_id=node_id(cid), message_type=MessageType.TRAIN)
    sent.metadata.__dict__["_message_id"] = f"m{cid}"
    content = RecordDict({"metrics": MetricRecord(
        {"num-examples": 1.0, "train_loss": 1.0} if metrics is None else metrics)})
    if tensors is not None:
        content["arrays"] = ArrayRecord({k: v if isinstance(v, Array) else arr(v)
                                         for k, v in tensors.items()})
    return Message(content, reply_to=sent)


def failed(cid: int) -> Message:
    sent = Message(RecordDict(), dst_node_id=node_id(cid), message_type=MessageType.TRAIN)
    sent.metadata.__dict__["_message_id"] = f"e{cid}"
    return Message(Error(code=0, reason="boom"), reply_to=sent)


class Grid:
    def __init__(self, n: int):
        self.n = n

    def get_node_ids(self):
        return [node_id(c) for c in range(self.n)]


def common(**kw) -> dict:
    return {**dict(fraction_train=1.0, fraction_evaluate=1.0, min_train_nodes=1,
                   min_evaluate_nodes=1, min_available_nodes=1,
                   train_metrics_aggr_fn=aggregate_client_metrics), **kw}


def ranks(*r):
    """``rank_of`` for clients 0, 1, ... of ranks ``r``."""
    return lambda node: r[node - node_id(0)]


def lora_record(dtype=np.float64, seed: int = 0) -> ArrayRecord:
    return ArrayRecord({A: arr(randn(R_MAX, IN, seed=seed), dtype),
                        B: arr(randn(OUT, R_MAX, seed=seed + 1), dtype),
                        "head": arr(np.zeros(3), dtype)})


# -- fedavg.py ------------------------------------------------------------------------------------

def test_local_only_takes_replies_that_carry_no_arrays(flower_task):
    """fedavg.LocalOnly.aggregate_train: Flower's reply check turned on (``validate`` True or
    left out), which refuses replies without an ArrayRecord, LocalOnly's every reply."""
    strategy = LocalOnly(**common())
    new, metrics = strategy.aggregate_train(1, [
        reply(0, None, {"num-examples": 1.0, "train_loss": 2.0}),
        reply(1, None, {"num-examples": 3.0, "train_loss": 4.0})])
    assert new is None and metrics["train_loss"] == pytest.approx(3.5)


def test_local_only_with_every_reply_failed_reports_no_metrics(flower_task):
    """fedavg.LocalOnly.aggregate_train: ``if contents`` made always true (the metrics of no
    client, a record of zeros, instead of None)."""
    assert LocalOnly(**common()).aggregate_train(1, [failed(0), failed(1)]) == (None, None)


@pytest.mark.parametrize("build", [
    lambda: PerTensorFedAvg(**common()), lambda: LocalOnly(**common()),
    lambda: HetLoRA(ranks(R_MAX, R_MAX), **common()),
    lambda: FedBuff(buffer_size=1, concurrency=2)], ids=["fedavg", "local", "lora", "fedbuff"])
def test_a_training_rounds_replies_are_logged_as_training(build, caplog, flower_task):
    """fedavg.PerTensorFedAvg / LocalOnly.aggregate_train, lora_rank.LoRARankStrategy.
    aggregate_train, fedbuff.FedBuff.aggregate_train: ``is_train`` None or False, the round's
    log line then says aggregate_evaluate."""
    strategy = build()
    current = lora_record() if isinstance(strategy, HetLoRA) else ArrayRecord({"head": arr([0.0])})
    strategy.configure_train(1, current, ConfigRecord({}), Grid(2))
    if isinstance(strategy, FedBuff):
        strategy.arrive({node_id(0): (0.0, 1.0)})
    ok = reply(0, {n: a.numpy() for n, a in current.items()})
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.aggregate_train(1, [ok, failed(1)])
    assert "aggregate_train: Received 1 results and 1 failures" in caplog.text
    assert "aggregate_evaluate" not in caplog.text


# -- lora_rank.py ----------------------------------------------------------------------------------

def test_a_reply_without_the_layer_leaves_it_to_the_replies_that_hold_it(flower_task):
    """lora_rank.LoRARankStrategy._aggregate_pair: ``shares_b and b_name in sent`` made ``or``
    (a reply holding neither factor refused), ``continue`` made ``break`` (the replies after
    it left out)."""
    strategy = HetLoRA(ranks(R_MAX, R_MAX), **common())
    current = lora_record()
    strategy.configure_train(1, current, ConfigRecord({}), Grid(2))
    a1, b1 = randn(R_MAX, IN, seed=5), randn(OUT, R_MAX, seed=6)
    new, _ = strategy.aggregate_train(1, [reply(0, {"head": [1.0, 1.0, 1.0]}),
                                          reply(1, {A: a1, B: b1, "head": [3.0, 3.0, 3.0]})])
    np.testing.assert_allclose(new[A].numpy(), a1, **TOL)  # the one reply that holds it
    np.testing.assert_allclose(new[B].numpy(), b1, **TOL)
    np.testing.assert_allclose(new["head"].numpy(), [2.0] * 3, **TOL)


def test_a_reply_b_that_is_not_a_matrix_is_refused_naming_it(flower_task):
    """lora_rank.LoRARankStrategy._aggregate_pair: ``matrix_b``'s name left out or None (the
    message then names 'B' or None, not the reply's tensor)."""
    strategy = HetLoRA(ranks(2), **common())
    strategy.configure_train(1, lora_record(), ConfigRecord({}), Grid(1))
    bad = reply(0, {A: randn(2, IN, seed=1), B: randn(OUT, 2, 2, seed=2)})
    with pytest.raises(ValueError) as err:
        strategy.aggregate_train(1, [bad])
    assert str(err.value) == f"{B!r} has shape ({OUT}, 2, 2): a LoRA B is out x r (x 1 x 1)"


def test_a_reply_b_of_another_rank_than_its_a_is_refused_in_full(flower_task):
    """lora_rank.LoRARankStrategy._aggregate_pair: the message of a B whose rank is not its
    A's made None, its shape None, or A's width given as its rank."""
    strategy = HetLoRA(ranks(3), **common())
    strategy.configure_train(1, lora_record(), ConfigRecord({}), Grid(1))
    bad = reply(0, {A: randn(2, IN, seed=1), B: randn(OUT, 3, seed=2)})
    with pytest.raises(ValueError) as err:
        strategy.aggregate_train(1, [bad])
    assert str(err.value) == (f"the reply of node {node_id(0)} holds {B!r} of shape ({OUT}, 3): "
                              f"out x 2 (the rank of its A) was expected")


def test_matrix_b_names_b_when_given_no_name():
    """lora_rank.matrix_b: the default name 'B' made 'XXBXX' or 'b'."""
    with pytest.raises(ValueError) as err:
        matrix_b(torch.zeros(2, 3, 2))
    assert str(err.value) == "'B' has shape (2, 3, 2): a LoRA B is out x r (x 1 x 1)"


@pytest.mark.parametrize("cls", [HetLoRA, FlexLoRA, FLoRA, FedExLoRA, FedSALoRA])
def test_replies_of_zero_total_weight_leave_every_layer_as_it_was(cls, flower_task):
    """lora_rank.LoRARankStrategy._aggregate_pair: ``not As or sum(ws) <= 0`` made ``and``, or
    ``< 0`` (the layer then aggregated with weights that sum to 0)."""
    strategy = cls(ranks(R_MAX, 2), **common())
    current = lora_record()
    strategy.configure_train(1, current, ConfigRecord({}), Grid(2))
    zero = {"num-examples": 0.0, "train_loss": 1.0}
    new, _ = strategy.aggregate_train(1, [
        reply(0, {A: randn(R_MAX, IN, seed=3), B: randn(OUT, R_MAX, seed=4), "head": [1.0] * 3},
              zero),
        reply(1, {A: randn(2, IN, seed=5), B: randn(OUT, 2, seed=6), "head": [2.0] * 3}, zero)])
    assert list(new.keys()) == list(current.keys())  # no base_delta either
    for name in current.keys():
        np.testing.assert_array_equal(new[name].numpy(), current[name].numpy())


# -- hetlora.py ------------------------------------------------------------------------------------

def test_hetlora_keeps_the_rank_a_client_pruned_to_after_a_failed_reply(flower_task):
    """hetlora.HetLoRA.aggregate_train: ``continue`` past a failed reply made ``break`` (the
    ranks of the replies after it forgotten)."""
    strategy = HetLoRA(ranks(R_MAX, R_MAX), **common())
    strategy.configure_train(1, lora_record(), ConfigRecord({}), Grid(2))
    strategy.aggregate_train(1, [failed(0), reply(1, {A: randn(2, IN, seed=1),
                                                      B: randn(OUT, 2, seed=2)})])
    assert strategy.client_rank(node_id(1)) == 2 and strategy.client_rank(node_id(0)) == R_MAX


@pytest.mark.parametrize("data_weighted", [False, True])
def test_hetlora_without_sparsity_weights_is_the_plain_padded_mean(data_weighted, flower_task):
    """hetlora.HetLoRA.aggregate_layer: ``sparsity=self.sparsity_weighted`` left out (the
    sparsity weights always on)."""
    strategy = HetLoRA(ranks(R_MAX, 2), sparsity_weighted=False, data_weighted=data_weighted,
                       **common())
    strategy.configure_train(1, lora_record(), ConfigRecord({}), Grid(2))
    a0, b0 = randn(R_MAX, IN, seed=1), randn(OUT, R_MAX, seed=2)
    a1, b1 = randn(2, IN, seed=3), 10 * randn(OUT, 2, seed=4)  # a larger norm
    new, _ = strategy.aggregate_train(1, [reply(0, {A: a0, B: b0}, {"num-examples": 1.0}),
                                          reply(1, {A: a1, B: b1}, {"num-examples": 3.0})])
    p = [0.25, 0.75] if data_weighted else [0.5, 0.5]
    want_a = p[0] * a0 + p[1] * np.vstack([a1, np.zeros((R_MAX - 2, IN))])
    want_b = p[0] * b0 + p[1] * np.hstack([b1, np.zeros((OUT, R_MAX - 2))])
    np.testing.assert_allclose(new[A].numpy(), want_a, **TOL)
    np.testing.assert_allclose(new[B].numpy(), want_b, **TOL)


def _documented_keys(name: str) -> dict:
    """The ``# Keys: k=v, ...`` defaults that conf/strategy/<name>.yaml states."""
    text = (CONF / f"{name}.yaml").read_text()
    block = text[text.index("# Keys:"):].split("\n# Set from")[0]
    return {k: v for k, v in re.findall(r"(\w+)=([\w.]*\w)", block)}


@pytest.mark.parametrize("name, build", [
    ("hetlora", lambda: HetLoRA(ranks(1))), ("fedbuff", lambda: FedBuff())])
def test_the_strategies_defaults_are_the_ones_their_config_states(name, build):
    """hetlora.HetLoRA.__init__: ``data_weighted`` default True, ``prune_gamma`` 1.0;
    fedbuff.FedBuff.__init__: ``buffer_size`` 11, ``server_lr`` 2.0: a strategy built in
    Python without them differs from the config's (conf/strategy/*.yaml's Keys line, the
    schema's defaults)."""
    documented = _documented_keys(name)
    schema = keys_of(strategy_schemas()[name]())
    built = build()
    assert documented and set(documented) <= set(schema)
    for key, text in documented.items():
        value = schema[key]
        assert str(value) == text, (key, value, text)
        if key != "concurrency":  # concurrency=0: derived (see the FedBuff tests)
            assert getattr(built, key) == value, (key, getattr(built, key), value)


# -- fedex_lora.py ---------------------------------------------------------------------------------

def test_fedex_sends_every_layer_its_folded_tails_in_its_base_deltas_dtype(flower_task):
    """fedex_lora.FedExLoRA.client_arrays: ``continue`` after a layer sent as it is made
    ``break`` (the later layers then sent without their tails folded); the folded
    base_delta's dtype taken from A instead of the global base_delta."""
    k_a, k_b, k_d = randn(2, IN, seed=1), randn(OUT, 2, seed=2), randn(OUT, IN, seed=3)
    q_a, q_b, q_d = randn(R_MAX, IN, seed=4), randn(OUT, R_MAX, seed=5), randn(OUT, IN, seed=6)
    current = ArrayRecord({A2: arr(k_a, np.float32), B2: arr(k_b, np.float32), D2: arr(k_d),
                           A: arr(q_a, np.float32), B: arr(q_b, np.float32), D: arr(q_d)})
    strategy = FedExLoRA(ranks(2), **common())
    sent = strategy.configure_train(1, current, ConfigRecord({}), Grid(1))[0].content["arrays"]
    np.testing.assert_array_equal(sent[D2].numpy(), k_d)  # rank 2 = its global rank: as it is
    q32 = [x.astype(np.float32).astype(np.float64) for x in (q_a, q_b)]
    assert sent[D].dtype == current[D].dtype  # float64, as the global base_delta
    np.testing.assert_allclose(sent[D].numpy(), q_d + q32[1][:, 2:] @ q32[0][2:], **TOL)


def _bad_b(record: ArrayRecord) -> ArrayRecord:
    """``record`` with a B of shape out x r x 2 (not a matrix, nor a conv's out x r x 1 x 1)."""
    out = ArrayRecord(dict(record.items()))
    out[B] = arr(randn(OUT, R_MAX, 2, seed=9))
    return out


@pytest.mark.parametrize("cls", [FedExLoRA, FlexLoRA])
def test_a_global_b_that_is_not_a_matrix_is_refused_naming_it_when_sending(cls, flower_task):
    """fedex_lora.FedExLoRA.client_arrays, flexlora.FlexLoRA._whole: ``matrix_b``'s name left
    out or None."""
    with pytest.raises(ValueError) as err:
        cls(ranks(2), **common()).configure_train(1, _bad_b(lora_record()), ConfigRecord({}),
                                                  Grid(1))
    assert str(err.value) == f"{B!r} has shape ({OUT}, {R_MAX}, 2): a LoRA B is out x r (x 1 x 1)"


def test_fedex_refuses_a_global_b_that_is_not_a_matrix_naming_it_when_folding():
    """fedex_lora.FedExLoRA.aggregate_layer: ``matrix_b``'s name left out or None."""
    As, Bs = [torch.from_numpy(randn(2, IN, seed=1))], [torch.from_numpy(randn(OUT, 2, seed=2))]
    with pytest.raises(ValueError) as err:
        FedExLoRA(ranks(2)).aggregate_layer(A, _bad_b(lora_record()), As, Bs, [1.0], [2])
    assert str(err.value) == f"{B!r} has shape ({OUT}, {R_MAX}, 2): a LoRA B is out x r (x 1 x 1)"


# -- fedsa_lora.py ---------------------------------------------------------------------------------

@pytest.mark.parametrize("names, says", [
    ([A, B, A2], f"{A2!r} is a LoRA A without its B {B2!r}"),
    ([A, B, B2], f"{B2!r} is a LoRA B without its A {A2!r}")])
def test_fedsa_checks_the_pairs_of_a_global_record_that_holds_b(names, says):
    """fedsa_lora.FedSALoRA.pairs: ``n.split('.')`` made ``split(None)`` or ``split('XX.XX')``
    (no B ever found: a record with B no longer checked for unpaired factors)."""
    with pytest.raises(ValueError) as err:
        FedSALoRA(ranks(1)).pairs(names)
    assert str(err.value) == says


# -- flexlora.py -----------------------------------------------------------------------------------

def test_flexlora_sends_the_svd_of_a_layer_after_one_still_at_zero(flower_task):
    """flexlora.FlexLoRA.client_arrays: ``continue`` after a zero layer made ``break`` (the
    layers after it then sent truncated, not as the best rank-r approximation)."""
    q_a, q_b = randn(R_MAX, IN, seed=1), randn(OUT, R_MAX, seed=2)
    current = ArrayRecord({A2: arr(randn(R_MAX, IN, seed=3)), B2: arr(np.zeros((OUT, R_MAX))),
                           A: arr(q_a), B: arr(q_b)})
    sent = FlexLoRA(ranks(2), **common()).configure_train(
        1, current, ConfigRecord({}), Grid(1))[0].content["arrays"]
    want_a, want_b = svd_split(torch.from_numpy(q_b @ q_a), 2)
    np.testing.assert_allclose(sent[A].numpy(), want_a.numpy(), **TOL)
    np.testing.assert_allclose(sent[B].numpy(), want_b.numpy(), **TOL)


def test_flexlora_sends_a_conv_b_in_its_conv_shape(flower_task):
    """flexlora.FlexLoRA.client_arrays: B's shape built from ``b_now.shape[3:]`` instead of
    ``[2:]`` (a conv's out x r x 1 x 1 sent as out x r x 1)."""
    a, b = randn(R_MAX, 3, 2, 2, seed=1), randn(OUT, R_MAX, 1, 1, seed=2)
    sent = FlexLoRA(ranks(2), **common()).configure_train(
        1, ArrayRecord({A: arr(a), B: arr(b)}), ConfigRecord({}), Grid(1))[0].content["arrays"]
    assert tuple(sent[A].shape) == (2, 3, 2, 2) and tuple(sent[B].shape) == (OUT, 2, 1, 1)
    want_a, want_b = svd_split(torch.from_numpy(b.reshape(OUT, R_MAX) @ a.reshape(R_MAX, -1)), 2)
    np.testing.assert_allclose(sent[B].numpy().reshape(OUT, 2), want_b.numpy(), **TOL)


# -- flora.py --------------------------------------------------------------------------------------

def test_flora_sends_the_first_zero_base_delta_in_the_records_dtype(flower_task):
    """flora.FLoRA.client_arrays: the zero base_delta's dtype None (sent in float64, twice the
    bytes of a float32 record)."""
    sent = FLoRA(ranks(2), **common()).configure_train(
        1, lora_record(np.float32), ConfigRecord({}), Grid(1))[0].content["arrays"]
    assert sent[D].dtype == sent[A].dtype == "float32"
    np.testing.assert_array_equal(sent[D].numpy(), np.zeros((OUT, IN), np.float32))


def test_floras_fresh_a_is_drawn_from_its_seed(flower_task):
    """flora.FLoRA.__init__: the generator seeded with None instead of ``seed`` (the fresh A
    then differs between two runs of one seed)."""
    def fresh(seed):
        strategy = FLoRA(ranks(R_MAX), seed=seed, **common())
        strategy.configure_train(1, lora_record(), ConfigRecord({}), Grid(1))
        new, _ = strategy.aggregate_train(1, [reply(0, {A: randn(R_MAX, IN, seed=1),
                                                        B: randn(OUT, R_MAX, seed=2)})])
        return new[A].numpy()

    np.testing.assert_array_equal(fresh(3), fresh(3))
    assert not np.array_equal(fresh(3), fresh(4))


# -- fedbuff.py ------------------------------------------------------------------------------------

def test_staleness_weight_is_the_papers_inverse_sqrt_by_default():
    """fedbuff.staleness_weight: the default kind 'sqrt' made 'XXsqrtXX' or 'SQRT' (then 1)."""
    assert staleness_weight(3) == 0.5 and staleness_weight(0) == 1.0
    assert staleness_weight(3, "constant") == 1.0


def test_fedbuff_refuses_an_old_checkpoint_in_one_whole_message():
    """fedbuff.FedBuff.configure_train: the refusal's wording changed after its first words."""
    old = FedBuff(buffer_size=1)
    old.in_flight = [{"cid": 3, "version": 0, "finish": 1.0, "weight": 1.0, "loss": 0.5,
                      "delta": {}}]
    with pytest.raises(StrategyStateError) as err:
        old.configure_train(2, ArrayRecord(), ConfigRecord({}), grid=None)
    assert str(err.value) == (
        "strategy=fedbuff: this checkpoint's clients in flight are keyed by partition id, as "
        "fedadapt wrote them before FedBuff took its arrivals by node id "
        "(AsynchronousStrategy); it cannot resume: start the run again")


def _fedbuff(n_nodes: int, **kw):
    """A FedBuff and its round: start the free slots, tell their arrivals, reply."""
    strategy = FedBuff(weighted_by_key="n", **kw)
    grid = Grid(n_nodes)

    def round_(server_round, x, values, weights, losses=None, seconds=None):
        started = strategy.configure_train(server_round, x, ConfigRecord({}), grid)
        nodes = [m.metadata.dst_node_id for m in started]
        strategy.arrive({n: (strategy.now, (seconds or {}).get(n, 1.0 + n - node_id(0)))
                         for n in nodes})
        out = [reply(n - node_id(0), {"w": np.asarray([values[n - node_id(0)]], np.float32)},
                     {"n": weights[n - node_id(0)],
                      **({} if losses is None or losses[n - node_id(0)] is None
                         else {"train_loss": losses[n - node_id(0)]})})
               for n in nodes]
        return strategy.aggregate_train(server_round, out)

    return strategy, round_


X0 = ArrayRecord({"w": Array(np.array([1.0], np.float32))})


def test_fedbuff_without_an_arrival_time_is_refused_in_full(flower_task):
    """fedbuff.FedBuff.aggregate_train: the message of a reply without an arrival time made
    None."""
    strategy = FedBuff(buffer_size=1, concurrency=1)
    strategy.configure_train(1, X0, ConfigRecord({}), Grid(1))
    with pytest.raises(ValueError) as err:
        strategy.aggregate_train(1, [reply(0, {"w": [2.0]})])
    assert str(err.value) == (f"FedBuff: no arrival time for node {node_id(0)} (fedadapt's "
                              f"server calls FedBuff.arrive; it needs fleet=)")


def test_fedbuff_replies_without_train_loss_are_left_out_of_the_loss(flower_task):
    """fedbuff.FedBuff.aggregate_train: ``metrics.get('train_loss', nan)``'s default made None
    or left out (a reply without train_loss: TypeError); ``if weight > 0`` made always true,
    or ``>= 0`` (no loss at all: ZeroDivisionError)."""
    _, round_ = _fedbuff(2, buffer_size=2, concurrency=2)
    new, metrics = round_(1, X0, [2.0, 3.0], [1.0, 3.0], losses=[None, 0.5])
    assert new["w"].numpy()[0] == pytest.approx(1.0 + (1.0 * 1.0 + 3.0 * 2.0) / 4)
    assert metrics["train_loss"] == 0.5
    _, round_ = _fedbuff(2, buffer_size=2, concurrency=2)
    new, metrics = round_(1, X0, [2.0, 3.0], [1.0, 3.0], losses=[None, None])
    assert "train_loss" not in metrics and metrics["staleness_max"] == 0.0


def test_fedbuff_weights_that_sum_below_one_are_weights_all_the_same(flower_task):
    """fedbuff.FedBuff.aggregate_train: ``total <= 0`` made ``<= 1`` (the tensor then kept),
    ``weight > 0`` made ``> 1`` (the loss then left out)."""
    _, round_ = _fedbuff(2, buffer_size=2, concurrency=2, server_lr=0.5)
    new, metrics = round_(1, X0, [2.0, 5.0], [0.25, 0.5], losses=[1.0, 4.0])
    step = (0.25 * 1.0 + 0.5 * 4.0) / 0.75
    assert new["w"].numpy()[0] == pytest.approx(1.0 + 0.5 * step)
    assert metrics["train_loss"] == pytest.approx((0.25 * 1.0 + 0.5 * 4.0) / 0.75)


def test_fedbuff_replies_of_zero_total_weight_leave_the_tensor_as_it_was(flower_task):
    """fedbuff.FedBuff.aggregate_train: ``not holders or total <= 0`` made ``and``, or
    ``< 0`` (a step divided by a zero total: ZeroDivisionError)."""
    strategy, round_ = _fedbuff(2, buffer_size=2, concurrency=2)
    new, metrics = round_(1, X0, [2.0, 3.0], [0.0, 0.0], losses=[1.0, 1.0])
    assert new["w"].numpy()[0] == 1.0 and strategy.version == 1
    assert "train_loss" not in metrics  # the loss's weights are zero too


def test_fedbuff_with_fewer_clients_than_its_buffer_waits_then_applies_them(flower_task):
    """fedbuff.FedBuff.aggregate_train, the buffer's size ``k``: made ``buffer_size`` always,
    or ``len(in_flight)`` / 1 while new clients arrive (an update applied before the buffer
    is full), or 0 when none arrive (the clients in flight then never applied: the run stalls).
    Two clients available, a buffer of three: round 1 buffers both and waits; round 2 has no
    free slot (configure_train starts nobody) and applies the two."""
    strategy, round_ = _fedbuff(2, buffer_size=3, concurrency=3)
    assert round_(1, X0, [2.0, 5.0], [1.0, 3.0]) == (None, None)
    assert len(strategy.in_flight) == 2 and strategy.version == 0
    assert strategy.configure_train(2, X0, ConfigRecord({}), Grid(2)) == []
    new, metrics = strategy.aggregate_train(2, [])
    assert new["w"].numpy()[0] == pytest.approx(1.0 + (1.0 * 1.0 + 3.0 * 4.0) / 4)
    assert strategy.in_flight == [] and strategy.version == 1 and strategy.now == 2.0
    assert metrics["staleness_max"] == 0.0


def test_fedbuff_with_constant_staleness_applies_a_stale_change_in_full(flower_task):
    """fedbuff.FedBuff.aggregate_train: ``staleness_weight(t, self.staleness)``'s kind left
    out (``staleness=constant`` then weighted 1/sqrt(1 + tau) all the same)."""
    strategy, round_ = _fedbuff(2, buffer_size=1, concurrency=2, staleness="constant")
    new, _ = round_(1, X0, [2.0, 5.0], [1.0, 1.0])  # node 0 first (1 s): 1 + (2 - 1)
    assert new["w"].numpy()[0] == 2.0
    new, metrics = round_(2, new, [9.0, 9.0], [1.0, 1.0], seconds={node_id(0): 5.0})
    # node 1 (2 s) started from 1.0 and sent 5.0, one update ago: its change 4.0, in full
    assert new["w"].numpy()[0] == 6.0 and metrics["staleness_max"] == 1.0


# -- records.py ------------------------------------------------------------------------------------

def test_own_gives_each_client_config_and_metric_records_of_its_own():
    """records.own: ``copy.deepcopy`` of a ConfigRecord / MetricRecord made ``copy.copy``
    (the records' values then shared: one client's mod changes another's config)."""
    content = RecordDict({"config": ConfigRecord({"lr": 0.1, "milestones": [1, 2]}),
                          "metrics": MetricRecord({"loss": 1.0})})
    mine = records.own(content)
    mine["config"]["lr"] = 0.05
    mine["config"]["milestones"][0] = 9
    mine["metrics"]["loss"] = 2.0
    mine["config"]["new"] = 1
    assert dict(content["config"].items()) == {"lr": 0.1, "milestones": [1, 2]}
    assert dict(content["metrics"].items()) == {"loss": 1.0}


def test_view_gives_a_client_the_shared_records_and_its_own_only():
    """records.view: the shared names' test ``'/' not in name`` made ``'XX/XX' not in name``
    (every client's prefixed records then shown to each)."""
    shared, mine, theirs = (ConfigRecord({"lr": 0.1}), MetricRecord({"n": 1.0}),
                            MetricRecord({"n": 2.0}))
    content = RecordDict({"config": shared, "c1/metrics": mine, "c2/metrics": theirs,
                          records.GRID: ConfigRecord({records.CLIENTS: [1, 2]})})
    view = records.view(content, 1)
    assert list(view.keys()) == ["config", "metrics"]
    assert view["config"] is shared and view["metrics"] is mine


def test_pack_adds_to_the_content_it_is_given_and_unpack_reads_it_back():
    """records.pack: ``out`` replaced by a new RecordDict even when given; records.unpack:
    ``partition`` made ``rpartition`` (a name holding '/' then lost), the client prefix's test
    made ``or`` in either place (names not of the form c<id>/... read as a client's)."""
    out = RecordDict({"fedadapt.grid": ConfigRecord({records.NODE: ""})})
    a, b = MetricRecord({"loss": 1.0}), ConfigRecord({"reason": "x"})
    assert records.pack({3: RecordDict({"metrics": a, "fit/extra": b})}, out) is out
    out["x5/metrics"], out["r1"] = MetricRecord({"loss": 2.0}), ConfigRecord({})
    back = records.unpack(out)
    assert list(back) == [3] and dict(back[3].items()) == {"metrics": a, "fit/extra": b}


def test_error_of_reads_only_the_error_record():
    """records.error_of: the record's name None or left out (then any ConfigRecord is read as
    the error)."""
    assert records.error_of(RecordDict({"config": ConfigRecord({"lr": 0.1})})) is None
    assert records.error_of(records.error("boom")) == "boom"


def test_served_by_names_the_ray_node_by_its_first_8_hex_digits(monkeypatch):
    """records.served_by: the module looked up None / 'XXrayXX' / 'RAY' or not at all, the
    test made always false, 9 digits kept, the node outside Ray 'XXXX', the record made
    empty. Ray is faked (a module with a runtime context), never started."""
    content = records.served_by(RecordDict())
    assert dict(content[records.GRID].items()) == {records.NODE: ""}  # outside Ray

    class Context:
        def get_node_id(self):
            return "0123456789abcdef"

    class Ray:
        is_initialized = staticmethod(lambda: True)
        get_runtime_context = staticmethod(Context)

    monkeypatch.setitem(sys.modules, "ray", Ray())
    content = records.served_by(RecordDict())
    assert dict(content[records.GRID].items()) == {records.NODE: "01234567"}


# -- fedavg.py: the client metrics and per_tensor ------------------------------------------------

def test_client_metrics_keep_every_key_and_a_zero_weight_gives_nan():
    """fedavg.aggregate_client_metrics: ``continue`` past a key without finite values made
    ``break`` (the later keys then dropped); ``if total_w`` made always true (0/0:
    ZeroDivisionError), or its nan made ``float(None)`` / ``float('XXnanXX')``."""
    rows = [RecordDict({"m": MetricRecord({"n": 0.0, "a": float("nan"), "b": 2.0, "c": 4.0})}),
            RecordDict({"m": MetricRecord({"n": 0.0, "a": float("nan"), "b": 4.0, "c": 6.0})})]
    out = aggregate_client_metrics(rows, "n")
    assert "a" not in out and np.isnan(out["b"]) and np.isnan(out["c"])
    assert out["b_client_mean"] == 3.0 and out["c_client_mean"] == 5.0


def test_per_tensor_of_a_users_strategy_is_one_class_named_and_documented_as_its():
    """fedavg.per_tensor: the class made None, or ``type()``'s name, bases or namespace None
    or left out, or ``__doc__`` misspelt (a run's first per_tensor of a class builds it; mutmut's
    forked children reuse the parent's cache, so the class here is new)."""
    from flwr.serverapp.strategy import FedAvg

    from fedadapt.strategies.fedavg import per_tensor

    class Mine(FedAvg):
        """My strategy."""

    built = per_tensor(Mine)
    assert built is per_tensor(Mine) and built.__mro__[1:3] == (Mine, PerTensorFedAvg)
    assert (built.__name__, built.__doc__, built.__module__) == (
        "PerTensorMine", "My strategy.", "fedadapt.strategies.fedavg")


# -- codec.py --------------------------------------------------------------------------------------

def test_as_numpy_leaves_an_array_of_another_stype_to_flower():
    """codec.as_numpy: the fast path's test ``stype == 'numpy.ndarray' and magic and version``
    made ``(stype and magic) or version`` (.npy bytes under another stype then decoded, where
    Flower refuses them)."""
    from fedadapt.codec import as_numpy, to_array

    npy = to_array(np.arange(3.0))
    odd = Array(npy.dtype, npy.shape, "other", npy.data)
    with pytest.raises(TypeError) as flower:
        odd.numpy()
    with pytest.raises(TypeError) as ours:
        as_numpy(odd)
    assert str(ours.value) == str(flower.value)
