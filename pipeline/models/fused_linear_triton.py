"""Triton kernel of `pipeline.models.fused_linear` (imported lazily: this module needs triton).

`fused_linear_kernel`: `y[M, N] = epilogue(prologue(x)[M, K] @ w[N, K]^T + bias)` for few rows, one program
per BLOCK_N output columns over the whole depth K (no split, so the epilogue sees finished sums):

- prologue NORM: RMSNorm of x's rows. The main loop feeds `x * weight` (one rounding) to the product, and the
  sums are multiplied by the rows' 1/rms after the loop, computed in float32 by a pass over x then (it is small,
  and in L2; `_rstd_rows`). That is one rounding fewer than `graphs.rms_norm`'s `weight * (x * rstd).to(dtype)`
  and half the loop's per-element work, which is what a normed linear costs over a plain one (H100, 1B and 8B
  batch-1 steps 0.5-2.5% faster than those eager roundings in the loop; `python -m ops.linear_chain_bench`). (Summing
  the squares inside the main loop instead measured 4-17% slower: a reduction across threads per tile, or a
  second accumulator, costs more than re-reading x from L2);
- x addressing: row m = (m // XT, m % XT) with strides (s_xb, s_xt), column k = (k // XD, k % XD) with
  strides (s_xj, 1). A plain [M, K] matrix is XT = 1, XD = 1; the attention output [B, Hkv, G*T, D] read as
  [B*T, H*D] is XT = T, XD = D, s_xj = T*D (the permute the eager path copies);
- prologue NORM_OFFSET (Gemma): the norm scales by (1 + weight), added in float32, and x times it rounded once;
- epilogue GATE: w holds gate rows [0, N) and up rows [N_UP, N_UP + N); y = silu(gate) * up (GELU: Gemma's
  gelu_pytorch_tanh(gate) * up), each rounded as the eager `act(gate) * up` rounds;
- epilogue RESIDUAL: y = res + (x @ w^T + bias) rounded to x's dtype first (the eager `x + linear(...)`);
  res may be y itself (in place: each element is read and written by the same program);
- otherwise y = (x @ w^T + bias) rounded to x's dtype, stored in y's dtype (float32 logits: the eager
  `linear(...).float()`).
- HAS_SCALE: w is float8 (e4m3) with a float32 scale per row; tiles are widened to x's dtype (exact) for the
  product, and each column's sum is multiplied by its row's scale before the bias. Half the weight bytes: for
  drafters (`quantize_fp8`), whose precision changes only how often drafts are accepted, never the output.

- PUSH (tensor parallel, `pipeline.models.tp_fused`): the float32 result (bias included, unrounded) goes not
  to y but to this rank's slot of every rank's partial buffer of a site (peer memory), a -0.0 result sent as
  +0.0 (-0.0 marks a slot not written yet). `reduce_partials_kernel` is the other half: it polls its columns'
  slots until every rank's partial is in and adds them to the residual stream in rank order.

GEMV (one row, `fused_linear(..., gemv=True)`): no tensor-core tile. Each program multiplies x's row by its weight
tiles on the CUDA cores into [BLOCK_K, BLOCK_N] float32 partial sums and reduces them once after the loop; the
weight tile AHEAD steps on, and x's next tile (with the norm weight's), are loaded before each step's products.
The prologue and epilogue are the same; only the order of the float32 additions differs from the tensor-core loop.
Float8 weights are widened by their bits (`_widen`: the value times 2**-120, which x's 2**64 and the sums' 2**56
undo), two integer operations an element instead of the hardware's two conversions.

`add_norm_kernel`: x += rms_norm(y) * (1 + weight), in place, a row a program: Gemma's norms after attention and
after the MLP, which need a linear's whole output row and so cannot sit in its epilogue.

USE_PDL: programmatic dependent launch (`pipeline.models.pdl`): wait for the previous kernel before touching x,
res or y; let the next kernel launch after the K loop (an earlier trigger measured 5-10% slower on an H100).
With PRELOAD the first K tile of the weight (peeled from the loop) is loaded into registers before the wait
(weights are never written by any kernel); `fused_linear` takes it for float8 weights by default, where it
measured faster (docs/benchmarks.md).

With TRITON_INTERPRET=1 set before triton's first import the kernel runs in Triton's CPU interpreter (tests;
no PDL there).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rstd_rows(X, M, K, XT, s_xb, s_xt, s_xj, eps, XD: tl.constexpr, M_PAD: tl.constexpr, R_PAD: tl.constexpr,
               NORM_CHUNK: tl.constexpr):
    """1 / rms of each of x's M rows, as [M_PAD] float32 (0 past M): a pass over x (small, and in L2) in
    [R_PAD, NORM_CHUNK] tiles, R_PAD = M rounded up to a power of two (no tensor-core product here, so no
    padding to 16 rows), NORM_CHUNK as wide as the registers allow: a few dependent L2 round trips, one for
    K <= 8192 at one row (in [16, BLOCK_K] tiles it would be K / BLOCK_K of them: 3.5 us more per kernel on an H100
    at K = 4096; a row at a time, an estimated 1.2 us more per row)."""
    offs_r = tl.arange(0, R_PAD)
    offs_c = tl.arange(0, NORM_CHUNK)
    rows = X + (offs_r // XT) * s_xb + (offs_r % XT) * s_xt
    sq = tl.zeros([R_PAD, NORM_CHUNK], dtype=tl.float32)
    for k0 in range(0, K, NORM_CHUNK):
        offs_k = k0 + offs_c
        cols = (offs_k // XD) * s_xj + offs_k % XD
        xs = tl.load(rows[:, None] + cols[None, :], mask=(offs_r < M)[:, None] & (offs_k < K)[None, :],
                     other=0.0).to(tl.float32)
        sq += xs * xs
    rstd_r = 1.0 / tl.sqrt(tl.sum(sq, axis=1) / K + eps)  # [R_PAD]
    offs_m = tl.arange(0, M_PAD)  # spread over the M_PAD rows of the product's tile (0 past M)
    pick = (offs_m[:, None] == offs_r[None, :]) & (offs_r < M)[None, :]
    return tl.sum(tl.where(pick, rstd_r[None, :], 0.0), axis=1)


@triton.jit
def _mul_rounded(a, b, IN_F32: tl.constexpr):
    """a * b rounded once to their (half) dtype: the product of two half-precision numbers is exact in float32, so
    the GPU's native half multiply gives the same bits as float32 math then rounding (IN_F32: the interpreter,
    whose bf16 arithmetic is not to be trusted)."""
    if IN_F32:
        return (a.to(tl.float32) * b.to(tl.float32)).to(a.dtype)
    return a * b


@triton.jit
def _load_x(x_rows, m_ok, offs_k, s_xj, K, XD: tl.constexpr, EVEN_K: tl.constexpr):
    """x's [M_PAD, BLOCK_K] tile at columns offs_k (0 past M and K)."""
    cols = (offs_k // XD) * s_xj + offs_k % XD
    if EVEN_K:
        x = tl.load(x_rows[:, None] + cols[None, :], mask=m_ok[:, None], other=0.0)
    else:
        x = tl.load(x_rows[:, None] + cols[None, :], mask=m_ok[:, None] & (offs_k < K)[None, :], other=0.0)
    return x


@triton.jit
def _w_tile(rows, offs_k, n_ok, K, EVEN_K: tl.constexpr):
    """The weight's [BLOCK_K, BLOCK_N] tile at depths offs_k of the rows `rows` [1, BLOCK_N] (0 past N and K)."""
    if EVEN_K:
        w = tl.load(rows + offs_k[:, None], mask=n_ok[None, :], other=0.0)
    else:
        w = tl.load(rows + offs_k[:, None], mask=n_ok[None, :] & (offs_k < K)[:, None], other=0.0)
    return w


@triton.jit
def _prep_x(x, NORM_W, offs_k, K, DT: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr,
            DOT_IN_F32: tl.constexpr, NORM_OFFSET: tl.constexpr = False):
    """x's tile as the product takes it: times the norm weight (NORM_OFFSET: 1 + weight, in float32), rounded (the
    rows' 1/rms scales the sums after the loop), in DT (float32 with DOT_IN_F32)."""
    if NORM:
        if EVEN_K:
            nw = tl.load(NORM_W + offs_k)
        else:
            nw = tl.load(NORM_W + offs_k, mask=offs_k < K, other=0.0)
        if NORM_OFFSET:  # Gemma: (1 + weight) in float32, the product rounded once
            x = (x.to(tl.float32) * (nw.to(tl.float32) + 1.0)[None, :]).to(DT)
        else:
            x = _mul_rounded(x, nw.to(DT)[None, :], DOT_IN_F32)  # one product per element; x is already in DT
    else:
        x = x.to(DT)
    if DOT_IN_F32:
        x = x.to(tl.float32)
    return x


@triton.jit
def _x_raw(X, NORM_W, offs_k, K, s_xj, XD: tl.constexpr, NORM: tl.constexpr, NORM_OFFSET: tl.constexpr = False):
    """(x's first row, the norm weight) at columns offs_k as loaded, 0 past K (without NORM, x twice; NORM_OFFSET:
    1 + the weight, in float32)."""
    cols = (offs_k // XD) * s_xj + offs_k % XD
    x = tl.load(X + cols, mask=offs_k < K, other=0.0)
    nw = x
    if NORM:
        if NORM_OFFSET:
            nw = tl.load(NORM_W + offs_k, mask=offs_k < K, other=0.0).to(tl.float32) + 1.0
        else:
            nw = tl.load(NORM_W + offs_k, mask=offs_k < K, other=0.0).to(x.dtype)
    return x, nw


@triton.jit
def _x_prep(x, nw, DT: tl.constexpr, NORM: tl.constexpr, IN_F32: tl.constexpr, NORM_OFFSET: tl.constexpr = False):
    """`_x_raw`'s row as the product takes it (`_prep_x`'s rounding), in float32."""
    if NORM:
        if NORM_OFFSET:
            x = (x.to(tl.float32) * nw).to(DT)
        else:
            x = _mul_rounded(x.to(DT), nw.to(DT), IN_F32)
    return x.to(tl.float32)


@triton.jit
def _gelu_tanh(x):
    """F.gelu(x, approximate="tanh") in float32: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), the tanh as
    2 sigmoid(2z) - 1."""
    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return x * tl.sigmoid(2.0 * z)  # 0.5 x (1 + tanh(z)) = x sigmoid(2z)


@triton.jit
def _widen(w, HAS_SCALE: tl.constexpr):
    """A weight tile in float32 for the CUDA-core product. Float8 (HAS_SCALE): e4m3's bits s.eeee.mmm moved into a
    float32's sign, the exponent field's low four bits and the mantissa's top three, which is its value times 2**-120
    exactly (normal and subnormal alike; e4m3's NaN code reads as a finite number): the sign-extended byte shifted by
    20 keeps the sign in bit 31, and one mask clears bits 27-30 and 0-19. Two integer operations an element where the
    hardware conversion takes two conversions (e4m3x2 -> f16x2, f16 -> f32) of the SM's slower conversion units,
    whose throughput bounded the loop (H100: the 1B's float8 layer 37.1 -> 33.3 us, the 8B's 100.0 -> 90.9)."""
    if HAS_SCALE:
        b = w.to(tl.int8, bitcast=True).to(tl.int32)
        return ((b << 20) & -2014314496).to(tl.float32, bitcast=True)  # -2014314496 = 0x87F00000
    return w.to(tl.float32)


@triton.jit
def _dot_acc(acc, x, w, DT: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_IN_F32: tl.constexpr):
    """acc + x @ w in float32 (float8 w widened to DT first: exact; its row scales multiply the sums later)."""
    if HAS_SCALE:
        w = w.to(DT)
    if DOT_IN_F32:
        acc += tl.dot(x, w.to(tl.float32), input_precision="ieee")
    else:
        acc += tl.dot(x, w)
    return acc


@triton.jit
def fused_linear_kernel(
    X, NORM_W, W, W_SCALE, BIAS, RES, Y,
    PEER_PARTS,
    M, N, K, N_UP, XT,
    s_xb, s_xt, s_xj, s_wn, s_rm, s_ym,
    s_pm, my_part,
    eps,
    XD: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM: tl.constexpr,
    GATE: tl.constexpr,
    RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SCALE: tl.constexpr,  # w is float8 with one float32 scale per row (W_SCALE): w_true = w * scale
    EVEN_K: tl.constexpr,  # K is a whole number of BLOCK_K tiles: no K mask
    R_PAD: tl.constexpr,  # with NORM: M rounded up to a power of two (the 1/rms pass's rows)
    NORM_CHUNK: tl.constexpr,  # with NORM: the 1/rms pass's tile width
    USE_PDL: tl.constexpr,
    PRELOAD: tl.constexpr,  # load the first K tile of the weights before the PDL wait (peeled from the loop)
    GEMV: tl.constexpr,  # M == 1: the product on the CUDA cores, not the tensor cores
    AHEAD: tl.constexpr,  # with GEMV: weight tiles loaded ahead of the one multiplied (1 or 2)
    DOT_IN_F32: tl.constexpr,  # interpreter + bf16 only: Triton 3.6's interpreter multiplies bf16 as raw bits
    PUSH: tl.constexpr,  # tensor parallel: the float32 result goes to every rank's partials of a site, not to Y
    N_RANKS: tl.constexpr,
    NORM_OFFSET: tl.constexpr = False,  # with NORM: the norm scales by (1 + weight) in float32 (Gemma)
    GELU: tl.constexpr = False,  # with GATE: gelu_pytorch_tanh(gate) * up (GeGLU), not silu
):
    DT = X.dtype.element_ty  # the model's activation dtype: products and roundings in it
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k0 = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    rows_n = offs_n.to(tl.int64)  # int64: N * K can pass 2**31 elements (a 128k x 16k output layer)
    w_rows = W + rows_n[None, :] * s_wn  # [1, BLOCK_N]
    u_rows = W + (rows_n + N_UP)[None, :] * s_wn
    if PRELOAD:  # weights are never written by any kernel: their first tile may load before the PDL wait
        w0 = _w_tile(w_rows, offs_k0, n_ok, K, EVEN_K)
        u0 = w0
        if GATE:
            u0 = _w_tile(u_rows, offs_k0, n_ok, K, EVEN_K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # every earlier kernel has finished: activations are ready

    x_rows = X + (offs_m // XT) * s_xb + (offs_m % XT) * s_xt  # [M_PAD]
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    if GEMV:  # one row: products on the CUDA cores into [BLOCK_K, BLOCK_N] partial sums, reduced once after the
        # loop. The weight tile AHEAD steps on and x's next tile are loaded before this step's products, so AHEAD + 1
        # weight tiles are in flight a program and no step waits on an L2 round trip for x.
        part = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        part_u = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
        if PRELOAD:
            w = w0
            u = u0
        else:
            w = _w_tile(w_rows, offs_k0, n_ok, K, EVEN_K)
            u = w
            if GATE:
                u = _w_tile(u_rows, offs_k0, n_ok, K, EVEN_K)
        w1 = w  # AHEAD == 2: the tile after w
        u1 = u
        if AHEAD == 2:
            w1 = _w_tile(w_rows, offs_k0 + BLOCK_K, n_ok, K, False)
            if GATE:
                u1 = _w_tile(u_rows, offs_k0 + BLOCK_K, n_ok, K, False)
        xr, nw = _x_raw(X, NORM_W, offs_k0, K, s_xj, XD, NORM, NORM_OFFSET)
        # `_widen`'s float8 bits are the weights times 2**-120: x times 2**64 and the sums times 2**56 put it back,
        # every product exact as before unless |x * w| < 2**-70 (then within 2**-93 of it).
        x_shift = 18446744073709551616.0 if HAS_SCALE else 1.0  # 2**64
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_k0
            w_new = _w_tile(w_rows, offs_k + AHEAD * BLOCK_K, n_ok, K, False)  # 0 past K: nothing read
            u_new = w_new
            if GATE:
                u_new = _w_tile(u_rows, offs_k + AHEAD * BLOCK_K, n_ok, K, False)
            xr_next, nw_next = _x_raw(X, NORM_W, offs_k + BLOCK_K, K, s_xj, XD, NORM, NORM_OFFSET)
            xv = _x_prep(xr, nw, DT, NORM, DOT_IN_F32, NORM_OFFSET) * x_shift
            part += xv[:, None] * _widen(w, HAS_SCALE)
            if GATE:
                part_u += xv[:, None] * _widen(u, HAS_SCALE)
            if AHEAD == 2:
                w = w1
                w1 = w_new
                u = u1
                u1 = u_new
            else:
                w = w_new
                u = u_new
            xr = xr_next
            nw = nw_next
        unshift = 72057594037927936.0 if HAS_SCALE else 1.0  # 2**56
        acc = tl.where(offs_m[:, None] == 0, tl.sum(part, axis=0)[None, :] * unshift, 0.0)
        if GATE:
            acc_u = tl.where(offs_m[:, None] == 0, tl.sum(part_u, axis=0)[None, :] * unshift, 0.0)
    else:
        if PRELOAD:  # the first K tile's weights came in before the wait; x's tile only now
            x = _load_x(x_rows, m_ok, offs_k0, s_xj, K, XD, EVEN_K)
            x = _prep_x(x, NORM_W, offs_k0, K, DT, EVEN_K, NORM, DOT_IN_F32, NORM_OFFSET)
            acc = _dot_acc(acc, x, w0, DT, HAS_SCALE, DOT_IN_F32)
            if GATE:
                acc_u = _dot_acc(acc_u, x, u0, DT, HAS_SCALE, DOT_IN_F32)
        for k0 in range(BLOCK_K * PRELOAD, K, BLOCK_K):
            offs_k = k0 + offs_k0
            x = _load_x(x_rows, m_ok, offs_k, s_xj, K, XD, EVEN_K)
            w = _w_tile(w_rows, offs_k, n_ok, K, EVEN_K)  # [BLOCK_K, BLOCK_N]
            x = _prep_x(x, NORM_W, offs_k, K, DT, EVEN_K, NORM, DOT_IN_F32, NORM_OFFSET)
            acc = _dot_acc(acc, x, w, DT, HAS_SCALE, DOT_IN_F32)
            if GATE:
                u = _w_tile(u_rows, offs_k, n_ok, K, EVEN_K)
                acc_u = _dot_acc(acc_u, x, u, DT, HAS_SCALE, DOT_IN_F32)

    if USE_PDL:  # the K loop is done: let the next kernel launch
        tl.extra.cuda.gdc_launch_dependents()
    if NORM:  # sum_k W[n, k] * (x[k] * w[k] / rms) = (1 / rms) * sum_k W[n, k] * (x[k] * w[k])
        rstd = _rstd_rows(X, M, K, XT, s_xb, s_xt, s_xj, eps, XD, M_PAD, R_PAD, NORM_CHUNK)
        acc = acc * rstd[:, None]
        if GATE:
            acc_u = acc_u * rstd[:, None]
    if HAS_SCALE:
        acc = acc * tl.load(W_SCALE + offs_n, mask=n_ok, other=0.0)[None, :]
        if GATE:
            acc_u = acc_u * tl.load(W_SCALE + N_UP + offs_n, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATE:
            acc_u += tl.load(BIAS + N_UP + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = acc.to(DT).to(tl.float32)  # what F.linear returns
    mask = m_ok[:, None] & n_ok[None, :]
    if GATE:
        up = acc_u.to(DT).to(tl.float32)
        if GELU:
            act = _gelu_tanh(out).to(DT).to(tl.float32)  # F.gelu(approximate="tanh"), rounded
        else:
            act = (out / (1.0 + tl.exp(-out))).to(DT).to(tl.float32)  # F.silu, rounded
        out = act * up
    if RESIDUAL:
        res = tl.load(RES + offs_m[:, None] * s_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        out = res + out
    if PUSH:  # this rank's partial, unrounded, into its slot of every rank's partials
        # The reduce waits for the values themselves, -0.0 meaning "not yet": send +0.0 for it
        acc = tl.where(acc == 0.0, 0.0, acc)
        for r in tl.static_range(N_RANKS):
            dst = tl.load(PEER_PARTS + r).to(tl.pointer_type(tl.float32)) + my_part
            tl.store(dst + offs_m[:, None] * s_pm + offs_n[None, :], acc, mask=mask)
    else:
        tl.store(Y + offs_m[:, None] * s_ym + offs_n[None, :], out.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def add_norm_kernel(X, Y, NORM_W, C, s_xm, s_ym, eps, BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """x[m] += rms_norm(y[m]) * (1 + weight), one row a program (Gemma's norms after attention and after the MLP,
    before the residual add): the norm in float32 rounded to x's dtype, then the sum rounded, as the eager
    `x + post_norm(y)` rounds."""
    m = tl.program_id(0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, BLOCK_C)
    ok = offs < C
    y = tl.load(Y + m * s_ym + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(y * y, axis=0) / C + eps)
    w = tl.load(NORM_W + offs, mask=ok, other=0.0).to(tl.float32)
    DT = X.dtype.element_ty
    normed = (y * rstd * (1.0 + w)).to(DT).to(tl.float32)
    x = tl.load(X + m * s_xm + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(X + m * s_xm + offs, (x + normed).to(DT), mask=ok)


@triton.jit
def _trap():
    """Abort the kernel: the process's CUDA context fails, and with it the process's next CUDA call."""
    tl.inline_asm_elementwise("trap; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


EMPTY = tl.constexpr(-2147483648)  # the bits of float32 -0.0: a partial not written yet (data waits; `tp_fused`)


@triton.jit
def _await_parts(PARTS, s_pr, s_pm, offs_m, offs_n, mask, spin_ns, N_RANKS: tl.constexpr,
                 RANKS_POW2: tl.constexpr, SPIN_LIMIT: tl.constexpr):
    """The N_RANKS partials of these columns as float32 [RANKS_POW2, M_PAD, BLOCK_C] (0 where masked), polled
    (volatile loads, one round trip a poll) until none is still EMPTY; then their slots are EMPTY again, for the
    site that reuses them. Trap after spin_ns with SPIN_LIMIT."""
    r = tl.arange(0, RANKS_POW2)
    ptrs = PARTS.to(tl.pointer_type(tl.int32)) + r[:, None, None] * s_pr + offs_m[None, :, None] * s_pm \
        + offs_n[None, None, :]
    ok = (r < N_RANKS)[:, None, None] & mask[None, :, :]
    bits = tl.load(ptrs, mask=ok, other=0, volatile=True)
    t0 = tl.extra.cuda.globaltimer() if SPIN_LIMIT else 0
    while tl.max(tl.where(bits == EMPTY, 1, 0)) > 0:
        if SPIN_LIMIT:
            if tl.extra.cuda.globaltimer() - t0 > spin_ns:
                _trap()
        bits = tl.load(ptrs, mask=ok, other=0, volatile=True)
    tl.store(ptrs, tl.full(bits.shape, EMPTY, tl.int32), mask=ok)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def reduce_partials_kernel(
    X, PARTS,
    M, C, s_xm, s_pr, s_pm, spin_ns,
    N_RANKS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
    RANKS_POW2: tl.constexpr,
):
    """Tensor parallel, the sum as a kernel of its own (`tp_fused.SiteBuffers.reduce_into`): X[m, cols] += the
    N_RANKS partials of a site once every partial of these columns is written, summed onto X's value in float32
    in rank order and rounded once, so every rank computes the same bits."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_m = tl.arange(0, M_PAD)
    mask = (offs_m < M)[:, None] & (offs_n < C)[None, :]
    # No PDL wait for the producer's grid (`tp_fused`: the data orders everything this kernel reads).
    parts = _await_parts(PARTS, s_pr, s_pm, offs_m, offs_n, mask, spin_ns, N_RANKS, RANKS_POW2, SPIN_LIMIT)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ptrs = offs_m[:, None] * s_xm + offs_n[None, :]
    acc = tl.load(X + ptrs, mask=mask, other=0.0).to(tl.float32)
    r = tl.arange(0, RANKS_POW2)[:, None, None]
    for i in tl.static_range(N_RANKS):  # rank order (one term of each sum is not 0)
        acc += tl.sum(tl.where(r == i, parts, 0.0), axis=0)
    tl.store(X + ptrs, acc.to(X.dtype.element_ty), mask=mask)


def interpreted() -> bool:
    """Whether this kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 before triton's import)."""
    return not isinstance(fused_linear_kernel, triton.runtime.JITFunction)


if interpreted():  # the K loops' data-dependent bounds need the interpreter fix of the attention kernels
    from pipeline.models.decode_attention_triton import _interpreter_scalar_index

    _interpreter_scalar_index()
