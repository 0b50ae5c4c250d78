"""LoRA of different ranks across clients (strategies/lora_rank.py and one module per paper:
hetlora.py, flexlora.py, flora.py, fedsa_lora.py, fedex_lora.py): each paper's aggregation
against its formula on small random float64 tensors, the same-rank cases that are FedAvg, what
configure_train sends each rank, and bad input."""

import inspect

import numpy as np
import pytest
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp.strategy import FedAvg

from fedadapt.adapters.lora import base_delta_name, lora_pairs
from fedadapt.codec import UNIFORM_KEY
from fedadapt.config import ConfigError
from fedadapt.federation.wire.grid import node_id
from fedadapt.strategies.fedavg import PerTensorFedAvg, aggregate_client_metrics
from fedadapt.strategies.fedex_lora import FedExLoRA
from fedadapt.strategies.fedsa_lora import FedSALoRA
from fedadapt.strategies.flexlora import FlexLoRA
from fedadapt.strategies.flora import FLoRA, flora_stack
from fedadapt.strategies.hetlora import HetLoRA, self_prune, sparsity_weights
from fedadapt.strategies.lora_rank import (
    check_rank,
    normalise,
    pad_rank,
    svd_split,
    truncate_rank,
    weighted_product_sum,
)
from fedadapt.strategies.state import load_strategy_state, strategy_state

A, B = "enc.q.lora_A.default.weight", "enc.q.lora_B.default.weight"
D = "enc.q.base_delta"
OUT, IN, R_MAX = 6, 5, 4
RANKS = {0: 2, 1: 3, 2: 4}  # partition id -> rank
TOL = dict(atol=1e-10, rtol=0)  # float64 throughout: far below the 1e-6 asked


def rank_of(node: int) -> int:
    return RANKS[node - node_id(0)]


def record(**tensors) -> ArrayRecord:
    return ArrayRecord({k.replace("__", "."): Array.from_numpy_ndarray(np.asarray(v, np.float64))
                        for k, v in tensors.items()})


def t(array: Array) -> torch.Tensor:
    return torch.from_numpy(array.numpy())


def global_record(seed: int = 0, b_zero: bool = False) -> ArrayRecord:
    g = torch.Generator().manual_seed(seed)
    b = torch.zeros(OUT, R_MAX) if b_zero else torch.randn(OUT, R_MAX, generator=g)
    return ArrayRecord({A: Array.from_torch_tensor(torch.randn(R_MAX, IN, generator=g).double()),
                        B: Array.from_torch_tensor(b.double()),
                        "head.weight": Array.from_numpy_ndarray(np.zeros((3, OUT))),
                        "head.bias": Array.from_numpy_ndarray(np.zeros(3))})


def reply(cid: int, tensors: dict, n: float) -> Message:
    """Client ``cid``'s reply as fedadapt's grid hands it to a strategy."""
    sent = Message(RecordDict(), dst_node_id=node_id(cid), message_type=MessageType.TRAIN)
    sent.metadata.__dict__["_message_id"] = f"m{cid}"
    arrays = ArrayRecord({k: Array.from_torch_tensor(torch.as_tensor(v, dtype=torch.float64)
                                                     .contiguous()) for k, v in tensors.items()})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
        {"num-examples": n, UNIFORM_KEY: 1.0, "train_loss": 1.0})}), reply_to=sent)


