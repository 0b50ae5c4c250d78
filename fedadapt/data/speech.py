"""Speech Commands v0.02 (Warden 2018) in the 12-class form of the Accumulator paper.

Paper: "Federated learning for inference at anytime and anywhere"
(``shared/papers/accumulator-anytime-fl.txt``, Sec. 5.1): "we conduct our experiment with the
12-classes version, with 10 classes as "yes", "no", "up", "down", "left", "right", "on", "off",
"stop", "go" and one class "unknown" and a class "silence" ... The dataset has three disjoint sets
of speakers: 2112 for training, 256 for validation and 250 for the test".

Two sources give the same result (``datasets/speech_commands.md``):

* the original archive ``speech_commands_v0.02.tar.gz`` extracted (``dataset.path=<folder>``):
  ``<word>/<speaker>_nohash_<n>.wav``, ``validation_list.txt``, ``testing_list.txt`` and
  ``_background_noise_/``; training clips are those in neither list (the archive's
  speaker-disjoint split). An optional ``test_set/`` folder holding the separately released
  ``speech_commands_test_set_v0.02.tar.gz`` replaces ``testing_list.txt`` as the test split;
* the hub copy (``google/speech_commands``, config ``v0.02``; or a ``save_to_disk`` copy of it
  passed as ``dataset.path``): 35 words plus ``_silence_``, columns ``file``, ``audio``,
  ``label``, ``speaker_id``.

Either way every word outside the ten is ``_unknown_``; each ``_background_noise_`` recording
(the hub labels them ``_silence_``) is cut into non-overlapping one-second ``_silence_`` clips
(``running_tap.wav``'s go to validation, the others to training, as TFDS and the hub do), and the
recordings themselves form a ``noise`` split (the personalization setting's background noise).
A ``_silence_`` clip has no speaker: it is given one of its split's speakers (a seeded
round-robin), so a natural partition by speaker spreads them over the clients.

Audio is kept as WAV bytes in a ``datasets.Audio(decode=False)`` column and decoded with the
standard library's :mod:`wave` (16-bit PCM), not torchcodec.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from fedadapt.config import ConfigError
from fedadapt.log import log

#: The ten command words, in the paper's order; every other word is ``_unknown_``.
WORDS = ("yes", "no", "up", "down", "left", "right", "on", "off", "stop", "go")
UNKNOWN, SILENCE, BACKGROUND = "_unknown_", "_silence_", "_background_noise_"
#: The 12 classes (label i is ``CLASS_NAMES[i]``).
CLASS_NAMES = (*WORDS, UNKNOWN, SILENCE)
#: The background recording whose clips are validation silence (TFDS, the hub's script).
VALIDATION_NOISE = "running_tap.wav"
#: Folder of the separately released test set inside ``dataset.path`` (optional).
TEST_SET_DIR = "test_set"
SPLITS = ("train", "validation", "test")
SAMPLING_RATE = 16_000
CLIP_SECONDS = 1.0


def class_index(word: str) -> int:
    """The 12-class label of a word (or folder name): one of :data:`WORDS`, ``_silence_`` for
    silence and background noise, ``_unknown_`` for everything else."""
    if word in WORDS:
        return WORDS.index(word)
    return CLASS_NAMES.index(SILENCE if word in (SILENCE, BACKGROUND) else UNKNOWN)


def read_wav(data: bytes, what: str, rate: int = SAMPLING_RATE) -> np.ndarray:
    """Mono 16-bit PCM WAV bytes -> ``float32 [T]`` in [-1, 1) (divided by 2**15, as
    torchaudio and soundfile return them). Anything else fails with one line naming ``what``."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            channels, width, found = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError, OSError) as err:
        raise ConfigError(f"{what} is not a readable WAV file ({err})") from err
    if width != 2 or channels != 1 or found != rate:
        raise ConfigError(f"{what} is {8 * width}-bit, {channels} channel(s), {found} Hz: Speech "
                          f"Commands clips are 16-bit PCM mono at {rate} Hz")
    return np.frombuffer(frames, dtype="<i2").astype(np.float32) / 32768.0


