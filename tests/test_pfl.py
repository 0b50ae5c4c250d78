"""Personalized FL (``pfl=``): FedPer, LG-FedAvg, FedRep, FedBABU and FedBN's norms, through
real tiny runs in process. What is personal and what is sent is read from the run directory (the
server's checkpoint holds what was sent and averaged; ``clients/<cid>/`` what stayed); FedRep's
round is pinned against plain numpy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import accuracy_of, final_checkpoint, tiny_run
from omegaconf import OmegaConf
from test_resume import _Killed, _stopping_after  # a run that dies after a round

from fedadapt.config import BackboneConfig, ConfigError, FederationConfig, PflConfig
from fedadapt.entry import compose_config, to_run_config
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.server.checkpoint import load_client_state
from fedadapt.federation.simulation.inprocess import in_process
from fedadapt.results.store import read_jsonl

#: A tiny run: digits features of a small random CNN, an MLP head with a hidden layer of 4
#: (``head.0``: the body, ``head.3``: the classifier), 3 clients all training, plain full-batch
#: SGD (one step per epoch: the numbers below do not depend on a shuffle).
TINY = ["dataset=digits", "dataset.max_samples=300", "backbone=small_cnn",
        "backbone.image_size=16", "partition.num_clients=3", "partition.fraction_fit=1.0",
        "train.precision=fp32", "federation.eval_every=1", "train.momentum=0",
        "train.batch_size=512", "train.lr=0.5"]
MLP = ["method=mlp_head", "method.hidden_dim=4"]
BODY, HEAD = ["head.0.weight", "head.0.bias"], ["head.3.weight", "head.3.bias"]
TINY_VIT = BackboneConfig(name="tiny_vit", family="vit", image_size=32, crop_pct=1.0,
                          interpolation="bilinear", arch=dict(
                              patch_size=8, hidden_size=32, num_hidden_layers=3,
                              num_attention_heads=2, intermediate_size=64))
#: A random timm ResNet with BatchNorm (no CNN of the tests has one; EfficientNet-Lite0 runs at
#: 224 px, too slow here).
TINY_BN = BackboneConfig(name="tiny_bn", family="timm", image_size=32,
                         arch=dict(model="resnet10t"))


def composed(cache_dir, *extra):
    method = [] if any(e.startswith("method=") for e in extra) else MLP
    c = compose_config([*TINY, *method, f"cache_dir={cache_dir}", *extra])
    return to_run_config(c), OmegaConf.to_yaml(c, resolve=True)


def run(cache_dir, run_dir: Path, *extra, execute=None, resume=False) -> Path:
    cfg, yaml = composed(cache_dir, *extra)
    run_experiment(cfg, run_dir, execute=execute or in_process("workers"), config_yaml=yaml,
                   resume=resume)
    return run_dir


def personal(run_dir: Path, cid: int, rnd: int = 1) -> dict[str, torch.Tensor]:
    return load_client_state(run_dir / "clients" / str(cid), rnd)


def one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# -- FedPer and LG-FedAvg --------------------------------------------------------------------

def test_fedper_and_lg_fedavg_keep_their_part_and_send_the_fedavg_mean_of_the_rest(
        cache_dir, tmp_path):
    """One round from the same start: the clients train exactly as under FedAvg, so FedPer's
    sent body is FedAvg's body, and FedAvg's head is the example-weighted mean of FedPer's
    personal heads (LG-FedAvg: the reverse); the bytes up are FedAvg's less exactly the kept
    tensors (each array travels as an .npy of 128 header bytes plus 4 bytes a float, and its
    name)."""
    avg = run(cache_dir, tmp_path / "avg", "rounds=1")
    per = run(cache_dir, tmp_path / "per", "rounds=1", "pfl=fedper")
    lg = run(cache_dir, tmp_path / "lg", "rounds=1", "pfl=lg_fedavg")
    prep = prepare_run(composed(cache_dir, "rounds=1")[0], quiet=True)
    sizes = np.array([len(c.train) for c in prep.spec.clients], dtype=np.float64)
    glob = final_checkpoint(avg)
    shapes = {n: tuple(t.shape) for n, t in prep.model.tensors(BODY + HEAD).items()}
    for got, kept, sent in ((per, HEAD, BODY), (lg, BODY, HEAD)):
        assert sorted(final_checkpoint(got)) == sorted(sent)  # the kept part never left
        for n in sent:  # the sent part: FedAvg's mean, to the bit
            torch.testing.assert_close(torch.as_tensor(final_checkpoint(got)[n]),
                                       torch.as_tensor(glob[n]), rtol=0, atol=0)
        mine = [personal(got, c) for c in range(3)]
        assert all(sorted(m) == sorted(kept) for m in mine)
        for n in kept:
            assert not torch.equal(mine[0][n], mine[1][n])  # each client its own
            mean = sum(w * m[n].double().numpy() for w, m in zip(sizes, mine)) / sizes.sum()
            np.testing.assert_allclose(np.asarray(glob[n]), mean, rtol=0, atol=1e-6)
        kept_bytes = sum(128 + 4 * math.prod(shapes[n]) + len(n) for n in kept)
        rows = [read_jsonl(d / "metrics.jsonl")[0] for d in (avg, got)]
        assert rows[0]["bytes_up"] - rows[1]["bytes_up"] == 3 * kept_bytes


def test_the_kept_part_on_an_accumulator_with_adapters_is_the_linear_maps_onto_the_classes(
        cache_dir):
    """On the Accumulator (with parallel adapters, anytime exits) the head is every linear map
    onto the 10 classes (a weight [10, k] and its bias [10]); everything else it trains (the
    adapters, the accumulator, the hidden layer) is the body."""
    from fedadapt.adapters.exits import AccumulatorConfig
    from fedadapt.config import SettingConfig, validate
    from fedadapt.pfl.fedper import FedPer, LgFedAvg

    def model(kind):
        cfg = tiny_run(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                    adapter_bottleneck=4),
                       backbone=TINY_VIT, setting=SettingConfig(name="anytime"), pfl=kind)
        return prepare_run(validate(cfg), quiet=True).model

    per, lg = model(FedPer()), model(LgFedAvg())
    shapes = {n: tuple(p.shape) for n, p in per.named_parameters()}
    head = per.personal_names()
    assert head and all(shapes[n][0] == 10 and len(shapes[n]) == (2 if n.endswith("weight")
                                                                  else 1) for n in head)
    assert {n.rsplit(".", 1)[0] for n in head} == {n.rsplit(".", 1)[0] for n in head
                                                   if n.endswith("weight")}
    body = per.communicated_names()
    assert any(".adapter." in n for n in body) and not any(
        shapes[n][0] == 10 and n.endswith("bias") for n in body)
    assert sorted(lg.personal_names()) == sorted(body)
    assert sorted(lg.communicated_names()) == sorted(head)


def test_a_method_without_the_kept_or_the_federated_part_is_refused_in_one_line(cache_dir,
                                                                                tmp_path):
    from conftest import TINY_CLIP

    from fedadapt.adapters.fedclip import FedClipConfig
    from fedadapt.config import validate
    from fedadapt.pfl.fedper import FedPer

    with pytest.raises(ConfigError) as err:  # linear_head: a head and nothing in front of it
        run(cache_dir, tmp_path / "lg", "method=linear_head", "pfl=lg_fedavg")
    assert one_line(err).startswith("pfl=lg_fedavg keeps the body on each client") \
        and "trains its head only" in str(err.value)
    with pytest.raises(ConfigError) as err:  # AttAI: its classes are text features, no head
        prepare_run(validate(tiny_run(cache_dir, FedClipConfig(), backbone=TINY_CLIP,
                                      pfl=FedPer())), quiet=True)
    assert one_line(err).startswith("pfl=fedper keeps the classifier (the head)") \
        and "no trainable classifier" in str(err.value)


# -- FedRep ----------------------------------------------------------------------------------

def _gelu(h):
    cdf = 0.5 * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    return h * cdf, cdf + h * np.exp(-h * h / 2) / math.sqrt(2 * math.pi)


def _grads(w, x, y):
    """Plain numpy: the mean cross-entropy's gradients of Linear -> GELU -> Linear."""
    h = x @ w["head.0.weight"].T + w["head.0.bias"]
    a, da_dh = _gelu(h)
    z = a @ w["head.3.weight"].T + w["head.3.bias"]
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    dz = (p - np.eye(z.shape[1])[y]) / len(y)
    dh = (dz @ w["head.3.weight"]) * da_dh
    return {"head.3.weight": dz.T @ a, "head.3.bias": dz.sum(0),
            "head.0.weight": dh.T @ x, "head.0.bias": dh.sum(0)}


