"""Would a persistent kernel remove the per-kernel cost of a batch-1 step's linears? One GPU (issues 5 and 6).

    python -m ops.persistent_bench --out $OUT                # 1b and 8b shapes, 16 layers
    python -m ops.persistent_bench --sets 1b --layers 16 --blocks-per-sm 2

A batch-1 step streams each weight matrix once, in one kernel per matrix, and every kernel pays a fixed cost (5.3
us on an H100 with programmatic dependent launch, `ops/linear_chain_bench.py`) on top of its bytes. Folding the
small kernels between the linears into them saves nothing (BENCHMARKS.md, issue 5, Update 7). This script
measures the alternative before anyone builds it into the model: the same chain of matrix-vector products,

- "chain": per layer q/k/v, output, gate/up and down projections as plain `fused_linear` launches (no norms or
  epilogues), captured in a CUDA graph with programmatic dependent launch, each reading the previous output;
- "persistent": the same products in ONE launch of `persistent_chain` below: a resident grid of `--blocks-per-sm`
  programs per multiprocessor takes each matrix's column blocks in turn, with a grid-wide barrier (an atomic
  counter; release, then acquire spin) between matrices, since each reads the one before's output;
- "persistent+pf": the same, each program asking L2 for the first `--pf-bytes` of its next matrix's rows before it
  waits at the barrier (weights never depend on the barrier);
- "persistent+sleep": the same, with a `--sleep-ns` pause between a waiting program's polls of the counter;
- "persistent 1-block": each program takes one column block of each product, BLOCK_N per product sized so the grid
  covers it (`one_block_tiles`): the products' loops are then the K loop alone, as in a standalone kernel;
  "unrolled": also the layer loop unrolled at compile time, so no K loop sits inside another loop; "x via L1
  (unsafe)": one block a program with the input read through L1, a diagnostic of what the .cg loads cost (L1 is not
  coherent across SMs, so it may read a stale line; its error column says);
- "barriers only" (and "+sleep"): the persistent kernel without its products: what its 4 barriers a layer cost.

Both give the same products (compared: max |difference| / max |value|, bf16 rounding per product in both). The
table gives us per layer, the weight floor (bytes / copy bandwidth of the card) and the excess over it, so the
per-matrix fixed cost of each way is (excess per layer) / 4.

Measured on an H100 (BENCHMARKS.md, issue 5, Update 7): a barrier costs 1.4 us, less than a launch's fixed cost
in the chain, but the products inside the persistent kernel as written here stream at about half the chain's
speed (167 registers a thread, 3 programs per SM; one column block a program, even unrolled, was slower still),
so "persistent" is 1.8-1.9x slower per layer. A persistent layer would pay only if its products ran as fast as
the standalone kernels.

The barrier needs every program resident at once: the grid is `blocks-per-sm` x SMs, checked against what the
compiled kernel's registers and shared memory allow, and a barrier that waits over `--spin-timeout-s` traps
(the process fails instead of hanging).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl


from pipeline.models import fused_linear as fl  # noqa: E402
from pipeline.models import pdl  # noqa: E402
from pipeline.models.fused_linear_triton import _prefetch_rows_l2, _trap  # noqa: E402
from pipeline.models.kernel_timing import captured_ms, copy_GBps  # noqa: E402

from ops.linear_chain_bench import SETS  # noqa: E402

M_PAD = 16  # rows of the tensor-core tile; row 0 is the vector, the rest zero


@triton.jit
def _column_block(W, X, Y, N, K, nb, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, L1: tl.constexpr):
    """Y[0, nb's BLOCK_N columns] = X[0, :K] @ W[those rows, K]^T (float32 sums, rounded to Y's dtype). X is read
    through L2 (.cg): other programs wrote it before the barrier. L1: through L1 instead, which may read a stale
    line (a diagnostic: how much the .cg loads cost; its error column says whether it went wrong)."""
    offs_m = tl.arange(0, 16)
    row0 = (offs_m < 1)[:, None]
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_rows = W + offs_n.to(tl.int64)[None, :] * K
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if L1:
            x = tl.load(X + offs_m[:, None] * 0 + offs_k[None, :], mask=row0, other=0.0)
        else:
            x = tl.load(X + offs_m[:, None] * 0 + offs_k[None, :], mask=row0, other=0.0, cache_modifier=".cg")
        w = tl.load(w_rows + offs_k[:, None], mask=n_ok[None, :], other=0.0)
        acc += tl.dot(x, w)
    tl.store(Y + offs_m[:, None] * 0 + offs_n[None, :], acc.to(Y.dtype.element_ty), mask=row0 & n_ok[None, :])


@triton.jit
def _matvec(W, X, Y, N, K, pid, G, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE: tl.constexpr):
    """Y = X @ W^T over column blocks: ONE (1, or 2: X through L1), program pid takes block pid only (the host sized
    BLOCK_N so that the grid covers N), the K loop alone, as in a standalone kernel; else blocks pid, pid + G, ...
    (a loop around it)."""
    if ONE:
        if pid < tl.cdiv(N, BLOCK_N):
            _column_block(W, X, Y, N, K, pid, BLOCK_N, BLOCK_K, ONE == 2)
    else:
        for nb in range(pid, tl.cdiv(N, BLOCK_N), G):
            _column_block(W, X, Y, N, K, nb, BLOCK_N, BLOCK_K, False)


@triton.jit
def _prefetch_next(W, N, K, pid, G, BLOCK_N: tl.constexpr, PF_BYTES: tl.constexpr):
    """Ask L2 for the first PF_BYTES of each row of this program's first column block of W[N, K]."""
    if pid * BLOCK_N < N:
        r = tl.minimum(pid * BLOCK_N + tl.arange(0, BLOCK_N), N - 1).to(tl.int64)
        _prefetch_rows_l2(W + r * K, tl.full([BLOCK_N], PF_BYTES, tl.int32))