def client_factors(seed: int = 1, ranks=RANKS, b_key=True):
    """Each client's trained (A_k, B_k, head, n_k)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for cid, r in ranks.items():
        out[cid] = (torch.randn(r, IN, generator=g).double(),
                    torch.randn(OUT, r, generator=g).double(),
                    torch.randn(3, OUT, generator=g).double(), float(10 * (cid + 1)))
    return out


def replies_of(factors, shares_b=True):
    return [reply(cid, {A: a, **({B: b} if shares_b else {}), "head.weight": h,
                        "head.bias": torch.full((3,), float(cid))}, n)
            for cid, (a, b, h, n) in factors.items()]


class Grid:
    """Enough of a grid for configure_train / configure_evaluate."""

    def __init__(self, n: int = len(RANKS)):
        self.n = n

    def get_node_ids(self):
        return [node_id(p) for p in range(self.n)]


def kwargs(**kw):
    return {**dict(rank_of=rank_of, fraction_train=1.0, fraction_evaluate=1.0,
                   min_train_nodes=1, min_evaluate_nodes=1, min_available_nodes=1,
                   train_metrics_aggr_fn=aggregate_client_metrics), **kw}


def same_rank(node: int) -> int:
    return R_MAX


SAME = {0: R_MAX, 1: R_MAX, 2: R_MAX}


def sent(strategy, arrays: ArrayRecord, evaluate: bool = False) -> dict[int, ArrayRecord]:
    """partition id -> the arrays configure_train (or configure_evaluate) sends it."""
    hook = strategy.configure_evaluate if evaluate else strategy.configure_train
    msgs = hook(1, arrays, ConfigRecord({}), Grid())
    return {m.metadata.dst_node_id - node_id(0): m.content["arrays"] for m in msgs}


def run_round(strategy, arrays: ArrayRecord, replies: list[Message]):
    strategy.configure_train(1, arrays, ConfigRecord({}), Grid())
    return strategy.aggregate_train(1, replies)


def weights(factors) -> list[float]:
    n = [f[3] for f in factors.values()]
    return [x / sum(n) for x in n]


def check_head(new: ArrayRecord, factors):
    p = weights(factors)
    want = sum(pk * f[2] for pk, f in zip(p, factors.values()))
    np.testing.assert_allclose(new["head.weight"].numpy(), want.numpy(), **TOL)
    np.testing.assert_allclose(new["head.bias"].numpy(), np.full(3, sum(
        pk * cid for pk, cid in zip(p, factors))), **TOL)


# -- shared helpers ---------------------------------------------------------------------------

def test_lora_pairs_and_base_delta_names():
    names = ["x.lora_A.weight", "x.lora_B.weight", A, B, "head.weight"]
    assert lora_pairs(names) == {"x.lora_A.weight": "x.lora_B.weight", A: B}
    assert base_delta_name(A) == D and base_delta_name("x.lora_A.weight") == "x.base_delta"


def test_pad_and_truncate_keep_the_product():
    a, b = torch.randn(2, IN).double(), torch.randn(OUT, 2).double()
    ap, bp = pad_rank(a, b, 5)
    assert ap.shape == (5, IN) and bp.shape == (OUT, 5)
    assert not ap[2:].any() and not bp[:, 2:].any()
    torch.testing.assert_close(bp @ ap, b @ a)
    at, bt = truncate_rank(ap, bp, 2)
    assert torch.equal(at, a) and torch.equal(bt, b)


def test_weighted_product_sum():
    As = [torch.randn(r, IN).double() for r in (1, 3)]
    Bs = [torch.randn(OUT, r).double() for r in (1, 3)]
    want = 0.25 * Bs[0] @ As[0] + 0.75 * Bs[1] @ As[1]
    torch.testing.assert_close(weighted_product_sum(As, Bs, [0.25, 0.75]), want, **TOL)


def test_svd_split_is_the_best_rank_r_approximation_split_symmetrically():
    w = torch.randn(OUT, IN).double()
    u, s, vh = np.linalg.svd(w.numpy(), full_matrices=False)
    for r in (1, 3, 5, 7):
        a, b = svd_split(w, r)
        assert a.shape == (r, IN) and b.shape == (OUT, r)
        k = min(r, 5)
        np.testing.assert_allclose((b @ a).numpy(), (u[:, :k] * s[:k]) @ vh[:k], atol=1e-10)
        np.testing.assert_allclose((b.T @ b).numpy(), (a @ a.T).numpy(), atol=1e-10)  # S_r


def test_self_prune_drops_small_trailing_components():
    g = torch.Generator().manual_seed(3)
    scale = torch.tensor([1.0, 0.5, 1e-3, 1e-4], dtype=torch.float64)
    a = torch.randn(4, IN, generator=g).double() * scale[:, None]
    b = torch.randn(OUT, 4, generator=g).double()
    ap, bp = self_prune(a, b, 0.01)
    assert ap.shape == (2, IN) and bp.shape == (OUT, 2)
    assert torch.equal(ap, a[:2]) and torch.equal(bp, b[:, :2])
    # the rule itself, step by step: what stays fails the test, what went passed it
    last = torch.linalg.vector_norm(bp[:, -1]) * torch.linalg.vector_norm(ap[-1])
    assert last >= 0.01 * torch.linalg.matrix_norm(bp @ ap)
    assert self_prune(a, b, 0.0)[0].shape[0] == 4  # gamma 0: nothing pruned
    assert self_prune(a, torch.zeros(OUT, 4), 0.5)[0].shape[0] == 4  # B = 0: nothing
    assert self_prune(a.numpy(), b.numpy(), 10.0)[0].shape == (1, IN)  # numpy; rank >= 1
    with pytest.raises(ConfigError, match="gamma"):
        self_prune(a, b, -1.0)


def test_sparsity_weights_follow_the_product_norms():
    As = [torch.randn(r, IN).double() for r in (2, 4)]
    Bs = [torch.randn(OUT, r).double() for r in (2, 4)]
    norms = [float(torch.linalg.matrix_norm(b @ a)) for a, b in zip(As, Bs)]
    np.testing.assert_allclose(sparsity_weights(As, Bs), np.array(norms) / sum(norms))
    both = np.array(norms) * [1.0, 3.0]
    np.testing.assert_allclose(sparsity_weights(As, Bs, [1.0, 3.0]), both / both.sum())
    zero = [torch.zeros(OUT, 2).double(), torch.zeros(OUT, 4).double()]
    assert sparsity_weights(As, zero, [1.0, 3.0]) == [0.25, 0.75]  # all zero: the data sizes


# -- configure_train: each rank its slices ---------------------------------------------------

@pytest.mark.parametrize("cls", [HetLoRA, FlexLoRA, FLoRA, FedSALoRA, FedExLoRA])
def test_each_client_is_sent_its_rank(cls, flower_task):
    arrays = global_record(b_zero=cls in (FlexLoRA, FLoRA))
    for evaluate in (False, True):
        out = sent(cls(**kwargs()), arrays, evaluate)
        for cid, r in RANKS.items():
            assert out[cid][A].shape == (r, IN)
            np.testing.assert_array_equal(out[cid][A].numpy(), arrays[A].numpy()[:r])
            if cls is FedSALoRA:
                assert B not in out[cid]
            else:
                np.testing.assert_array_equal(out[cid][B].numpy(), arrays[B].numpy()[:, :r])
            assert (D in out[cid]) == (cls in (FLoRA, FedExLoRA))
            np.testing.assert_array_equal(out[cid]["head.weight"].numpy(),
                                          arrays["head.weight"].numpy())


def test_clients_of_one_rank_share_one_record(flower_task):
    strategy = HetLoRA(**kwargs(rank_of=lambda node: 4 if node == node_id(2) else 2))
    msgs = strategy.configure_train(1, global_record(), ConfigRecord({}), Grid())
    by = {m.metadata.dst_node_id - node_id(0): m.content["arrays"] for m in msgs}
    assert by[0] is by[1] and by[0] is not by[2]


# -- HetLoRA ----------------------------------------------------------------------------------

@pytest.mark.parametrize("data_weighted", [False, True])
def test_hetlora_is_the_sparsity_weighted_mean_of_padded_factors(data_weighted, flower_task):
    factors = client_factors()
    new, metrics = run_round(HetLoRA(**kwargs(data_weighted=data_weighted)), global_record(),
                             replies_of(factors))
    w = [float(torch.linalg.matrix_norm(b @ a)) * (n if data_weighted else 1.0)
         for a, b, _, n in factors.values()]
    w = [x / sum(w) for x in w]
    want_a = sum(wk * torch.cat([a, torch.zeros(R_MAX - a.shape[0], IN)])
                 for wk, (a, *_) in zip(w, factors.values()))
    want_b = sum(wk * torch.cat([b, torch.zeros(OUT, R_MAX - b.shape[1])], 1)
                 for wk, (_, b, *_) in zip(w, factors.values()))
    np.testing.assert_allclose(new[A].numpy(), want_a.numpy(), **TOL)
    np.testing.assert_allclose(new[B].numpy(), want_b.numpy(), **TOL)
    check_head(new, factors)
    assert metrics["num-clients"] == 3


@pytest.mark.parametrize("weighting", [UNIFORM_KEY, "num-examples"])
def test_hetlora_with_equal_ranks_and_norms_is_fedavg(weighting, flower_task):
    factors = {cid: (a / torch.linalg.matrix_norm(b @ a), b, h, n)  # ||B_k A_k|| = 1
               for cid, (a, b, h, n) in client_factors(ranks=SAME).items()}
    het, _ = run_round(HetLoRA(**kwargs(rank_of=same_rank, weighted_by_key=weighting,
                                        data_weighted=weighting != UNIFORM_KEY)),
                       global_record(), replies_of(factors))
    fedavg = {k: v for k, v in kwargs(weighted_by_key=weighting).items() if k != "rank_of"}
    plain, _ = run_round(PerTensorFedAvg(**fedavg), global_record(), replies_of(factors))
    assert list(het.keys()) == list(plain.keys())
    for name in plain.keys():
        np.testing.assert_allclose(het[name].numpy(), plain[name].numpy(), **TOL)


def test_hetlora_accepts_a_pruned_reply_and_refuses_a_larger_rank(flower_task):
    factors = client_factors()
    a, b, h, n = factors[1]  # sent rank 3, replies at rank 1
    factors[1] = (a[:1], b[:, :1], h, n)
    new, _ = run_round(HetLoRA(**kwargs()), global_record(), replies_of(factors))
    assert new[A].shape == (R_MAX, IN)
    factors[0] = (torch.randn(3, IN).double(), torch.randn(OUT, 3).double(), h, n)  # sent 2
    with pytest.raises(ValueError, match="lora_A"):
        run_round(HetLoRA(**kwargs()), global_record(), replies_of(factors))


# -- FlexLoRA ---------------------------------------------------------------------------------

def test_flexlora_keeps_the_svd_of_the_mean_product_and_sends_each_rank_its_best_approx(
        flower_task):
    factors = client_factors()
    strategy = FlexLoRA(**kwargs())
    new, _ = run_round(strategy, global_record(b_zero=True), replies_of(factors))
    w = weighted_product_sum([f[0] for f in factors.values()], [f[1] for f in factors.values()],
                             weights(factors)).numpy()
    u, s, vh = np.linalg.svd(w, full_matrices=False)
    best = {r: (u[:, :r] * s[:r]) @ vh[:r] for r in range(1, 6)}
    assert new[A].shape == (R_MAX, IN) and new[B].shape == (OUT, R_MAX)
    np.testing.assert_allclose(new[B].numpy() @ new[A].numpy(), best[R_MAX], atol=1e-10)
    check_head(new, factors)
    out = sent(strategy, new)  # round 2: client k gets the rank-r_k factors of W
    for cid, r in RANKS.items():
        a, b = t(out[cid][A]), t(out[cid][B])
        assert a.shape == (r, IN) and b.shape == (OUT, r)
        np.testing.assert_allclose((b @ a).numpy(), best[r], atol=1e-10)
        np.testing.assert_allclose((b.T @ b).numpy(), (a @ a.T).numpy(), atol=1e-10)


# -- FLoRA ------------------------------------------------------------------------------------

def test_flora_stack_is_the_weighted_sum_of_products():
    factors = client_factors()
    As, Bs = [f[0] for f in factors.values()], [f[1] for f in factors.values()]
    a_stack, b_stack = flora_stack(As, Bs, weights(factors))
    assert a_stack.shape == (sum(RANKS.values()), IN)
    assert b_stack.shape == (OUT, sum(RANKS.values()))
    torch.testing.assert_close(b_stack @ a_stack,
                               sum(p * b @ a for p, a, b in zip(weights(factors), As, Bs)),
                               **TOL)


def test_flora_folds_the_stack_into_base_delta_and_restarts_lora(flower_task):
    strategy = FLoRA(**kwargs(seed=5))
    arrays = global_record(b_zero=True)
    total = torch.zeros(OUT, IN, dtype=torch.float64)
    for rnd in (1, 2):
        out = sent(strategy, arrays)
        np.testing.assert_allclose(out[0][D].numpy(), total.numpy(), **TOL)  # zero, then sum
        assert out[0][D].shape == (OUT, IN) and not out[2][B].numpy().any()
        factors = client_factors(seed=rnd)
        arrays, _ = strategy.aggregate_train(rnd, replies_of(factors))
        total = total + weighted_product_sum([f[0] for f in factors.values()],
                                             [f[1] for f in factors.values()], weights(factors))
        np.testing.assert_allclose(arrays[D].numpy(), total.numpy(), **TOL)
        assert arrays[A].shape == (R_MAX, IN) and not arrays[B].numpy().any()  # fresh LoRA
        assert np.abs(arrays[A].numpy()).max() <= 1 / np.sqrt(IN) and arrays[A].numpy().any()
        check_head(arrays, factors)
    again = FLoRA(**kwargs(seed=5))
    again.configure_train(1, global_record(b_zero=True), ConfigRecord({}), Grid())
    first, _ = again.aggregate_train(1, replies_of(client_factors(seed=1)))
    assert not np.array_equal(first[A].numpy(), arrays[A].numpy())  # a new draw each round


def test_flora_generator_is_checkpointed(flower_task):
    strategy = FLoRA(**kwargs(seed=2))
    state, tensors = strategy_state(strategy)
    arrays = global_record(b_zero=True)
    strategy.configure_train(1, arrays, ConfigRecord({}), Grid())
    first, _ = strategy.aggregate_train(1, replies_of(client_factors()))
    resumed = FLoRA(**kwargs(seed=99))
    load_strategy_state(resumed, state, tensors)
    resumed.configure_train(1, arrays, ConfigRecord({}), Grid())
    second, _ = resumed.aggregate_train(1, replies_of(client_factors()))
    np.testing.assert_array_equal(first[A].numpy(), second[A].numpy())


# -- FedSA-LoRA -------------------------------------------------------------------------------

def test_fedsa_averages_padded_a_and_leaves_b_alone(flower_task):
    factors = client_factors()
    arrays = global_record()
    new, _ = run_round(FedSALoRA(**kwargs()), arrays, replies_of(factors))  # B sent: ignored
    want = sum(p * torch.cat([a, torch.zeros(R_MAX - a.shape[0], IN)])
               for p, (a, *_) in zip(weights(factors), factors.values()))
    np.testing.assert_allclose(new[A].numpy(), want.numpy(), **TOL)
    np.testing.assert_array_equal(new[B].numpy(), arrays[B].numpy())
    check_head(new, factors)
    new, _ = run_round(FedSALoRA(**kwargs()), arrays, replies_of(factors, shares_b=False))
    np.testing.assert_allclose(new[A].numpy(), want.numpy(), **TOL)


def test_fedsa_with_equal_ranks_is_fedavg_on_a(flower_task):
    factors = client_factors(ranks=SAME)
    fedavg = {k: v for k, v in kwargs().items() if k != "rank_of"}
    plain, _ = run_round(PerTensorFedAvg(**fedavg), global_record(), replies_of(factors))
    ours, _ = run_round(FedSALoRA(**kwargs(rank_of=same_rank)), global_record(),
                        replies_of(factors, shares_b=False))
    np.testing.assert_allclose(ours[A].numpy(), plain[A].numpy(), **TOL)


# -- FedEx-LoRA -------------------------------------------------------------------------------

def test_fedex_same_rank_is_fedavg_plus_the_exact_residual(flower_task):
    factors = client_factors(ranks=SAME)
    fedavg = {k: v for k, v in kwargs().items() if k != "rank_of"}
    plain, _ = run_round(PerTensorFedAvg(**fedavg), global_record(), replies_of(factors))
    strategy = FedExLoRA(**kwargs(rank_of=same_rank))
    new, _ = run_round(strategy, global_record(), replies_of(factors))
    for name in (A, B, "head.weight", "head.bias"):
        np.testing.assert_allclose(new[name].numpy(), plain[name].numpy(), **TOL)
    exact = weighted_product_sum([f[0] for f in factors.values()],
                                 [f[1] for f in factors.values()], weights(factors))
    np.testing.assert_allclose(new[B].numpy() @ new[A].numpy() + new[D].numpy(), exact.numpy(),
                               **TOL)
    again, _ = run_round(strategy, new, replies_of(factors))  # base_delta accumulates
    np.testing.assert_allclose(again[D].numpy(), new[D].numpy() + exact.numpy()
                               - again[B].numpy() @ again[A].numpy(), **TOL)


def test_fedex_heterogeneous_ranks_the_global_model_is_the_mean_of_the_clients(flower_task):
    strategy = FedExLoRA(**kwargs())
    arrays = global_record()
    arrays[D] = Array.from_numpy_ndarray(np.random.default_rng(0).normal(size=(OUT, IN)))
    out = sent(strategy, arrays)
    model = t(arrays[D]) + t(arrays[B]) @ t(arrays[A])
    for cid in RANKS:  # every client starts from the global model exactly
        np.testing.assert_allclose((t(out[cid][D]) + t(out[cid][B]) @ t(out[cid][A])).numpy(),
                                   model.numpy(), **TOL)
    factors = client_factors()
    new, _ = strategy.aggregate_train(1, replies_of(factors))
    mean = sum(p * (t(out[cid][D]) + f[1] @ f[0])
               for p, (cid, f) in zip(weights(factors), factors.items()))
    np.testing.assert_allclose((t(new[D]) + t(new[B]) @ t(new[A])).numpy(), mean.numpy(), **TOL)


def test_conv_lora_shapes(flower_task):
    """peft's Conv2d LoRA: A (r, in, kh, kw), B (out, r, 1, 1); base_delta has the conv's
    shape and the product is B A over the flattened kernel."""
    g = torch.Generator().manual_seed(0)
    arrays = ArrayRecord({A: Array.from_torch_tensor(torch.randn(R_MAX, 2, 3, 3, generator=g)
                                                     .double()),
                          B: Array.from_torch_tensor(torch.zeros(OUT, R_MAX, 1, 1).double())})
    strategy = FedExLoRA(**kwargs())
    out = sent(strategy, arrays)
    assert out[0][A].shape == (2, 2, 3, 3) and out[0][B].shape == (OUT, 2, 1, 1)
    assert out[0][D].shape == (OUT, 2, 3, 3)
    factors = {cid: (torch.randn(r, 2, 3, 3, generator=g).double(),
                     torch.randn(OUT, r, 1, 1, generator=g).double())
               for cid, r in RANKS.items()}
    new, _ = strategy.aggregate_train(1, [reply(cid, {A: a, B: b}, 1.0)
                                          for cid, (a, b) in factors.items()])
    mean = sum((b.reshape(OUT, -1) @ a.reshape(a.shape[0], -1)) / 3 for a, b in factors.values())
    got = t(new[D]).reshape(OUT, -1) + t(new[B]).reshape(OUT, -1) @ t(new[A]).reshape(R_MAX, -1)
    np.testing.assert_allclose(got.numpy(), mean.numpy(), **TOL)
    assert new[D].shape == (OUT, 2, 3, 3) and new[A].shape == (R_MAX, 2, 3, 3)


# -- wiring and bad input ---------------------------------------------------------------------

@pytest.mark.parametrize("cls", [HetLoRA, FlexLoRA, FLoRA, FedSALoRA, FedExLoRA])
def test_constructors_take_fedavgs_parameters_by_name(cls):
    """fedadapt's build_strategy passes FedAvg's parameters (through the classes' ``**kwargs``)
    and ``rank_of``."""
    from fedadapt.strategies.build import build_strategy
    from fedadapt.strategies.fedavg import aggregate_client_metrics
    from fedadapt.strategies.schema import accepted_params

    ours = accepted_params(cls)
    assert set(inspect.signature(FedAvg.__init__).parameters) - {"self"} <= ours
    assert "rank_of" in ours

    class Cfg:
        name, target = "custom", f"{cls.__module__}.{cls.__qualname__}"
        kwargs: dict = {}

    from fedadapt.config import DPConfig

    built = build_strategy(Cfg(), DPConfig(), num_clients=10, fraction_train=0.5,
                           fraction_evaluate=0.2, weighting="uniform", lr=0.1,
                           rank_of=lambda node: 4)
    assert (built.fraction_train, built.min_train_nodes, built.fraction_evaluate,
            built.min_evaluate_nodes, built.min_available_nodes) == (0.5, 5, 0.2, 2, 10)
    assert built.weighted_by_key == "unit-weight"
    assert built.train_metrics_aggr_fn is aggregate_client_metrics
    assert built.client_rank(7) == 4


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_a_rank_below_one_is_refused_naming_rank_of(bad, flower_task):
    with pytest.raises(ConfigError, match=r"rank_of\(100000000\d\)="):
        sent(HetLoRA(**kwargs(rank_of=lambda node: bad)), global_record())
    with pytest.raises(ConfigError, match="rank="):
        check_rank(bad)


def test_a_rank_above_the_global_rank_is_refused(flower_task):
    with pytest.raises(ConfigError, match=r"rank_of\(100000000\d\)=5 .*global rank 4"):
        sent(FlexLoRA(**kwargs(rank_of=lambda node: 5)), global_record())


def test_rank_of_must_be_callable():
    with pytest.raises(ConfigError, match="rank_of"):
        HetLoRA(**kwargs(rank_of=4))


def test_a_lora_name_without_its_pair_is_refused(flower_task):
    with pytest.raises(ValueError, match="'x.lora_A.weight' is a LoRA A without its B"):
        lora_pairs(["x.lora_A.weight", "head.weight"])
    with pytest.raises(ValueError, match="'x.lora_B.weight' is a LoRA B without its A"):
        lora_pairs(["x.lora_B.weight"])
    arrays = global_record()
    del arrays[B]
    with pytest.raises(ValueError, match=A.replace(".", r"\.")):
        sent(FedExLoRA(**kwargs()), arrays)
    factors = client_factors()
    replies = replies_of(factors)
    del replies[0].content["arrays"][B]
    with pytest.raises(ValueError, match="without its pair"):
        run_round(FedExLoRA(**kwargs()), global_record(), replies)
    replies = replies_of(factors)
    del replies[1].content["arrays"][A]
    with pytest.raises(ValueError, match="lora_B.* without its pair"):
        run_round(HetLoRA(**kwargs()), global_record(), replies)


@pytest.mark.parametrize("cls", [HetLoRA, FlexLoRA, FLoRA, FedSALoRA, FedExLoRA])
def test_state_is_checkpointable(cls, flower_task):
    """rank_of is configuration (a callable), the sent arrays transient: the state saves."""
    strategy = cls(**kwargs())
    run_round(strategy, global_record(b_zero=True), replies_of(client_factors()))
    state, _ = strategy_state(strategy)
    assert "rank_of" not in str(state) and "_sent_arrays" not in str(state)


# -- bugs no other test caught (issue 58) ------------------------------------------------------

def test_hetlora_keeps_sending_a_client_the_rank_it_pruned_itself_to(flower_task):
    """Pins HetLoRA.client_rank forgetting a client's pruned rank (``return rank`` instead of
    the smaller pruned one): after client 1 (rank 3) replies at rank 1, every later round
    sends it rank 1, and a reply of rank 2 from it is refused."""
    strategy = HetLoRA(**kwargs(prune_gamma=0.5))
    factors = client_factors()
    a, b, h, n = factors[1]
    factors[1] = (a[:1], b[:, :1], h, n)  # client 1 pruned itself from 3 to 1
    new, _ = run_round(strategy, global_record(), replies_of(factors))
    assert strategy.client_rank(node_id(1)) == 1
    assert strategy.client_rank(node_id(0)) == RANKS[0]  # the others keep theirs
    out = sent(strategy, new)
    assert {cid: out[cid][A].shape[0] for cid in RANKS} == {0: 2, 1: 1, 2: 4}
    assert out[1][B].shape == (OUT, 1)
    again = client_factors(seed=2)
    again[1] = (again[1][0][:2], again[1][1][:, :2], again[1][2], again[1][3])
    with pytest.raises(ValueError, match="at most rank 1"):
        strategy.aggregate_train(2, replies_of(again))


def test_hetlora_the_rank_a_client_pruned_itself_to_never_rises(flower_task):
    """Pins ``min(rank, pruned.get(node, rank))`` in HetLoRA.aggregate_train (issue 71: the
    mutant ``pruned.get(None, rank)`` survived, as every layer the server holds is checked
    against the pruned rank first). Client 1 pruned itself to rank 1; its next reply holds
    first a LoRA pair of a layer the server does not have, at rank 3 (neither checked nor
    aggregated), then its own layer at rank 1: the rank remembered stays 1."""
    strategy = HetLoRA(**kwargs(prune_gamma=0.5))
    factors = client_factors()
    a, b, h, n = factors[1]
    factors[1] = (a[:1], b[:, :1], h, n)
    new, _ = run_round(strategy, global_record(), replies_of(factors))
    assert strategy.client_rank(node_id(1)) == 1
    strategy.configure_train(2, new, ConfigRecord({}), Grid())
    other = {"x.lora_A.weight": torch.ones(3, IN), "x.lora_B.weight": torch.ones(OUT, 3)}
    replies = [reply(cid, {**(other if cid == 1 else {}), A: a, B: b, "head.weight": h}, n)
               for cid, (a, b, h, n) in factors.items()]
    again, _ = strategy.aggregate_train(2, replies)
    assert "x.lora_A.weight" not in again and again[A].shape == (R_MAX, IN)
    assert strategy.client_rank(node_id(1)) == 1 and strategy.pruned[str(node_id(1))] == 1


def test_flora_draws_the_fresh_a_up_to_peft_kaiming_bound():
    """Pins FLoRA's fresh ``A`` bound: uniform(-1/sqrt(in), 1/sqrt(in)) as peft initialises it,
    not 1/in. 64 x 256 draws: their largest magnitude is within 1% of 1/sqrt(in) and their mean
    magnitude half of it, as a uniform's is."""
    width, r_max = 256, 64
    strategy = FLoRA(rank_of=lambda node: r_max, seed=0)
    a = torch.zeros(r_max, width, dtype=torch.float64)
    b = torch.zeros(3, r_max, dtype=torch.float64)
    current = ArrayRecord({"x.lora_A.weight": Array.from_torch_tensor(a),
                           "x.lora_B.weight": Array.from_torch_tensor(b)})
    fresh_a, fresh_b, _ = strategy.aggregate_layer(
        "x.lora_A.weight", current, [torch.randn(2, width).double()],
        [torch.randn(3, 2).double()], [1.0], [2])
    bound = 1 / np.sqrt(width)
    drawn = np.abs(fresh_a.numpy())
    assert fresh_a.shape == (r_max, width) and not fresh_b.numpy().any()
    assert 0.99 * bound < drawn.max() <= bound
    assert drawn.mean() == pytest.approx(bound / 2, rel=0.03)