def write_wav(samples: np.ndarray, rate: int = SAMPLING_RATE) -> bytes:
    """``float32 [T]`` in [-1, 1] -> mono 16-bit PCM WAV bytes (rounded, clipped)."""
    pcm = np.clip(np.round(np.asarray(samples, np.float64) * 32768.0), -32768, 32767)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.astype("<i2").tobytes())
    return buf.getvalue()


def audio_bytes(value: dict, what: str) -> bytes:
    """The bytes of an ``Audio(decode=False)`` value (``{"bytes", "path"}``)."""
    if value.get("bytes") is not None:
        return value["bytes"]
    path = value.get("path")
    if path and Path(path).is_file():
        return Path(path).read_bytes()
    raise ConfigError(f"{what}: the audio has neither bytes nor a readable file ({path!r})")


def segments(samples: np.ndarray, rate: int = SAMPLING_RATE,
             seconds: float = CLIP_SECONDS) -> list[np.ndarray]:
    """Non-overlapping ``seconds``-long pieces of a recording (the remainder is dropped)."""
    n = int(round(rate * seconds))
    return [samples[i:i + n] for i in range(0, len(samples) - n + 1, n)]


def speaker_of(filename: str) -> str:
    """``<speaker>_nohash_<n>.wav`` (or the test set's ``<word>_<speaker>_nohash_<n>.wav``)."""
    return Path(filename).stem.split("_nohash_")[0].split("_")[-1]


def assign_speakers(speakers: Sequence[Optional[str]], seed: int = 0x5111) -> list[str]:
    """Speakers for rows without one (silence): a seeded round-robin over the split's speakers
    (sorted, then permuted), so silence spreads evenly over a natural partition's clients."""
    known = sorted({s for s in speakers if s})
    if not known:
        return [s or SILENCE for s in speakers]
    order = np.random.default_rng(seed).permutation(len(known))
    out, k = [], 0
    for s in speakers:
        if s:
            out.append(s)
        else:
            out.append(known[order[k % len(known)]])
            k += 1
    return out


class Rows:
    """One split being assembled: audio values, files, words and speakers (None: silence)."""

    def __init__(self) -> None:
        self.audio: list[dict] = []
        self.files: list[str] = []
        self.words: list[str] = []
        self.speakers: list[Optional[str]] = []

    def add(self, audio: dict, file: str, word: str, speaker: Optional[str]) -> None:
        self.audio.append(audio)
        self.files.append(file)
        self.words.append(word)
        self.speakers.append(speaker)

    def add_background(self, name: str, samples: np.ndarray, rate: int) -> None:
        """A background recording's one-second clips, as ``_silence_`` rows."""
        for k, piece in enumerate(segments(samples, rate)):
            self.add({"bytes": write_wav(piece, rate), "path": None}, f"{BACKGROUND}/{name}#{k}",
                     SILENCE, None)


def _audio_dataset(audio: list[dict], rate: int, **columns):
    """A ``Dataset`` with ``audio`` as ``Audio(decode=False)`` (built as a plain struct and
    cast: datasets' own Audio encoding needs torchcodec) and string columns."""
    from datasets import Audio, Dataset, Features, Value

    features = Features({"audio": {"bytes": Value("binary"), "path": Value("string")},
                         **{k: Value("string") for k in columns}})
    ds = Dataset.from_dict({"audio": audio, **columns}, features=features)
    return ds.cast_column("audio", Audio(sampling_rate=rate, decode=False))


def _finish(base, rows: Rows, rate: int):
    """``base`` (a dataset of the split's kept clips, ``audio`` first, in ``rows`` order) plus
    the rows ``rows`` added after them, with ``file``, ``speaker_id`` and the 12-class
    ``label``."""
    from datasets import ClassLabel, concatenate_datasets

    extra = rows.audio[len(base):]
    parts = [base.select_columns(["audio"])]
    if extra:
        parts.append(_audio_dataset(extra, rate))
    ds = concatenate_datasets(parts) if len(parts) > 1 else parts[0]
    ds = ds.add_column("file", rows.files).add_column(
        "speaker_id", assign_speakers(rows.speakers))
    labels = [class_index(w) for w in rows.words]
    return ds.add_column("label", labels).cast_column("label", ClassLabel(names=list(CLASS_NAMES)))


