"""CIFAR-100-C-style image corruptions in pure torch, for the personalization setting.

Re-implements, from scratch, seven of the common corruptions of Hendrycks & Dietterich (2019),
"Benchmarking Neural Network Robustness to Common Corruptions and Perturbations" (ICLR), with
the severity constants of their CIFAR-sized reference code. In the Accumulator paper's
personalization setting every client's local data gets one corruption kind at one severity
(0 = clean), assigned by :func:`assign_corruptions`; :func:`image_seed` gives each image its own
random stream, so a corrupted data set is reproducible image by image::

    g = torch.Generator().manual_seed(image_seed(seed, index))
    x_c = corrupt(x, kind, severity, generator=g)

``jpeg_compression`` is left out: torchvision's JPEG codec is unavailable next to the CPU build
of torch this project pins (see :mod:`fedadapt._compat`).

Audio (Speech Commands): the paper adds "60% background noise into each validation speaker"
(Sec. 5.2). ``background_noise`` (:func:`mix_background_noise`) adds a random one-second stretch
of one of the data set's background recordings, scaled by a ratio, to each clip: severity ``s``
is the ratio ``0.2 s`` (:data:`AUDIO_PARAMS`), so the paper's 60% is severity 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Optional

import numpy as np
import torch

from fedadapt.config import ConfigError

__all__ = ["AUDIO_CORRUPTIONS", "AUDIO_PARAMS", "CORRUPTIONS", "PARAMS", "assign_corruptions",
           "check_kinds", "corrupt", "corrupt_images", "image_seed", "mix_background_noise"]

#: Severity 1..5 parameter of each kind (the CIFAR constants of the reference code).
PARAMS: dict[str, tuple[float, ...]] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),  # noise std
    "shot_noise": (500, 250, 100, 75, 50),  # photons per unit intensity
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),  # salt-and-pepper fraction
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),  # sigma in pixels
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),  # factor towards the mean
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),  # added to HSV value
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),  # downsampling factor
}

CORRUPTIONS: tuple[str, ...] = tuple(PARAMS)

#: Audio kinds: severity 1..5 -> the factor a background recording is scaled by before it is
#: added to a clip (both in [-1, 1] full scale; the Accumulator paper's "60% background noise"
#: is severity 3).
AUDIO_PARAMS: dict[str, tuple[float, ...]] = {
    "background_noise": (0.2, 0.4, 0.6, 0.8, 1.0),
}
AUDIO_CORRUPTIONS: tuple[str, ...] = tuple(AUDIO_PARAMS)

MAX_SEVERITY = 5


def _check_kind(kind: str) -> None:
    if kind not in PARAMS and kind not in AUDIO_PARAMS:
        raise ConfigError(f"setting.corruptions={kind!r} is invalid: one of "
                          f"{CORRUPTIONS + AUDIO_CORRUPTIONS}")


def check_kinds(kinds: Sequence[str], modality: str, dataset: str) -> None:
    """Every kind of ``setting.corruptions`` applies to ``dataset``'s inputs (``image`` or
    ``audio``); one line naming the setting otherwise."""
    allowed = AUDIO_CORRUPTIONS if modality == "audio" else CORRUPTIONS
    wrong = [k for k in kinds if k not in allowed]
    if wrong:
        raise ConfigError(f"setting.corruptions={list(kinds)} is invalid for dataset={dataset} "
                          f"({modality}): {wrong} do not apply; use kinds of {list(allowed)}")


def _check_severity(severity: int, key: str = "severity") -> None:
    if (
        isinstance(severity, bool)
        or not isinstance(severity, (int, np.integer))
        or not (0 <= severity <= MAX_SEVERITY)
    ):
        raise ConfigError(f"{key}={severity!r} is invalid: an integer in 0..{MAX_SEVERITY}")


def _draw(
    draw: Callable[..., torch.Tensor], x: torch.Tensor, generator: Optional[torch.Generator]
) -> torch.Tensor:
    """Call ``draw(device=..., generator=...)`` on the generator's device, move the result to x."""
    device = generator.device if generator is not None else x.device
    return draw(device=device, generator=generator).to(x.device, x.dtype)


