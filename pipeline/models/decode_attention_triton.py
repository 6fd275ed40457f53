"""Triton kernels of `pipeline.models.decode_attention` (imported lazily: this module needs triton).

Split-KV ("flash-decoding") attention over the slot-indexed cache, read in place:

- `slot_attention_split`: grid (key splits, B * Hkv, query blocks). A program takes one row b, one KV head h,
  a block of BLOCK_M stacked query rows (index g*T + t) and one chunk of key positions (below); it reads
  keys/values straight from `cache[slots[b], h, key, :]` (explicit strides: the cache and its slices are not
  contiguous), runs an online softmax in float32 (scores in log2 units, exp2), and writes either the final
  output (one split) or its un-normalised partial sum, running maximum and denominator.
- `slot_attention_combine`: grid (B * Hkv, query blocks); merges the partials of every split (log-sum-exp).

Chunks are sized on the device from the positions, not from the grid: a program block needs the keys
[0, n) with n = its largest query position + 1 (at most S), and cuts them into chunks of
max(MIN_CHUNK, cdiv(n, NUM_SPLITS)) keys rounded up to BLOCK_N. Splits past the last chunk return at once and
the combine reads only the chunks in use. So the grid (NUM_SPLITS, sized for S, the cache's capacity) need not
follow the context: one CUDA graph serves every context length, and a short context still spreads over as many
programs as its length warrants. With a sliding window the loop starts at the block's smallest position -
window + 1; with attention sinks as well (StreamingLLM: the first `sinks` positions stay visible), split 0 first
reads the sink keys below that start. A query row whose chunk holds no visible key keeps max = -inf and
denominator 0; the combine gives such a split weight 0. Every real query row sees at least its own position, so
its total is > 0.

Token trees (TREE): the call's T fed tokens are the nodes of a tree region starting at the row's first fed
position (`pipeline.models.tree_attention`). A query sees every key before the region and, inside it, the nodes
whose bits its ancestor set (TBITS, int64 per fed token) holds; its sliding window is measured from its RoPE
position (QROPE: region start + depth), and region keys, all within T of it, are inside any window >= T.

With TRITON_INTERPRET=1 in the environment before triton is first imported, the kernels run in Triton's CPU
interpreter on CPU tensors (the tests); the mode holds for the whole process.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _chunk(n_keys, NUM_SPLITS, MIN_CHUNK, BLOCK_N: tl.constexpr):
    """Keys per split for a block that needs n_keys: the splits' share rounded up to BLOCK_N, at least MIN_CHUNK."""
    return tl.maximum(tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit
def _tanh(x):
    """tanh in float32 as 2 * sigmoid(2x) - 1 (saturates to +-1, no overflow; the interpreter has it too)."""
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _attend_keys(q, k_base, v_base, start, hi, qpos, qwin, tbits, base, m_i, l_i, acc, scale_log2, window, sinks,
                 cap_log2, offs_n0, offs_d, d_valid, s_kl, s_kd, s_vl, s_vd, HAS_WINDOW: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_IN_F32: tl.constexpr, SOFTCAP: tl.constexpr, TREE: tl.constexpr):
    """One block of keys [start, start + BLOCK_N) below `hi` into the online softmax -> (m_i, l_i, acc). With
    SOFTCAP the logits are cap * tanh(scale * q.k / cap) before the mask (scale_log2 = scale / cap, cap_log2 =
    cap * log2(e)); otherwise scale * q.k (scale_log2 = scale * log2(e)). qwin: the positions windows are measured
    from (qpos, or the RoPE positions of a tree's nodes); TREE: tbits and base as in the module docstring."""
    offs_n = start + offs_n0
    n_valid = offs_n < hi
    kt = tl.load(k_base + offs_n[None, :] * s_kl + offs_d[:, None] * s_kd,
                 mask=n_valid[None, :] & d_valid[:, None], other=0.0)  # [BLOCK_D, BLOCK_N]
    if DOT_IN_F32:
        kt = kt.to(tl.float32)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
    if SOFTCAP:  # Gemma 2's attention logit soft-capping, in log2 units
        s = _tanh(s * scale_log2) * cap_log2
    else:
        s = s * scale_log2
    allowed = (offs_n[None, :] <= qpos[:, None]) & n_valid[None, :]
    if TREE:  # inside the region, the node's own path only
        rel = offs_n - base  # [BLOCK_N] region index of each key
        in_region = rel >= 0
        on_path = ((tbits[:, None] >> tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)[None, :]) & 1) != 0
        allowed = allowed & (~in_region[None, :] | on_path)
    if HAS_WINDOW:  # the window, and the sinks below it (StreamingLLM; sinks = 0 for a model's own window)
        in_window = (offs_n[None, :] > qwin[:, None] - window) | (offs_n[None, :] < sinks)
        if TREE:
            in_window = in_window | in_region[None, :]
        allowed = allowed & in_window
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + offs_n[:, None] * s_vl + offs_d[None, :] * s_vd,
                mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
    p = p.to(v_base.dtype.element_ty)  # the P @ V product in the cache's dtype, as flash kernels do
    if DOT_IN_F32:
        p, v = p.to(tl.float32), v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def slot_attention_split(
    Q, K, V, SLOTS, POS, QROPE, TBITS, OUT, PART_ACC, PART_M, PART_L,
    M, T, S, MIN_CHUNK, NUM_SPLITS, scale_log2, window, sinks, cap_log2,
    s_qb, s_qh, s_qm, s_qd,
    s_kn, s_kh, s_kl, s_kd,
    s_vn, s_vh, s_vl, s_vd,
    s_pb, s_pt,
    s_ob, s_oh, s_om, s_od,
    HKV: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SINGLE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_F32: tl.constexpr,  # interpreter + bf16 only: Triton 3.6's interpreter multiplies bf16 as raw bits
    USE_PDL: tl.constexpr = False,  # launched with programmatic dependent launch (pipeline.models.pdl)
    SOFTCAP: tl.constexpr = False,  # logits soft-capped (cap_log2; `_attend_keys`)
    TREE: tl.constexpr = False,  # the fed tokens are a token tree (QROPE, TBITS [B, T] with POS's strides)
):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    mb = tl.program_id(2)
    b = bh // HKV
    h = bh % HKV
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_valid = offs_m < M
    d_valid = offs_d < HEAD_D

    # Query row m = g*T + t has the absolute position pos[b, t]; padded rows (m >= M) get -1 (see nothing).
    # Positions and slots are read before the PDL wait: the step writes them before its first layer, and with
    # PDL every kernel but the one just before has finished when a kernel starts (each triggers after its wait).
    qpos = tl.load(POS + b * s_pb + (offs_m % T) * s_pt, mask=m_valid, other=-1).to(tl.int32)
    if TREE:
        qwin = tl.load(QROPE + b * s_pb + (offs_m % T) * s_pt, mask=m_valid, other=-1).to(tl.int32)
        tbits = tl.load(TBITS + b * s_pb + (offs_m % T) * s_pt, mask=m_valid, other=0).to(tl.int64)
        base = tl.load(POS + b * s_pb).to(tl.int32)  # the region's first node: the row's first fed token
    else:
        qwin, tbits, base = qpos, qpos, 0
    n_keys = tl.minimum(tl.max(qpos, axis=0) + 1, S)  # no key past the block's last query position
    chunk = _chunk(n_keys, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    lo = split * chunk
    if lo >= n_keys:  # a split past the last chunk: nothing to read, and the combine does not read it
        return
    hi = tl.minimum(lo + chunk, n_keys)
    slot = tl.load(SLOTS + b).to(tl.int64)  # int64: slot * slot stride may pass 2**31 elements
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the queries and this step's keys are written by the kernel before
        tl.extra.cuda.gdc_launch_dependents()

    q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_IN_F32:
        q = q.to(tl.float32)
    k_base = K + slot * s_kn + h * s_kh
    v_base = V + slot * s_vn + h * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if HAS_WINDOW:
        first = tl.min(tl.where(m_valid, qwin, 2147483647), axis=0) - window + 1
        if split == 0:  # the sink keys below the window, [0, min(sinks, first)): visible to every query row
            for start in range(0, tl.minimum(sinks, first), BLOCK_N):
                m_i, l_i, acc = _attend_keys(q, k_base, v_base, start, tl.minimum(sinks, first), qpos, qwin, tbits,
                                             base, m_i, l_i, acc, scale_log2, window, sinks, cap_log2, offs_n0, offs_d,
                                             d_valid, s_kl, s_kd, s_vl, s_vd, HAS_WINDOW, DOT_PRECISION, DOT_IN_F32,
                                             SOFTCAP, TREE)
        lo = tl.maximum(lo, first)
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, k_base, v_base, start, hi, qpos, qwin, tbits, base, m_i, l_i, acc,
                                     scale_log2, window, sinks, cap_log2, offs_n0, offs_d, d_valid, s_kl, s_kd, s_vl,
                                     s_vd, HAS_WINDOW, DOT_PRECISION, DOT_IN_F32, SOFTCAP, TREE)

    if SINGLE:
        y = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(OUT + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od,
                 y.to(OUT.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])
    else:
        row = (bh * NUM_SPLITS + split) * M + offs_m  # partials: [B*Hkv, NUM_SPLITS, M] (+ [HEAD_D])
        tl.store(PART_M + row, m_i, mask=m_valid)
        tl.store(PART_L + row, l_i, mask=m_valid)
        tl.store(PART_ACC + row[:, None] * HEAD_D + offs_d[None, :], acc, mask=m_valid[:, None] & d_valid[None, :])


