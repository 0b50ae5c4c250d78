"""Audio clips as an audio backbone's input: spectrograms computed once, stored like images.

The AST recipe (Gong et al. 2021, "AST: Audio Spectrogram Transformer"), as the Accumulator
paper uses AST for Speech Commands v2 (``shared/papers/accumulator-anytime-fl.txt``, Sec. 5.1):
every clip becomes a 128-bin log-mel filterbank (25 ms Hann windows every 10 ms), padded or cut to
the backbone's ``max_length`` frames and normalised as ``(fbank - mean) / (2 std)``. That is
``transformers.ASTFeatureExtractor``, used as it is (its numpy filterbank where torchaudio is
absent; which one ran is part of the store key).

* :class:`AudioPreprocess` holds the extractor's settings (from the backbone, like
  :class:`fedadapt.data.transforms.Preprocess` for images) and turns stored rows into the model's
  input on the device (``float32 [B, T, F]``); with ``train.crop_scale`` it applies the
  Accumulator paper's ``RandomResizedCrop`` to the spectrogram as to an image (seeded per clip,
  bilinear, back to ``T x F``).
* :func:`spectrogram_store`: every clip of a prepared split through the extractor once, into a
  memory-mapped ``float16 [N, T, F]`` array (32 KiB per clip at 128 x 128) built and sealed by
  :func:`fedadapt.data.store.build_sealed`, keyed by the data's fingerprint, the split and the
  extractor's settings. No training or evaluation loop runs per-clip Python.
* :func:`corrupted_spectrograms`: the personalization setting's background noise
  (:func:`fedadapt.data.corruptions.mix_background_noise`) mixed into a client's clips, then
  through the same extractor, once per process and client.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar, Optional, Sequence

import numpy as np
import torch

from fedadapt.config import ConfigError
from fedadapt.data.loading import PreparedDataset
from fedadapt.log import log

_VERSION = 1
#: Stored precision: float16 keeps ~3 significant digits of the normalised filterbank (values
#: of order 1), finer than the bf16 the backbone runs in on a GPU; half the bytes of float32.
STORE_DTYPE = np.float16


def _fbank_backend() -> str:
    """Which filterbank ``ASTFeatureExtractor`` computes here: torchaudio's Kaldi one when
    torchaudio imports, else its numpy one (they differ slightly, so it is part of the key)."""
    from transformers.utils import is_speech_available

    return "torchaudio" if is_speech_available() else "numpy"


@dataclass(frozen=True)
class AudioPreprocess:
    """How an audio backbone wants its input (picklable; part of the store and feature keys).

    Parameters
    ----------
    sampling_rate : int
        Hz of the clips (16,000 for Speech Commands).
    num_mel_bins, max_length : int
        Mel bins ``F`` and frames ``T`` of a spectrogram (AST's Speech Commands setting: 128 and
        128, i.e. 1.28 s at a 10 ms hop).
    mean, std : float
        Normalisation of the log-mel values (AST's Speech Commands statistics: -6.845978 and
        5.5654526).
    backend : str
        ``numpy`` or ``torchaudio`` (see :func:`_fbank_backend`).
    """

    modality: ClassVar[str] = "audio"
    sampling_rate: int
    num_mel_bins: int
    max_length: int
    mean: float
    std: float
    backend: str

    @classmethod
    def for_backbone(cls, backbone) -> "AudioPreprocess":
        return cls(sampling_rate=int(backbone.sampling_rate),
                   num_mel_bins=int(backbone.num_mel_bins), max_length=int(backbone.max_length),
                   mean=float(backbone.feature_mean), std=float(backbone.feature_std),
                   backend=_fbank_backend())

    def extractor(self):
        """``transformers.ASTFeatureExtractor`` with these settings."""
        import warnings

        from transformers import ASTFeatureExtractor

        with warnings.catch_warnings():  # 128 mel bins over a 512-point FFT: AST's own setting
            warnings.filterwarnings("ignore", message="At least one mel filter")
            return ASTFeatureExtractor(sampling_rate=self.sampling_rate,
                                       num_mel_bins=self.num_mel_bins,
                                       max_length=self.max_length, mean=self.mean, std=self.std,
                                       do_normalize=True)

    def features(self, waves: Sequence[np.ndarray]) -> np.ndarray:
        """Waveforms (``float32 [samples]`` each, in [-1, 1]) -> ``float32 [B, T, F]``."""
        if not len(waves):
            return np.zeros((0, self.max_length, self.num_mel_bins), np.float32)
        out = self.extractor()(list(waves), sampling_rate=self.sampling_rate,
                               return_tensors="np")
        return np.asarray(out["input_values"], dtype=np.float32)

    def apply(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored ``[B, T, F]`` rows (on the device) -> the model's ``float32 [B, T, F]``."""
        return rows.float().contiguous()

    def crop(self, rows: torch.Tensor, scale: tuple[float, float], seeds: np.ndarray,
             indices: np.ndarray) -> torch.Tensor:
        """``RandomResizedCrop(scale)`` of each spectrogram as an image (boxes drawn as
        torchvision draws them, from a hash of (seed, clip index)), resampled bilinearly back
        to ``T x F``: ``float32 [B, T, F]``."""
        from fedadapt.data.transforms import crop_boxes, resample_matrix

        x = self.apply(rows)  # [B, T, F]
        t, f = x.shape[-2:]
        boxes = torch.from_numpy(crop_boxes(t, f, scale, seeds, indices)).to(x.device)
        along_t = resample_matrix(t, t, boxes[:, 0], boxes[:, 2]).to(x.dtype)  # [B, T, T]
        along_f = resample_matrix(f, f, boxes[:, 1], boxes[:, 3]).to(x.dtype)  # [B, F, F]
        return along_t @ x @ along_f.transpose(-1, -2)


