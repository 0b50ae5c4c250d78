"""ICIIA: grouping and shuffling, attention within one client's images, padding, one-by-one
recognition against batch mode, the cold start, the ablations and Table 1's counts."""

import math

import pytest
import torch
from torch import nn

from fedadapt.config import ConfigError
from fedadapt.methods.plugin.iciia import (
    ICIIA_B,
    ICIIA_T,
    GroupedLinear,
    HistoryCache,
    Iciia,
    IciiaLayer,
    iciia_counts,
    recognize_stream,
    shuffle_groups,
)


def _model(dim=32, classes=5, **kw) -> Iciia:
    torch.manual_seed(0)
    return Iciia(dim, classes, **{"layers": 2, "groups": 4, **kw}).eval()


def test_shuffle_transposes_the_group_layout():
    x = torch.arange(6.0)
    # groups [0 1 2] [3 4 5] -> transposed -> [0 3] [1 4] [2 5]
    assert shuffle_groups(x, 2).tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(shuffle_groups(x, 1), x)
    assert shuffle_groups(torch.randn(2, 3, 6), 3).shape == (2, 3, 6)


@pytest.mark.parametrize("groups", [1, 4, 16])
def test_grouped_projection_is_block_diagonal_with_d2_over_p_weights(groups):
    dim = 64
    proj = GroupedLinear(dim, groups, shuffle=False)
    assert proj.weight.numel() == dim * dim // groups
    assert sum(p.numel() for p in proj.parameters()) == dim * dim // groups + dim
    x = torch.randn(3, 5, dim)
    dense = x @ torch.block_diag(*proj.weight).t() + proj.bias
    torch.testing.assert_close(proj(x), dense)
    shuffled = GroupedLinear(dim, groups)
    shuffled.load_state_dict(proj.state_dict())
    torch.testing.assert_close(shuffled(x), shuffle_groups(dense, groups))


def test_shuffling_mixes_every_group_into_every_head():
    dim, groups, heads = 64, 16, 4
    width = dim // groups
    for g in range(groups):
        x = torch.zeros(dim)
        x[g * width:(g + 1) * width] = 1.0
        assert (shuffle_groups(x, groups).view(heads, -1).sum(-1) > 0).all()
        # through a projection: without shuffling group g's output stays in one head's slice
        proj = GroupedLinear(dim, groups, bias=False, shuffle=False)
        nn.init.uniform_(proj.weight, 0.1, 1.0)
        reached = proj(x).view(heads, -1).abs().sum(-1) > 0
        assert reached.sum() == 1
        proj.shuffle = True
        assert (proj(x).view(heads, -1).abs().sum(-1) > 0).all()


def test_attention_stays_within_one_clients_images():
    model = _model()
    x = torch.randn(2, 6, 32)
    out = model(x)
    assert out.shape == (2, 6, 5)
    other = x.clone()
    other[1] = torch.randn(6, 32)  # another client's session
    torch.testing.assert_close(model(other)[0], out[0], rtol=0, atol=1e-6)
    same = x.clone()
    same[0, 5] = torch.randn(32)  # another image of the same client
    changed = (model(same)[0, :5] - out[0, :5]).abs().amax(-1)
    assert (changed > 1e-4).all()


@pytest.mark.parametrize("mixing", ["attention", "conv"])
def test_key_padding_hides_padded_images(mixing):
    model = _model(mixing=mixing)
    x = torch.randn(2, 7, 32)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[0, 4:] = True  # sequence 0: 4 images then padding
    out = model(x, mask)
    torch.testing.assert_close(out[0, :4], model(x[0, :4]), rtol=0, atol=1e-5)
    torch.testing.assert_close(out[1], model(x[1]), rtol=0, atol=1e-5)
    x[0, 4:] = 100 * torch.randn(3, 32)
    torch.testing.assert_close(model(x, mask)[0, :4], out[0, :4], rtol=0, atol=1e-5)
    assert torch.isfinite(model(x, torch.ones(2, 7, dtype=torch.bool))).all()


@pytest.mark.parametrize("preset", [ICIIA_B, dict(groups=8)])
def test_one_by_one_equals_batch_mode(preset):
    model = _model(**preset)
    feats = torch.randn(8, 32)
    batch = model(feats)
    for i in range(8):
        history = torch.cat([feats[:i], feats[i + 1:]])
        torch.testing.assert_close(model.predict_one(history, feats[i]), batch[i],
                                   rtol=0, atol=1e-5)
    # the stream with a full cache of B - 1 = 7 features: the last image sees the whole batch
    logits = recognize_stream(model, model.classifier, feats, history_size=7, min_history=7)
    torch.testing.assert_close(logits[-1], batch[-1], rtol=0, atol=1e-5)


def test_history_cache_keeps_the_most_recent():
    cache = HistoryCache(3)
    assert len(cache) == 0 and cache.features().numel() == 0
    for t in range(5):
        cache.add(torch.full((4,), float(t)))
    assert len(cache) == 3
    assert cache.features()[:, 0].tolist() == [2.0, 3.0, 4.0]


