"""The Array codec (:mod:`fedadapt.codec`) against Flower's own: ``to_array`` makes the Array
``Array.from_numpy_ndarray`` / ``from_torch_tensor`` make, field by field, the first time a
shape is seen and from the header cache after; ``as_numpy`` reads what ``Array.numpy`` reads,
for every ``.npy`` header version and the layouts its fast path leaves to Flower. (Written from
mutmut's survivors in codec.py: docs/reliability.md.)"""

import io

import numpy as np
import pytest
import torch
from flwr.app import Array

from fedadapt.codec import as_numpy, to_array

VALUES = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.linspace(-1, 1, 7, dtype=np.float64),
    np.array([[1, -2], [3, 4]], dtype=np.int64),
    np.array([True, False, True]),
    np.arange(6, dtype=np.float16).reshape(2, 3),
    np.array(2.5, dtype=np.float32),  # 0-d
    np.zeros((0, 3), dtype=np.float32),  # empty
]


def fields(array: Array) -> tuple:
    return array.dtype, tuple(array.shape), array.stype, bytes(array.data)


@pytest.mark.parametrize("value", VALUES, ids=lambda v: f"{v.dtype}{list(v.shape)}")
def test_to_array_makes_flowers_array_the_first_time_and_from_its_cache(value):
    expected = fields(Array.from_numpy_ndarray(value))
    for _ in range(2):  # the header formatted, then read from the cache
        assert fields(to_array(value)) == expected
    other = np.asarray(value + 1 if value.dtype != bool else ~value)  # cached header, new bytes
    assert fields(to_array(other)) == fields(Array.from_numpy_ndarray(other))


def test_to_array_of_a_torch_tensor_is_flowers():
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).requires_grad_(True)
    assert fields(to_array(tensor)) == fields(Array.from_torch_tensor(tensor.detach()))
    assert fields(to_array(tensor)) == fields(Array.from_numpy_ndarray(tensor.detach().numpy()))


def test_to_array_of_what_its_fast_path_leaves_to_flower():
    """A view that is not C-contiguous, an object array and a plain list go through Flower."""
    strided = np.arange(20, dtype=np.float32).reshape(4, 5)[:, ::2]
    assert fields(to_array(strided)) == fields(Array.from_numpy_ndarray(strided))
    listed = [[1.0, 2.0], [3.0, 4.0]]
    assert fields(to_array(listed)) == fields(Array.from_numpy_ndarray(np.asarray(listed)))
    with pytest.raises(Exception):  # noqa: B017 - Flower refuses pickled objects; so do we
        to_array(np.array([{"a": 1}], dtype=object))


def npy(value: np.ndarray, version) -> Array:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, value, version=version, allow_pickle=False)
    return Array(dtype=str(value.dtype), shape=tuple(value.shape), stype="numpy.ndarray",
                 data=buffer.getvalue())


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
@pytest.mark.parametrize("value", VALUES, ids=lambda v: f"{v.dtype}{list(v.shape)}")
def test_as_numpy_reads_every_npy_header_version_as_flower_does(value, version):
    array = npy(value, version)
    got = as_numpy(array)
    np.testing.assert_array_equal(got, array.numpy())
    assert got.dtype == value.dtype and got.shape == value.shape
    assert not got.flags.writeable  # a view of the message's bytes, not a copy


def test_as_numpy_leaves_fortran_order_and_other_stypes_to_flower():
    fortran = np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4))
    array = npy(fortran, (1, 0))
    np.testing.assert_array_equal(as_numpy(array), fortran)
    assert as_numpy(array).shape == (3, 4)
    other = Array(dtype="float32", shape=(2,), stype="torch.Tensor", data=b"\x00" * 8)
    with pytest.raises(Exception) as ours:  # noqa: B017 - what Flower's numpy() raises
        as_numpy(other)
    with pytest.raises(type(ours.value)):
        other.numpy()
