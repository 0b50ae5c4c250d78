"""Prepared data sets (``<cache_dir>/data/<name>-<key>/``) are sealed when written (size and
SHA-256 of every file) and checked before a run uses them: a copy changed in place or truncated
is rebuilt from its source, or refused with one line naming it when the source is gone."""

import shutil

import numpy as np
import pytest

from fedadapt.config import DatasetConfig
from fedadapt.data import loading
from fedadapt.data.integrity import SEAL, CacheIntegrityError, check_folder
from fedadapt.data.loading import prepare_dataset


def arrow_file(prepared):
    return sorted((p for p in __import__("pathlib").Path(prepared.path).rglob("*.arrow")),
                  key=lambda p: p.stat().st_size)[-1]


def labels(prepared):
    loading._OPEN.pop(prepared.path, None)
    return np.asarray(prepared.load()["train"]["label"])


def test_written_sealed_and_rebuilt_when_altered_or_truncated(tmp_path):
    cfg = DatasetConfig(name="digits", max_samples=120)
    prepared = prepare_dataset(cfg, str(tmp_path), seed=0)
    assert (tmp_path / "data" / prepared.path.split("/")[-1] / SEAL).is_file()
    want, f = labels(prepared), arrow_file(prepared)
    original = f.read_bytes()

    changed = bytearray(original)
    changed[len(changed) // 2] ^= 0xFF  # in place, same size
    f.write_bytes(bytes(changed))
    again = prepare_dataset(cfg, str(tmp_path), seed=0)
    assert again.path == prepared.path and f.read_bytes() == original
    assert np.array_equal(labels(again), want)

    f.write_bytes(original[:-100])  # truncated: other processes see it from the sizes alone
    with pytest.raises(CacheIntegrityError, match=f"{f.name} is {len(original) - 100} bytes"):
        check_folder(prepared.path, "prepared data set", digests=False)
    prepare_dataset(cfg, str(tmp_path), seed=0)
    assert f.read_bytes() == original


def test_copy_without_a_seal_is_rebuilt(tmp_path):
    cfg = DatasetConfig(name="digits", max_samples=60)
    prepared = prepare_dataset(cfg, str(tmp_path), seed=0)
    seal = tmp_path / "data" / prepared.path.split("/")[-1] / SEAL
    seal.unlink()  # as written by a version without seals
    prepare_dataset(cfg, str(tmp_path), seed=0)
    assert seal.is_file()


def test_altered_copy_whose_source_is_gone_is_refused_naming_it(tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Image, Value

    rng = np.random.default_rng(0)
    source = tmp_path / "source"
    DatasetDict(train=Dataset.from_dict(
        {"image": list(rng.integers(0, 255, (40, 8, 8), dtype=np.uint8)),
         "label": [i % 2 for i in range(40)], "user_id": [str(i % 4) for i in range(40)]},
        features=Features({"image": Image(), "label": ClassLabel(names=["a", "b"]),
                           "user_id": Value("string")})),
    ).save_to_disk(str(source))
    cfg = DatasetConfig(name="inaturalist", path=str(source), test_fraction=0.25)
    prepared = prepare_dataset(cfg, str(tmp_path / "cache"), seed=0)
    f = arrow_file(prepared)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    shutil.rmtree(source)
    with pytest.raises(CacheIntegrityError) as err:
        prepare_dataset(cfg, str(tmp_path / "cache"), seed=0)
    msg = str(err.value)
    assert msg.startswith(f"prepared data set {prepared.path} failed its check")
    assert f.name in msg and "dataset.path" in msg and "\n" not in msg