def test_cold_start_falls_back_to_the_original_classifier():
    model = _model()
    original = nn.Linear(32, 5).eval()
    feats = torch.randn(9, 32)
    history_size, min_history = 4, 3
    logits = recognize_stream(model, original, feats, history_size, min_history)
    assert logits.shape == (9, 5)
    with torch.no_grad():
        for t in range(9):
            if t < min_history:
                expected = original(feats[t])
            else:
                expected = model.predict_one(feats[max(0, t - history_size):t], feats[t])
            torch.testing.assert_close(logits[t], expected)
        assert not torch.allclose(logits[min_history], original(feats[min_history]))
    # no minimum: the module from the first image, alone in its sequence
    first = recognize_stream(model, original, feats[:1], history_size, 0)
    torch.testing.assert_close(first[0], model(feats[:1])[0])
    with pytest.raises(ValueError, match="min_history"):
        recognize_stream(model, original, feats, 2, 3)


@pytest.mark.parametrize("mixing", ["attention", "conv", "none"])
def test_ablations_run_and_every_parameter_trains(mixing):
    model = _model(mixing=mixing).train()
    x = torch.randn(3, 6, 32)
    model(x).logsumexp(-1).mean().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert hasattr(model.layers[0], "q") == (mixing == "attention")
    noshuffle = _model(mixing=mixing, shuffle=False)
    assert noshuffle(x).shape == (3, 6, 5)


def test_no_mixing_is_independent_of_the_other_images():
    model = _model(mixing="none")
    x = torch.randn(1, 6, 32)
    out = model(x)
    torch.testing.assert_close(model(x[:, 2:3])[0, 0], out[0, 2], rtol=0, atol=1e-6)
    x[0, 0] = torch.randn(32)
    torch.testing.assert_close(model(x)[0, 1:], out[0, 1:], rtol=0, atol=1e-6)


def test_conv_mixing_reaches_only_the_neighbouring_images():
    model = _model(mixing="conv", layers=1)
    x = torch.randn(1, 6, 32)
    out = model(x)
    x[0, 5] = torch.randn(32)
    new = model(x)
    torch.testing.assert_close(new[0, :4], out[0, :4], rtol=0, atol=1e-6)
    assert not torch.allclose(new[0, 4], out[0, 4])


def printed(value: int, figure: str) -> bool:
    """``value`` as Table 1 prints it: three significant figures, then half-up to the printed
    figure's last digit (29,491,200 -> 29.5M -> "30M"; the paper's rounding)."""
    scale = {"M": 1e6, "G": 1e9}[figure[-1]]
    digits = figure[:-1]
    decimals = len(digits.partition(".")[2])
    x = float(f"{value:.3g}") / scale
    return f"{math.floor(x * 10 ** decimals + 0.5) / 10 ** decimals:.{decimals}f}" == digits


# D: (ICIIA-B params, FLOPs), (ICIIA-T params, FLOPs); N = 3, B = 16
TABLE_1 = {
    1280: (("30M", "0.47G"), ("0.14M", "3.8M")),  # MobileNetV3-L
    2048: (("76M", "1.2G"), ("0.33M", "7.9M")),  # ResNet-152
    1024: (("19M", "0.30G"), ("0.09M", "2.8M")),  # Swin-B
}


@pytest.mark.parametrize("dim", sorted(TABLE_1))
def test_counts_reproduce_table_1(dim):
    for preset, (params, flops) in zip((ICIIA_B, ICIIA_T), TABLE_1[dim]):
        p = preset["groups"]
        c = iciia_counts(dim, layers=3, images=16, **preset)
        assert c["paper_params"] == 6 * dim * dim * 3 // p
        assert c["projection_params"] == 6 * (dim * dim // p + dim) * 3
        assert c["module_params"] == c["projection_params"] + 3 * 4 * dim  # + 2 LayerNorms
        assert c["paper_flops"] == (6 * 16 * dim * dim // p + 2 * 16 * 16 * dim) * 3
        assert c["measured_flops"] == 2 * c["paper_flops"]  # 2 FLOPs per multiply-add
        assert printed(c["projection_params"], params)
        assert printed(c["paper_flops"], flops)
        if p == 1:
            assert printed(c["paper_params"], params)


def test_counts_by_hand():
    b = iciia_counts(1280, **ICIIA_B)
    assert b["paper_params"] == 29_491_200 and b["paper_flops"] == 473_825_280
    t = iciia_counts(1280, **ICIIA_T)
    assert t["projection_params"] == 138_240 and t["paper_flops"] == 3_809_280
    layer = IciiaLayer(64, groups=16)
    assert iciia_counts(64, layers=1, groups=16)["module_params"] == sum(
        p.numel() for p in layer.parameters())


def test_invalid_settings_name_the_key():
    with pytest.raises(ConfigError, match="method.groups"):
        GroupedLinear(10, 3)
    with pytest.raises(ConfigError, match="method.groups"):
        Iciia(10, 2, groups=3)
    with pytest.raises(ConfigError, match="method.groups"):
        iciia_counts(1000, groups=256)
    with pytest.raises(ConfigError, match="method.heads"):
        IciiaLayer(10, heads=4)
    with pytest.raises(ConfigError, match="method.mixing"):
        IciiaLayer(16, mixing="mlp")
