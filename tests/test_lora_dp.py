"""Client-side DP (``dp=client_fixed|client_adaptive``) with LoRA of different ranks across
clients, where the maths allows it (FedSA-LoRA; HetLoRA without its sparsity weights): each
client clips its own rank's update with Flower's own mod; the wrapper's aggregate is the public
padded truncation plus the mean of the clipped updates; the noise has std z C / n on every
element of every rank; the releases are accounted as FedAvg's. Everything else is refused in
one line naming the key."""

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod

from fedadapt.codec import UNIFORM_KEY
from fedadapt.config import ConfigError
from fedadapt.entry import compose_config, to_run_config
from fedadapt.federation.wire.grid import node_id
from fedadapt.strategies.build import build_strategy
from fedadapt.strategies.checks import check_strategy

A, B = "enc.q.lora_A.default.weight", "enc.q.lora_B.default.weight"
OUT, IN, R_MAX = 96, 80, 8
RANKS = [2, 4, 8, 2, 8]  # partition id -> rank
CLIP = 0.5


class Grid:
    def get_node_ids(self):
        return [node_id(p) for p in range(len(RANKS))]


def dp_cfg(strategy: str, *overrides):
    return to_run_config(compose_config(
        ["method=lora", f"strategy={strategy}", "dp=client_fixed", "method.weighting=uniform",
         f"dp.clipping_norm={CLIP}", "partition.fraction_fit=1.0", *overrides]))


def build(cfg):
    return build_strategy(cfg.strategy, cfg.dp, num_clients=len(RANKS), fraction_train=1.0,
                          fraction_evaluate=0.0, weighting="uniform", lr=0.1,
                          rank_of=lambda node: RANKS[node - node_id(0)])


def global_record(shares_b: bool) -> ArrayRecord:
    g = torch.Generator().manual_seed(0)
    out = {A: torch.randn(R_MAX, IN, generator=g)}
    if shares_b:
        out[B] = torch.randn(OUT, R_MAX, generator=g)
    out["head.weight"] = torch.randn(3, OUT, generator=g)
    return ArrayRecord({k: Array.from_torch_tensor(v) for k, v in out.items()})


def client_round(strategy, arrays: ArrayRecord, mod, scale: float = 1.0, rnd: int = 1):
    """Round ``rnd``'s training messages through Flower's clipping ``mod`` around a client that
    adds a random update of norm ``scale`` per tensor (at the client's own rank); returns the
    messages, the unclipped updates and the replies."""
    msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord({}), Grid()))
    rng = np.random.default_rng(1)
    raw, replies = {}, []
    for msg in msgs:
        sent = msg.content["arrays"]
        cid = msg.metadata.dst_node_id - node_id(0)
        upd = {n: rng.standard_normal(sent[n].shape).astype(np.float32) for n in sent.keys()}
        upd = {n: scale * u / np.linalg.norm(u) for n, u in upd.items()}
        raw[cid] = upd

        def train(m, context, upd=upd, sent=sent):
            arrays = ArrayRecord({n: Array.from_numpy_ndarray(sent[n].numpy() + upd[n])
                                  for n in sent.keys()})
            return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(
                {"num-examples": 10, UNIFORM_KEY: 1.0, "train_loss": 1.0})}), reply_to=m)

        msg.metadata.__dict__["_message_id"] = f"m{cid}"
        replies.append(mod(msg, Context(0, node_id(cid), {}, RecordDict(), {}), train))
    return msgs, raw, replies


def clipped(updates: dict, norm: float) -> dict:
    total = np.sqrt(sum(float((u.astype(np.float64) ** 2).sum()) for u in updates.values()))
    return {n: u * min(1.0, norm / total) for n, u in updates.items()}


def pad(x: np.ndarray, axis: int) -> np.ndarray:
    width = [(0, 0)] * x.ndim
    width[axis] = (0, R_MAX - x.shape[axis])
    return np.pad(x, width)


def expected(arrays: ArrayRecord, msgs, raw) -> dict[str, np.ndarray]:
    """The public part (each client's padded truncation of the global factors, as sent) plus
    the mean of the clipped updates, each padded to the largest rank."""
    want = {}
    for msg in msgs:
        sent = msg.content["arrays"]
        upd = clipped(raw[msg.metadata.dst_node_id - node_id(0)], CLIP)
        for n in sent.keys():
            x = sent[n].numpy().astype(np.float64) + upd[n]
            x = pad(x, 0) if n == A else pad(x, 1) if n == B else x
            want[n] = want.get(n, 0) + x / len(msgs)
    return want


@pytest.mark.parametrize("strategy,extra", [
    ("fedsa_lora", []), ("hetlora", ["strategy.sparsity_weighted=false"])])
