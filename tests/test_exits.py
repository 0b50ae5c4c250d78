"""Early-exit methods (Accumulator paper): counts from the architecture, and the mechanism on a
tiny random ViT: exits, token replacement, residual, parallel adapters, what trains."""

import pytest
import torch
from conftest import accuracy_of, final_checkpoint, tiny_run

from fedadapt.adapters import build_model
from fedadapt.adapters.exits import AccumulatorConfig, LwLinearConfig, LwMlpConfig
from fedadapt.backbones import build_backbone
from fedadapt.config import BackboneConfig, ConfigError
from fedadapt.counts import inspect_run
from fedadapt.entry import compose_config, to_run_config
from fedadapt.experiment import prepare_run, run_experiment
from fedadapt.federation.simulation.inprocess import run_in_process
from fedadapt.results.store import read_jsonl

TINY_VIT = BackboneConfig(name="tiny_vit", family="vit", image_size=32, arch=dict(
    patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    intermediate_size=64))


@pytest.mark.parametrize("method,cifar,femnist", [
    # docs/accumulator-sizing.md; paper Table 5: 0.46M/0.28M, 8.95M/8.77M, 3.17M/2.99M
    ("lw_linear", 462_000, 286_440),
    ("lw_mlp", 8_949_936, 8_249_064),
    ("accumulator", 3_000_676, 2_986_046),
])
@pytest.mark.slow
def test_deit_small_counts(method, cifar, femnist):
    for dataset, expected in (("cifar100", cifar), ("femnist", femnist)):
        for pa, extra in (("false", 0), ("true", 595_200)):  # Table 5: adapters 0.60M
            run = to_run_config(compose_config([f"method={method}", "backbone=deit_small",
                                                f"dataset={dataset}",
                                                f"method.parallel_adapter={pa}"]))
            info = inspect_run(run, flops=False)
            assert info["backbone_params"] == 21_665_664
            assert info["trainable_params"] == info["communicated_params"] == expected + extra


def test_full_finetuning_count():
    """Table 5: full fine-tuning = DeiT-S without head + the layer-wise MLP heads, 30.62M."""
    run = to_run_config(compose_config(["method=lw_mlp", "method.train_backbone=true",
                                        "backbone=deit_small", "dataset=cifar100"]))
    info = inspect_run(run, flops=False)
    assert info["trainable_params"] == info["communicated_params"] == 21_665_664 + 8_949_936


def model(cfg, num_classes=5):
    torch.manual_seed(0)
    return build_model(cfg, build_backbone(TINY_VIT), num_classes, with_backbone=True)


def test_exits_and_compute_saving():
    m = model(AccumulatorConfig(head_hidden=[16]))
    x = torch.randn(2, 3, 32, 32)
    assert [t.shape for t in m.exit_logits(x)] == [(2, 5)] * 3
    assert len(m.exit_logits(x, last_exit=0)) == 1  # only block 0 ran
    torch.testing.assert_close(m(x), m.exit_logits(x)[-1])
    calls = []
    hook = m.backbone.blocks[2].register_forward_hook(lambda *a: calls.append(1))
    m.exit_logits(x, last_exit=1)
    hook.remove()
    assert not calls  # block 2 never computed for exit 1


