"""Work done once per source row (fedadapt/data/rows.py): prepared copies of one data set for
different seeds share its decoded images and backbone features by source row; only rows no
earlier copy held are decoded or run; what they read equals what a copy computed alone; a part
that fails its digest is computed again."""

import numpy as np
import pytest

from fedadapt.data.rows import RowCache


def test_a_row_cache_holds_each_row_once_and_recomputes_a_damaged_part(tmp_path, capsys):
    cache = RowCache(tmp_path / "rows")
    rows = np.array([5, 2, 9, 2])
    assert list(cache.missing(rows)) == [0, 1, 2]  # first occurrences, ascending
    values = np.arange(3 * 4, dtype=np.float32).reshape(3, 4)

    def write(values):
        def fill(tmp):
            with open(tmp, "wb") as fh:
                np.save(fh, values)
        return fill

    cache.add(rows[[0, 1, 2]], write(values))
    out = np.empty((4, 4), np.float32)
    cache.gather(rows, out)
    np.testing.assert_array_equal(out, values[[0, 1, 2, 1]])
    assert list(cache.missing(np.array([2, 7, 5, 8]))) == [1, 3]
    cache.add(np.array([7, 8]), write(-np.ones((2, 4), np.float32)))
    cache.gather(np.array([8, 9, 7]), out[:3])
    np.testing.assert_array_equal(out[:3], [[-1] * 4, values[2], [-1] * 4])

    part = next(p for p in (tmp_path / "rows").glob("part-*.npy")
                if not p.name.endswith(".rows.npy") and np.load(p).shape[0] == 3)
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF  # one value changed in place
    part.write_bytes(bytes(data))
    assert list(cache.missing(rows)) == [0, 1, 2]  # that part's rows are missing again
    assert "rebuilding it" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="missing"):
        cache.gather(rows, out)


def _run_config(cache_dir, seed: int):
    from fedadapt.entry import compose_config, to_run_config

    return to_run_config(compose_config([
        "method=linear_head", "backbone=small_cnn", "dataset.max_samples=600", f"seed={seed}",
        "train.precision=fp32", f"cache_dir={cache_dir}"]))  # features compared exactly below


def _part_rows(folder) -> list[int]:
    return [int(r) for p in sorted(folder.glob("part-*.rows.npy")) for r in np.load(p)]


def test_seeds_share_decoded_images_and_features_by_source_row(tmp_path):
    from fedadapt.backbones import build_backbone
    from fedadapt.data.cache import extract_features
    from fedadapt.data.catalogue import load_card
    from fedadapt.data.sources import input_source
    from fedadapt.experiment import prepare_run

    cache_dir = tmp_path / "cache"
    cfgs = [_run_config(cache_dir, seed) for seed in (0, 1)]
    specs = [prepare_run(cfg, quiet=True).spec for cfg in cfgs]
    first, second = (spec.train_source for spec in specs)
    a, b = first.prepared, second.prepared
    assert a.fingerprint != b.fingerprint and a.source_key == b.source_key
    (base_a, rows_a), (base_b, rows_b) = a.source_rows("train"), b.source_rows("train")
    assert base_a == base_b == "train" and a.source_rows("test")[0] == "train"  # digits: split
    shared = np.intersect1d(rows_a, rows_b)
    assert 0 < len(shared) < len(rows_b)  # two seeded subsamples of 600 of 1,437 rows

    for kind in ("images", "features"):  # each source row computed once, over both seeds
        (folder,) = (cache_dir / kind).glob("digits-rows-train-*")
        held = _part_rows(folder)
        assert len(held) == len(set(held))
        union = np.union1d(np.union1d(rows_a, rows_b),
                           np.union1d(a.source_rows("test")[1], b.source_rows("test")[1]))
        assert sorted(held) == sorted(union.tolist())

    # the same source row: the same label, pixels and feature in both copies
    ia, ib = (np.flatnonzero(np.isin(r, shared)) for r in (rows_a, rows_b))
    ia, ib = ia[np.argsort(rows_a[ia])], ib[np.argsort(rows_b[ib])]
    np.testing.assert_array_equal(first.labels()[ia], second.labels()[ib])
    np.testing.assert_array_equal(first.features()[ia], second.features()[ib])
    card, backbone = load_card("digits"), build_backbone(cfgs[1].backbone)
    images_a, images_b = (input_source(card, backbone, p, "train", str(cache_dir))
                          for p in (a, b))
    np.testing.assert_array_equal(images_a.images(ia), images_b.images(ib))
    # the second copy's features (partly computed for it, partly gathered) are its images'
    np.testing.assert_allclose(second.features(), extract_features(
        backbone.to(specs[1].device), images_b, device=specs[1].device,
        precision=specs[1].precision), rtol=0, atol=1e-5)