def test_fedrep_round_is_head_steps_with_the_body_fixed_then_body_steps(cache_dir, tmp_path):
    """Round 1 of FedRep with head_epochs=3, local_epochs=2, plain SGD on full batches, in
    numpy: 3 steps of the head (the body at the start), then 2 of the body (the new head
    fixed); the server's body is the example-weighted mean, each client's head its own and
    never sent."""
    extra = ["rounds=1", "pfl=fedrep", "pfl.head_epochs=3", "train.local_epochs=2"]
    out = run(cache_dir, tmp_path / "rep", *extra)
    prep = prepare_run(composed(cache_dir, *extra)[0], quiet=True)
    start = {n: t.double().numpy() for n, t in prep.model.tensors(BODY + HEAD).items()}
    bodies, sizes = [], []
    for cid, client in enumerate(prep.spec.clients):
        x, y = prep.spec.train_source.get(client.train, "cpu")
        x, y = x.double().numpy(), y.numpy()
        assert len(y) <= 512  # one batch an epoch
        w = dict(start)
        for _ in range(3):
            g = _grads(w, x, y)
            w.update({n: w[n] - 0.5 * g[n] for n in HEAD})
        for _ in range(2):
            g = _grads(w, x, y)
            w.update({n: w[n] - 0.5 * g[n] for n in BODY})
        mine = personal(out, cid)
        assert sorted(mine) == sorted(HEAD)
        for n in HEAD:
            np.testing.assert_allclose(mine[n].double().numpy(), w[n], rtol=0, atol=2e-6)
        bodies.append(w)
        sizes.append(len(y))
    glob = final_checkpoint(out)
    assert sorted(glob) == sorted(BODY)  # the head never left a client
    for n in BODY:
        mean = sum(s * b[n] for s, b in zip(sizes, bodies)) / sum(sizes)
        assert not np.allclose(mean, start[n])
        np.testing.assert_allclose(np.asarray(glob[n], dtype=np.float64), mean, rtol=0,
                                   atol=2e-6)


