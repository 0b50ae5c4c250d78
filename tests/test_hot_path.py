"""The per-round shortcuts give exactly what they replace: encoding and decoding a message's
arrays without formatting or parsing their ``.npy`` headers each time, seeding torch for the
device in use, reading a label column through Arrow."""

import numpy as np
import pytest
import torch
from flwr.app import Array

from fedadapt.data.loading import column
from fedadapt.devices import heap_free_bytes, return_freed_memory, seed_torch
from fedadapt.federation.records import as_numpy, to_array


@pytest.mark.parametrize("value", [
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.arange(5, dtype=np.int64),
    np.ones((), dtype=np.float32),
    np.zeros((0, 3), dtype=np.float16),
    np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)),  # Array.numpy's path
    np.arange(6, dtype=">f4").reshape(3, 2),
    np.array([True, False]),
], ids=["f32", "i64", "scalar", "empty", "fortran", "big-endian", "bool"])
def test_as_numpy_equals_flowers_decoding(value):
    array = Array(np.asarray(value))
    ours, flowers = as_numpy(array), array.numpy()
    assert ours.dtype == flowers.dtype and ours.shape == flowers.shape
    assert np.array_equal(ours, flowers)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(3, 4), lambda: torch.arange(5), lambda: torch.tensor(1.5),
    lambda: torch.randn(4, 3).t(),  # not contiguous: Flower's own path
    lambda: np.ones((2, 2), np.float16), lambda: np.zeros((0, 4), np.float32),
    lambda: np.asfortranarray(np.random.default_rng(0).random((3, 2))),
], ids=["f32", "i64", "scalar", "transposed", "f16", "empty", "fortran"])
def test_to_array_gives_flowers_bytes_the_first_time_and_after(make):
    for _ in range(2):  # the header is made, then reused
        value = make()
        ref = (Array.from_torch_tensor(value) if isinstance(value, torch.Tensor)
               else Array.from_numpy_ndarray(value))
        ours = to_array(value)
        assert (ours.dtype, tuple(ours.shape), ours.stype, ours.data) == \
            (ref.dtype, tuple(ref.shape), ref.stype, ref.data)


def test_as_numpy_is_a_read_only_view_of_the_message():
    array = Array(np.arange(4, dtype=np.float32))
    view = as_numpy(array)
    assert not view.flags.writeable
    assert np.shares_memory(view, np.frombuffer(array.data, dtype=np.uint8))


def test_seed_torch_on_the_cpu_draws_what_manual_seed_draws():
    torch.manual_seed(123)
    expected = (torch.randn(5), torch.nn.functional.dropout(torch.ones(64), 0.5),
                torch.randperm(10))
    torch.manual_seed(0)  # another state first
    seed_torch(123, torch.device("cpu"))
    got = (torch.randn(5), torch.nn.functional.dropout(torch.ones(64), 0.5), torch.randperm(10))
    for a, b in zip(expected, got):
        assert torch.equal(a, b)


def test_a_label_column_read_through_arrow_equals_the_datasets_column():
    from datasets import Dataset

    ds = Dataset.from_dict({"label": [3, 1, 4, 1, 5, 9, 2, 6]}).select([7, 0, 2, 5])
    assert np.array_equal(column(ds, "label", np.int64),
                          np.asarray(ds["label"], dtype=np.int64))
    assert column(ds, "label", np.int64).tolist() == [6, 3, 4, 9]


def test_freed_memory_is_trimmed_only_when_the_heaps_hold_enough_of_it():
    free = heap_free_bytes()
    if free is None:
        pytest.skip("no glibc mallinfo2 here: every call trims, as before")
    assert return_freed_memory(min_free=free + (1 << 30)) is False  # far more than is free
    blocks = [bytearray(100_000) for _ in range(400)]  # under the mmap threshold: heap blocks
    kept = blocks[1::2]  # every other one freed: holes the heap keeps (no top to shrink)
    del blocks
    assert heap_free_bytes() >= 100_000 * 150
    assert return_freed_memory(min_free=1 << 20) is True
    del kept
