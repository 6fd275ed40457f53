"""Triton kernels of `pipeline.models.skinny_linear` (imported lazily: this module needs triton).

`y[M, N] = x[M, K] @ w[N, K]^T (+ bias)` for few rows (M <= 64): decode and verify steps, where the weight
read is the whole cost. A program owns BLOCK_N output columns and one slice of K (split-K); it streams its
[BLOCK_N, BLOCK_K] weight tiles once, multiplies them with the matching [M_PAD, BLOCK_K] block of x
(tensor cores, rows padded to M_PAD >= 16; the padding costs compute, which is idle here) and accumulates in
float32. One split writes y directly (bias added, cast to y's dtype); several write float32 partials
[SPLIT, M, N] that `skinny_linear_reduce` sums (bias, cast).

With TRITON_INTERPRET=1 set before triton's first import the kernels run in Triton's CPU interpreter (tests).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def skinny_linear_kernel(
    X, W, BIAS, Y, PART,
    M, N, K, K_PER_SPLIT,
    s_xm, s_xk, s_wn, s_wk, s_ym, s_yn,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SINGLE: tl.constexpr,  # one split: write y (with bias); else float32 partials
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,  # every split's K range is a whole number of BLOCK_K blocks: no K mask
    DOT_IN_F32: tl.constexpr,  # interpreter + bf16 only: Triton 3.6's interpreter multiplies bf16 as raw bits
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 weights (Triton's default there is TF32), else "tf32"
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k0 = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    # int64 row offsets: N * K can pass 2**31 elements (a 128k x 16k output layer).
    w_rows = W + offs_n.to(tl.int64)[None, :] * s_wn  # [1, BLOCK_N]
    x_rows = X + offs_m[:, None] * s_xm  # [M_PAD, 1]
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + offs_k0
        if EVEN_K:
            x = tl.load(x_rows + offs_k[None, :] * s_xk, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_rows + offs_k[:, None] * s_wk, mask=n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        else:
            k_ok = offs_k < k_hi
            x = tl.load(x_rows + offs_k[None, :] * s_xk, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + offs_k[:, None] * s_wk, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if DOT_IN_F32:
            x, w = x.to(tl.float32), w.to(tl.float32)
        else:
            x = x.to(W.dtype.element_ty)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)

    mask = m_ok[:, None] & n_ok[None, :]
    if SINGLE:
        if HAS_BIAS:
            acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * s_ym + offs_n[None, :] * s_yn, acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(PART + (split * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)


@triton.jit
def skinny_linear_reduce(
    PART, BIAS, Y,
    M, N, SPLITS,
    s_ym, s_yn,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # flat index m * N + n
    ok = offs < M * N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(PART + s * M * N + offs, mask=ok, other=0.0)
    m = offs // N
    n = offs % N
    if HAS_BIAS:
        acc += tl.load(BIAS + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * s_ym + n * s_yn, acc.to(Y.dtype.element_ty), mask=ok)


def interpreted() -> bool:
    """Whether these kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 before triton's import)."""
    return not isinstance(skinny_linear_kernel, triton.runtime.JITFunction)


if interpreted():  # the K loop's data-dependent bounds need the interpreter fix of the attention kernels
    from pipeline.models.decode_attention_triton import _interpreter_scalar_index

    _interpreter_scalar_index()
