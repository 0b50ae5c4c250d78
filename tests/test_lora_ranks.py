"""LoRA of different ranks across clients (method.ranks) under the heterogeneous-rank
aggregators (strategy=hetlora|flexlora|fedsa_lora|flora|fedex_lora): ranks assigned, only a
client's own rank travels, clients of different ranks side by side equal one at a time,
HetLoRA's self-pruning, FedSA-LoRA's B kept on the clients, FLoRA's and FedEx-LoRA's updates
folded into the frozen weights (clients, server, export); bad input in one line."""

from pathlib import Path

import numpy as np
import pytest
from flwr.app import MessageType
from omegaconf import OmegaConf

from fedadapt.config import ConfigError
from fedadapt.results.store import read_jsonl

TINY = ["method=lora", "backbone=tiny_vit", "dataset.max_samples=300", "partition.num_clients=6",
        "partition.fraction_fit=1.0", "rounds=2", "federation.eval_every=1", "train.lr=0.05",
        "method.ranks=[2,4,8]", "train.precision=fp32"]  # compared exactly: fp32 on any device


def _run(run_dir: Path, overrides, cache_dir, on_reply=None, base=tuple(TINY)):
    from fedadapt.entry import compose_config, to_run_config, with_method_train
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.simulation.inprocess import in_process

    composed = compose_config([*base, *overrides, f"cache_dir={cache_dir}"])
    cfg = to_run_config(composed)
    yaml = OmegaConf.to_yaml(with_method_train(composed), resolve=True)  # as fedadapt writes it
    summary = run_experiment(cfg, run_dir, config_yaml=yaml,
                             execute=in_process("workers", on_reply=on_reply))
    return cfg, summary, read_jsonl(run_dir / "metrics.jsonl")


def _replies(store: dict):
    """An ``on_reply`` hook keeping each client's training reply arrays, per round."""
    from fedadapt.federation.wire import records

    def keep(sent, reply, context):
        if sent.metadata.message_type != MessageType.TRAIN or reply.has_error():
            return
        rnd = int(next(iter(sent.content.config_records.values())).get("server-round", 0))
        for cid, content in records.unpack(reply.content).items():
            if "arrays" in content:
                store.setdefault(rnd, {})[cid] = {n: a.numpy().copy()
                                                  for n, a in content["arrays"].items()}
    return keep


def test_ranks_by_share_and_by_tier_and_their_bad_input():
    from fedadapt.adapters.lora import LoraMethodConfig, assign_ranks

    cfg = LoraMethodConfig(ranks=[2, 8], rank_fractions=[0.25, 0.75])
    ranks = assign_ranks(cfg, 8, [], seed=0)
    assert sorted(ranks) == [2, 2, 8, 8, 8, 8, 8, 8] and ranks == assign_ranks(cfg, 8, [], 0)
    by_tier = assign_ranks(LoraMethodConfig(ranks=[2, 4, 8]), 4, [3, 7, 11, 3], seed=0)
    assert by_tier == [2, 4, 8, 2]
    with pytest.raises(ConfigError, match="one rank per tier"):
        assign_ranks(LoraMethodConfig(ranks=[2, 4]), 3, [3, 7, 11], seed=0)
    for bad, says in ((dict(ranks=[0, 4]), "method.ranks=[0, 4] is invalid"),
                      (dict(ranks=[2, 4], rank_fractions=[1.0]), "method.rank_fractions"),
                      (dict(ranks=[2, 4], rslora=True), "method.rslora=true is invalid")):
        with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
            LoraMethodConfig(**bad).check()


