"""The rank rules of the LoRA-rank aggregators pinned where they switch (issue 71): HetLoRA's
self-pruning (:func:`fedadapt.strategies.hetlora.self_prune`), FlexLoRA's truncation
(:func:`fedadapt.strategies.lora_rank.svd_split` and what FlexLoRA keeps and sends), FLoRA's
stacking (:func:`fedadapt.strategies.flora.flora_stack`), the checks of a rank against what
was sent, and the rank each client is given by ``method.rank_fractions``
(:func:`fedadapt.adapters.lora.assign_ranks`).

The cases sit on the threshold or just either side of it (equal components, ties of singular
values, shares of exactly half a client), the expected numbers worked by hand (written in each
case) and the inequalities checked again in plain numpy."""

import math

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from fedadapt.adapters.lora import LoraMethodConfig, assign_ranks
from fedadapt.config import ConfigError
from fedadapt.strategies.flexlora import FlexLoRA
from fedadapt.strategies.flora import FLoRA, flora_stack
from fedadapt.strategies.hetlora import HetLoRA, self_prune
from fedadapt.strategies.lora_rank import check_rank, pad_rank, svd_split

A, B, D = "q.lora_A.weight", "q.lora_B.weight", "q.base_delta"


def orthogonal(norms, out: int = 4, width: int = 4):
    """Rank components ``norms[j] e_j e_j^T``: ``A = eye(r, width)``, ``B = eye(out, r) *
    norms`` (orthogonal, so ``||B[:, :r] A[:r]||_F = sqrt(sum norms[:r]^2)``)."""
    r = len(norms)
    return (torch.eye(r, width, dtype=torch.float64),
            torch.eye(out, r, dtype=torch.float64) * torch.tensor(norms, dtype=torch.float64))


def paper_inequality(a, b, j: int, gamma: float) -> bool:
    """Cho et al.'s test of component ``j`` (1-based) in plain numpy:
    ``||b_j a_j^T||_F < gamma ||B[:, :j] A[:j]||_F``."""
    a, b = np.asarray(a, np.float64).reshape(len(a), -1), np.asarray(b, np.float64)
    b = b.reshape(b.shape[0], b.shape[1])
    last = np.linalg.norm(np.outer(b[:, j - 1], a[j - 1]), "fro")
    return bool(last < gamma * np.linalg.norm(b[:, :j] @ a[:j], "fro"))


def check_pruned(a, b, gamma: float, want: int):
    """``self_prune`` keeps ``want`` components (worked by hand), and the paper's inequality
    holds for every component it dropped and fails for the last one it kept (unless that is
    the first: rank >= 1)."""
    ap, bp = self_prune(a, b, gamma)
    assert ap.shape[0] == want and bp.shape[1] == want
    assert np.array_equal(np.asarray(ap), np.asarray(a)[:want])
    assert np.array_equal(np.asarray(bp), np.asarray(b)[:, :want])
    for j in range(want + 1, a.shape[0] + 1):
        assert paper_inequality(a, b, j, gamma), f"component {j} was pruned without cause"
    if want > 1:
        assert not paper_inequality(a, b, want, gamma), f"component {want} should have gone"


# -- HetLoRA's self-pruning -------------------------------------------------------------------

