"""Host-to-device copies of a step's small inputs without a stream sync.

`torch.tensor(values, device=cuda)` and `.to(cuda)` of a pageable host tensor copy and then wait for the stream:
every such call on the per-token path is a host sync, which lets the GPU run dry while the host prepares the next
work. `to_device` stages the values in pinned host memory and copies them asynchronously: the copy is ordered on
the stream before the kernels that read it, and PyTorch's pinned-memory allocator keeps the staging block until
the copy is done, so the caller may drop it at once. On the CPU it is a plain tensor.
"""

from __future__ import annotations

from typing import Sequence

import torch


def to_device(values: Sequence[int] | Sequence[float] | torch.Tensor, device: torch.device | str,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """`values` (a list or a host tensor) as a tensor of `dtype` on `device`, copied without a stream sync."""
    device = torch.device(device)
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