@triton.jit
def _nanosleep(ns):
    tl.inline_asm_elementwise("nanosleep.u32 $1; // $0", "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _grid_barrier(CTR, target, spin_ns, SPIN_LIMIT: tl.constexpr, SLEEP_NS: tl.constexpr):
    """Every program has arrived (the counter reached target): release this program's stores, acquire theirs.
    SLEEP_NS > 0: a pause between polls, so that hundreds of programs polling one address leave the arrivals'
    atomics room."""
    tl.debug_barrier()  # every thread's stores are issued before the release
    tl.atomic_add(CTR, 1, sem="release", scope="gpu")
    t0 = tl.extra.cuda.globaltimer()
    while tl.atomic_add(CTR, 0, sem="acquire", scope="gpu") < target:
        if SLEEP_NS > 0:
            _nanosleep(tl.full([], SLEEP_NS, tl.int32))
        if SPIN_LIMIT:
            if tl.extra.cuda.globaltimer() - t0 > spin_ns:
                _trap()
    tl.debug_barrier()


@triton.jit
def _phase(W, X, Y, N, K, W_NEXT, N_NEXT, K_NEXT, CTR, target, pid, G, spin_ns, MATVEC: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BN_NEXT: tl.constexpr, ONE: tl.constexpr,
           PF_BYTES: tl.constexpr, SPIN_LIMIT: tl.constexpr, SLEEP_NS: tl.constexpr):
    """One matrix of the chain: Y = W X (MATVEC), the L2 prefetch of the next matrix's first rows (PF_BYTES),
    then the grid barrier (the counter at `target`)."""
    if MATVEC:
        _matvec(W, X, Y, N, K, pid, G, BLOCK_N, BLOCK_K, ONE)
    if PF_BYTES > 0:
        _prefetch_next(W_NEXT, N_NEXT, K_NEXT, pid, G, BN_NEXT, PF_BYTES)
    _grid_barrier(CTR, target, spin_ns, SPIN_LIMIT, SLEEP_NS)


@triton.jit
def _layer(l, layers, W_PTRS, X, B1, B2, B3, CTR, spin_ns, pid, G,
           D: tl.constexpr, QKV: tl.constexpr, Q: tl.constexpr, I2: tl.constexpr, I: tl.constexpr,
           BN0: tl.constexpr, BK0: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
           BN2: tl.constexpr, BK2: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr,
           PF_BYTES: tl.constexpr, SPIN_LIMIT: tl.constexpr, SLEEP_NS: tl.constexpr, MATVEC: tl.constexpr,
           ONE: tl.constexpr):
    """Layer l of `persistent_chain`: its four products, each followed by a grid barrier."""
    bf = tl.pointer_type(tl.bfloat16)
    w_qkv = tl.load(W_PTRS + 4 * l).to(bf)
    w_o = tl.load(W_PTRS + 4 * l + 1).to(bf)
    w_gu = tl.load(W_PTRS + 4 * l + 2).to(bf)
    w_down = tl.load(W_PTRS + 4 * l + 3).to(bf)
    w_next = tl.load(W_PTRS + 4 * tl.minimum(l + 1, layers - 1)).to(bf)  # the next layer's q/k/v (or this one's)
    base = 4 * l * G
    _phase(w_qkv, X, B1, QKV, D, w_o, D, Q, CTR, base + G, pid, G, spin_ns, MATVEC, BN0, BK0, BN1, ONE,
           PF_BYTES, SPIN_LIMIT, SLEEP_NS)
    _phase(w_o, B1, B2, D, Q, w_gu, I2, D, CTR, base + 2 * G, pid, G, spin_ns, MATVEC, BN1, BK1, BN2, ONE,
           PF_BYTES, SPIN_LIMIT, SLEEP_NS)
    _phase(w_gu, B2, B3, I2, D, w_down, D, I, CTR, base + 3 * G, pid, G, spin_ns, MATVEC, BN2, BK2, BN3, ONE,
           PF_BYTES, SPIN_LIMIT, SLEEP_NS)
    _phase(w_down, B3, X, D, I, w_next, QKV, D, CTR, base + 4 * G, pid, G, spin_ns, MATVEC, BN3, BK3, BN0, ONE,
           PF_BYTES, SPIN_LIMIT, SLEEP_NS)


@triton.jit
def persistent_chain(W_PTRS, X, B1, B2, B3, CTR, layers, spin_ns,
                     D: tl.constexpr, QKV: tl.constexpr, Q: tl.constexpr, I2: tl.constexpr, I: tl.constexpr,
                     BN0: tl.constexpr, BK0: tl.constexpr, BN1: tl.constexpr, BK1: tl.constexpr,
                     BN2: tl.constexpr, BK2: tl.constexpr, BN3: tl.constexpr, BK3: tl.constexpr,
                     PF_BYTES: tl.constexpr, SPIN_LIMIT: tl.constexpr, SLEEP_NS: tl.constexpr = 0,
                     MATVEC: tl.constexpr = True, ONE: tl.constexpr = False, UNROLLED: tl.constexpr = 0):
    """Per layer l: B1 = W_qkv X; B2 = W_o B1[:Q]; B3 = W_gu B2; X = W_down B3[:I] (W_PTRS[l, 0..3] the four
    matrices' addresses, BN_i x BK_i the tiles of product i), a grid barrier after each product. CTR is 0 at
    launch. MATVEC False: the barriers alone (what they cost). ONE: one column block per program (`_matvec`).
    UNROLLED > 0: the layer loop unrolled at compile time (that many layers; `layers` ignored), so each product's
    K loop is outermost in its own code, as in a standalone kernel."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if UNROLLED > 0:
        for l in tl.static_range(UNROLLED):
            _layer(l, UNROLLED, W_PTRS, X, B1, B2, B3, CTR, spin_ns, pid, G, D, QKV, Q, I2, I, BN0, BK0, BN1, BK1,
                   BN2, BK2, BN3, BK3, PF_BYTES, SPIN_LIMIT, SLEEP_NS, MATVEC, ONE)
    else:
        for l in range(layers):
            _layer(l, layers, W_PTRS, X, B1, B2, B3, CTR, spin_ns, pid, G, D, QKV, Q, I2, I, BN0, BK0, BN1, BK1,
                   BN2, BK2, BN3, BK3, PF_BYTES, SPIN_LIMIT, SLEEP_NS, MATVEC, ONE)


def one_block_tiles(ns: list[int], grid: int) -> list[tuple[int, int]]:
    """Per product of N columns: (BLOCK_N, BLOCK_K) with BLOCK_N the smallest power of two >= 16 whose blocks the
    grid covers at one block a program, and BLOCK_K keeping a weight tile at 16 KB (32 to 256)."""
    out = []
    for n in ns:
        bn = 16
        while -(-n // bn) > grid:
            bn *= 2
        out.append((bn, max(32, min(256, 8192 // bn))))
    return out


class Chain:
    """`layers` layers of random bf16 weights of one set's shapes, and the buffers both ways share."""

    def __init__(self, name: str, layers: int):
        D, Q, KV, I = SETS[name]
        self.D, self.Q, self.QKV, self.I, self.n = D, Q, Q + KV, I, layers
        rnd = lambda *s: (torch.randn(*s, device="cuda") * s[-1] ** -0.5).to(torch.bfloat16)  # noqa: E731
        self.w = [(rnd(Q + KV, D), rnd(D, Q), rnd(2 * I, D), rnd(D, I)) for _ in range(layers)]
        self.ptrs = torch.tensor([[m.data_ptr() for m in ws] for ws in self.w], dtype=torch.int64, device="cuda")
        self.x0 = rnd(1, D)
        self.x = torch.empty(1, D, dtype=torch.bfloat16, device="cuda")
        self.b1 = torch.empty(1, Q + KV, dtype=torch.bfloat16, device="cuda")
        self.b2 = torch.empty(1, D, dtype=torch.bfloat16, device="cuda")
        self.b3 = torch.empty(1, 2 * I, dtype=torch.bfloat16, device="cuda")
        self.ctr = torch.zeros(1, dtype=torch.int32, device="cuda")

    def layer_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.w[0])

    def chain(self, use_pdl: bool):
        def run() -> None:
            self.x.copy_(self.x0)
            for wq, wo, wgu, wd in self.w:
                fl.fused_linear(self.x, wq, out=self.b1, use_pdl=use_pdl)
                fl.fused_linear(self.b1[:, : self.Q], wo, out=self.b2, use_pdl=use_pdl)
                fl.fused_linear(self.b2, wgu, out=self.b3, use_pdl=use_pdl)
                fl.fused_linear(self.b3[:, : self.I], wd, out=self.x, use_pdl=use_pdl)
        return run

    def products(self) -> list[int]:
        """Output columns of the four products."""
        return [self.QKV, self.D, 2 * self.I, self.D]

    def launch_args(self, tiles: list[tuple[int, int]], pf_bytes: int, spin_s: float, sleep_ns: int, matvec: bool,
                    one: int, unrolled: bool = False) -> tuple[tuple, dict]:
        tile_kw = {f"{b}{i}": t[j] for i, t in enumerate(tiles) for j, b in enumerate(("BN", "BK"))}
        return ((self.ptrs, self.x, self.b1, self.b2, self.b3, self.ctr, self.n, int(spin_s * 1e9)),
                dict(D=self.D, QKV=self.QKV, Q=self.Q, I2=2 * self.I, I=self.I, **tile_kw, PF_BYTES=pf_bytes,
                     SPIN_LIMIT=spin_s > 0, SLEEP_NS=sleep_ns, MATVEC=matvec, ONE=one,
                     UNROLLED=self.n if unrolled else 0))

    def persistent(self, grid: int, tiles: list[tuple[int, int]], pf_bytes: int, spin_s: float, warps: int,
                   stages: int, sleep_ns: int = 0, matvec: bool = True, one: int = 0, unrolled: bool = False):
        args, kw = self.launch_args(tiles, pf_bytes, spin_s, sleep_ns, matvec, one, unrolled)

        def run() -> None:
            self.x.copy_(self.x0)
            self.ctr.zero_()
            persistent_chain[(grid,)](*args, **kw, num_warps=warps, num_stages=stages)
        return run