@pytest.mark.parametrize("norms, gamma, want", [
    # the case: 1 < 0.8 sqrt(2) = 1.13 (the norm of both), so rank 1; measured against
    # the first component alone (1 < 0.8) it would keep 2
    ((1.0, 1.0), 0.8, 1),
    ((1.0, 1.0), 0.7, 2),  # 1 < 0.7 sqrt(2) = 0.990: no
    # two equal components switch at gamma = 1/sqrt(2) = 0.70711
    ((1.0, 1.0), 0.7072, 1),  # 0.7072 sqrt(2) = 1.00013
    ((1.0, 1.0), 0.7071, 2),  # 0.7071 sqrt(2) = 0.99999
    # four equal: component r goes while 1 < gamma sqrt(r): 0.6 * (2, 1.732, 1.414) =
    # 1.2 (go), 1.039 (go), 0.849 (stay)
    ((1.0, 1.0, 1.0, 1.0), 0.6, 2),
    ((1.0, 1.0, 1.0, 1.0), 0.7072, 1),  # 1.414, 1.225, 1.00013: all go
    # exactly on the threshold: 1 < 0.5 * 2 is false (strict), so all four stay ...
    ((1.0, 1.0, 1.0, 1.0), 0.5, 4),
    # ... and just above it the fourth goes, the third stays (1 < 0.5 sqrt(3) = 0.866: no)
    ((1.0, 1.0, 1.0, 1.0), 0.5 + 1e-9, 3),
    # 3-4-5: 4 < 0.8 * 5 = 4.0 is false, exactly (0.8 * 5 rounds to 4.0 in float64)
    ((3.0, 4.0), 0.8, 2),
    ((3.0, 4.0), 0.8 + 1e-9, 1),
    ((3.0, 4.0), 0.79, 2),
    # a second component s beside a first of 1 goes while s < gamma sqrt(1 + s^2), i.e.
    # s < gamma / sqrt(1 - gamma^2) = 0.6 / 0.8 = 0.75 for gamma 0.6
    ((1.0, 0.75 - 1e-9), 0.6, 1),
    ((1.0, 0.75 + 1e-9), 0.6, 2),
    # gamma 0 prunes nothing, not even a zero component (0 < 0 is false) ...
    ((1.0, 1.0, 0.0), 0.0, 3),
    ((1.0, 0.0, 0.0), 0.0, 3),
    # ... while any gamma above 0 drops a zero trailing component
    ((1.0, 1.0, 0.0), 1e-12, 2),
    # gamma 1: an orthogonal component is below the norm of its pair whenever an earlier one
    # is non-zero, however large it is (1000 < sqrt(1 + 10^6))
    ((1.0, 1.0, 1.0, 1.0), 1.0, 1),
    ((1.0, 1000.0), 1.0, 1),
    ((0.0, 1.0), 1.0, 2),  # the earlier ones zero: 1 < 1 is false
    ((0.0, 0.0, 1.0), 1.0, 3),
    ((1.0, 0.0, 1.0), 1.0, 1),  # 1 < sqrt(2), then 0 < 1
    # trailing first: a tiny component before a large last one is never reached
    # (5 < 0.8 sqrt(26) = 4.08: no) ...
    ((1.0, 1e-6, 5.0), 0.8, 3),
    # ... and goes once the last has gone (1 < 0.8 sqrt(2) = 1.131, then 1e-6 < 0.8)
    ((1.0, 1e-6, 1.0), 0.8, 1),
])
def test_self_prune_at_its_threshold(norms, gamma, want):
    a, b = orthogonal(norms)
    check_pruned(a, b, gamma, want)
    check_pruned(a.numpy(), b.numpy(), gamma, want)  # numpy factors: the same rule


def test_the_exact_ties_above_are_exact_in_float64():
    """The two cases on the threshold are exact, not rounding: 0.5 * 2 == 1 and 0.8 * 5 == 4
    in float64, and the norms of axis-aligned components are exact."""
    assert 0.5 * math.sqrt(4.0) == 1.0 and 0.8 * 5.0 == 4.0
    assert float(torch.linalg.matrix_norm(torch.diag(torch.tensor([3.0, 4.0],
                                                                  dtype=torch.float64)))) == 5.0


@pytest.mark.parametrize("gamma, want", [(0.5, 2), (0.5 + 1e-9, 1), (1.0, 1), (0.0, 2)])
def test_self_prune_of_two_equal_parallel_components(gamma, want):
    """Two equal components along the same direction: ``B A = 2 e_1 e_1^T`` (norm 2), each
    component of norm 1: the second goes iff 1 < 2 gamma, i.e. gamma > 0.5 (against the
    first component alone, 1 < gamma, it would stay up to gamma 1)."""
    a = torch.zeros(2, 3, dtype=torch.float64)
    a[:, 0] = 1.0
    b = torch.zeros(4, 2, dtype=torch.float64)
    b[0, :] = 1.0
    check_pruned(a, b, gamma, want)


@pytest.mark.parametrize("gamma", [0.5, 1.0, 100.0])
def test_self_prune_keeps_components_that_cancel(gamma):
    """The second component is minus the first: ``B A = 0``, so nothing is below
    ``gamma * 0`` and both stay for any gamma (the first alone, norm 1, would let the second
    go for gamma > 1)."""
    a = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.zeros(4, 2, dtype=torch.float64)
    b[0, 0], b[0, 1] = 1.0, -1.0
    assert not (b @ a).any()
    check_pruned(a, b, gamma, 2)