@triton.jit
def slot_attention_combine(
    OUT, PART_ACC, PART_M, PART_L, POS,
    M, T, S, MIN_CHUNK, NUM_SPLITS,
    s_pb, s_pt,
    s_ob, s_oh, s_om, s_od,
    HKV: tl.constexpr,
    HEAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    bh = tl.program_id(0)
    mb = tl.program_id(1)
    b = bh // HKV
    h = bh % HKV
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_valid = offs_m < M
    d_valid = offs_d < HEAD_D
    # The chunks the split kernel used for this block (same positions, same formula): only those hold partials.
    # Read before the PDL wait, as there.
    qpos = tl.load(POS + b * s_pb + (offs_m % T) * s_pt, mask=m_valid, other=-1).to(tl.int32)
    n_keys = tl.minimum(tl.max(qpos, axis=0) + 1, S)
    used = tl.cdiv(n_keys, _chunk(n_keys, NUM_SPLITS, MIN_CHUNK, BLOCK_N))
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    m_max = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for split in range(0, used):
        row = (bh * NUM_SPLITS + split) * M + offs_m
        m_max = tl.maximum(m_max, tl.load(PART_M + row, mask=m_valid, other=float("-inf")))
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for split in range(0, used):
        row = (bh * NUM_SPLITS + split) * M + offs_m
        w = tl.exp2(tl.load(PART_M + row, mask=m_valid, other=float("-inf")) - m_safe)  # empty split: 0
        l_sum += w * tl.load(PART_L + row, mask=m_valid, other=0.0)
        part = tl.load(PART_ACC + row[:, None] * HEAD_D + offs_d[None, :],
                       mask=m_valid[:, None] & d_valid[None, :], other=0.0)
        acc += w[:, None] * part
    y = acc / tl.where(l_sum > 0.0, l_sum, 1.0)[:, None]
    tl.store(OUT + b * s_ob + h * s_oh + offs_m[:, None] * s_om + offs_d[None, :] * s_od,
             y.to(OUT.dtype.element_ty), mask=m_valid[:, None] & d_valid[None, :])



def interpreted() -> bool:
    """Whether these kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1 set before triton was
    imported: the mode is fixed per process, at decoration time)."""
    return not isinstance(slot_attention_split, triton.runtime.JITFunction)


def _interpreter_scalar_index() -> None:
    """Triton's interpreter (3.6) holds scalars as 1-element arrays and turns one into a loop bound with
    `int(array)`, which NumPy >= 2.4 refuses for arrays of one dimension: the split kernel's data-dependent
    key loop (`range(lo, hi, ...)`) needs `int(array.item())`. Interpreter mode only (tests, CPU)."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "scalar_index", False):
        return

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch.scalar_index = True
    interpreter._patch_lang_tensor = patch


if interpreted():
    _interpreter_scalar_index()