def test_flexloras_global_model_is_the_whole_weighted_sum_of_products(flower_task):
    """Issue 58: FlexLoRA's server holds the whole ``W = sum_k p_k B_k A_k`` (the paper's), not
    its rank-``r_max`` truncation. Ranks 2/4/8 on 20 x 16: ``W`` has rank 14; the global
    record's ``base_delta + B A`` is ``W`` (the model the server evaluates and exports), its
    ``B A`` the best rank-8 part; the clients are sent their rank's best approximation of
    ``W`` and never ``base_delta``; round 2 replaces ``W``, it does not add to it."""
    out_, in_, ranks = 20, 16, {0: 2, 1: 4, 2: 8}
    strategy = FlexLoRA(**kwargs(rank_of=lambda node: ranks[node - node_id(0)]))
    g = torch.Generator().manual_seed(3)
    arrays = ArrayRecord({A: Array.from_torch_tensor(torch.randn(8, in_, generator=g).double()),
                          B: Array.from_torch_tensor(torch.zeros(out_, 8).double()),
                          D: Array.from_torch_tensor(torch.zeros(out_, in_).double())})
    w = np.zeros((out_, in_))  # round 1's: B = 0
    for rnd in (1, 2):
        out = strategy.configure_train(rnd, arrays, ConfigRecord({}), Grid())
        out = {m.metadata.dst_node_id - node_id(0): m.content["arrays"] for m in out}
        assert all(D not in out[c] for c in ranks)
        if rnd == 2:
            u, s, vh = np.linalg.svd(w, full_matrices=False)
            for cid, r in ranks.items():
                np.testing.assert_allclose(out[cid][B].numpy() @ out[cid][A].numpy(),
                                           (u[:, :r] * s[:r]) @ vh[:r], atol=1e-10)
        factors = {c: (torch.randn(r, in_, generator=g).double(),
                       torch.randn(out_, r, generator=g).double(), float(5 + c)) for c, r in
                   ranks.items()}
        replies = [reply(c, {A: a, B: b}, n) for c, (a, b, n) in factors.items()]
        arrays, _ = strategy.aggregate_train(rnd, replies)
        n = np.array([f[2] for f in factors.values()])
        w = sum(p * (b.numpy() @ a.numpy()) for p, (a, b, _) in zip(n / n.sum(),
                                                                     factors.values()))
        assert np.linalg.matrix_rank(w) == 14
        product = arrays[B].numpy() @ arrays[A].numpy()
        np.testing.assert_allclose(arrays[D].numpy() + product, w, atol=1e-10)
        u, s, vh = np.linalg.svd(w, full_matrices=False)
        np.testing.assert_allclose(product, (u[:, :8] * s[:8]) @ vh[:8], atol=1e-10)
        assert np.abs(product - w).max() > 0.1  # the truncation alone is not W