def test_self_prune_reads_conv_factors_as_matrices():
    """peft's conv shapes (``A``: ``r x in x kh x kw``, ``B``: ``out x r x 1 x 1``): the rule
    on the flattened matrices, the kept slices in the conv shapes. Two equal orthogonal
    components at gamma 0.8: rank 1 (the issue's case)."""
    a, b = orthogonal((1.0, 1.0))
    a4, b4 = a.reshape(2, 1, 2, 2), b.reshape(4, 2, 1, 1)
    ap, bp = self_prune(a4, b4, 0.8)
    assert ap.shape == (1, 1, 2, 2) and bp.shape == (4, 1, 1, 1)
    assert torch.equal(ap, a4[:1]) and torch.equal(bp, b4[:, :1])
    assert self_prune(a4, b4, 0.7)[0].shape == (2, 1, 2, 2)


def test_a_client_prunes_all_its_layers_to_the_largest_rank_any_layer_keeps():
    """The client's rank after pruning (one for all its layers): the largest rank any layer
    keeps. Layer q keeps 1 of its 3 equal components at gamma 0.8 (1 < 0.8 sqrt(3) = 1.386,
    then 1 < 0.8 sqrt(2) = 1.131), layer v keeps 2 (norms 3, 4, 0.1: 0.1 < 0.8 * 5.001, then
    4 < 0.8 * 5 fails): both are sent at rank 2. With gamma 0, its whole rank 3."""
    from fedadapt.methods.rounds.clients import _at_client_rank

    qa, qb = orthogonal((1.0, 1.0, 1.0, 1.0))
    va, vb = orthogonal((3.0, 4.0, 0.1, 5.0))
    sent = {"q.lora_A.weight": qa, "q.lora_B.weight": qb, "v.lora_A.weight": va,
            "v.lora_B.weight": vb, "head.weight": torch.ones(2, 4)}
    out = _at_client_rank(sent, 3, 0.8)  # the client's rank 3: the first 3 components
    assert out["q.lora_A.weight"].shape == (2, 4) and out["q.lora_B.weight"].shape == (4, 2)
    assert out["v.lora_A.weight"].shape == (2, 4) and out["v.lora_B.weight"].shape == (4, 2)
    assert torch.equal(out["v.lora_B.weight"], vb[:, :2]) and out["head.weight"].shape == (2, 4)
    whole = _at_client_rank(sent, 3, 0.0)
    assert whole["q.lora_A.weight"].shape == (3, 4) and whole["v.lora_B.weight"].shape == (4, 3)


# -- the checks of a rank against what was sent ------------------------------------------------

def test_check_rank_at_one():
    assert check_rank(1) == 1 and check_rank(np.int64(1)) == 1
    for bad in (0, -1, True, 1.0):
        with pytest.raises(ConfigError, match=r"rank=.* is invalid: a LoRA rank is an integer"):
            check_rank(bad)


def test_pad_rank_at_its_own_rank_and_one_above():
    a, b = orthogonal((1.0, 2.0))
    same_a, same_b = pad_rank(a, b, 2)  # r == k: unchanged
    assert torch.equal(same_a, a) and torch.equal(same_b, b)
    with pytest.raises(ValueError, match="rank 2 cannot be padded to the smaller rank 1"):
        pad_rank(a, b, 1)


def test_hetlora_remembers_the_smallest_rank_a_client_replied_at():
    """``client_rank``: the rank from ``rank_of`` until the client replies at a smaller one;
    a reply at the very rank it was sent changes nothing, one below lowers it for good."""
    strategy = HetLoRA(rank_of=lambda node: 3)
    assert strategy.client_rank(7) == 3
    strategy.pruned["7"] = 3
    assert strategy.client_rank(7) == 3
    strategy.pruned["7"] = 2
    assert strategy.client_rank(7) == 2 and strategy.client_rank(8) == 3


# -- FlexLoRA's truncation --------------------------------------------------------------------

def diag(values, out: int = 4, width: int = 3) -> torch.Tensor:
    w = torch.zeros(out, width, dtype=torch.float64)
    for i, v in enumerate(values):
        w[i, i] = v
    return w


@pytest.mark.parametrize("r, kept", [(1, (3.0, 0, 0)), (2, (3.0, 2.0, 0)), (3, (3.0, 2.0, 1.0)),
                                     (4, (3.0, 2.0, 1.0))])
