"""The AST backbone (backbone.family=ast): DeiT/ViT weights converted as AST does, checked on a
tiny random ViT saved to a folder and loaded by path; the ViT backbone's interface; counts from
the architecture; the one-line message for missing weights."""

import pytest
import torch
import torch.nn.functional as F

from fedadapt.assets import MissingAssetError
from fedadapt.backbones import build_backbone
from fedadapt.config import BackboneConfig

TINY_AST = BackboneConfig(name="tiny_ast", family="ast", image_size=128, arch=dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
    patch_size=16, frequency_stride=10, time_stride=10, max_length=128, num_mel_bins=128))


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
    """A tiny random ViT (32 px, 8 px patches: a 4 x 4 grid) saved with save_pretrained."""
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    vit = ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=64),
                   add_pooling_layer=False)
    with torch.no_grad():  # non-zero tokens so that every copy is visible
        vit.embeddings.cls_token.normal_()
        vit.embeddings.position_embeddings.normal_()
    folder = tmp_path_factory.mktemp("tiny_vit")
    vit.save_pretrained(folder)
    return vit.eval(), str(folder)


def ast_from(folder: str, length: int, stride: int):
    return build_backbone(BackboneConfig(name="ast", family="ast", weights=folder, arch=dict(
        patch_size=8, frequency_stride=stride, time_stride=stride, max_length=length,
        num_mel_bins=length)))


@pytest.mark.parametrize("length,stride,cut", [(24, 8, True), (40, 6, False)])
def test_weights_converted_as_ast_does(tiny_vit, length, stride, cut):
    vit, folder = tiny_vit
    b = ast_from(folder, length, stride)
    ast = b.model
    assert b.weights_id == folder and b.modality == "audio"
    for mine, theirs in zip(ast.layers, vit.layers):  # blocks copied exactly
        for (n, p), (m, q) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert n == m and torch.equal(p, q)
    assert torch.equal(ast.layernorm.weight, vit.layernorm.weight)
    w = vit.embeddings.patch_embeddings.projection.weight  # [D, 3, 8, 8]
    proj = ast.embeddings.patch_embeddings.projection
    assert proj.weight.shape == (32, 1, 8, 8)
    torch.testing.assert_close(proj.weight, w.sum(dim=1, keepdim=True))  # channels summed
    assert torch.equal(proj.bias, vit.embeddings.patch_embeddings.projection.bias)
    cls, pos = vit.embeddings.cls_token, vit.embeddings.position_embeddings  # [1, 1 + 16, D]
    emb = ast.embeddings
    assert torch.equal(emb.cls_token, cls) and torch.equal(emb.distillation_token, cls)
    assert torch.equal(emb.position_embeddings[:, 0], pos[:, 0])
    assert torch.equal(emb.position_embeddings[:, 1], pos[:, 0])  # both leading tokens: CLS's
    grid = pos[0, 1:].reshape(4, 4, 32)  # [freq, time, D]
    n = (length - 8) // stride + 1  # patches per axis
    got = emb.position_embeddings[0, 2:].reshape(n, n, 32)
    if cut:  # 3 of 4: cut from the middle
        assert n == 3 and torch.equal(got, grid[1:4, 1:4])
    else:  # 6 of 4: bilinear
        want = F.interpolate(grid.permute(2, 0, 1)[None], size=(n, n), mode="bilinear",
                             align_corners=False)[0].permute(1, 2, 0)
        assert n == 6 and torch.allclose(got, want, atol=1e-6)


def test_pooled_feature_is_the_cls_token_and_asts_own(tiny_vit):
    """From image weights the two leading tokens stay equal, so AST's pooled output (their mean
    after the final norm) is the final-norm CLS token that fedadapt's exits read."""
    _, folder = tiny_vit
    b = ast_from(folder, 24, 8)
    x = torch.randn(3, 24, 24)
    with torch.no_grad():
        own = b.model(x).pooler_output
        torch.testing.assert_close(b(x), own)
        torch.testing.assert_close(b.final_norm(b.forward_exits(x)[-1]), own)


def test_vit_interface_exits_hook_and_adapters():
    b = build_backbone(TINY_AST)
    assert (b.embed_dim, b.num_layers, b.weights_id) == (32, 2, "random")
    assert not b.training and not any(p.requires_grad for p in b.parameters())
    x = torch.randn(2, 128, 128)  # [B, frames, mel bins]
    assert b.example_input(2).shape == x.shape and b(x).shape == (2, 32)
    tokens = b.forward_exits(x, last_exit=0)
    assert len(tokens) == 1 and tokens[0].shape == (2, 32)
    seen = []

    def hook(i, h):  # [B, 2 + 144, D]: the CLS token at position 0 replaced
        seen.append((i, h.shape[1]))
        return torch.cat([torch.zeros_like(h[:, :1]), h[:, 1:]], dim=1)

    replaced = b.forward_exits(x, cls_hook=hook)
    assert seen == [(0, 146), (1, 146)]
    assert not torch.allclose(replaced[-1], b.forward_exits(x)[-1])
    before = b(x)
    adapters = b.insert_mlp_adapters(lambda i, d: torch.nn.Linear(d, d))
    assert len(adapters) == 2
    with torch.no_grad():
        for a in adapters:
            a.weight.zero_()
            a.bias.zero_()
    torch.testing.assert_close(b(x), before)  # a zero adapter changes nothing


def test_counts_from_the_architecture():
    """AST with DeiT-S's sizes: DeiT-S (21,665,664 without head) with a one-channel patch
    kernel (-2 x 384 x 256), a distillation token (+384) and 146 instead of 197 position
    embeddings (-51 x 384)."""
    from fedadapt.counts import inspect_run
    from fedadapt.entry import compose_config, to_run_config

    run = to_run_config(compose_config(["method=accumulator", "backbone=ast_deit_small",
                                        "dataset=speech_commands"]))
    info = inspect_run(run, flops=False)
    assert info["backbone_params"] == 21_665_664 - 2 * 384 * 256 + 384 - 51 * 384
    assert info["num_classes"] == 12
    tiny = to_run_config(compose_config(["method=lw_linear", "backbone=tiny_ast",
                                         "dataset=speech_commands"]))
    exits = inspect_run(tiny)["per_exit"]  # FLOPs on one 128 x 128 spectrogram
    assert [e["exit"] for e in exits] == [0, 1] and 0 < exits[0]["flops"] < exits[1]["flops"]


def test_missing_weights_name_the_fetch_command(tmp_path):
    cfg = BackboneConfig(name="ast_deit_small", family="ast",
                         weights="facebook/deit-small-patch16-224-not-cached", arch={})
    with pytest.raises(MissingAssetError) as err:
        build_backbone(cfg)
    msg = str(err.value)
    assert "\n" not in msg and "facebook/deit-small-patch16-224-not-cached" in msg
    assert "fedadapt-prefetch backbone=ast_deit_small" in msg
    with pytest.raises(MissingAssetError, match=r"backbone.weights=.*no ViT, DeiT or AST"):
        build_backbone(BackboneConfig(name="a", family="ast", weights=str(tmp_path / "none")))