def test_per_exit_flops_count_the_attention_matmuls():
    """2 FLOPs per multiply-add: the patch convolution, every linear layer, and QK^T and AV,
    which the CPU attention kernel hides from torch's counter unless it is given its formula."""
    from fedadapt.measure import per_exit_counts

    tokens, d, hidden = (32 // 8) ** 2 + 1, 32, 64
    patch = 2 * 16 * (3 * 8 * 8) * d
    linear = 2 * tokens * (d * 3 * d + d * d + 2 * d * hidden)
    attention = 2 * (2 * tokens * tokens * d)
    counts = per_exit_counts(build_backbone(TINY_VIT))
    assert [c["flops"] for c in counts] == [patch + (e + 1) * (linear + attention)
                                            for e in range(3)]


def test_token_replace_and_residual_change_the_output():
    x = torch.randn(2, 3, 32, 32)
    base = model(AccumulatorConfig(head_hidden=[16])).eval()
    no_replace = model(AccumulatorConfig(head_hidden=[16], token_replace=False)).eval()
    no_residual = model(AccumulatorConfig(head_hidden=[16], residual=False)).eval()
    with torch.no_grad():
        a, b, c = base.exit_logits(x), no_replace.exit_logits(x), no_residual.exit_logits(x)
    # the token entering every block, block 0 included, is the Accumulator's: all exits change
    assert all(not torch.allclose(p, q) for p, q in zip(a, b))
    assert not torch.allclose(a[-1], c[-1])


def test_an_identity_accumulator_replaces_each_token_by_itself():
    """Eq. 7 wiring: with its residual branches and layer embeddings at zero the Accumulator
    returns its input, so token replace must reproduce the no-replace model exactly."""
    x = torch.randn(2, 3, 32, 32)
    models = [model(AccumulatorConfig(head_hidden=[16], token_replace=r)).eval()
              for r in (True, False)]
    for m in models:
        acc = m.head
        with torch.no_grad():
            acc.layer_embed.zero_()
            for layer in acc.blocks.layers:
                for lin in (layer.self_attn.out_proj, layer.linear2):
                    lin.weight.zero_()
                    lin.bias.zero_()
    models[1].load_state_dict(models[0].state_dict())
    with torch.no_grad():
        for a, b in zip(models[0].exit_logits(x), models[1].exit_logits(x)):
            torch.testing.assert_close(a, b)


def test_a_new_accumulator_replaces_each_token_by_itself_plus_its_layer_embedding():
    """method.zero_init (the default): token replace starts from the backbone's own CLS tokens,
    moved only by the layer embeddings p'; PyTorch's default initialisation does not."""
    x = torch.randn(2, 3, 32, 32)
    for zero_init in (True, False):
        m = model(AccumulatorConfig(head_hidden=[16], zero_init=zero_init)).eval()
        acc, history, pairs = m.head, [], []

        def hook(k, hidden, acc=acc, history=history, pairs=pairs):
            history.append(hidden[:, 0])
            pairs.append((acc.accumulate(history)[:, k + 1], hidden[:, 0] + acc.layer_embed[0, k]))
            return hidden

        with torch.no_grad():
            m.backbone.forward_exits(x, cls_hook=hook)
        assert len(pairs) == 3
        assert all(torch.allclose(a, b, atol=1e-6) is zero_init for a, b in pairs)


def test_only_the_method_trains():
    m = model(AccumulatorConfig(head_hidden=[16], parallel_adapter=True, adapter_bottleneck=4))
    names = m.trainable_names()
    assert any(n.startswith("head.client_token") for n in names)
    assert any(".mlp.adapter." in n for n in names)
    assert all(n.startswith("head.") or ".mlp.adapter." in n for n in names)
    loss = m(torch.randn(2, 3, 32, 32)).sum()
    loss.backward()
    frozen = [p for n, p in m.named_parameters() if n not in set(names)]
    assert frozen and all(p.grad is None for p in frozen)
    assert m.head.layer_embed.grad is not None and m.head.client_token.grad is not None


def test_zero_adapters_leave_the_backbone_unchanged():
    x = torch.randn(2, 3, 32, 32)
    plain = model(LwLinearConfig()).eval()
    adapted = model(LwLinearConfig(parallel_adapter=True, adapter_bottleneck=4)).eval()
    with torch.no_grad():
        for a, b in zip(plain.exit_logits(x), adapted.exit_logits(x)):
            torch.testing.assert_close(a, b)  # up-projections start at zero


def test_adapter_scale_multiplies_the_adapter_branch():
    """He et al.'s s: ``mlp(x) + s * adapter(x)``; the default (the Accumulator paper) is 1."""
    outs = {}
    for scale in (1.0, 4.0):
        m = model(LwLinearConfig(parallel_adapter=True, adapter_bottleneck=4,
                                 adapter_scale=scale)).eval()
        adapter = m.backbone.blocks[0].mlp.adapter
        assert adapter.scale == scale
        torch.manual_seed(1)
        with torch.no_grad():
            adapter.up.weight.normal_()
            tokens = torch.randn(2, 17, 32)
            outs[scale] = (m.backbone.blocks[0].mlp(tokens) - m.backbone.blocks[0].mlp.mlp(tokens))
    torch.testing.assert_close(outs[4.0], 4 * outs[1.0])
    assert LwLinearConfig().adapter_scale == 1.0
    with pytest.raises(ConfigError, match="method.adapter_scale=0"):
        model(LwLinearConfig(parallel_adapter=True, adapter_scale=0.0))


def test_layerwise_linear_heads_read_the_final_layernormed_cls():
    """As DeiT's own classifier: the last exit's linear head on the pooled (final-LN) CLS."""
    m = model(LwLinearConfig()).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        logits = m.exit_logits(x)
        tokens = m.backbone.forward_exits(x)
        torch.testing.assert_close(logits[-1], m.head.heads[-1](m.backbone(x)))
        for head, token, out in zip(m.head.heads, tokens, logits):
            torch.testing.assert_close(out, head(m.backbone.model.layernorm(token)))


def test_exit_methods_need_a_vit():
    with pytest.raises(ConfigError, match="needs a backbone with exits"):
        build_model(LwMlpConfig(), build_backbone(BackboneConfig(
            name="s", family="small_cnn", image_size=16)), 5, with_backbone=True)


@pytest.mark.slow
def test_accumulator_federates_end_to_end(cache_dir, tmp_path):
    cfg = tiny_run(cache_dir, AccumulatorConfig(head_hidden=[16], parallel_adapter=True,
                                                adapter_bottleneck=4))
    cfg.backbone = TINY_VIT
    prep = prepare_run(cfg, quiet=True)
    summary = run_experiment(cfg, tmp_path / "acc", config_yaml="acc\n", prepared=prep,
                             execute=run_in_process)
    rows = read_jsonl(tmp_path / "acc" / "metrics.jsonl")
    assert [r["clients_trained"] for r in rows] == [3, 3]
    assert summary["params"]["communicated_params"] == summary["params"]["trainable_params"]
    # the headline: the mean over the exits of the final global model, recomputed here
    assert summary["final"]["global_acc"] == pytest.approx(
        accuracy_of(prep, final_checkpoint(tmp_path / "acc")), rel=1e-6, abs=0)