# -- from the mutation run's survivors (scripts/mutation.sh, docs/reliability.md) --------------

A2, B2 = "enc.v.lora_A.default.weight", "enc.v.lora_B.default.weight"


@pytest.mark.parametrize("cls", [HetLoRA, FlexLoRA, FLoRA, FedSALoRA, FedExLoRA])
def test_two_layers_in_float32_each_aggregated_as_alone_in_the_records_dtype(cls, flower_task):
    """Every LoRA layer of the record is aggregated (not only the first), each as it is alone,
    and the new record, what each client is sent and ``X.base_delta`` keep the record's
    float32."""
    g = torch.Generator().manual_seed(4)
    fold = cls in (FlexLoRA, FLoRA, FedExLoRA)

    def layer(a_name, b_name):
        out = {a_name: torch.randn(R_MAX, IN, generator=g),
               b_name: torch.zeros(OUT, R_MAX) if cls is FLoRA else torch.randn(OUT, R_MAX,
                                                                                 generator=g)}
        if fold:
            out[base_delta_name(a_name)] = torch.randn(OUT, IN, generator=g)
        return out

    q, v = layer(A, B), layer(A2, B2)
    factors = {cid: {n: torch.randn(r, IN, generator=g) if "lora_A" in n else
                     torch.randn(OUT, r, generator=g) for n in (A, B, A2, B2)}
               for cid, r in RANKS.items()}

    def run(tensors, names):
        arrays = ArrayRecord({n: Array.from_torch_tensor(t.float()) for n, t in tensors.items()})
        strategy = cls(**kwargs(**({"seed": 3} if cls is FLoRA else {})))
        out = sent(strategy, arrays)
        replies = [reply(cid, {n: f[n] for n in names}, 10.0 * (cid + 1))
                   for cid, f in factors.items()]
        for r in replies:  # float32 replies, as clients send them
            r.content["arrays"] = ArrayRecord({n: Array.from_torch_tensor(t.float()) for n, t
                                               in r.content["arrays"].to_torch_state_dict()
                                               .items()})
        return out, strategy.aggregate_train(1, replies)[0]

    both_sent, both = run({**q, **v}, [A, B, A2, B2])
    for tensors, names in ((q, [A, B]), (v, [A2, B2])):
        alone_sent, alone = run(tensors, names)
        for name in tensors:
            if cls is FLoRA and "lora_A" in name:
                continue  # a fresh draw: the generator's stream goes on from the other layer
            assert both[name].dtype == alone[name].dtype == "float32", name
            np.testing.assert_allclose(both[name].numpy(), alone[name].numpy(), atol=1e-6)
        for cid in RANKS:
            for name in alone_sent[cid].keys():
                assert both_sent[cid][name].dtype == "float32"
                np.testing.assert_allclose(both_sent[cid][name].numpy(),
                                           alone_sent[cid][name].numpy(), atol=1e-6)


