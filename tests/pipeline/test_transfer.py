"""`pipeline.transfer.to_device`: the values, dtype and device asked for (CPU here; the CUDA path's copy is the
GPU tests' business)."""

from __future__ import annotations

import torch

from pipeline.transfer import to_device


def test_lists_and_host_tensors_arrive_with_the_dtype_asked_for():
    t = to_device([3, 1, 2], "cpu")
    assert t.dtype == torch.int64 and t.tolist() == [3, 1, 2]
    f = to_device(torch.tensor([1, 2]), torch.device("cpu"), torch.float32)
    assert f.dtype == torch.float32 and f.tolist() == [1.0, 2.0]
    assert to_device([], "cpu").shape == (0,)