def _gaussian_noise(x: torch.Tensor, std: float, g: Optional[torch.Generator]) -> torch.Tensor:
    noise = _draw(lambda **kw: torch.randn(x.shape, dtype=torch.float32, **kw), x, g)
    return x + std * noise


def _shot_noise(x: torch.Tensor, photons: float, g: Optional[torch.Generator]) -> torch.Tensor:
    def draw(device, generator):
        rate = (x.detach().to(device, torch.float32).clamp(0, 1)) * photons
        return torch.poisson(rate, generator=generator)

    return _draw(draw, x, g) / photons


def _impulse_noise(x: torch.Tensor, amount: float, g: Optional[torch.Generator]) -> torch.Tensor:
    # Salt and pepper on each value independently, half each (as skimage's random_noise "s&p").
    u = _draw(lambda **kw: torch.rand((2, *x.shape), dtype=torch.float32, **kw), x, g)
    flipped, salt = u[0] < amount, u[1] < 0.5
    out = x.masked_fill(flipped & salt, 1.0)
    return out.masked_fill(flipped & ~salt, 0.0)


def _blur_matrix(n: int, sigma: float, x: torch.Tensor) -> torch.Tensor:
    """``[n, n]`` 1-D Gaussian filter with reflect padding (``d c b | a b c d``) folded in."""
    radius = min(int(4.0 * sigma + 0.5), n - 1)  # scipy's truncate=4; one reflection suffices
    offsets = torch.arange(-radius, radius + 1)
    kernel = torch.exp(-0.5 * (offsets.double() / sigma) ** 2)
    src = torch.arange(n)[:, None] + offsets[None, :]
    src = torch.where(src < 0, -src, src)
    src = torch.where(src > n - 1, 2 * (n - 1) - src, src)
    weights = torch.zeros(n, n, dtype=torch.float64)
    weights.scatter_add_(1, src, (kernel / kernel.sum()).expand(n, -1))
    return weights.to(x.device, x.dtype)


def _gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    # Separable: rows then columns, as two small matrix products (cheaper than conv2d on CPU).
    h, w = x.shape[-2:]
    return _blur_matrix(h, sigma, x) @ x @ _blur_matrix(w, sigma, x).T


def _contrast(x: torch.Tensor, c: float) -> torch.Tensor:
    mean = x.mean(dim=(-2, -1), keepdim=True)  # per channel, as the reference (axis=(0, 1))
    return (x - mean) * c + mean


def _brightness(x: torch.Tensor, c: float) -> torch.Tensor:
    # Exact HSV value shift without a full RGB<->HSV round trip: with hue and saturation fixed,
    # RGB is proportional to V = max(R, G, B), so V -> min(V + c, 1) rescales all three channels;
    # a black pixel (V = 0, saturation 0 by convention) becomes grey c.
    v = x.amax(dim=-3, keepdim=True)
    v_new = (v + c).clamp(max=1.0)
    scale = v_new / v.clamp(min=torch.finfo(x.dtype).tiny)
    return torch.where(v > 0, x * scale, v_new.expand_as(x))


def _box_matrix(n: int, m: int, x: torch.Tensor) -> torch.Tensor:
    """``[m, n]`` weights of PIL's ``BOX`` resize from n to m pixels (nearest when m > n)."""
    scale = n / m
    width = max(scale, 1.0)
    centre = (torch.arange(m, dtype=torch.float64)[:, None] + 0.5) * scale
    t = (torch.arange(n, dtype=torch.float64)[None, :] + 0.5 - centre) / width
    weights = ((t > -0.5) & (t <= 0.5)).to(torch.float64)
    return (weights / weights.sum(dim=1, keepdim=True)).to(x.device, x.dtype)


