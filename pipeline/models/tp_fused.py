"""A tensor-parallel all-reduce whose send is the producing linear's epilogue (`allreduce="fused"`).

A sharded Llama layer sums two partial results over the ranks: the output projection's and the down
projection's (row-parallel). The default graph path (`tp_allreduce`, "symm") copies each partial into a
symmetric-memory buffer and runs PyTorch's one-shot all-reduce kernel, then adds the residual: about 10 us a
sum at batch 1 on an H100. Here:

- the producer (`fused_linear(..., push=)`, the fused layer's output and down projections) writes its float32
  partial straight into slot `rank` of every rank's buffer of that *site* (peer memory over NVLink, PyTorch
  symmetric memory, never multicast). Plain stores: no fence, no signal.
- `reduce_into` (one small kernel, 64 columns a program) polls this rank's slots of its columns (volatile loads,
  one round trip a poll) until no value is -0.0, the mark of a slot not written yet (the producer sends a -0.0
  result as +0.0, which sums alike); then it marks those slots empty again for the site that reuses them, and
  adds the ranks' partials to the residual stream in place, summed in float32 in rank order and rounded once, so
  every rank holds the same bits. The next fused linear reads it as usual.

A 4-byte store arrives whole, so a value that is not -0.0 is the producer's; the data orders itself and the
reduce needs no PDL wait for the producer's grid. What it reads besides (x) was written before the producer's own
PDL wait. This is the "Lamport" scheme of TensorRT-LLM's low-latency all-reduce, with one sentinel and two
buffers (below).

Measured on 4x H100 (batch-1 decode, the Llama-3-8B shape; docs/benchmarks.md), against per-16-column
release/acquire counters signalled by each producer program after its stores (the same logits to the bit): TP=2
3.225 against 3.404 ms, TP=4 1.988 against 2.21 ms, 70B at TP=4 13.5 against 14.2 ms. A system-scope release has to
see the program's remote writes land before its atomics go out, so a signal follows the data instead of travelling
with it. Also measured and not kept: summing in the producer itself (each program waits for its peers' twins; no
reduce kernel): 2-3% slower at TP=2 and TP=4; the reduce letting the next kernel launch before its wait: 2-3%
slower; summing the partials inside the next linear's RMSNorm prologue (no kernel): TP=2 5.52 against 3.44 ms, TP=4
5.34 against 2.32 (every program of that linear polls the whole site). Against "symm" (`tp_allreduce`), "fused" with
the counters already measured 14% faster at TP=2 and 31% at TP=4; `tensor_parallel_graphs(..., allreduce="auto")`
takes it at 2 and 4 ranks (`FUSED_AUTO_RANKS`).

The logits stay a gather after the graph (`tensor_parallel.gather_vocab`). Gathering them here instead, from the
output layer's epilogue into every rank's logits area with a waiting kernel at the end of the graph, was exact and
11 us slower at TP=4 on H100s: the output layer has 1,002 programs a rank, each with its remote writes.

Site s of a step: 2i is layer i's output projection, 2i+1 its down projection. Every forward must push and
reduce every site once (`reset()` after anything else): a reduce empties the slots it read. Nothing is reset
between steps or CUDA graph replays. Two partial buffers (even and odd sites) are enough: rank A writes site s+2's
partials only after its reduce of s+1 saw every rank's s+1 partials, which each rank pushed only after its reduce of
s had finished, emptied slots included (the producer's PDL wait follows a chain of PDL waits back to that reduce).

A rank that dies mid-step must not leave its peers' GPUs spinning: `reduce_into` gives up after `spin_timeout_s`
(`GraphConfig.tp_spin_timeout_s`, default 120 s) and traps, which fails that process's CUDA context and with it
the replica.

Ranks must run the same sequence of fused forwards (the SPMD lockstep the tensor-parallel runner keeps). The
layout and the protocol are tested on CPU under Triton's interpreter with the ranks simulated in one process
(tests/pipeline/models/test_kernels.py); across GPUs by `self_test` at start and `python -m ops.tp_bench` (logits
against TP=1).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipeline.models.fused_linear import Push

_ALIGN = 256
# How long `reduce_into` waits for the other ranks' partials before it gives up and fails its process's CUDA
# context: a rank that died mid-step must not leave its peers' GPUs spinning for ever. Generous: a peer's first
# call of a shape may compile and tune kernels in between.
SPIN_TIMEOUT_S = 120.0
REDUCE_COLS = 64  # `reduce_into`'s columns a program (32-256 measured alike on 4x H100)
_EMPTY = -(1 << 31)  # the int32 bits of float32 -0.0 (fused_linear_triton.EMPTY)


class SiteBuffers:
    """One rank's view of the partial buffers of every site (see the module doc).

    `buf`: this rank's block of `SiteBuffers.nbytes(...)` bytes, in memory every rank can write (symmetric memory;
    plain memory for tests); `bases`: every rank's block address, in rank order. `spin_timeout_s`: how long a
    reduce waits for the other ranks' partials before it traps (0: for ever)."""

    def __init__(self, buf: torch.Tensor, bases: Sequence[int], rank: int, rows: int, hidden: int,
                 n_sites: int, spin_timeout_s: float = SPIN_TIMEOUT_S) -> None:
        R = len(bases)
        assert 0 <= rank < R and buf.dtype == torch.uint8 and buf.numel() >= self.nbytes(R, rows, hidden, n_sites)
        assert spin_timeout_s >= 0, f"spin_timeout_s must be >= 0, got {spin_timeout_s}"
        self.rank, self.n_ranks, self.rows, self.hidden, self.n_sites = rank, R, rows, hidden, n_sites
        self.spin_timeout_s = spin_timeout_s
        part_bytes = R * rows * hidden * 4
        self.parts = buf[: 2 * part_bytes].view(torch.float32).view(2, R, rows, hidden)
        self._peer_parts = [torch.tensor([b + p * part_bytes for b in bases], dtype=torch.int64, device=buf.device)
                            for p in range(2)]
        self._empty_parts()

    def _empty_parts(self) -> None:
        """Every partial slot back to -0.0, "not written"."""
        self.parts.view(torch.int32).fill_(_EMPTY)

    @staticmethod
    def nbytes(n_ranks: int, rows: int, hidden: int, n_sites: int) -> int:
        """Bytes of one rank's block: two partial buffers of [n_ranks, rows, hidden] float32 (even and odd sites)."""
        return _round_up(2 * n_ranks * rows * hidden * 4)

    def reset(self, group: Any = None) -> None:
        """Every slot empty again, on every rank of `group` at once (collective; no forward in flight)."""
        import torch.distributed as dist

        self._empty_parts()
        if self.parts.is_cuda:
            torch.cuda.synchronize(self.parts.device)
        if dist.is_initialized():
            dist.barrier(group=group)  # no rank pushes into a block that is not yet emptied

    def push(self, site: int) -> Push:
        assert 0 <= site < self.n_sites, site
        return Push(self._peer_parts[site % 2], self.rank, self.rows, self.hidden)

    def reduce_into(self, x: torch.Tensor, site: int, use_pdl: bool = False) -> None:
        """x [M, C] += every rank's partial of `site`, in place, once they are all in (one small kernel)."""
        from pipeline.models import fused_linear_triton as kern
        from pipeline.models.pdl import launch_kwargs

        M, C = x.shape
        assert C == self.hidden and M <= self.rows and x.stride(1) == 1, (tuple(x.shape), self.hidden, self.rows)
        parts = self.parts[site % 2]
        spin_ns = _spin_ns(self.spin_timeout_s)
        kern.reduce_partials_kernel[(-(-C // REDUCE_COLS),)](
            x, parts, M, C, x.stride(0), parts.stride(0), parts.stride(1), spin_ns,
            N_RANKS=self.n_ranks, M_PAD=_next_pow2(M), BLOCK_C=REDUCE_COLS, USE_PDL=use_pdl,
            SPIN_LIMIT=spin_ns > 0, RANKS_POW2=_next_pow2(self.n_ranks), num_warps=4, **launch_kwargs(use_pdl))


def _spin_ns(timeout_s: float) -> int:
    """How long a wait for the other ranks may spin before it traps, in ns (0: no limit; under the interpreter,
    which has no timer, always 0)."""
    from pipeline.models import fused_linear_triton as kern

    return 0 if kern.interpreted() else int(timeout_s * 1e9)


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def symmetric_sites(group: Any, device: torch.device, rows: int, hidden: int, n_sites: int,
                    spin_timeout_s: float = SPIN_TIMEOUT_S) -> SiteBuffers:
    """`SiteBuffers` over a zeroed PyTorch symmetric-memory block (peer-to-peer access over NVLink; never
    multicast). Collective: every rank of `group` calls it. Raises where symmetric memory is unavailable."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from pipeline.models.tp_allreduce import enable_symmetric_memory

    name = (group or dist.group.WORLD).group_name
    enable_symmetric_memory(name)
    R = dist.get_world_size(group)
    buf = symm_mem.empty(SiteBuffers.nbytes(R, rows, hidden, n_sites), dtype=torch.uint8, device=device)
    handle = symm_mem.rendezvous(buf, name)
    buf.zero_()
    sites = SiteBuffers(buf, list(handle.buffer_ptrs), dist.get_rank(group), rows, hidden, n_sites, spin_timeout_s)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every block is zeroed and emptied before any rank pushes into it
    return sites


def self_test(sites: SiteBuffers, group: Any, dtype: torch.dtype, reps: int = 2) -> None:
    """Push small-integer partials (different on every rank, so every sum is exact) through both partial buffers
    and reduce them into a residual stream, `reps` times: a setup whose peer writes do not arrive exactly is
    refused here, on every rank at once, not met mid-request."""
    import torch.distributed as dist

    from pipeline.models import fused_linear as fl

    dev, R, C = sites.parts.device, sites.n_ranks, sites.hidden
    M, K = 2, 32
    x = torch.ones(M, K, dtype=dtype, device=dev)
    n = torch.arange(C, device=dev)[:, None]
    k = torch.arange(K, device=dev)[None, :]
    ok = True
    for rep in range(reps):
        res = torch.arange(M * C, device=dev).remainder(5).to(dtype).view(M, C)
        for site in (0, 1):
            w = [((n + k + r + rep + site) % 3 - 1).to(dtype) for r in range(R)]  # [C, K] of -1, 0, 1
            want = (res.float() + sum(x.float() @ wr.float().T for wr in w)).to(dtype)
            fl.fused_linear(x, w[sites.rank], push=sites.push(site))
            sites.reduce_into(res, site)
            ok = ok and torch.equal(res, want)
    flag = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(flag, group=group)  # after every rank's reduces, hence after every push into this rank
    if int(flag.item()):
        raise RuntimeError(f"fused all-reduce self-test: {int(flag.item())} of {R} ranks summed wrongly")
    sites.reset(group)  # every slot empty again, on every rank, before the first forward


def setup_fused_allreduce(group: Any, device: torch.device, rows: int, hidden: int, n_sites: int,
                          dtype: torch.dtype = torch.bfloat16, spin_timeout_s: float = SPIN_TIMEOUT_S) -> SiteBuffers:
    """`symmetric_sites`, then `self_test`: what `tensor_parallel_graphs` sets up for allreduce='fused'."""
    sites = symmetric_sites(group, device, rows, hidden, n_sites, spin_timeout_s)
    self_test(sites, group, dtype)
    return sites