def test_the_helpers_refuse_what_they_cannot_do_naming_it():
    with pytest.raises(ValueError, match=r"weights \[0.0, 0.0\] do not sum to a positive"):
        normalise([0.0, 0.0])
    assert normalise([1.0, 3.0]) == [0.25, 0.75]
    with pytest.raises(ValueError, match="rank 4 cannot be padded to the smaller rank 2"):
        pad_rank(torch.zeros(4, IN), None, 2)
    a, b = truncate_rank(torch.ones(4, IN), None, 2)
    assert a.shape == (2, IN) and b is None
    from fedadapt.strategies.lora_rank import matrix_b as _matrix_b

    for shape in ((6,), (6, 2, 3, 1)):
        with pytest.raises(ValueError, match=rf"'x.lora_B' has shape \({shape[0]},"
                                             rf".*\): a LoRA B is out x r"):
            _matrix_b(torch.zeros(shape), "x.lora_B")
    assert _matrix_b(torch.ones(6, 2, 1, 1)).shape == (6, 2)
    with pytest.raises(ValueError, match="two LoRA adapters on one layer"):
        lora_pairs(["x.lora_A.a.weight", "x.lora_B.a.weight", "x.lora_A.b.weight",
                    "x.lora_B.b.weight"])
    for gamma in (True, "0.1", -0.1, float("nan")):
        with pytest.raises(ConfigError, match="gamma="):
            self_prune(torch.ones(2, IN), torch.ones(OUT, 2), gamma)
        with pytest.raises(ConfigError, match=r"prune_gamma=.* is invalid: a finite number >= 0"):
            HetLoRA(**kwargs(prune_gamma=gamma))


