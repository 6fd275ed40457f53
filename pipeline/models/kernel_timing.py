"""Timing kernels the way a captured step runs them, for the per-shape tuners of the graph path's linears
(`fused_linear.config_for`, `skinny_linear.tune`) and the GPU benchmarks; and the card's copy bandwidth, the
floor every GPU benchmark divides by (`copy_GBps`).

A decode step replays one CUDA graph: each linear runs right after the previous one (overlapped with it under
programmatic dependent launch), its weight streamed from memory because the layers before it have pushed it out
of L2. `chain_ms` times a candidate the same way: a chain of launches captured in one graph, each over its own
copy of the weight (`weight_copies`: enough copies that the chain outgrows L2).

Timing one launch alone after a write that flushes L2 ranks the candidates differently from how they run in a
step: on an H100 it picked fused-layer configurations up to 37% slower there, and its picks changed from one
process to the next (`python -m ops.linear_chain_bench --configs`).
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def captured_ms(fn: Callable[[], object], reps: int = 5) -> float:
    """Median milliseconds of one replay of `fn` captured in a CUDA graph (`fn` runs once before, uncaptured: it
    may compile or tune there)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def copies_needed(l2_bytes: int, weight_bytes: int, l2_multiple: int = 4, most: int = 8) -> int:
    """How many tensors of `weight_bytes` make `l2_multiple` times L2 (at least 1, at most `most`)."""
    return max(1, min(most, -(-l2_multiple * l2_bytes // max(weight_bytes, 1))))


def weight_copies(w: torch.Tensor, l2_multiple: int = 4, most: int = 8) -> list[torch.Tensor]:
    """`w` and as many clones as make `l2_multiple` times the device's L2 (`copies_needed`; just `w` where it
    alone is that large). Matrices so small that `most` copies fit in L2 (under 6 MB on an H100) are timed
    partly from L2: at that size a launch's fixed cost, not its bytes, decides."""
    l2 = torch.cuda.get_device_properties(w.device).L2_cache_size
    n = copies_needed(l2, w.numel() * w.element_size(), l2_multiple, most)
    return [w] + [w.clone() for _ in range(n - 1)]


def chain_ms(launch: Callable[[torch.Tensor], object], weights: list[torch.Tensor], reps: int = 5,
             least: int = 8) -> float:
    """Milliseconds per launch of `launch(w)` over `weights` (cycled to at least `least` launches), captured in
    one CUDA graph (`captured_ms`)."""
    n = max(least, len(weights))
    return captured_ms(lambda: [launch(weights[i % len(weights)]) for i in range(n)], reps) / n


def copy_GBps(device: torch.device | str = "cuda", gib: float = 4.0, iters: int = 20) -> float:
    """The card's copy bandwidth, GB/s: bytes read + written by a `gib` GiB device-to-device copy over its median
    time (CUDA events, after one warm-up copy). The bandwidth floor of the GPU benchmarks (ops/)."""
    n = int(gib * (1 << 30))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize(src.device)
    ms = statistics.median(s.elapsed_time(e) for s, e in times)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3) / 1e9
