"""LoRA of different ranks across clients (method.ranks) under the heterogeneous-rank
aggregators (strategy=hetlora|flexlora|fedsa_lora): ranks assigned, only a client's own rank
travels, clients of different ranks side by side equal one at a time, HetLoRA's self-pruning,
FedSA-LoRA's B kept on the clients; bad input in one line."""

from pathlib import Path

import numpy as np
import pytest
from flwr.app import MessageType
from omegaconf import OmegaConf

from fedadapt.config import ConfigError
from fedadapt.results.store import read_jsonl

TINY = ["method=lora", "backbone=tiny_vit", "dataset.max_samples=300", "partition.num_clients=6",
        "partition.fraction_fit=1.0", "rounds=2", "federation.eval_every=1", "train.lr=0.05",
        "method.ranks=[2,4,8]"]


def _run(run_dir: Path, overrides, cache_dir, on_reply=None, base=tuple(TINY)):
    from fedadapt.entry import compose_config, to_run_config, with_method_train
    from fedadapt.experiment import run_experiment
    from fedadapt.federation.inprocess import in_process

    composed = compose_config([*base, *overrides, f"cache_dir={cache_dir}"])
    cfg = to_run_config(composed)
    yaml = OmegaConf.to_yaml(with_method_train(composed), resolve=True)  # as fedadapt writes it
    summary = run_experiment(cfg, run_dir, config_yaml=yaml,
                             execute=in_process("workers", on_reply=on_reply))
    return cfg, summary, read_jsonl(run_dir / "metrics.jsonl")


def _replies(store: dict):
    """An ``on_reply`` hook keeping each client's training reply arrays, per round."""
    from fedadapt.federation import records

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
])
def test_what_cannot_aggregate_ranks_is_refused_in_one_line(overrides, says, tmp_path,
                                                            cache_dir):
    other_method = any(o.startswith("method=") for o in overrides)
    base = [t for t in TINY if not t.startswith("method")] if other_method else TINY
    with pytest.raises(ConfigError) as err:
        _run(tmp_path / "bad", overrides, cache_dir, base=base)
    assert str(err.value).startswith(says) and "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()


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


@pytest.mark.slow  # a whole run, in process, and the export loaded back by peft
def test_the_largest_rank_adapter_exports_and_loads_in_peft_to_the_runs_accuracy(tmp_path,
                                                                                  cache_dir):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import ViTModel

    from fedadapt.experiment import prepare_run
    from fedadapt.export import export_run

    cfg, summary, _ = _run(tmp_path / "het", ["strategy=hetlora"], cache_dir)
    out = export_run(tmp_path / "het", tmp_path / "exported")
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
    assert round(acc, 4) == round(summary["final"]["global_acc"], 4)

    _run(tmp_path / "fedsa", ["strategy=fedsa_lora", "rounds=1"], cache_dir)
    with pytest.raises(ConfigError, match="is a FedSA-LoRA run"):
        export_run(tmp_path / "fedsa")


@pytest.mark.slow  # four one-round runs, in process
def test_clients_of_different_ranks_side_by_side_in_bf16_add_no_more_than_bf16s_own_error(
        tmp_path, cache_dir):
    """bf16 (a GPU's default, forced on this CPU): grouped against one at a time differs by no
    more than bf16 against fp32 does (the tolerance of tests/test_grouped_bf16.py)."""
    from fedadapt.api import load_result

    final = {}
    for precision in ("bf16", "fp32"):
        for k in (1, 6):
            folder = tmp_path / f"{precision}-{k}"
            _run(folder, ["strategy=hetlora", "rounds=1", f"train.precision={precision}",
                          f"federation.clients_per_worker={k}"], cache_dir)
            arrays = load_result(folder).arrays
            final[precision, k] = {n: arrays[n].numpy().astype(np.float64)
                                   for n in arrays.keys()}

    def gap(a, b):
        return max(float(np.abs(final[a][n] - final[b][n]).max()) for n in final[a])

    assert gap(("bf16", 6), ("bf16", 1)) <= 2 * gap(("bf16", 1), ("fp32", 1)) + 1e-4
