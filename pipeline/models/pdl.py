"""Programmatic dependent launch (PDL) for the graph path's Triton kernels.

On Hopper and later, a kernel launched with the programmatic-stream-serialization attribute may start while
the kernel before it in the stream is still running. Each of our PDL kernels then:

1. does the work that reads nothing an earlier kernel writes (index math; `fused_linear` can also load its
   first weight tile, which no kernel ever writes: `GraphConfig.pdl_preload`);
2. waits (`griddepcontrol.wait`) until every earlier kernel in the stream has finished and its writes are
   visible. Every PDL kernel waits before it reads any activation or writes anything, so ordering holds
   transitively down the whole chain. One exception: the tensor-parallel reduce (`tp_fused.reduce_into`)
   does not wait for the producer before it; it polls the partials themselves until they are written, and the
   producer's own wait already covers every kernel before that;
3. lets the next kernel launch (`griddepcontrol.launch_dependents`): `fused_linear` after its K loop (an
   earlier trigger measured 5-10% slower on an H100: the next kernel's waiting programs hold SMs the running
   one still needs), the small attention and RoPE kernels at once.

What this buys: the next kernel's launch and its programs' start-up overlap the running kernel's epilogue and
tail. Kernels that are not launched this way (cuBLAS, torch ops) keep the ordinary stream order; mixing both is
safe. CUDA graph capture keeps the programmatic edges (CUDA 12.3+). tests/gpu/test_gpu_graphs.py checks that
logits are bit-identical with and without PDL.

`enabled(device)`: a CUDA device of compute capability >= 9 and a triton that knows `launch_pdl`; never under
Triton's CPU interpreter. `GraphConfig.pdl=False` turns it off (the benchmarks compare both ways).
"""

from __future__ import annotations

import functools

import torch

from pipeline import envs


@functools.lru_cache(maxsize=None)
def _triton_supports_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:  # noqa: BLE001 - no triton, or no NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def enabled(device: torch.device) -> bool:
    """Whether the graph path's Triton kernels launch with PDL on this device (see the module doc)."""
    if device.type != "cuda" or envs.TRITON_INTERPRET:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9 and _triton_supports_pdl()


def launch_kwargs(use_pdl: bool) -> dict:
    """Keyword arguments of a Triton launch: `launch_pdl=True` only when used (older tritons lack the name)."""
    return {"launch_pdl": True} if use_pdl else {}