def _check_disjoint(dsd, where: str) -> None:
    """Log (not fail: the hub's test split is the separately released test set) speakers
    found in more than one split."""
    seen = {s: set(dsd[s]["speaker_id"]) for s in SPLITS if s in dsd}
    for i, a in enumerate(SPLITS):
        for b in SPLITS[i + 1:]:
            both = seen.get(a, set()) & seen.get(b, set())
            if both:
                log(f"[data] {where}: {len(both)} speaker(s) in both {a} and {b} "
                    f"(e.g. {sorted(both)[:3]})")


# -- the original archive -------------------------------------------------------------------

def _read_list(path: Path) -> set[str]:
    return {line.strip() for line in path.read_text().splitlines() if line.strip()}


def _archive_splits(root: Path, path: str) -> dict[str, list[Path]]:
    """The archive's clips of each split (``validation_list.txt``, ``testing_list.txt``; the
    rest is training; ``test_set/`` replaces the test list when present)."""
    lists = [root / "validation_list.txt", root / "testing_list.txt"]
    missing = [p.name for p in lists if not p.is_file()]
    if missing:
        raise ConfigError(f"dataset.path={path!r} is invalid: {root} has no {' / '.join(missing)} "
                          f"(the extracted speech_commands_v0.02.tar.gz has both; see "
                          f"datasets/speech_commands.md)")
    clips = sorted(p for p in root.glob("*/*.wav") if not p.parent.name.startswith(("_", ".")))
    if not clips:
        raise ConfigError(f"dataset.path={path!r} is invalid: no .wav files in {root}/<word>/ "
                          f"(expected the extracted speech_commands_v0.02.tar.gz, or a "
                          f"save_to_disk copy of google/speech_commands v0.02)")
    val, test = _read_list(lists[0]), _read_list(lists[1])
    rel = {p: p.relative_to(root).as_posix() for p in clips}
    out = {"train": [p for p in clips if rel[p] not in val and rel[p] not in test],
           "validation": [p for p in clips if rel[p] in val],
           "test": [p for p in clips if rel[p] in test]}
    test_set = root / TEST_SET_DIR
    if test_set.is_dir():
        out["test"] = sorted(test_set.glob("*/*.wav"))
        if not out["test"]:
            raise ConfigError(f"dataset.path={path!r}: {test_set} holds no <word>/*.wav clips")
    return out


def load_archive(path: str, rate: int = SAMPLING_RATE):
    """The extracted ``speech_commands_v0.02.tar.gz`` at ``path`` as
    ``DatasetDict(train, validation, test, noise)`` (see the module docstring). Clips are
    referenced by path; ``save_to_disk`` embeds their bytes."""
    from datasets import DatasetDict

    root = Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"dataset.path={path!r} is invalid: no such folder (see "
                          f"datasets/speech_commands.md)")
    clips = _archive_splits(root, path)
    out = {}
    for split, files in clips.items():
        rows = Rows()
        for f in files:
            word = f.parent.name
            silent = word in (SILENCE, BACKGROUND)
            rows.add({"bytes": None, "path": str(f.resolve())}, f"{word}/{f.name}",
                     word if word != UNKNOWN else f.stem.split("_")[0],
                     None if silent else speaker_of(f.name))
        base = _audio_dataset(rows.audio, rate)
        out[split] = rows, base
    noise = sorted((root / BACKGROUND).glob("*.wav"))
    for f in noise:
        samples = read_wav(f.read_bytes(), f"dataset.path={path!r}: {f}", rate)
        out["validation" if f.name == VALIDATION_NOISE else "train"][0].add_background(
            f.name, samples, rate)
    dsd = DatasetDict({s: _finish(base, rows, rate) for s, (rows, base) in out.items()})
    dsd["noise"] = _audio_dataset([{"bytes": None, "path": str(f.resolve())} for f in noise],
                                  rate, file=[f"{BACKGROUND}/{f.name}" for f in noise])
    _check_disjoint(dsd, f"dataset.path={path!r}")
    return dsd