def test_svd_split_of_a_diagonal_at_each_rank(r, kept):
    """``W = diag(3, 2, 1)`` (4 x 3, rank 3): the rank-r part keeps the r largest singular
    values (all three from r = 3 on, the min of the sides); the factors split them
    symmetrically, ``|A[i, i]| = |B[i, i]| = sqrt(s_i)``, zero beyond rank 3."""
    a, b = svd_split(diag((3.0, 2.0, 1.0)), r)
    assert a.shape == (r, 3) and b.shape == (4, r)
    np.testing.assert_allclose((b @ a).numpy(), diag(kept).numpy(), atol=1e-12)
    root = np.sqrt(np.array([3.0, 2.0, 1.0]))[:min(r, 3)]
    np.testing.assert_allclose(np.abs(np.diag(a.numpy()[:3, :3]))[:min(r, 3)], root, atol=1e-12)
    np.testing.assert_allclose(np.abs(np.diag(b.numpy()[:3, :3]))[:min(r, 3)], root, atol=1e-12)
    assert not a[3:].any() and not b[:, 3:].any()


def test_svd_split_with_tied_singular_values():
    """A tie inside the kept part (``diag(2, 2, 1)`` at rank 2): the part is unique,
    ``diag(2, 2, 0)``. A tie across the cut (``diag(2, 1, 1)`` at rank 2): any of the equal
    directions may go, but the kept singular values are (2, 1) and the error is the dropped
    one's, ``||W - B A||_F = 1`` (Eckart-Young)."""
    a, b = svd_split(diag((2.0, 2.0, 1.0)), 2)
    np.testing.assert_allclose((b @ a).numpy(), diag((2.0, 2.0)).numpy(), atol=1e-12)
    w = diag((2.0, 1.0, 1.0))
    a, b = svd_split(w, 2)
    np.testing.assert_allclose(np.linalg.svd((b @ a).numpy(), compute_uv=False), [2, 1, 0],
                               atol=1e-12)
    assert float(torch.linalg.matrix_norm(w - b @ a)) == pytest.approx(1.0, abs=1e-12)
    assert float((b @ a)[0, 0]) == pytest.approx(2.0, abs=1e-12)


def flex_record(a, b, delta=None) -> ArrayRecord:
    arrays = {A: a, B: b, **({} if delta is None else {D: delta})}
    return ArrayRecord({n: Array.from_numpy_ndarray(np.asarray(v, np.float64))
                        for n, v in arrays.items()})


@pytest.mark.parametrize("r_max, kept, rest", [(2, (3.0, 2.0), (0, 0, 1.0)),
                                               (3, (3.0, 2.0, 1.0), (0, 0, 0))])
def test_flexlora_keeps_the_top_r_max_and_the_rest_as_base_delta(r_max, kept, rest):
    """Two clients whose weighted sum is ``W = diag(3, 2, 1)`` (weights 1 and 3: ``0.25 *
    diag(4, 0, 4) + 0.75 * diag(8/3, 8/3, 0)``): at ``r_max = 2`` the factors keep
    ``diag(3, 2, 0)`` and ``base_delta`` the rest, ``diag(0, 0, 1)``; at ``r_max = 3`` (the
    rank of W) they keep all of it and ``base_delta`` is zero."""
    a1, b1 = torch.eye(3, 3, dtype=torch.float64), diag((4.0, 0.0, 4.0), width=3)
    a2, b2 = torch.eye(2, 3, dtype=torch.float64), diag((8 / 3, 8 / 3), width=2)
    current = flex_record(np.zeros((r_max, 3)), np.zeros((4, r_max)))
    a, b, delta = FlexLoRA(rank_of=lambda n: 1).aggregate_layer(
        A, current, [a1, a2], [b1, b2], [1.0, 3.0], [3, 2])
    assert a.shape == (r_max, 3) and b.shape == (4, r_max)
    np.testing.assert_allclose((b @ a).numpy(), diag(kept).numpy(), atol=1e-12)
    np.testing.assert_allclose(delta.numpy(), diag(rest).numpy(), atol=1e-12)


