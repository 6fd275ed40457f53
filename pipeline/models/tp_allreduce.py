"""The all-reduce of the tensor-parallel graph path (`tensor_parallel.tensor_parallel_graphs`).

A decode step of an N-way sharded Llama sums two small partial results per layer over the ranks (a few KB at
batch 1): the cost is latency, not bandwidth. Kinds:

- "nccl": `dist.all_reduce` (NCCL on CUDA, gloo on CPU), in place. Captured inside the step's CUDA graph.
- "symm": one-shot all-reduce over PyTorch symmetric memory (`torch.ops.symm_mem.one_shot_all_reduce`): every
  rank copies its partial into a buffer its peers can read over NVLink, and one kernel on each rank reads all
  N buffers and sums them in rank order (so every rank holds bit-identical sums). One launch, no NCCL protocol.
  Only peer-to-peer reads are used; never NVLink multicast. Inputs past `max_bytes` (large prefill chunks),
  of another dtype, or not a whole number of 16-byte vectors go to NCCL.
- "auto": "symm" on CUDA where symmetric memory sets up and passes a self-test at start, else "nccl" (said once).

`tensor_parallel.tensor_parallel_graphs` also takes "fused" (opt-in, `pipeline.models.tp_fused`): the fused
layer's linears push their partials to every rank from their epilogues. It is not a reducer of this module;
calls the fused layer does not take use the "auto" reducer from here.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

ALLREDUCE_KINDS = ("auto", "nccl", "symm")
Reducer = Callable[[torch.Tensor], torch.Tensor]  # partial sums -> the sum over ranks (maybe the same tensor)


def enable_symmetric_memory(group_name: str) -> None:
    """Before a group's first symmetric-memory rendezvous: torch < 2.8 needs symmetric memory enabled for it; newer
    versions need nothing and deprecate the call (a FutureWarning on every rank, silenced here)."""
    import warnings

    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*enable_symm_mem_for_group.*", category=FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def nccl_all_reduce(group: Any) -> Reducer:
    def reduce(x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    return reduce


class SymmetricOneShot:
    """One-shot all-reduce of tensors up to `max_bytes` over a symmetric-memory buffer (see module doc)."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype, max_bytes: int = 512 << 10) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = (group or dist.group.WORLD).group_name
        self.fallback = nccl_all_reduce(group)
        enable_symmetric_memory(self.group_name)
        self.max_numel = max_bytes // torch.empty(0, dtype=dtype).element_size()
        self.buf = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.buf, self.group_name)
        self._op = torch.ops.symm_mem.one_shot_all_reduce
        self._self_test()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if n > self.max_numel or x.dtype != self.buf.dtype or (n * x.element_size()) % 16:
            return self.fallback(x)  # too large, another dtype, or not whole 16-byte vectors (the kernel's unit)
        staged = self.buf[:n]
        staged.copy_(x.reshape(-1))
        return self._op(staged, "sum", self.group_name).view(x.shape)

    def _self_test(self) -> None:
        """Sum a rank-dependent tensor both ways (several sizes, twice each: the buffer is reused): a setup that
        does not sum exactly what NCCL sums is refused here, not met mid-request."""
        rank = dist.get_rank(self.group)
        for n in (8, 4096, self.max_numel):
            for rep in range(2):
                x = (torch.arange(n, device=self.buf.device) % 7 + rank + rep).to(self.buf.dtype)
                want = self.fallback(x.clone())
                got = self(x)
                if not torch.equal(got, want):
                    raise RuntimeError(f"symmetric-memory all-reduce of {n} elements differs from NCCL's")
        torch.cuda.synchronize(self.buf.device)


def make_reducer(kind: str, group: Any, device: torch.device, dtype: torch.dtype,
                 max_bytes: int = 512 << 10) -> tuple[Reducer, str]:
    """(reducer, the kind it resolved to). 'symm' that cannot set up raises; 'auto' falls back to 'nccl'."""
    if kind not in ALLREDUCE_KINDS:
        raise ValueError(f"allreduce must be one of {ALLREDUCE_KINDS}, got {kind!r}")
    device = torch.device(device)
    if kind == "symm" and device.type != "cuda":
        raise ValueError(f"allreduce='symm' needs CUDA tensors; the model is on {device}")
    if kind in ("auto", "symm") and device.type == "cuda":
        try:
            return SymmetricOneShot(group, device, dtype, max_bytes), "symm"
        except Exception as e:  # noqa: BLE001 - no symmetric memory here (torch build, driver, topology)
            if kind == "symm":
                raise
            log.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL", type(e).__name__, e)
    return nccl_all_reduce(group), "nccl" if device.type == "cuda" else "gloo"