def _pixelate(x: torch.Tensor, c: float) -> torch.Tensor:
    # Box down to int(c * size), box (= pixel-centre nearest) back up, as the reference's PIL.
    h, w = x.shape[-2:]
    sh, sw = max(1, int(h * c)), max(1, int(w * c))
    rows = _box_matrix(sh, h, x) @ _box_matrix(h, sh, x)
    cols = _box_matrix(sw, w, x) @ _box_matrix(w, sw, x)
    return rows @ x @ cols.T


def corrupt(
    image: torch.Tensor, kind: str, severity: int, generator: Optional[torch.Generator] = None
) -> torch.Tensor:
    """Apply one corruption at one severity.

    Parameters
    ----------
    image
        Float RGB image ``[3, H, W]`` or batch ``[B, 3, H, W]`` with values in [0, 1].
    kind
        One of :data:`CORRUPTIONS`.
    severity
        0 (clean: the input is returned unchanged, as a copy) to 5.
    generator
        Source of randomness for the noise kinds (the global torch RNG when None); the other
        kinds are deterministic.

    Returns
    -------
    torch.Tensor
        The corrupted image, same shape and dtype, clipped to [0, 1].

    Notes
    -----
    Parameters per severity are in :data:`PARAMS`: ``gaussian_noise`` adds N(0, std^2);
    ``shot_noise`` is Poisson(x * photons) / photons; ``impulse_noise`` sets a fraction of the
    values to 0 or 1; ``gaussian_blur`` is a separable Gaussian (radius 4 sigma, reflect
    padding); ``contrast`` is ``(x - mean) * c + mean`` with the per-channel mean over the image;
    ``brightness`` adds c to the HSV value channel (computed exactly, see ``_brightness``);
    ``pixelate`` downsamples to ``int(c * size)`` with PIL's box filter, then upsamples with
    pixel-centre aligned nearest neighbour (PIL's ``BOX`` both ways, as the reference).
    """
    _check_kind(kind)
    _check_severity(severity)
    if not torch.is_tensor(image) or not image.is_floating_point():
        raise ValueError("corrupt: image must be a floating-point tensor with values in [0, 1]")
    if image.dim() not in (3, 4) or image.shape[-3] != 3:
        raise ValueError(f"corrupt: image must be [3, H, W] or [B, 3, H, W], got {image.shape}")
    if severity == 0:
        return image.clone()
    p = PARAMS[kind][severity - 1]
    x = image if image.dtype in (torch.float32, torch.float64) else image.float()
    if kind == "gaussian_noise":
        out = _gaussian_noise(x, p, generator)
    elif kind == "shot_noise":
        out = _shot_noise(x, p, generator)
    elif kind == "impulse_noise":
        out = _impulse_noise(x, p, generator)
    elif kind == "gaussian_blur":
        out = _gaussian_blur(x, p)
    elif kind == "contrast":
        out = _contrast(x, p)
    elif kind == "brightness":
        out = _brightness(x, p)
    else:
        out = _pixelate(x, p)
    return out.clamp(0.0, 1.0).to(image.dtype)


NOISE_KINDS = ("gaussian_noise", "shot_noise", "impulse_noise")