@dataclass(frozen=True)
class SpectrogramStore:
    """A sealed ``.npy`` of ``float16 [N, T, F]`` (picklable; Ray workers open it themselves)."""

    path: str
    shape: tuple[int, int, int]

    def array(self) -> np.ndarray:
        """The memory-mapped spectrograms, checked against their digest once per process."""
        from fedadapt.data.integrity import mapped

        return mapped(self.path, "spectrogram store")


def store_key(prepared: PreparedDataset, split: str, pre: AudioPreprocess) -> str:
    blob = json.dumps({"v": _VERSION, "data": prepared.fingerprint, "split": split,
                       "extractor": asdict(pre), "dtype": np.dtype(STORE_DTYPE).name},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def spectrogram_store(prepared: PreparedDataset, split: str, pre: AudioPreprocess,
                      cache_dir: str, *, workers: Optional[int] = None) -> SpectrogramStore:
    """The spectrograms of ``split`` (built once, or again when the file fails its digest)."""
    from fedadapt.data.integrity import valid_or_removed
    from fedadapt.data.store import DECODE_CHUNK, build_sealed

    folder = Path(cache_dir).expanduser() / "spectrograms"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{prepared.name}-{split}-{store_key(prepared, split, pre)}.npy"
    n = prepared.num_train if split == "train" else prepared.num_test
    shape = (n, pre.max_length, pre.num_mel_bins)
    if not valid_or_removed(path):
        if workers is None:  # ~20 ms of numpy per clip: worth processes beyond one chunk
            workers = 1 if n <= DECODE_CHUNK else min(16, os.cpu_count() or 1)
        log(f"[audio] {n} clips of {prepared.name}/{split} through ASTFeatureExtractor "
            f"({pre.max_length} x {pre.num_mel_bins}, {pre.backend}) once into {path.name} "
            f"({workers} process(es))")
        build_sealed(path, shape, STORE_DTYPE, _extract_chunk, (prepared.path, split, pre),
                     workers=workers, label=f"spectrograms {prepared.name}/{split}",
                     unit="clips")
    return SpectrogramStore(path=str(path), shape=shape)


def waveforms(data_path: str, split: str, rows: np.ndarray | range, rate: int
              ) -> list[np.ndarray]:
    """Decoded clips (``float32 [samples]``) of ``rows`` of a prepared split."""
    from fedadapt.data.loading import open_prepared
    from fedadapt.data.speech import audio_bytes, read_wav

    ds = open_prepared(data_path)[split]
    values = ds[rows.start:rows.stop]["audio"] if isinstance(rows, range) else \
        ds.select(np.asarray(rows, dtype=np.int64))["audio"]
    idx = list(rows)
    return [read_wav(audio_bytes(v, f"audio row {i} of {split}"), f"audio row {i} of {split} "
                     f"({v.get('path')})", rate) for i, v in zip(idx, values)]


def _extract_chunk(args) -> int:
    """Rows ``[a, b)`` of a split through the extractor into the store (runs in a worker)."""
    out_path, data_path, split, pre, a, b = args
    out = np.load(out_path, mmap_mode="r+")
    out[a:b] = pre.features(waveforms(data_path, split, range(a, b), pre.sampling_rate))
    out.flush()
    return b - a


# -- corruption (personalization) -------------------------------------------------------------

_NOISE: dict[str, list[np.ndarray]] = {}


def background_noise(prepared: PreparedDataset, rate: int) -> list[np.ndarray]:
    """The data set's background recordings (its ``noise`` split), decoded once per process."""
    from fedadapt.data.loading import open_prepared

    if prepared.path not in _NOISE:
        dsd = open_prepared(prepared.path)
        if "noise" not in dsd or len(dsd["noise"]) == 0:
            raise ConfigError(f"setting.corruptions=['background_noise'] needs background "
                              f"recordings: dataset={prepared.name} has none (its card keeps no "
                              f"'noise' split)")
        _NOISE[prepared.path] = waveforms(prepared.path, "noise", range(len(dsd["noise"])), rate)
    return _NOISE[prepared.path]


def corrupted_spectrograms(source, indices: np.ndarray) -> np.ndarray:
    """``float16 [B, T, F]``: clips ``indices`` of ``source``'s split with its corruption mixed
    into the waveform (each clip seeded by ``(source.corruption_seed, index)``), then through
    the source's extractor."""
    from fedadapt.data.corruptions import mix_background_noise

    pre = source.preprocess
    waves = waveforms(source.prepared.path, source.split, indices, pre.sampling_rate)
    noise = background_noise(source.prepared, pre.sampling_rate)
    mixed = mix_background_noise(waves, source.corruption, source.severity,
                                 source.corruption_seed, indices, noise)
    return pre.features(mixed).astype(STORE_DTYPE)