def test_each_rank_clips_its_own_update_and_the_aggregate_is_public_plus_their_mean(
        strategy, extra, flower_task):
    cfg = dp_cfg(strategy, "dp.noise_multiplier=0", "dp.accounting=false", *extra)
    wrapped = build(cfg)
    shares_b = strategy == "hetlora"
    arrays = global_record(shares_b)
    msgs, raw, replies = client_round(wrapped, arrays, fixedclipping_mod, scale=3.0)
    assert sorted({m.content["arrays"][A].shape[0] for m in msgs}) == [2, 4, 8]
    for msg, reply in zip(msgs, replies):
        sent, got = msg.content["arrays"], reply.content["arrays"]
        assert [got[n].shape for n in got.keys()] == [sent[n].shape for n in sent.keys()]
        norm = np.sqrt(sum(float(((got[n].numpy().astype(np.float64)
                                   - sent[n].numpy()) ** 2).sum()) for n in got.keys()))
        assert norm == pytest.approx(CLIP, rel=1e-5)  # clipped at the client's own rank
    new, _ = wrapped.aggregate_train(1, replies)
    want = expected(arrays, msgs, raw)
    assert set(new.keys()) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(new[name].numpy(), value, atol=1e-6, rtol=0)


def test_the_noise_has_std_z_clip_over_n_on_every_rank_component(flower_task):
    z, n = 4.0, len(RANKS)
    quiet = build(dp_cfg("hetlora", "dp.noise_multiplier=0", "dp.accounting=false",
                         "strategy.sparsity_weighted=false"))
    noisy = build(dp_cfg("hetlora", f"dp.noise_multiplier={z}", "dp.accounting=false",
                         "strategy.sparsity_weighted=false"))
    arrays = global_record(shares_b=True)
    want, _ = quiet.aggregate_train(1, client_round(quiet, arrays, fixedclipping_mod, 3.0)[2])
    np.random.seed(0)  # Flower draws the noise from numpy's global generator
    got, _ = noisy.aggregate_train(1, client_round(noisy, arrays, fixedclipping_mod, 3.0)[2])
    noise = {name: got[name].numpy().astype(np.float64) - want[name].numpy()
             for name in want.keys()}
    every = np.concatenate([x.ravel() for x in noise.values()])
    assert every.size > 1500 and np.std(every) == pytest.approx(z * CLIP / n, rel=0.07)
    a_noise = noise[A]  # the components only rank-8 clients train carry the same noise
    assert np.std(a_noise[4:]) == pytest.approx(z * CLIP / n, rel=0.2)
    assert abs(np.mean(every)) < 3 * z * CLIP / n / np.sqrt(every.size)


def test_the_releases_are_accounted_as_fedavgs(flower_task):
    from flwr.supercore.privacy_accounting import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        SamplingMethod,
    )
    from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

    wrapped = build(dp_cfg("fedsa_lora", "dp.noise_multiplier=1.2", "dp.delta=1e-4"))
    assert wrapped.accountant is not None
    arrays = global_record(shares_b=False)
    for rnd in (1, 2):
        msgs, _, replies = client_round(wrapped, arrays, fixedclipping_mod, rnd=rnd)
        assert len(msgs) == len(RANKS)
        wrapped.aggregate_train(rnd, replies)
    reference = RdpAccountant(PrivacyConfig(
        target_delta=1e-4, population_size=len(RANKS),
        neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
        sampling_method=SamplingMethod.NO_AMPLIFICATION))
    reference.compose(GaussianPrivacyEvent(1.2, len(RANKS), len(RANKS)), 2)
    spent = wrapped.privacy_spent()
    assert spent.epsilon == pytest.approx(reference.get_epsilon(1e-4))


def test_adaptive_clipping_clips_each_rank_and_adapts_the_norm(flower_task):
    cfg = to_run_config(compose_config(
        ["method=lora", "strategy=fedsa_lora", "dp=client_adaptive", "method.weighting=uniform",
         f"dp.initial_clipping_norm={CLIP}", "dp.noise_multiplier=0",
         "dp.clipped_count_stddev=0", "partition.fraction_fit=1.0"]))
    wrapped = build(cfg)
    arrays = global_record(shares_b=False)
    msgs, _, replies = client_round(wrapped, arrays, adaptiveclipping_mod, scale=3.0)
    for msg, reply in zip(msgs, replies):
        assert not reply.has_error()
        sent, got = msg.content["arrays"], reply.content["arrays"]
        norm = np.sqrt(sum(float(((got[n].numpy().astype(np.float64)
                                   - sent[n].numpy()) ** 2).sum()) for n in got.keys()))
        assert norm == pytest.approx(CLIP, rel=1e-5)
    new, _ = wrapped.aggregate_train(1, replies)
    assert new[A].shape == (R_MAX, IN)
    # every client, at every rank, reported its update clipped: Flower's geometric update
    # with a clipped fraction of 1 (which lowers the norm: Flower counts clipped updates where
    # Andrew et al. count unclipped ones)
    assert wrapped.clipping_norm == pytest.approx(
        CLIP * np.exp(-wrapped.clip_norm_lr * (1.0 - wrapped.target_clipped_quantile)))


