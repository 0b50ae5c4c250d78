"""CIFAR-100-C-style corruptions: shapes and ranges, severity ordering, seeding, client assignment,
and agreement with the reference operations (scipy's Gaussian filter, colorsys' HSV, PIL's BOX)."""

from __future__ import annotations

import colorsys
from collections import Counter

import numpy as np
import pytest
import torch

import fedadapt  # noqa: F401  (torchvision shim)
from fedadapt.config import ConfigError
from fedadapt.data.corruptions import (
    CORRUPTIONS,
    PARAMS,
    assign_corruptions,
    corrupt,
    image_seed,
)

NOISE = ("gaussian_noise", "shot_noise", "impulse_noise")
DETERMINISTIC = tuple(k for k in CORRUPTIONS if k not in NOISE)
SPATIAL = ("gaussian_blur", "pixelate")


def random_images(n: int = 4, size: int = 32, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.rand(n, 3, size, size, generator=g, dtype=dtype)


def textured_images(n: int = 4, size: int = 32) -> torch.Tensor:
    """Sinusoidal stripes at a few frequencies and orientations, with a random phase."""
    g = torch.Generator().manual_seed(99)
    coords = torch.arange(size, dtype=torch.float32) / size
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    freq = torch.randint(1, 5, (n, 3, 2), generator=g).float()
    phase = 2 * torch.pi * torch.rand(n, 3, 1, 1, generator=g)
    wave = freq[..., 0, None, None] * xx + freq[..., 1, None, None] * yy
    return 0.5 + 0.5 * torch.sin(2 * torch.pi * wave + phase)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = 1e-6) -> None:
    # (torch.testing.assert_close costs a second of lazy imports on its first call)
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.allclose(actual, expected, rtol=0, atol=atol), (actual - expected).abs().max()


def test_constants():
    expected = {
        "gaussian_noise",
        "shot_noise",
        "impulse_noise",
        "gaussian_blur",
        "contrast",
        "brightness",
        "pixelate",
    }
    assert expected <= set(CORRUPTIONS)
    assert all(len(PARAMS[k]) == 5 for k in CORRUPTIONS)
    assert PARAMS["gaussian_noise"] == (0.04, 0.06, 0.08, 0.09, 0.10)
    assert PARAMS["pixelate"] == (0.95, 0.9, 0.85, 0.75, 0.65)


@pytest.mark.parametrize("kind", CORRUPTIONS)
@pytest.mark.parametrize(
    "shape, dtype",
    [((3, 32, 32), torch.float32), ((2, 3, 16, 24), torch.float64), ((3, 32, 32), torch.float16)],
)
def test_shape_dtype_range(kind, shape, dtype):
    image = torch.rand(shape, generator=gen(0)).to(dtype)
    for severity in range(6):
        out = corrupt(image, kind, severity, generator=gen(severity))
        assert out.shape == image.shape
        assert out.dtype == image.dtype
        assert out.min() >= 0 and out.max() <= 1
        assert torch.isfinite(out).all()
        if severity > 0:
            assert not torch.equal(out, image), (kind, severity)


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_severity_zero_is_identity(kind):
    image = random_images(2)
    out = corrupt(image, kind, 0, generator=gen(0))
    assert torch.equal(out, image)
    assert out is not image  # a copy: changing it must not change the caller's data
    out.zero_()
    assert image.sum() > 0


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_higher_severity_moves_further(kind):
    clean = textured_images() if kind in SPATIAL else random_images()
    dist = [
        (corrupt(clean, kind, s, generator=gen(7)) - clean).abs().mean().item() for s in range(1, 6)
    ]
    assert all(a < b for a, b in zip(dist, dist[1:])), (kind, dist)
    assert dist[0] > 0