def test_flexlora_sends_the_truncation_only_while_the_whole_w_is_zero():
    """What a rank-1 client is sent switches on ``W = base_delta + B A`` being exactly zero:
    zero (B zero; or a base_delta that cancels B A): the truncation of the global factors;
    any non-zero W, however small: its best rank-1 factors, never base_delta."""
    strategy = FlexLoRA(rank_of=lambda n: 1)
    pairs = {A: B}
    a = np.array([[1.0, 0, 0], [0, 1.0, 0]])
    for b, delta in ((np.zeros((4, 2)), None),
                     (np.array([[2.0, 0], [0, 1.0], [0, 0], [0, 0]]), -diag((2.0, 1.0)).numpy())):
        out = strategy.client_arrays(flex_record(a, b, delta), pairs, 1)
        assert set(out.keys()) == {A, B}
        np.testing.assert_array_equal(out[A].numpy(), a[:1])
        np.testing.assert_array_equal(out[B].numpy(), b[:, :1])
    tiny = np.zeros((4, 2))
    tiny[1, 1] = 1e-9  # W = 1e-9 e_2 e_2^T: the SVD's factors, sqrt(1e-9) each
    out = strategy.client_arrays(flex_record(a, tiny), pairs, 1)
    np.testing.assert_allclose(np.abs(out[A].numpy()), [[0, math.sqrt(1e-9), 0]], atol=1e-15)
    np.testing.assert_allclose(np.abs(out[B].numpy()).ravel(), [0, math.sqrt(1e-9), 0, 0],
                               atol=1e-15)
    # base_delta alone, diag(3, 2, 1) with B A = 0: the rank-1 part, diag(3, 0, 0)
    out = strategy.client_arrays(flex_record(a, np.zeros((4, 2)), diag((3.0, 2.0, 1.0))),
                                 pairs, 1)
    np.testing.assert_allclose(out[B].numpy() @ out[A].numpy(), diag((3.0,)).numpy(),
                               atol=1e-12)


# -- FLoRA's stacking -------------------------------------------------------------------------

def test_flora_stack_puts_each_client_at_its_own_offset():
    """Ranks 1 and 3, weights 0.25 and 0.75: rows 0 and 1-3 of ``A_stack`` are ``A_1`` and
    ``A_2``, columns 0 and 1-3 of ``B_stack`` are ``0.25 B_1`` and ``0.75 B_2``; worked by
    hand on axis-aligned factors, ``B_stack A_stack = 0.25 * 2 e_1 e_1^T + 0.75 * 4 (e_2
    e_2^T + e_3 e_3^T)`` (client 2's third component zero)."""
    a1 = torch.tensor([[1.0, 0, 0, 0]], dtype=torch.float64)
    b1 = torch.tensor([[2.0], [0], [0]], dtype=torch.float64)
    a2 = torch.eye(4, dtype=torch.float64)[1:4]
    b2 = torch.zeros(3, 3, dtype=torch.float64)
    b2[1, 0], b2[2, 1] = 4.0, 4.0  # the third component of client 2 is zero
    a_stack, b_stack = flora_stack([a1, a2], [b1, b2], [0.25, 0.75])
    assert a_stack.shape == (4, 4) and b_stack.shape == (3, 4)
    assert torch.equal(a_stack[:1], a1) and torch.equal(a_stack[1:], a2)
    assert torch.equal(b_stack[:, :1], 0.25 * b1) and torch.equal(b_stack[:, 1:], 0.75 * b2)
    want = np.zeros((3, 4))
    want[0, 0], want[1, 1], want[2, 2] = 0.5, 3.0, 3.0
    np.testing.assert_array_equal((b_stack @ a_stack).numpy(), want)


def test_flora_stack_keeps_a_zero_weight_clients_rows_and_one_client_whole():
    """A client of weight 0 still takes its rank in the stack (its rows of A, zero columns
    of B): ``sum r_k`` whatever the weights. One client of weight 1: the stack is its own
    factors."""
    a1, b1 = orthogonal((1.0, 2.0), out=3, width=3)
    a2, b2 = orthogonal((5.0,), out=3, width=3)
    a_stack, b_stack = flora_stack([a1, a2], [b1, b2], [1.0, 0.0])
    assert a_stack.shape == (3, 3) and b_stack.shape == (3, 3)
    assert torch.equal(a_stack[2:], a2) and not b_stack[:, 2:].any()
    np.testing.assert_array_equal((b_stack @ a_stack).numpy(), np.diag([1.0, 2.0, 0.0]))
    a_one, b_one = flora_stack([a1], [b1], [1.0])
    assert torch.equal(a_one, a1) and torch.equal(b_one, b1)


