"""Host metadata to the device in one copy: values, dtypes, shapes and alignment of the views."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tidal.executor.upload import Upload, device_ints

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_upload_returns_each_array_with_its_dtype_shape_and_values(device):
    up = Upload()
    arrays = [([3, 1, 4], np.int64), ([[1, 2, 3], [4, 5, 6]], np.int32), ([True, False, True], np.bool_),
              ([], np.int64), (np.zeros((0, 3)), np.int64), ([7], np.int32), ([(1, 2), (3, 4)], np.int64)]
    index = [up.add(values, dtype) for values, dtype in arrays]
    views = up.send(torch.device(device))
    for (values, dtype), i in zip(arrays, index, strict=True):
        want = torch.from_numpy(np.asarray(values, dtype=dtype))
        got = views[i]
        assert got.device.type == device and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.cpu(), want)
        assert got.data_ptr() % 16 == 0  # as aligned as a tensor of its own (Triton specialises on it)


def test_device_ints_of_pairs_and_of_nothing():
    pairs = device_ints([(5, 0), (6, 1)], "cpu")
    assert pairs.dtype == torch.long and pairs.tolist() == [[5, 0], [6, 1]]
    assert device_ints([], "cpu").shape == (0,)