@pytest.mark.parametrize("kind", NOISE)
def test_noise_is_seeded_by_the_generator_only(kind):
    image = random_images(1)[0]
    state = torch.get_rng_state()
    a = corrupt(image, kind, 3, generator=gen(5))
    b = corrupt(image, kind, 3, generator=gen(5))
    c = corrupt(image, kind, 3, generator=gen(6))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is untouched


@pytest.mark.parametrize("kind", DETERMINISTIC)
def test_deterministic_kinds_ignore_generator_and_work_per_image(kind):
    images = random_images(3)
    batch = corrupt(images, kind, 4, generator=gen(1))
    assert torch.equal(batch, corrupt(images, kind, 4, generator=gen(2)))
    for i in range(3):  # each image of a batch is corrupted on its own (e.g. its own mean)
        assert_close(batch[i], corrupt(images[i], kind, 4))


def test_gaussian_noise_std():
    grey = torch.full((3, 64, 64), 0.5)
    for severity, std in enumerate(PARAMS["gaussian_noise"], 1):
        diff = corrupt(grey, "gaussian_noise", severity, generator=gen(severity)) - grey
        assert diff.mean().abs() < 0.01
        assert diff.std().item() == pytest.approx(std, rel=0.05)


def test_shot_noise_is_poisson():
    grey = torch.full((3, 64, 64), 0.4)
    for severity, photons in enumerate(PARAMS["shot_noise"], 1):
        out = corrupt(grey, "shot_noise", severity, generator=gen(severity))
        counts = out * photons
        assert_close(counts, counts.round(), atol=1e-3)  # whole photons
        assert out.mean().item() == pytest.approx(0.4, abs=0.01)
        assert out.var().item() == pytest.approx(0.4 / photons, rel=0.1)


def test_impulse_noise_salt_and_pepper():
    grey = torch.full((3, 96, 96), 0.5)
    for severity, amount in enumerate(PARAMS["impulse_noise"], 1):
        out = corrupt(grey, "impulse_noise", severity, generator=gen(severity))
        changed = out != 0.5
        assert set(out[changed].unique().tolist()) == {0.0, 1.0}
        sd = (amount * (1 - amount) / grey.numel()) ** 0.5  # binomial: allow 4 sd
        assert changed.float().mean().item() == pytest.approx(amount, abs=4 * sd)
        salt = (out == 1).float().sum() / changed.sum()
        assert abs(salt.item() - 0.5) < 4 * (0.25 / changed.sum().item()) ** 0.5


def test_contrast_formula():
    image = random_images(1)[0]
    mean = image.mean(dim=(1, 2), keepdim=True)
    for severity, c in enumerate(PARAMS["contrast"], 1):
        assert_close(corrupt(image, "contrast", severity), (image - mean) * c + mean)


def test_brightness_matches_hsv_value_shift():
    image = random_images(1, size=8, dtype=torch.float64)[0]
    image[:, 0, 0] = 0.0  # black pixel: becomes grey
    image[:, 0, 1] = torch.tensor([0.95, 0.2, 0.1])  # saturates at V = 1
    pixels = image.reshape(3, -1).T.tolist()
    for severity, c in enumerate(PARAMS["brightness"], 1):
        expected = []
        for rgb in pixels:
            h, s, v = colorsys.rgb_to_hsv(*rgb)
            expected.append(colorsys.hsv_to_rgb(h, s, min(v + c, 1.0)))
        expected = torch.tensor(expected, dtype=torch.float64).T.reshape(image.shape)
        assert_close(corrupt(image, "brightness", severity), expected)


def test_gaussian_blur_matches_scipy():
    ndimage = pytest.importorskip("scipy.ndimage")
    image = random_images(1, dtype=torch.float64)[0]
    for severity, sigma in enumerate(PARAMS["gaussian_blur"], 1):
        # torch's "reflect" padding is scipy's "mirror"; truncate=4 is scipy's default.
        expected = ndimage.gaussian_filter(image.numpy(), sigma=(0, sigma, sigma), mode="mirror")
        assert_close(corrupt(image, "gaussian_blur", severity), torch.from_numpy(expected))


