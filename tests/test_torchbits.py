"""Tensors and arrays cross between torch and numpy with their bits unchanged and memory shared."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the model extra")
from kvtool.errors import UsageError  # noqa: E402
from kvtool.torchbits import from_numpy, numpy_dtype, to_numpy  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2])
def test_bits_cross_both_ways_unchanged(dtype):
    tensor = (torch.randn(3, 17, 8, generator=torch.Generator().manual_seed(1)) * 40).to(dtype)
    array = to_numpy(tensor)
    assert array.dtype == numpy_dtype(dtype) and array.shape == (3, 17, 8)
    width = torch.uint8 if tensor.element_size() == 1 else {2: torch.int16, 4: torch.int32}[tensor.element_size()]
    assert np.array_equal(array.view(f"u{array.itemsize}"), tensor.view(width).numpy().view(f"u{array.itemsize}"))
    back = from_numpy(array, dtype)
    assert back.dtype == dtype and torch.equal(back.view(width), tensor.view(width))
    array[0, 0, 0] = array[0, 0, 1]  # shared memory: the tensor sees the change
    assert tensor.view(width)[0, 0, 0] == tensor.view(width)[0, 0, 1]


def test_read_only_arrays_are_copied_and_wrong_dtypes_refused():
    array = to_numpy(torch.ones(2, 3, dtype=torch.bfloat16)).copy()
    array.flags.writeable = False
    assert from_numpy(array, torch.bfloat16).sum().item() == 6
    with pytest.raises(UsageError, match="needs torch.float16"):
        from_numpy(array, torch.float16)
    with pytest.raises(UsageError, match="not supported"):
        numpy_dtype(torch.int64)