def resident_per_sm(kernel, warps: int) -> int:
    """Programs of a compiled kernel one multiprocessor holds at once (registers, shared memory, threads)."""
    kernel._init_handles()  # loads the binary: n_regs is known from then on
    props = torch.cuda.get_device_properties(0)
    regs = max(kernel.n_regs, 1) * 32 * warps
    smem = max(kernel.metadata.shared, 1)
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // regs  # 64K on every NVIDIA GPU since Kepler
    by_smem = props.shared_memory_per_multiprocessor // smem
    by_threads = props.max_threads_per_multi_processor // (32 * warps)
    return min(by_regs, by_smem, by_threads)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", default="1b,8b")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--blocks-per-sm", type=int, default=2)
    p.add_argument("--block-n", type=int, default=16)
    p.add_argument("--block-k", type=int, default=256)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--pf-bytes", type=int, default=1024, help="per row, for persistent+pf (a multiple of 16)")
    p.add_argument("--spin-timeout-s", type=float, default=2.0)
    p.add_argument("--sleep-ns", type=int, default=200, help="pause between barrier polls, persistent+sleep")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    bad = [s for s in a.sets.split(",") if s not in SETS]
    if bad or a.layers < 1 or a.blocks_per_sm < 1 or a.pf_bytes % 16:
        print(f"persistent_bench: bad arguments (sets from {tuple(SETS)}, layers and blocks-per-sm >= 1, "
              f"pf-bytes a multiple of 16): {bad[0] if bad else vars(a)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("persistent_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    card, bw, have_pdl = torch.cuda.get_device_name(dev), copy_GBps(), pdl.enabled(dev)
    print(f"card: {card}; {sms} SMs; copy bandwidth {bw:.0f} GB/s; PDL {'on' if have_pdl else 'off'}", flush=True)
    rows = []
    for s in a.sets.split(","):
        c = Chain(s, a.layers)
        floor_us = c.layer_bytes() / bw / 1e3
        c.chain(have_pdl)()
        torch.cuda.synchronize()
        want = c.x.float().clone()
        ways = {"chain": c.chain(have_pdl)}
        strided = [(a.block_n, a.block_k)] * 4
        fits = sms
        for one, unrolled in ((False, False), (True, False), (True, True)):  # the fewest that fit decide the grid
            tiles = one_block_tiles(c.products(), a.blocks_per_sm * sms) if one else strided
            args, kw = c.launch_args(tiles, 0, a.spin_timeout_s, 0, True, one, unrolled)
            compiled = persistent_chain.warmup(*args, **kw, num_warps=a.warps, num_stages=a.stages, grid=(1,))
            fits = min(fits, resident_per_sm(compiled, a.warps))
            print(f"{s}: persistent kernel ({'one block a program' if one else 'strided'}"
                  f"{', unrolled' if unrolled else ''}, tiles {tiles}) {compiled.n_regs} registers, "
                  f"{compiled.metadata.shared} B shared: {resident_per_sm(compiled, a.warps)} programs fit per SM",
                  flush=True)
        grid = min(a.blocks_per_sm, fits) * sms
        one_tiles = one_block_tiles(c.products(), grid)
        print(f"{s}: grid {grid}; one-block tiles {one_tiles}", flush=True)
        for name, pf, sleep in (("persistent", 0, 0), ("persistent+pf", a.pf_bytes, 0),
                                ("persistent+sleep", 0, a.sleep_ns)):
            ways[name] = c.persistent(grid, strided, pf, a.spin_timeout_s, a.warps, a.stages, sleep)
        ways["persistent 1-block"] = c.persistent(grid, one_tiles, 0, a.spin_timeout_s, a.warps, a.stages, one=True)
        ways["persistent 1-block unrolled"] = c.persistent(grid, one_tiles, 0, a.spin_timeout_s, a.warps, a.stages,
                                                           one=True, unrolled=True)
        ways["1-block, x via L1 (unsafe)"] = c.persistent(grid, one_tiles, 0, a.spin_timeout_s, a.warps, a.stages,
                                                          one=2)
        for name, sleep in (("barriers only", 0), ("barriers only+sleep", a.sleep_ns)):
            ways[name] = c.persistent(grid, strided, 0, a.spin_timeout_s, a.warps, a.stages, sleep, matvec=False)
        for name, fn in ways.items():
            fn()
            torch.cuda.synchronize()
            err = float((c.x.float() - want).abs().max() / want.abs().max()) if "only" not in name else float("nan")
            us = captured_ms(fn, reps=20) * 1e3 / a.layers
            rows.append({"set": s, "way": name, "us_per_layer": us, "floor_us": floor_us, "err": err,
                         "excess_per_matrix_us": (us - floor_us) / 4, "grid": grid if name != "chain" else None})
            print(f"{s:4s} {name:14s} {us:8.1f} us/layer  floor {floor_us:7.1f}  x{us / floor_us:.2f}  "
                  f"excess/matrix {(us - floor_us) / 4:5.1f} us  err vs chain {err:.1e}", flush=True)
        del c
        torch.cuda.empty_cache()
    print("\n| set | way | us per layer | floor us | x floor | excess per matrix us | err vs chain |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['set']} | {r['way']} | {r['us_per_layer']:.1f} | {r['floor_us']:.1f} | "
              f"{r['us_per_layer'] / r['floor_us']:.2f} | {r['excess_per_matrix_us']:.1f} | {r['err']:.1e} |")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "persistent_bench.json").write_text(json.dumps({"card": card, "copy_GBps": bw, "rows": rows,
                                                                        "args": vars(a)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