@pytest.mark.parametrize("overrides,says", [
    (["method=linear_head", "strategy=hetlora"], "strategy=hetlora is invalid for "
                                                "method=linear_head"),
    (["strategy=fedavg"], "method.ranks=[2, 4, 8] needs a strategy that aggregates LoRA"),
    (["strategy=hetlora", "dp=server_fixed", "method.weighting=uniform"],
     "dp=server_fixed is invalid with strategy=hetlora"),
    (["strategy=flora", "method=dora", "method.ranks=null"],
     "strategy=flora is invalid for method=dora"),
    (["strategy=fedex_lora", "method.ranks=null", "method.ffa=true"],
     "method.ffa=true is invalid with strategy=fedex_lora"),
])
def test_what_cannot_aggregate_ranks_is_refused_in_one_line(overrides, says, tmp_path,
                                                            cache_dir):
    other_method = any(o.startswith("method=") for o in overrides)
    base = [t for t in TINY if not t.startswith("method")] if other_method else TINY
    with pytest.raises(ConfigError) as err:
        _run(tmp_path / "bad", overrides, cache_dir, base=base)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()


def test_a_strategy_the_method_cannot_use_is_refused_before_any_data_is_loaded(monkeypatch,
                                                                               cache_dir):
    from fedadapt.data import loading
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    def no_data(*args, **kwargs):
        raise AssertionError("the data set was loaded before the refusal")

    monkeypatch.setattr(loading, "prepare_dataset", no_data)
    says = r"^strategy=hetlora is invalid for method=linear_head: it aggregates LoRA factors"
    with pytest.raises(ConfigError, match=says):  # where the config is composed
        to_run_config(compose_config(["method=linear_head", "strategy=hetlora",
                                      f"cache_dir={cache_dir}"]))
    cfg = to_run_config(compose_config(["method=lora", "strategy=hetlora",
                                        f"cache_dir={cache_dir}"]))
    cfg.method = to_run_config(compose_config(["method=linear_head"])).method
    with pytest.raises(ConfigError, match=says):  # a config changed in Python
        prepare_run(cfg, quiet=True)


@pytest.mark.slow  # whole runs, in process
def test_only_a_clients_own_rank_travels_and_groups_equal_one_at_a_time(tmp_path, cache_dir):
    got: dict = {}
    cfg, _, rows = _run(tmp_path / "k6", ["strategy=flexlora",
                                          "federation.clients_per_worker=6"], cache_dir,
                        on_reply=_replies(got))
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    ranks = prepare_run(to_run_config(compose_config([*TINY, "strategy=flexlora"])),
                        quiet=True).spec.client_ranks
    assert sorted(set(ranks)) == [2, 4, 8]
    for cid, arrays in got[1].items():
        lora = {n: a.shape for n, a in arrays.items() if ".lora_" in n}
        assert lora and all(s[0] == ranks[cid] for n, s in lora.items() if ".lora_A." in n)
        assert all(s[1] == ranks[cid] for n, s in lora.items() if ".lora_B." in n)
    _, _, homogeneous = _run(tmp_path / "r8", ["strategy=flexlora", "method.ranks=null",
                                               "method.rank=8"], cache_dir)
    assert rows[0]["bytes_up"] < homogeneous[0]["bytes_up"]  # ranks 2 and 4 send less

    alone: dict = {}
    _run(tmp_path / "k1", ["strategy=flexlora", "federation.clients_per_worker=1"], cache_dir,
         on_reply=_replies(alone))
    for rnd in got:
        for cid in got[rnd]:
            for name, value in got[rnd][cid].items():
                np.testing.assert_allclose(value, alone[rnd][cid][name], atol=1e-5, rtol=0)


@pytest.mark.slow  # whole runs, in process
def test_hetlora_clients_prune_their_rank_and_keep_it(tmp_path, cache_dir):
    got: dict = {}
    _, _, rows = _run(tmp_path / "prune", ["strategy=hetlora", "strategy.prune_gamma=0.9",
                                           "rounds=3"], cache_dir, on_reply=_replies(got))
    assert all(r["clients_failed"] == 0 for r in rows)

    def rank(arrays):
        return next(a.shape[0] for n, a in arrays.items() if ".lora_A." in n)

    first, last = got[1], got[3]
    assert any(rank(first[c]) < 8 for c in first)  # pruned below what was sent
    for cid in last:
        assert rank(last[cid]) <= rank(got[2][cid]) <= rank(first[cid])  # and kept