def test_pixelate_matches_pil_box():
    pil = pytest.importorskip("PIL.Image")
    image = torch.randint(0, 256, (3, 32, 40), generator=gen(3)).float() / 255
    img = pil.fromarray((image.permute(1, 2, 0) * 255).round().byte().numpy())
    for severity, c in enumerate(PARAMS["pixelate"], 1):
        small = img.resize((int(40 * c), int(32 * c)), pil.BOX)
        expected = np.asarray(small.resize((40, 32), pil.BOX), dtype=np.float32) / 255
        out = corrupt(image, "pixelate", severity).permute(1, 2, 0).numpy()
        assert np.abs(out - expected).max() <= 1.01 / 255  # PIL rounds to uint8 in between


def test_image_seed():
    assert image_seed(0, 5) == image_seed(0, 5)
    seeds = {image_seed(s, i) for s in range(3) for i in range(100)}
    assert len(seeds) == 300
    assert all(isinstance(s, int) and 0 <= s < 2**32 for s in seeds)


@pytest.mark.parametrize("num_clients", [1, 7, 10, 23, 100])
def test_assign_corruptions_balanced_and_deterministic(num_clients):
    first = assign_corruptions(num_clients, seed=3)
    assert first == assign_corruptions(num_clients, seed=3)
    assert len(first) == num_clients
    kinds = Counter(k for k, _ in first)
    severities = Counter(s for _, s in first)
    assert set(kinds) <= set(CORRUPTIONS) and set(severities) <= set(range(6))
    if num_clients >= len(CORRUPTIONS):
        assert set(kinds) == set(CORRUPTIONS)
    if num_clients >= 6:
        assert set(severities) == set(range(6))
    kind_counts = [kinds.get(k, 0) for k in CORRUPTIONS]
    severity_counts = [severities.get(s, 0) for s in range(6)]
    assert max(kind_counts) - min(kind_counts) <= 1
    assert max(severity_counts) - min(severity_counts) <= 1
    assert all(isinstance(k, str) and type(s) is int for k, s in first)


def test_assign_corruptions_seed_and_subsets():
    assert assign_corruptions(20, seed=0) != assign_corruptions(20, seed=1)
    chosen = assign_corruptions(9, seed=0, kinds=["contrast", "pixelate"], severities=[2, 5])
    assert Counter(k for k, _ in chosen) in (
        Counter(contrast=5, pixelate=4),
        Counter(contrast=4, pixelate=5),
    )
    assert {s for _, s in chosen} == {2, 5}


def test_bad_kind_names_the_key_and_the_known_kinds():
    with pytest.raises(ConfigError, match="setting.corruptions") as err:
        corrupt(random_images(1)[0], "fog", 1)
    assert all(kind in str(err.value) for kind in CORRUPTIONS)
    with pytest.raises(ConfigError, match="setting.corruptions"):
        assign_corruptions(4, seed=0, kinds=["gaussian_noise", "snow"])
    with pytest.raises(ConfigError, match="setting.corruptions"):
        assign_corruptions(4, seed=0, kinds=[])


@pytest.mark.parametrize("severity", [-1, 6, 2.0, True])
def test_bad_severity_names_the_key(severity):
    with pytest.raises(ConfigError, match="severity"):
        corrupt(random_images(1)[0], "contrast", severity)
    with pytest.raises(ConfigError, match="setting.severities"):
        assign_corruptions(4, seed=0, severities=[0, severity])


def test_bad_image_is_rejected():
    with pytest.raises(ValueError, match="floating-point"):
        corrupt(torch.zeros(3, 8, 8, dtype=torch.uint8), "contrast", 1)
    with pytest.raises(ValueError, match=r"\[3, H, W\]"):
        corrupt(torch.zeros(1, 8, 8), "contrast", 1)