def test_fedrep_side_by_side_equals_one_at_a_time(cache_dir, tmp_path):
    """Three clients trained side by side in both phases (grouped forms) end where one at a
    time does."""
    extra = ["rounds=1", "pfl=fedrep", "pfl.head_epochs=2", "train.batch_size=16"]
    alone = run(cache_dir, tmp_path / "1", *extra, "federation.clients_per_worker=1")
    side = run(cache_dir, tmp_path / "3", *extra, "federation.clients_per_worker=3")
    for n, t in final_checkpoint(alone).items():
        np.testing.assert_allclose(np.asarray(final_checkpoint(side)[n]), np.asarray(t),
                                   rtol=0, atol=1e-6)
    for cid in range(3):
        for n, t in personal(alone, cid).items():
            torch.testing.assert_close(personal(side, cid)[n], t, rtol=0, atol=1e-6)


def test_fedrep_bad_input_is_refused_in_one_line(cache_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        composed(cache_dir, "pfl=fedrep", "pfl.head_epochs=0")
    assert one_line(err).startswith("pfl.head_epochs=0 is invalid")
    with pytest.raises(ConfigError) as err:  # DP-SGD's accounting counts local_epochs only
        composed(cache_dir, "pfl=fedrep", "dp=dpsgd")
    assert one_line(err).startswith("pfl='fedrep' is invalid: dp=dpsgd accounts")
    with pytest.raises(ConfigError) as err:  # FedRep without a body to federate
        run(cache_dir, tmp_path / "x", "method=linear_head", "pfl=fedrep")
    assert one_line(err).startswith("pfl=fedrep keeps the head on each client and federates "
                                    "the body, and this method trains its head only")


# -- FedBABU ---------------------------------------------------------------------------------

def test_fedbabu_head_stays_at_its_initialisation_until_the_fine_tune(cache_dir, tmp_path):
    """Two rounds: the head on every client is its initialisation to the bit and never sent
    (the server's arrays are the body, which trained); the fine-tune after FL trains body and
    head on each client (setting=local_finetune) and reports accuracy before and after."""
    extra = ["rounds=2", "pfl=fedbabu", "setting=local_finetune", "setting.epochs=2"]
    out = run(cache_dir, tmp_path / "babu", *extra)
    prep = prepare_run(composed(cache_dir, *extra)[0], quiet=True)
    start = prep.model.tensors(BODY + HEAD)
    glob = final_checkpoint(out)
    assert sorted(glob) == sorted(BODY)
    assert not torch.equal(torch.as_tensor(glob["head.0.weight"]), start["head.0.weight"])
    # the server's global accuracy is the averaged body's with the initial head
    assert read_jsonl(out / "metrics.jsonl")[-1]["global_acc"] == pytest.approx(
        accuracy_of(prep, glob), abs=1e-6)
    for cid in range(3):
        mine = personal(out, cid, 2)
        assert sorted(mine) == sorted(HEAD)
        for n in HEAD:
            assert torch.equal(mine[n], start[n])
        tuned = load_client_state(out / "clients" / str(cid) / "personalized", 99)
        assert sorted(tuned) == sorted(BODY + HEAD)
        for n in HEAD:
            assert not torch.allclose(tuned[n], start[n])
    rows = json.loads((out / "personalization.json").read_text())
    assert sorted(r["client"] for r in rows) == [0, 1, 2]
    assert all(0 <= r["acc_before"] <= 1 and 0 <= r["acc_after"] <= 1 for r in rows)


def test_fedbabu_without_the_fine_tune_or_a_body_is_refused_in_one_line(cache_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        composed(cache_dir, "pfl=fedbabu")
    assert one_line(err).startswith("pfl='fedbabu' is invalid") \
        and "add setting=local_finetune" in str(err.value)
    with pytest.raises(ConfigError) as err:
        composed(cache_dir, "pfl=fedbabu", "setting=local_finetune",
                 "setting.personalize=adapters")
    assert one_line(err).startswith("setting.personalize='adapters' is invalid")
    with pytest.raises(ConfigError) as err:
        run(cache_dir, tmp_path / "x", "method=linear_head", "pfl=fedbabu",
            "setting=local_finetune")
    assert one_line(err).startswith("pfl=fedbabu keeps the head on each client and federates "
                                    "the body, and this method trains its head only")


# -- FedBN's norms ---------------------------------------------------------------------------

@pytest.mark.parametrize("backbone", [TINY_VIT, TINY_BN], ids=["layernorm", "batchnorm"])
def test_fedbn_norms_train_stay_personal_and_side_by_side_equals_one_at_a_time(
        backbone, cache_dir, tmp_path, capfd):
    """pfl.norms=true on a linear head: the backbone's norm weights and biases train, stay on
    each client (differently), the head is federated; three clients side by side (one worker)
    end where one at a time does, and the layout line says so once."""
    from fedadapt.adapters.heads import LinearHeadConfig

    def go(k):
        cfg = tiny_run(cache_dir, LinearHeadConfig(use_cache=False), backbone=backbone,
                       pfl=PflConfig(norms=True), rounds=1,
                       federation=FederationConfig(eval_every=1, clients_per_worker=k))
        run_experiment(cfg, tmp_path / str(k), execute=in_process("workers"), config_yaml="")
        return tmp_path / str(k)

    alone = go(1)
    capfd.readouterr()
    side = go(3)
    said = [line for line in capfd.readouterr().err.splitlines()
            if "clients side by side" in line]
    assert len(said) == 1, said
    prep = prepare_run(tiny_run(cache_dir, LinearHeadConfig(use_cache=False), backbone=backbone,
                                pfl=PflConfig(norms=True)), quiet=True)
    norms = [n for n in prep.model.personal_names()]
    assert norms and all(n.startswith("backbone.") and n.rsplit(".", 1)[1] in ("weight", "bias")
                         for n in norms)
    start = prep.model.tensors(norms)
    assert sorted(final_checkpoint(alone)) == ["head.bias", "head.weight"]
    for cid in range(3):
        mine = personal(alone, cid)
        assert sorted(mine) == sorted(norms)
        assert any(not torch.equal(mine[n], start[n]) for n in norms)  # they trained
        grouped = personal(side, cid)
        for n in norms:
            torch.testing.assert_close(grouped[n], mine[n], rtol=0, atol=1e-6)
    assert any(not torch.equal(personal(alone, 0)[n], personal(alone, 1)[n]) for n in norms)
    for n, t in final_checkpoint(side).items():
        torch.testing.assert_close(torch.as_tensor(t), torch.as_tensor(final_checkpoint(alone)[n]),
                                   rtol=0, atol=1e-6)


def test_fedbn_norms_refused_with_cached_features_and_with_full_fine_tuning(cache_dir,
                                                                            tmp_path):
    with pytest.raises(ConfigError) as err:
        composed(cache_dir, "pfl.norms=true")
    assert one_line(err).startswith("pfl.norms=True is invalid") \
        and "method.use_cache=false" in str(err.value)
    with pytest.raises(ConfigError) as err:  # refused where the model is built
        run(cache_dir, tmp_path / "x", "method=finetune", "pfl.norms=true")
    assert one_line(err).startswith("pfl.norms=true is invalid") \
        and "trains the whole backbone" in str(err.value)


# -- resume ----------------------------------------------------------------------------------

def _metrics(run_dir):
    return [{k: v for k, v in r.items() if k not in ("round_s", "wall_s")}
            for r in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize("kind", [["pfl=fedrep", "pfl.head_epochs=2"], ["pfl=fedper"]],
                         ids=["fedrep", "fedper"])
def test_stopped_after_round_one_and_resumed_equals_a_straight_run(kind, cache_dir, tmp_path):
    """Stopped after round 1 of 3 (checkpoint every round), resumed: the same metrics, the
    same global tensors and the same personal heads as a run straight through. The clients
    train side by side (FedRep's head phase beside the body the round received: a group took
    the body the model was last left with, which the resumed process's model did not hold)."""
    import json

    extra = ["rounds=3", "federation.checkpoint_every=1", "train.batch_size=32", *kind]
    ref = run(cache_dir, tmp_path / "ref", *extra)
    assert json.loads((ref / "summary.json").read_text())["layout"]["clients_per_worker"] == 3
    with pytest.raises(_Killed):
        run(cache_dir, tmp_path / "cut", *extra, execute=_stopping_after(1))
    assert len(read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == 1
    cut = run(cache_dir, tmp_path / "cut", *extra, resume=True)
    assert _metrics(cut) == _metrics(ref)
    for n, t in final_checkpoint(ref).items():
        assert np.array_equal(np.asarray(final_checkpoint(cut)[n]), np.asarray(t))
    for cid in range(3):
        a, b = personal(ref, cid, 3), personal(cut, cid, 3)
        assert sorted(a) == sorted(HEAD) and all(torch.equal(a[n], b[n]) for n in a)