@pytest.mark.slow  # a whole run, in process
def test_fedsa_lora_keeps_b_on_the_clients(tmp_path, cache_dir):
    got: dict = {}
    cfg, summary, rows = _run(tmp_path / "fedsa", ["strategy=fedsa_lora"], cache_dir,
                              on_reply=_replies(got))
    assert cfg.method.share == "a" and summary["strategy"]["class"] == "FedSALoRA"
    assert OmegaConf.load(tmp_path / "fedsa" / "config.yaml").method.share == "a"
    sent = {n for per in got.values() for arrays in per.values() for n in arrays}
    assert any(".lora_A." in n for n in sent) and not any(".lora_B." in n for n in sent)
    assert any((tmp_path / "fedsa" / "clients").rglob("*.safetensors"))  # each client's own B
    assert rows[-1]["client_acc"] is not None


@pytest.mark.slow  # whole runs, in process, and the exports loaded back by peft
def test_the_largest_rank_adapter_exports_and_loads_in_peft_to_the_runs_accuracy(tmp_path,
                                                                                  cache_dir):
    """HetLoRA's global LoRA; FLoRA's and FlexLoRA's on top of base/, the base with their
    updates folded in (FlexLoRA's: its sum beyond rank 8), and fedadapt's own load_export,
    which folds folded.safetensors."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import ViTModel

    from fedadapt.experiment import prepare_run
    from fedadapt.export import FOLDED, export_run, load_export

    for strategy in ("hetlora", "flora", "flexlora"):
        cfg, summary, _ = _run(tmp_path / strategy, [f"strategy={strategy}"], cache_dir)
        out = export_run(tmp_path / strategy, tmp_path / f"exported-{strategy}")
        assert (out / FOLDED).is_file() == (strategy != "hetlora")
        base = ViTModel.from_pretrained(out / "base", add_pooling_layer=False)
        tuned = PeftModel.from_pretrained(base, str(out)).eval()
        assert tuned.peft_config["default"].r == 8  # the global LoRA: the largest rank
        head = load_file(out / "head.safetensors")
        test = prepare_run(cfg, quiet=True).spec.test_source
        x, y = test.get(np.arange(len(test.labels())))
        with torch.no_grad():
            feats = tuned(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 0]
            acc = float((torch.nn.functional.linear(feats, head["weight"], head["bias"])
                         .argmax(1) == y).float().mean())
            ours = float((load_export(out)(x).argmax(1) == y).float().mean())
        assert round(acc, 4) == round(ours, 4) == round(summary["final"]["global_acc"], 4)

    _run(tmp_path / "fedsa", ["strategy=fedsa_lora", "rounds=1"], cache_dir)
    with pytest.raises(ConfigError, match="is a FedSA-LoRA run"):
        export_run(tmp_path / "fedsa")


@pytest.mark.slow  # three short runs each, in process
@pytest.mark.parametrize("strategy,rounds", [("hetlora", 1), ("fedex_lora", 2)])
def test_clients_of_different_ranks_side_by_side_in_bf16_add_no_more_than_bf16s_own_error(
        tmp_path, cache_dir, strategy, rounds, monkeypatch):
    """bf16 (a GPU's default, forced on this CPU): grouped against one at a time differs by no
    more than bf16 against fp32 does (the tolerance of tests/test_grouped_bf16.py); for
    FedEx-LoRA in round 2, the first whose clients train on the folded frozen weights."""
    from fedadapt import devices
    from fedadapt.api import load_result

    # forced, as tests/test_grouped_bf16.py does: a CPU without native bf16 (AVX2) refuses it
    monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: True)

    final = {}
    for precision, k in (("bf16", 1), ("bf16", 6), ("fp32", 1)):
        folder = tmp_path / f"{precision}-{k}"
        _run(folder, [f"strategy={strategy}", f"rounds={rounds}", f"train.precision={precision}",
                      f"federation.clients_per_worker={k}"], cache_dir)
        arrays = load_result(folder).arrays
        final[precision, k] = {n: arrays[n].numpy().astype(np.float64) for n in arrays.keys()}

    def gap(a, b):
        return max(float(np.abs(final[a][n] - final[b][n]).max()) for n in final[a])

    assert gap(("bf16", 6), ("bf16", 1)) <= 2 * gap(("bf16", 1), ("fp32", 1)) + 1e-4


def _tiny_lora(cache_dir, *overrides):
    from fedadapt.entry import compose_config, to_run_config
    from fedadapt.experiment import prepare_run

    return prepare_run(to_run_config(compose_config([*TINY, *overrides,
                                                     f"cache_dir={cache_dir}"])), quiet=True)


def test_a_folded_update_replaces_the_frozen_weight_never_adds_to_it(cache_dir):
    import torch

    prep = _tiny_lora(cache_dir, "method.alpha=4", "strategy=flora")
    model = prep.model.eval()
    layers = model.lora_layers()
    assert layers and all(n.endswith(".base_delta") for n in layers)
    name, layer = next(iter(layers.items()))
    weight = layer.get_base_layer().weight
    w0 = weight.detach().clone()
    x, _ = prep.spec.test_source.get(np.arange(4), prep.spec.device)
    before = model(x)
    d1, d2 = torch.randn_like(w0), torch.randn_like(w0)
    model.fold({name: d1})
    assert layer.scaling["default"] == 0.5  # alpha / max(ranks) = 4 / 8
    torch.testing.assert_close(weight, w0 + 0.5 * d1, rtol=0, atol=1e-6)
    model.load_tensors({name: d2})  # a second round's delta: W0 + s D2, not W0 + s (D1 + D2)
    torch.testing.assert_close(weight, w0 + 0.5 * d2, rtol=0, atol=1e-6)
    model.fold({})  # no delta: the pretrained weight again
    torch.testing.assert_close(weight, w0, rtol=0, atol=0)
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    with pytest.raises(KeyError, match="no LoRA layer of that name"):
        model.fold({"backbone.nothing.base_delta": d1})


def _client_eval(prep, arrays: dict, cid: int) -> tuple[float, float]:
    """(loss, accuracy) of the global ``arrays`` (folded as the server folds them) on client
    ``cid``'s test split."""
    from fedadapt.methods.rounds.clients import local_accuracy

    prep.model.load_tensors(arrays)
    return local_accuracy(prep.model, prep.spec, prep.spec.clients[cid].test, None)[:2]


@pytest.mark.slow  # three whole runs, in process
def test_fedex_and_flora_clients_fold_side_by_side_as_one_at_a_time(tmp_path, cache_dir):
    """FedEx-LoRA with ranks 2/4/8: each rank's clients get their own folded weights (the
    components they cannot hold folded in), so they train in groups by rank; grouped equals
    one at a time, and every client evaluates the exact global model (the server's). FLoRA:
    the clients evaluate the global model folded as the server folds it."""
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint

    got: dict = {}
    _, _, rows = _run(tmp_path / "k6", ["strategy=fedex_lora",
                                        "federation.clients_per_worker=6"], cache_dir,
                      on_reply=_replies(got))
    assert all(r["clients_failed"] == 0 for r in rows)
    alone: dict = {}
    _run(tmp_path / "k1", ["strategy=fedex_lora", "federation.clients_per_worker=1"],
         cache_dir, on_reply=_replies(alone))
    for cid, arrays in got[2].items():  # round 2: every client trains on folded weights
        for name, value in arrays.items():
            np.testing.assert_allclose(value, alone[2][cid][name], atol=1e-5, rtol=0)
    prep = _tiny_lora(cache_dir, "strategy=fedex_lora")
    for strategy, run_dir in (("fedex_lora", tmp_path / "k6"),
                              ("flora", tmp_path / "flora")):
        if strategy == "flora":
            _run(run_dir, ["strategy=flora"], cache_dir)
        arrays, _ = load_checkpoint(latest_checkpoint(run_dir))  # round 2's global model
        deltas = [t for n, t in arrays.items() if n.endswith(".base_delta")]
        assert deltas and any(bool(t.any()) for t in deltas)
        per_client = read_jsonl(run_dir / "clients.jsonl")
        for row in (r for r in per_client if r["round"] == 2):  # the loss: the finer check
            loss, acc = _client_eval(prep, arrays, row["client"])
            assert (row["loss"], row["accuracy"]) == pytest.approx((loss, acc), abs=1e-5), \
                strategy
        if strategy == "flora":  # base_delta travels down, dense, with every message
            per_message = sum(4 * t.numel() for t in deltas)
            flex = _run(tmp_path / "flex", ["strategy=flexlora"], cache_dir)[2]
            rows = read_jsonl(run_dir / "metrics.jsonl")
            for mine, other in zip(rows, flex):  # the same shapes of A and B otherwise
                messages = mine["clients_sampled"] + mine["clients_evaluated"]
                extra = mine["bytes_down"] - other["bytes_down"]  # each array's header too
                assert 0 <= extra - messages * per_message <= messages * len(deltas) * 256
        unfolded = {n: t for n, t in arrays.items() if not n.endswith(".base_delta")}
        prep.model.fold({})
        assert any(_client_eval(prep, unfolded, r["client"])[0] != pytest.approx(
            r["loss"], abs=1e-5) for r in per_client if r["round"] == 2)  # folding matters


@pytest.mark.slow  # a whole run, in process (the formula itself: tests/test_lora_het.py)
def test_flexloras_server_evaluates_the_whole_sum_folded_into_the_frozen_weights(tmp_path,
                                                                                 cache_dir):
    """Issue 58: FlexLoRA's global model is ``W0 + s W``, ``W = sum_k p_k B_k A_k`` of the
    round's replies (rank up to 14 for ranks 2/4/8), not its rank-8 truncation: the
    checkpoint's ``base_delta + B A`` of every layer is ``W``, and the server's global loss is
    the loss of the model with it folded in (without the fold it differs). The clients get no
    ``base_delta``."""
    from fedadapt.federation.client.training import evaluate
    from fedadapt.federation.server.checkpoint import latest_checkpoint, load_checkpoint

    got: dict = {}
    sent: list = []

    def hook(message, reply, context):
        sent.extend(message.content.array_records.get("arrays", {}).keys()
                    if message.content.array_records else [])
        keep(message, reply, context)

    keep = _replies(got)
    cfg, _, rows = _run(tmp_path / "flex", ["strategy=flexlora", "method.weighting=uniform"],
                        cache_dir, on_reply=hook)
    assert all(r["clients_failed"] == 0 for r in rows)
    assert not any(n.endswith(".base_delta") for n in sent)
    arrays, _ = load_checkpoint(latest_checkpoint(tmp_path / "flex"))
    layers = [n[:-len(".base_delta")] for n in arrays if n.endswith(".base_delta")]
    assert layers
    replies = got[2]
    for layer in layers:
        a_name = next(n for n in arrays if n.startswith(f"{layer}.lora_A."))
        b_name = a_name.replace(".lora_A.", ".lora_B.")
        w = sum(r[b_name].astype(np.float64) @ r[a_name].astype(np.float64)
                for r in replies.values()) / len(replies)
        held = arrays[f"{layer}.base_delta"].double() + arrays[b_name].double() @ arrays[
            a_name].double()
        np.testing.assert_allclose(held.numpy(), w, atol=1e-5, rtol=0)
    prep = _tiny_lora(cache_dir, "strategy=flexlora", "method.weighting=uniform")
    prep.model.load_tensors({n: t for n, t in arrays.items()})
    loss = evaluate(prep.model, prep.spec.test_source, precision="fp32")[0]
    assert rows[-1]["global_loss"] == loss  # the same evaluation, to the bit
    prep.model.fold({})  # the rank-8 factors alone: another model
    assert evaluate(prep.model, prep.spec.test_source, precision="fp32")[0] != loss