@pytest.mark.parametrize("strategy,extra,says", [
    ("flexlora", [], "dp=client_fixed is invalid with strategy=flexlora: its aggregate is the "
                     "SVD"),
    ("flora", [], "dp=client_fixed is invalid with strategy=flora: it folds"),
    ("fedex_lora", [], "dp=client_fixed is invalid with strategy=fedex_lora: it folds"),
    ("hetlora", [], "strategy.sparsity_weighted=true is invalid with dp=client_fixed"),
    ("hetlora", ["strategy.sparsity_weighted=false", "strategy.prune_gamma=0.5"],
     "strategy.prune_gamma=0.5 is invalid with dp=client_fixed"),
    ("fedsa_lora", ["dp=server_fixed"], "dp=server_fixed is invalid with strategy=fedsa_lora: "
                                        "the server clips each reply against the global record"),
])
def test_what_the_maths_does_not_allow_is_refused_in_one_line(strategy, extra, says):
    with pytest.raises(ConfigError) as err:
        cfg = dp_cfg(strategy, *extra)
        check_strategy(cfg)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)


# -- whole runs -------------------------------------------------------------------------------

TINY = ["method=lora", "backbone=tiny_vit", "dataset.max_samples=300", "partition.num_clients=6",
        "partition.fraction_fit=1.0", "rounds=2", "federation.eval_every=1", "train.lr=0.05",
        "method.ranks=[2,4,8]", "method.weighting=uniform", "dp=client_fixed",
        f"dp.clipping_norm={CLIP / 10}", "train.precision=fp32"]  # compared exactly


def run(run_dir, overrides, cache_dir, on_reply=None):
    from omegaconf import OmegaConf

    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process
    from fedadapt.results.store import read_jsonl

    composed = compose_config([*TINY, *overrides, f"cache_dir={cache_dir}"])
    summary = run_experiment(to_run_config(composed), run_dir,
                             config_yaml=OmegaConf.to_yaml(composed, resolve=True),
                             execute=in_process("workers", on_reply=on_reply))
    return summary, read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow  # whole runs, in process
@pytest.mark.parametrize("strategy", ["fedsa_lora", "hetlora"])
def test_a_run_clips_every_rank_side_by_side_as_one_at_a_time_and_reports_epsilon(
        strategy, tmp_path, cache_dir):
    from flwr.app import MessageType

    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint
    from fedadapt.federation.wire import records

    extra = [f"strategy={strategy}", "dp.noise_multiplier=0.5"] + (
        ["strategy.sparsity_weighted=false"] if strategy == "hetlora" else [])
    finals, norms = [], {}
    for k in (6, 1):
        def keep(sent, reply, context, k=k):
            if sent.metadata.message_type != MessageType.TRAIN:
                return
            for cid, content in records.unpack(reply.content).items():
                got, given = content["arrays"], records.view(sent.content, cid)["arrays"]
                rank = next(got[n].shape[0] for n in got.keys() if ".lora_A." in n)
                norms.setdefault(k, []).append((rank, np.sqrt(sum(
                    float(((got[n].numpy().astype(np.float64)
                            - given[n].numpy()) ** 2).sum())
                    for n in got.keys()))))

        summary, rows = run(tmp_path / f"k{k}", extra + [f"federation.clients_per_worker={k}"],
                            cache_dir, on_reply=keep)
        assert all(r["clients_failed"] == 0 for r in rows)
        assert 0 < rows[0]["epsilon"] < rows[1]["epsilon"] == summary["privacy"]["epsilon"]
        arrays, _ = load_checkpoint(latest_checkpoint(tmp_path / f"k{k}"))
        finals.append({n: t.numpy() for n, t in arrays.items()})
    assert sorted({rank for rank, _ in norms[6]}) == [2, 4, 8]
    assert len(norms[6]) == 2 * 6 and max(n for _, n in norms[6]) == pytest.approx(CLIP / 10,
                                                                                  rel=1e-4)
    for name in finals[0]:  # the same noise (seeded) on the same clipped updates
        np.testing.assert_allclose(finals[0][name], finals[1][name], atol=1e-5)
