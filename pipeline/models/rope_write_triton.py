"""Triton kernel of `pipeline.models.rope_write` (imported lazily: this module needs triton).

`rope_cache_write_kernel`: grid (B * T,). A program takes one token row of the fused q/k/v projection output,
(RMS-normalises each query and key head first, where the model has q/k norms: Qwen3, and Gemma 3 with its
(1 + weight) scale) rotates its query and key
heads (RoPE, HF's rotate-half convention, float32 math, one rounding), writes the
queries stacked per KV head (`q[b, h // G, (h % G) * T + t, :]`, the attention kernels' layout) and the
rotated keys and the values into the row's slot of the cache at the token's position. It replaces the RoPE,
permute and two `index_copy_` kernels of the reference path with one launch per layer.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rope_cache_write_kernel(
    QKV, COS, SIN, POS, RPOS, SLOTS, KC, VC, QOUT, QN, KN,
    T, EPS,
    s_qkv_r, s_cos, s_pb, s_pt,
    s_kn, s_kh, s_kl,
    s_vn, s_vh, s_vl,
    s_ob, s_oh, s_om,
    H: tl.constexpr,
    HKV: tl.constexpr,
    D: tl.constexpr,
    HALF_P: tl.constexpr,  # >= D // 2, a power of two
    HEADS_P: tl.constexpr,  # >= H + HKV
    KV_P: tl.constexpr,  # >= HKV
    D_P: tl.constexpr,  # >= D
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pipeline.models.pdl)
    QK_NORM: tl.constexpr = False,  # RMSNorm over each q and k head (weights QN, KN [D]) before RoPE
    NORM_OFFSET: tl.constexpr = False,  # with QK_NORM: scale by (1 + weight) in float32 (Gemma 3)
):
    r = tl.program_id(0)  # token row b * T + t
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # q/k/v come from the kernel before
        tl.extra.cuda.gdc_launch_dependents()
    b = r // T
    t = r % T
    p = tl.load(POS + b * s_pb + t * s_pt).to(tl.int64)  # the cache index written
    rp = tl.load(RPOS + b * s_pb + t * s_pt).to(tl.int64)  # the RoPE position (a tree node's: by depth)
    slot = tl.load(SLOTS + b).to(tl.int64)
    G: tl.constexpr = H // HKV
    HALF: tl.constexpr = D // 2

    j = tl.arange(0, HALF_P)
    j_ok = j < HALF
    c1 = tl.load(COS + rp * s_cos + j, mask=j_ok, other=0.0).to(tl.float32)
    c2 = tl.load(COS + rp * s_cos + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + rp * s_cos + j, mask=j_ok, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + rp * s_cos + HALF + j, mask=j_ok, other=0.0).to(tl.float32)

    hd = tl.arange(0, HEADS_P)  # q heads 0..H-1, then k heads H..H+HKV-1
    h_ok = hd < H + HKV
    row = QKV + r * s_qkv_r + hd[:, None] * D
    ld = h_ok[:, None] & j_ok[None, :]
    x1 = tl.load(row + j[None, :], mask=ld, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + j[None, :], mask=ld, other=0.0).to(tl.float32)
    is_q = hd < H
    if QK_NORM:  # HF's RMSNorm over the head's D features, in float32
        inv = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + EPS)  # [HEADS_P]
        wq1 = tl.load(QN + j, mask=j_ok, other=0.0).to(tl.float32)
        wq2 = tl.load(QN + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
        wk1 = tl.load(KN + j, mask=j_ok, other=0.0).to(tl.float32)
        wk2 = tl.load(KN + HALF + j, mask=j_ok, other=0.0).to(tl.float32)
        if NORM_OFFSET:
            wq1 += 1.0
            wq2 += 1.0
            wk1 += 1.0
            wk2 += 1.0
        x1 = x1 * inv[:, None] * tl.where(is_q[:, None], wq1[None, :], wk1[None, :])
        x2 = x2 * inv[:, None] * tl.where(is_q[:, None], wq2[None, :], wk2[None, :])
    o1 = x1 * c1[None, :] - x2 * s1[None, :]  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
    o2 = x2 * c2[None, :] + x1 * s2[None, :]

    q_row = QOUT + b * s_ob + (hd // G) * s_oh + ((hd % G) * T + t) * s_om
    st = is_q[:, None] & j_ok[None, :]
    tl.store(q_row[:, None] + j[None, :], o1.to(QOUT.dtype.element_ty), mask=st)
    tl.store(q_row[:, None] + HALF + j[None, :], o2.to(QOUT.dtype.element_ty), mask=st)

    is_k = (hd >= H) & h_ok
    k_row = KC + slot * s_kn + (hd - H) * s_kh + p * s_kl
    st = is_k[:, None] & j_ok[None, :]
    tl.store(k_row[:, None] + j[None, :], o1.to(KC.dtype.element_ty), mask=st)
    tl.store(k_row[:, None] + HALF + j[None, :], o2.to(KC.dtype.element_ty), mask=st)

    vh = tl.arange(0, KV_P)
    d = tl.arange(0, D_P)
    vm = (vh < HKV)[:, None] & (d < D)[None, :]
    v = tl.load(QKV + r * s_qkv_r + (H + HKV) * D + vh[:, None] * D + d[None, :], mask=vm, other=0.0)
    tl.store(VC + slot * s_vn + vh[:, None] * s_vh + p * s_vl + d[None, :], v.to(VC.dtype.element_ty), mask=vm)


def interpreted() -> bool:
    """Whether this kernel runs in Triton's CPU interpreter (TRITON_INTERPRET=1 before triton's import)."""
    return not isinstance(rope_cache_write_kernel, triton.runtime.JITFunction)