def test_the_aggregators_own_formulas_on_their_own():
    """hetlora_aggregate without sparsity weights (uniform, or by ``base``), the sparsity
    weights of small products (norms below 1), flexlora_aggregate, self-pruning by the last
    component's own norm."""
    from fedadapt.strategies.flexlora import flexlora_aggregate
    from fedadapt.strategies.hetlora import hetlora_aggregate

    g = torch.Generator().manual_seed(9)
    As = [torch.randn(r, IN, generator=g).double() for r in (2, 4)]
    Bs = [torch.randn(OUT, r, generator=g).double() for r in (2, 4)]
    for base, w in ((None, [0.5, 0.5]), ([1.0, 3.0], [0.25, 0.75])):
        a, b, got = hetlora_aggregate(As, Bs, 4, base, sparsity=False)
        assert got == w
        torch.testing.assert_close(a, w[0] * pad_rank(As[0], None, 4)[0] + w[1] * As[1])
    assert hetlora_aggregate(As, Bs, 4)[2] == sparsity_weights(As, Bs)  # sparsity by default
    tiny = [1e-3 * b for b in Bs]  # products of norm < 1: still weighted by their norms
    norms = [float(torch.linalg.matrix_norm(b @ a)) for a, b in zip(As, tiny)]
    np.testing.assert_allclose(sparsity_weights(As, tiny), np.array(norms) / sum(norms))
    a, b = flexlora_aggregate(As, Bs, [0.25, 0.75], 3)
    w = 0.25 * Bs[0] @ As[0] + 0.75 * Bs[1] @ As[1]
    want_a, want_b = svd_split(w, 3)
    torch.testing.assert_close((a, b), (want_a, want_b))
    # the last component alone is small, the one before it large: pruned by the last's norm
    a = torch.ones(3, IN).double()
    b = torch.cat([torch.ones(OUT, 1), 100 * torch.ones(OUT, 1), 1e-4 * torch.ones(OUT, 1)],
                  1).double()
    assert self_prune(a, b, 0.01)[0].shape[0] == 2