# -- the hub copy ---------------------------------------------------------------------------

HUB_COLUMNS = ("audio", "label", "speaker_id")


def _hub_split(ds, split: str, where: str, rate: int, noise: list[tuple[str, bytes]]):
    """One split of the hub copy in the 12-class form; its background recordings (``_silence_``
    rows longer than a clip) are cut into clips and appended to ``noise``."""
    from datasets import Audio

    missing = [c for c in HUB_COLUMNS if c not in ds.column_names]
    if missing:
        raise ConfigError(f"{where}: split {split!r} lacks column(s) {missing} of "
                          f"google/speech_commands v0.02 (columns: {ds.column_names})")
    ds = ds.cast_column("audio", Audio(sampling_rate=rate, decode=False))
    names = ds.features["label"].names
    words = [names[i] for i in ds["label"]]
    files = list(ds["file"]) if "file" in ds.column_names else [None] * len(ds)
    speakers = list(ds["speaker_id"])
    background = []
    for i in (i for i, w in enumerate(words) if w == SILENCE):
        data = audio_bytes(ds[i]["audio"], f"{where}: {split} row {i}")
        if len(read_wav(data, f"{where}: {split} row {i}", rate)) > rate * CLIP_SECONDS + 1:
            background.append((i, data))
    drop = {i for i, _ in background}
    keep = [i for i in range(len(ds)) if i not in drop]
    rows = Rows()
    for i in keep:
        silent = words[i] == SILENCE
        rows.add({}, files[i] or f"{words[i]}/{i}", words[i], None if silent else speakers[i])
    for i, data in background:
        name = Path(files[i] or f"{i}.wav").name
        noise.append((name, data))
        rows.add_background(name, read_wav(data, f"{where}: {split} row {i}", rate), rate)
    return _finish(ds.select(keep), rows, rate)


def load_hub_copy(raw, where: str, rate: int = SAMPLING_RATE):
    """``google/speech_commands`` v0.02 (``DatasetDict(train, validation, test)``, 35 words
    and ``_silence_``) as ``DatasetDict(train, validation, test, noise)`` in the 12-class
    form. ``where`` names the source in messages (the hub id or ``dataset.path``)."""
    from datasets import DatasetDict

    absent = [s for s in SPLITS if s not in raw]
    if absent:
        raise ConfigError(f"{where}: no split(s) {absent} (has {list(raw)}); expected "
                          f"google/speech_commands v0.02's train / validation / test")
    noise: list[tuple[str, bytes]] = []
    dsd = DatasetDict({s: _hub_split(raw[s], s, where, rate, noise) for s in SPLITS})
    dsd["noise"] = _audio_dataset([{"bytes": b, "path": None} for _, b in noise], rate,
                                  file=[f"{BACKGROUND}/{n}" for n, _ in noise])
    _check_disjoint(dsd, where)
    return dsd


def load_speech_commands(card, path: Optional[str] = None):
    """The data set of a ``source: speech_commands`` card: ``dataset.path`` (an extracted
    archive, or a ``save_to_disk`` copy of the hub data set), else the card's hub id."""
    rate = int(card.sampling_rate or SAMPLING_RATE)
    if path:
        p = Path(path).expanduser()
        if (p / "dataset_dict.json").is_file():
            from datasets import load_from_disk

            return load_hub_copy(load_from_disk(str(p)), f"dataset.path={path!r}", rate)
        return load_archive(path, rate)
    from fedadapt.data.hub import load_hub

    return load_hub_copy(load_hub(card), f"dataset={card.name} ({card.hub_id})", rate)