def corrupt_images(images: np.ndarray, kind: str, severity: int, seed: int,
                   indices: np.ndarray) -> np.ndarray:
    """Corrupt decoded images as the reference data sets are made: at native resolution (e.g.
    32x32 CIFAR images, as Hendrycks & Dietterich define CIFAR-100-C), then stored as bytes.

    ``images`` is ``uint8 [B, H, W, C]`` (C = 1 grey, expanded to RGB), ``indices`` the images'
    indices in their split: image ``i`` draws its noise from its own generator seeded with
    ``image_seed(seed, indices[i])``, so a corrupted image is the same whichever batch it is in.
    Returns ``uint8 [B, H, W, 3]``.
    """
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float().div_(255.0)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if kind in NOISE_KINDS and severity > 0:  # per-image streams (once per image and client)
        out = torch.stack([corrupt(img, kind, severity, torch.Generator().manual_seed(
            image_seed(seed, int(i)))) for img, i in zip(x, indices)]) if len(x) else x
    else:
        out = corrupt(x, kind, severity)
    return out.mul_(255.0).round_().clamp_(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def mix_background_noise(waves: Sequence[np.ndarray], kind: str, severity: int, seed: int,
                         indices: np.ndarray, noise: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Add background noise to clips: ``clip + r * noise[o : o + len(clip)]``, clipped to
    [-1, 1], with ``r = AUDIO_PARAMS[kind][severity - 1]``.

    Parameters
    ----------
    waves
        Clips, ``float32 [samples]`` each, in [-1, 1].
    kind, severity
        ``background_noise`` and 0 (clean: copies returned) to 5.
    seed, indices
        Clip ``indices[i]`` draws its recording and offset ``o`` from its own generator,
        ``image_seed(seed, indices[i])``: the same noise whichever batch it is in.
    noise
        The background recordings (Speech Commands' ``_background_noise_``), each at least as
        long as the clips it is mixed into (a shorter one is tiled).
    """
    if kind not in AUDIO_PARAMS:
        raise ConfigError(f"setting.corruptions={kind!r} is invalid for audio: one of "
                          f"{AUDIO_CORRUPTIONS}")
    _check_severity(severity)
    if severity == 0:
        return [np.array(w, dtype=np.float32, copy=True) for w in waves]
    ratio = AUDIO_PARAMS[kind][severity - 1]
    out = []
    for w, i in zip(waves, indices):
        rng = np.random.default_rng(image_seed(seed, int(i)))
        rec = noise[int(rng.integers(len(noise)))]
        if len(rec) < len(w):
            rec = np.tile(rec, -(-len(w) // max(len(rec), 1)))
        start = int(rng.integers(len(rec) - len(w) + 1))
        out.append(np.clip(w + ratio * rec[start:start + len(w)], -1.0, 1.0).astype(np.float32))
    return out


def assign_corruptions(
    num_clients: int,
    seed: int,
    kinds: Sequence[str] = CORRUPTIONS,
    severities: Sequence[int] = (0, 1, 2, 3, 4, 5),
) -> list[tuple[str, int]]:
    """Give every client one ``(kind, severity)``, seeded and balanced.

    Clients are put in a seeded random order and the kinds cycle over it, so the counts per kind
    differ by at most one; the severities cycle the same way over an independent order.

    Parameters
    ----------
    num_clients
        Number of clients (>= 1).
    seed
        Seed of ``numpy.random.default_rng``; the same ``(num_clients, seed, kinds, severities)``
        always gives the same list.
    kinds, severities
        What to assign (``setting.corruptions`` / ``setting.severities``).

    Returns
    -------
    list of (str, int)
        Entry ``i`` is client ``i``'s corruption kind and severity.
    """
    if num_clients < 1:
        raise ConfigError(f"partition.num_clients={num_clients!r} is invalid: must be >= 1")
    kinds, severities = list(kinds), list(severities)
    if not kinds:
        raise ConfigError(f"setting.corruptions={kinds!r} is invalid: must not be empty")
    for kind in kinds:
        _check_kind(kind)
    if not severities:
        raise ConfigError(f"setting.severities={severities!r} is invalid: must not be empty")
    for severity in severities:
        _check_severity(severity, key="setting.severities")
    rng = np.random.default_rng(seed)
    kind_order, severity_order = rng.permutation(num_clients), rng.permutation(num_clients)
    out_kinds: list[str] = [""] * num_clients
    out_severities: list[int] = [0] * num_clients
    for rank in range(num_clients):
        out_kinds[kind_order[rank]] = kinds[rank % len(kinds)]
        out_severities[severity_order[rank]] = int(severities[rank % len(severities)])
    return list(zip(out_kinds, out_severities))


def image_seed(seed: int, index: int) -> int:
    """A seed for image ``index``'s generator, independent across indices (``SeedSequence``)."""
    if seed < 0 or index < 0:
        raise ValueError(f"image_seed: seed and index must be >= 0, got {seed}, {index}")
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0])