def test_hetlora_sends_its_prune_gamma_only_when_it_prunes(flower_task):
    arrays = global_record()
    for gamma, key in ((0.0, False), (0.5, True)):
        msgs = HetLoRA(**kwargs(prune_gamma=gamma)).configure_train(
            1, arrays, ConfigRecord({"lr": 0.1}), Grid())
        for m in msgs:
            config = m.content["config"]
            assert ("prune-gamma" in config) == key and config["lr"] == 0.1
            if key:
                assert config["prune-gamma"] == 0.5


def test_fedsa_lora_pairs_a_global_record_without_b(flower_task):
    """FedSA-LoRA's global model may hold no B at all (each client keeps its own): every A is
    paired with its B's name, aggregated, and the clients are sent A only."""
    factors = client_factors()
    arrays = global_record()
    no_b = ArrayRecord({n: a for n, a in arrays.items() if n != B})
    strategy = FedSALoRA(**kwargs())
    assert strategy.pairs(no_b.keys()) == {A: B}
    out = sent(strategy, no_b)
    assert all(set(out[c].keys()) == {A, "head.weight", "head.bias"} for c in RANKS)
    new, _ = strategy.aggregate_train(1, replies_of(factors, shares_b=False))
    want = sum(p * torch.cat([a, torch.zeros(R_MAX - a.shape[0], IN)])
               for p, (a, *_) in zip(weights(factors), factors.values()))
    np.testing.assert_allclose(new[A].numpy(), want.numpy(), **TOL)
    assert B not in new
