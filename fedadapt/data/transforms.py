"""Image transforms as batched tensor operations on the model's device.

Images are stored decoded as ``uint8`` (:mod:`fedadapt.data.store`); every transform below takes a
batch ``[B, H, W, C]`` of them (``C`` = 1 or 3) already on the device and returns the model's
input ``[B, 3, S, S]``. No PIL and no per-image Python work runs in a training or evaluation loop.

* **Evaluation** (:meth:`Preprocess.apply`): resize the shortest side to ``resize`` and centre-crop
  ``size`` x ``size`` with the backbone's own interpolation (CLIP: bicubic, ``resize = size``, as
  open_clip's preprocess; DeiT: bicubic 256 then crop 224, as its image processor), clamp to
  [0, 1] (PIL works on bytes), normalise. The resize is ``torch.nn.functional.interpolate`` with
  ``antialias=True``, whose kernels are PIL's (bicubic ``a = -0.5``, support scaled when
  shrinking): ``tests/test_transforms.py`` bounds the difference to PIL and to open_clip's and
  transformers' preprocessing.
* **Training augmentation** (:func:`random_resized_crop`): torchvision's
  ``RandomResizedCrop(size, scale, ratio=(3/4, 4/3))`` drawn per image, applied to the stored image
  and resized straight to ``size`` with bilinear interpolation (torchvision's default), as
  torchvision's crop-then-resize does (samples never reach outside the crop box). Every box is
  drawn from a counter-based hash of ``(seed, image index)`` (:func:`hash_uniform`), so a crop is
  the same run to run and whichever batch or group the image travels in. The boxes of a batch
  become two resampling matrices per image (:func:`resample_matrix`), applied as batched matmuls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import numpy as np
import torch
import torch.nn.functional as F

from fedadapt.config import ConfigError

INTERPOLATIONS = ("bilinear", "bicubic")


@dataclass(frozen=True)
class Preprocess:
    """How a backbone wants its images (picklable; part of the feature-cache key).

    Parameters
    ----------
    size : int
        The model's input ``S`` (square).
    resize : int
        Shortest side before the centre crop (``size / crop_pct``); ``resize == size`` crops only
        non-square images.
    interpolation : str
        ``bicubic`` or ``bilinear`` (PIL's kernels, antialiased when shrinking).
    mean, std : tuple of float
        Per-channel normalisation of the [0, 1] image.
    """

    modality: ClassVar[str] = "image"
    size: int
    resize: int
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def for_backbone(cls, backbone) -> "Preprocess":
        size = int(backbone.image_size)
        crop_pct = float(getattr(backbone, "crop_pct", 1.0))
        interpolation = str(getattr(backbone, "interpolation", "bilinear"))
        if interpolation not in INTERPOLATIONS:
            raise ConfigError(f"backbone.interpolation={interpolation!r} is invalid: one of "
                              f"{INTERPOLATIONS}")
        if not 0 < crop_pct <= 1:
            raise ConfigError(f"backbone.crop_pct={crop_pct} is invalid: must be in (0, 1]")
        return cls(size=size, resize=int(math.floor(size / crop_pct)),
                   interpolation=interpolation, mean=tuple(map(float, backbone.mean)),
                   std=tuple(map(float, backbone.std)))

    def apply(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8 [B, H, W, C]`` -> normalised ``float32 [B, 3, S, S]`` on the same device."""
        return self.normalize(self.resized(images))

    def resized_bytes(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8 [B, H, W, C]`` -> the resized and centre-cropped ``uint8 [B, S, S, C]``:
        every resampling pass is rounded to bytes (as PIL stores it), so ``apply(images)`` is
        ``normalize(to_float(resized_bytes(images)))`` to the bit. What a source keeps per row
        to resize each image once (:mod:`fedadapt.data.sources`)."""
        x = self.resized(images).mul(255.0).round_().to(torch.uint8)
        return x.permute(0, 2, 3, 1).contiguous()

    def resized(self, images: torch.Tensor) -> torch.Tensor:
        """``uint8 [B, H, W, C]`` -> resized and centre-cropped ``float32 [B, C, S, S]`` in
        [0, 1], on the byte grid."""
        x = to_float(images)
        h, w = x.shape[-2:]
        # torchvision's Resize(int) and transformers' processors: the long side truncated
        new_h, new_w = (self.resize, self.resize) if h == w else (
            (self.resize, int(self.resize * w / h)) if h < w
            else (int(self.resize * h / w), self.resize))
        # PIL resizes the width, then the height, each pass rounded and clipped to bytes
        if new_w != w:
            x = _quantize(F.interpolate(x, size=(h, new_w), mode=self.interpolation,
                                        align_corners=False, antialias=True))
        if new_h != h:
            x = _quantize(F.interpolate(x, size=(new_h, new_w), mode=self.interpolation,
                                        align_corners=False, antialias=True))
        return center_crop(x, self.size)

    def crop(self, images: torch.Tensor, scale: tuple[float, float], seeds: np.ndarray,
             indices: np.ndarray) -> torch.Tensor:
        """Training input: :func:`random_resized_crop` of ``uint8 [B, H, W, C]`` images."""
        return random_resized_crop(images, self, scale, seeds, indices)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """``(x - mean) / std`` of ``[B, C, H, W]`` in [0, 1] as one fused pass into a new
        contiguous ``[B, 3, H, W]`` (a grey image, C = 1, becomes RGB as PIL's
        ``convert("RGB")``, then per-channel normalised). The scale and shift are made once
        per device and dtype: making them took as long as the pass itself on a batch of 32
        small images."""
        key = (self.mean, self.std, x.device, x.dtype)
        if key not in _NORMALIZERS:
            scale = 1.0 / torch.tensor(self.std, device=x.device, dtype=x.dtype).view(1, 3, 1, 1)
            shift = -torch.tensor(self.mean, device=x.device, dtype=x.dtype).view(1, 3, 1,
                                                                                 1) * scale
            _NORMALIZERS[key] = (scale, shift)
        scale, shift = _NORMALIZERS[key]
        return torch.addcmul(shift, x, scale)


#: :meth:`Preprocess.normalize`'s ``(scale, shift)`` by ``(mean, std, device, dtype)``.
_NORMALIZERS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def to_float(images: torch.Tensor) -> torch.Tensor:
    """``uint8 [B, H, W, C]`` -> ``float32 [B, C, H, W]`` in [0, 1] (C = 1 stays grey: resampling
    one channel is a third of the work; :meth:`Preprocess.normalize` expands it)."""
    return images.permute(0, 3, 1, 2).float().div_(255.0)


def _quantize(x: torch.Tensor) -> torch.Tensor:
    """Round to the byte grid and clip, as PIL stores each resampling pass."""
    return x.mul_(255.0).round_().clamp_(0.0, 255.0).div_(255.0)


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    """torchvision's ``center_crop`` (offsets ``round((H - S) / 2)``) of ``[B, C, H, W]``."""
    h, w = x.shape[-2:]
    if (h, w) == (size, size):
        return x
    if h < size or w < size:
        raise ValueError(f"center_crop: {h}x{w} image smaller than {size}")
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return x[..., top:top + size, left:left + size]


# -- resampling matrices (PIL's separable filters) --------------------------------------------

def _kernel(name: str, t: torch.Tensor) -> torch.Tensor:
    t = t.abs()
    if name == "bilinear":
        return (1.0 - t).clamp(min=0.0)
    a = -0.5  # PIL's bicubic
    near = ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
    far = (((t - 5.0) * t + 8.0) * t - 4.0) * a
    return torch.where(t < 1.0, near, torch.where(t < 2.0, far, torch.zeros_like(t)))


def resample_matrix(n_in: int, n_out: int, start: torch.Tensor, length: torch.Tensor,
                    kernel: str = "bilinear") -> torch.Tensor:
    """Weights ``[B, n_out, n_in]`` that resample the window ``[start, start + length)`` of a
    length-``n_in`` axis to ``n_out`` samples, as PIL's resampling does (antialiased: the kernel
    widens by the scale when shrinking; rows renormalised). Taps are confined to the window
    (torchvision's crop-then-resize); ``start``/``length`` are integer tensors ``[B]``."""
    dev = start.device
    start, length = start.to(torch.float32), length.to(torch.float32)
    scale = (length / n_out)[:, None, None]  # [B, 1, 1]
    support_scale = scale.clamp(min=1.0)
    support = (1.0 if kernel == "bilinear" else 2.0) * support_scale
    centre = start[:, None, None] + (torch.arange(n_out, device=dev, dtype=torch.float32)
                                     [None, :, None] + 0.5) * scale  # [B, n_out, 1]
    src = torch.arange(n_in, device=dev, dtype=torch.float32)[None, None, :]  # [1, 1, n_in]
    lo = torch.maximum(torch.floor(centre - support + 0.5), start[:, None, None])
    hi = torch.minimum(torch.floor(centre + support + 0.5), (start + length)[:, None, None])
    weights = _kernel(kernel, (src - centre + 0.5) / support_scale)
    weights = weights * ((src >= lo) & (src < hi))
    return weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-12)


def resample_boxes(x: torch.Tensor, boxes: torch.Tensor, size: int,
                   kernel: str = "bilinear") -> torch.Tensor:
    """Crop box ``i`` (``[top, left, height, width]``, integers) of image ``i`` of ``x``
    (``[B, C, H, W]``) and resize it to ``size`` x ``size``: two batched matmuls."""
    h, w = x.shape[-2:]
    rows = resample_matrix(h, size, boxes[:, 0], boxes[:, 2], kernel).to(x.dtype)
    cols = resample_matrix(w, size, boxes[:, 1], boxes[:, 3], kernel).to(x.dtype)
    return rows[:, None] @ x @ cols[:, None].transpose(-1, -2)


# -- seeded crops -----------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hash_uniform(seeds: np.ndarray, indices: np.ndarray, draws: int) -> np.ndarray:
    """``[N, draws]`` uniforms in [0, 1) from a counter-based hash (splitmix64) of each
    ``(seed, index)`` pair: image ``index`` draws the same numbers under ``seed`` whatever batch
    it is in and on whichever machine."""
    seeds = np.broadcast_to(np.asarray(seeds, dtype=np.uint64), np.shape(indices))
    key = _splitmix64(_splitmix64(seeds.astype(np.uint64)) ^ np.asarray(indices, np.uint64))
    with np.errstate(over="ignore"):
        counters = key[:, None] + np.arange(1, draws + 1, dtype=np.uint64)[None, :] * _GOLDEN
    return (_splitmix64(counters) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def crop_boxes(height: int, width: int, scale: tuple[float, float], seeds: np.ndarray,
               indices: np.ndarray, tries: int = 10) -> np.ndarray:
    """torchvision's ``RandomResizedCrop.get_params`` (area ``scale``, aspect ratio in
    [3/4, 4/3] log-uniform, ten tries, then the central crop) for every image at once:
    ``[N, 4]`` int64 boxes ``[top, left, height, width]``."""
    n = len(indices)
    u = hash_uniform(seeds, indices, 4 * tries).reshape(n, tries, 4)
    area = height * width * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    lo, hi = math.log(3 / 4), math.log(4 / 3)
    ratio = np.exp(lo + (hi - lo) * u[..., 1])
    w = np.rint(np.sqrt(area * ratio)).astype(np.int64)  # Python's round: half to even
    h = np.rint(np.sqrt(area / ratio)).astype(np.int64)
    ok = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    first = np.where(ok.any(axis=1), ok.argmax(axis=1), -1)
    rows = np.arange(n)
    pick = np.maximum(first, 0)
    h, w = h[rows, pick], w[rows, pick]
    top = np.floor(u[rows, pick, 2] * (height - h + 1)).astype(np.int64)
    left = np.floor(u[rows, pick, 3] * (width - w + 1)).astype(np.int64)
    # no try fitted: torchvision's fallback, the whole image clipped to the ratio range
    fh, fw = _fallback_box(height, width)
    miss = first < 0
    h[miss], w[miss] = fh, fw
    top[miss], left[miss] = (height - fh) // 2, (width - fw) // 2
    return np.stack([top, left, h, w], axis=1)


def _fallback_box(height: int, width: int) -> tuple[int, int]:
    in_ratio = width / height
    if in_ratio < 3 / 4:
        return int(round(width / (3 / 4))), width
    if in_ratio > 4 / 3:
        return height, int(round(height * (4 / 3)))
    return height, width


def random_resized_crop(images: torch.Tensor, preprocess: Preprocess, scale: tuple[float, float],
                        seeds: np.ndarray, indices: np.ndarray) -> torch.Tensor:
    """Training input: ``uint8 [B, H, W, C]`` -> a seeded ``RandomResizedCrop(S, scale)`` of each
    image, bilinear, normalised ``float32 [B, 3, S, S]``. Bilinear weights are convex, so the
    normalisation commutes with the resampling: an RGB image is normalised at its native size
    (cheap) and resampled once into the output; a grey one is resampled on its one channel and
    normalised into three."""
    x = to_float(images)
    boxes = torch.from_numpy(crop_boxes(x.shape[-2], x.shape[-1], scale, seeds, indices))
    boxes = boxes.to(x.device)
    if x.shape[1] == 1:
        return preprocess.normalize(resample_boxes(x, boxes, preprocess.size, "bilinear"))
    return resample_boxes(preprocess.normalize(x), boxes, preprocess.size, "bilinear")


def model_input(images: torch.Tensor, preprocess: Preprocess,
                crop: Optional[tuple[tuple[float, float], np.ndarray, np.ndarray]] = None
                ) -> torch.Tensor:
    """Evaluation transform, or with ``crop = (scale, seeds, indices)`` the training crop (of
    images, or of spectrograms with :class:`fedadapt.data.audio.AudioPreprocess`)."""
    if crop is None:
        return preprocess.apply(images)
    return preprocess.crop(images, *crop)