def test_flora_folds_the_weighted_stack_and_restarts_at_r_max():
    """FLoRA's layer: ``base_delta`` grows by ``sum p_k B_k A_k`` (weights 1 and 3 made 0.25
    and 0.75: ``0.25 * diag(2, 0, 0) + 0.75 * diag(0, 4, 0) = diag(0.5, 3, 0)``) and the new
    LoRA has the global rank ``r_max = 2`` whatever the clients' ranks sum to (3), with B
    zero and A inside peft's bound ``1 / sqrt(in)``."""
    a1, b1 = orthogonal((2.0,), out=3, width=3)
    a2, b2 = orthogonal((0.0, 4.0), out=3, width=3)
    current = flex_record(np.zeros((2, 3)), np.zeros((3, 2)))
    a, b, delta = FLoRA(rank_of=lambda n: 1, seed=3).aggregate_layer(
        A, current, [a1, a2], [b1, b2], [1.0, 3.0], [1, 2])
    np.testing.assert_array_equal(delta.numpy(), np.diag([0.5, 3.0, 0.0]))
    assert a.shape == (2, 3) and b.shape == (3, 2) and not b.any()
    assert float(a.abs().max()) <= 1 / math.sqrt(3) and a.abs().min() > 0


# -- the rank each client is given by its share -----------------------------------------------

@pytest.mark.parametrize("n, small", [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 2), (7, 2),
                                      (8, 2), (10, 2), (14, 4)])
def test_the_clients_of_each_rank_are_its_share_rounded(n, small):
    """``ranks=[2, 8]``, ``rank_fractions=[0.25, 0.75]``: ``round(0.25 n)`` clients get rank
    2, the rest 8; numpy's rounding, half to even (n = 2: 0.5 -> 0; 6: 1.5 -> 2; 10: 2.5 -> 2;
    14: 3.5 -> 4), each count within half a client of its share."""
    cfg = LoraMethodConfig(ranks=[2, 8], rank_fractions=[0.25, 0.75])
    ranks = assign_ranks(cfg, n, [], seed=0)
    assert len(ranks) == n and ranks.count(2) == small and ranks.count(8) == n - small
    assert abs(small - 0.25 * n) <= 0.5


@pytest.mark.parametrize("n, counts", [(3, (1, 1, 1)), (4, (1, 2, 1)), (5, (2, 1, 2)),
                                       (2, (1, 0, 1)), (1, (0, 1, 0))])
def test_equal_shares_by_default(n, counts):
    """No ``rank_fractions``: thirds. Bounds ``round(n * (0, 1/3, 2/3, 1))``: n = 4:
    (0, 1, 3, 4); n = 5: (0, 2, 3, 5); n = 2: (0, 1, 1, 2); n = 1: (0, 0, 1, 1)."""
    ranks = assign_ranks(LoraMethodConfig(ranks=[2, 4, 8]), n, [], seed=1)
    assert tuple(ranks.count(r) for r in (2, 4, 8)) == counts


def test_a_share_of_zero_or_one():
    for fractions, want in (([0.0, 1.0], 8), ([1.0, 0.0], 2)):
        cfg = LoraMethodConfig(ranks=[2, 8], rank_fractions=fractions)
        cfg.check()
        assert assign_ranks(cfg, 5, [], seed=0) == [want] * 5


def test_the_shares_must_sum_to_one_within_1e_6():
    LoraMethodConfig(ranks=[2, 8], rank_fractions=[0.25, 0.75 + 5e-7]).check()
    LoraMethodConfig(ranks=[2, 8], rank_fractions=[0.25, 0.75 - 5e-7]).check()
    for fractions in ([0.25, 0.75 + 2e-6], [0.25, 0.75 - 2e-6], [-1e-9, 1.0 + 1e-9],
                      [0.5, 0.5, 0.0]):
        with pytest.raises(ConfigError, match="method.rank_fractions=.* is invalid"):
            LoraMethodConfig(ranks=[2, 8], rank_fractions=fractions).check()


def test_the_slowest_clients_get_the_first_rank():
    """With the devices' speeds the clients are ordered slowest first: half of six at rank 2
    are the three slowest (speeds 1, 2, 3: clients 1, 3, 2). A tie across the cut (speeds 1,
    2, 2, 3, half at rank 2): client 0 and one of the tied pair, the same one for a seed."""
    cfg = LoraMethodConfig(ranks=[2, 8], rank_fractions=[0.5, 0.5])
    assert assign_ranks(cfg, 6, [], seed=0, speeds=[5.0, 1.0, 3.0, 2.0, 4.0, 6.0]) == \
        [8, 2, 2, 2, 8, 8]
    for seed in range(4):
        ranks = assign_ranks(cfg, 4, [], seed=seed, speeds=[1.0, 2.0, 2.0, 3.0])
        assert ranks[0] == 2 and ranks[3] == 8 and sorted(ranks[1:3]) == [2, 8]
        assert ranks == assign_ranks(cfg, 4, [], seed=seed, speeds=[1.0, 2.0, 2.0, 3.0])
