"""Decode/verify attention over the slot-indexed KV cache, for the static-shape graph path (`graphs.py`).

Cache layout per layer: `k_cache`, `v_cache` of shape `[num_slots, Hkv, max_len, D]`. Queries come stacked per
KV head, `q [B, Hkv, G*T, D]` (G = n_heads / n_kv_heads, query index g*T + t). Row b reads slot `slots[b]`;
query (g, t) of row b sits at absolute position `pos[b, t]` and sees the keys at positions `<= pos[b, t]`
(and `> pos[b, t] - window` for sliding-window models; with `sinks` > 0, the keys at positions < sinks as well:
StreamingLLM attention) among the first S positions of its slot. Padding rows
point at a scratch slot with position 0, padding columns at positions past the row's real tokens: both are
ordinary rows/columns here (every query row sees at least its own position).

With `softcap` (Gemma 2), the logits `scale * q.k` become `softcap * tanh(scale * q.k / softcap)` before the mask.

With `tree` (`TreeInputs`: RoPE positions and ancestor bit sets, `pipeline.models.tree_attention.tree_bits`), the T
fed tokens are the nodes of a token tree whose region starts at `pos[b, 0]`: a query sees the keys before the region
and, inside it, only its own path; its window is measured from its RoPE position.

Two implementations of one signature, `(q, k_cache, v_cache, slots, pos, S, scale, window=None, ..., sinks=0,
softcap=None) -> [B, Hkv, G*T, D]`:

- `sdpa_slot_attention`: the reference and fallback. Gathers each row's slot (`index_select`, a copy of
  every row's first S keys and values) and runs masked `scaled_dot_product_attention`.
- `triton_slot_attention`: split-KV ("flash-decoding") Triton kernels that read the cache in place (no gather)
  and stop at each query block's last visible key. The key axis is cut into chunks spread over programs, so
  one row still fills the GPU, and a second small kernel merges the chunks (log-sum-exp); one chunk (large
  batches) writes the output directly. Float32 accumulation; bf16/fp16/fp32 inputs; any head_dim (padded to a
  power of two, >= 16). No host sync and a grid fixed by the shapes and S: capturable in a CUDA graph. Each
  block sizes its key chunks from its own positions, so S only bounds the grid: the graph path passes the
  cache length and one graph serves every context length. On
  CPU tensors it runs in Triton's interpreter (TRITON_INTERPRET=1 before triton's import; the tests).

`triton` is imported lazily: this module (and `pipeline`) imports without it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.models.llama import soft_cap

ATTENTION_KINDS = ("auto", "triton", "sdpa")
# A token tree's (RoPE positions [B, T] int64, ancestor bit sets [B, T] int64), both laid out as `pos`
TreeInputs = tuple[torch.Tensor, torch.Tensor]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import pipeline.models.decode_attention_triton  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or a broken install: the reference serves
        return False
    return True


def resolve_attention(kind: str, device: torch.device) -> str:
    """'auto' -> 'triton' on CUDA when triton imports, else 'sdpa'; 'triton' without triton is an error."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {kind!r}")
    if kind == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if kind == "triton" and not triton_available():
        raise ValueError("attention='triton' needs the triton package (pip install triton)")
    return kind


# ----------------------------------------------------------------------------------------------------
# reference


def sdpa_mask(pos: torch.Tensor, S: int, G: int, window: int | None, dtype: torch.dtype,
              sinks: int = 0, tree: TreeInputs | None = None) -> torch.Tensor:
    """Additive mask [B, 1, G*T, S] (0 = attend, dtype's min = hidden) for the stacked query rows g*T + t."""
    B, T = pos.shape
    key_pos = torch.arange(S, device=pos.device)
    allowed = key_pos[None, None, :] <= pos[:, :, None]  # [B, T, S]
    win_from = pos
    if tree is not None:  # the region's keys on the node's own path only (`TreeInputs`)
        win_from, bits = tree
        rel = key_pos[None, :] - pos[:, :1]  # [B, S] region index of each key
        on_path = ((bits[:, :, None] >> rel.clamp(0, 63)[:, None, :]) & 1) != 0  # [B, T, S]
        allowed &= (rel < 0)[:, None, :] | on_path
    if window is not None:
        in_window = (key_pos[None, None, :] > win_from[:, :, None] - window) | (key_pos[None, None, :] < sinks)
        if tree is not None:  # region keys lie within T of the node: inside any window >= T
            in_window |= (rel >= 0)[:, None, :]
        allowed &= in_window
    mask = torch.zeros(B, T, S, dtype=dtype, device=pos.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, None].expand(B, 1, G, T, S).reshape(B, 1, G * T, S)


def sdpa_slot_attention(
    q: torch.Tensor,  # [B, Hkv, G*T, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, max_len, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64
    pos: torch.Tensor,  # [B, T] int64 absolute positions
    S: int,  # keys read per row (<= max_len)
    scale: float,
    window: int | None = None,
    mask: torch.Tensor | None = None,  # sdpa_mask(...), when the caller shares one across layers
    sinks: int = 0,  # with a window: the first `sinks` positions stay visible too (StreamingLLM)
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap) before the mask (Gemma 2)
    tree: TreeInputs | None = None,  # the fed tokens are a token tree
) -> torch.Tensor:  # [B, Hkv, G*T, D]
    if mask is None:
        mask = sdpa_mask(pos, S, q.shape[2] // pos.shape[1], window, q.dtype, sinks, tree)
    keys = k_cache[:, :, :S].index_select(0, slots)  # [B, Hkv, S, D]
    values = v_cache[:, :, :S].index_select(0, slots)
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    # SDPA cannot cap its logits: the same math written out (softmax in float32, as the eager runner computes it)
    scores = soft_cap(torch.matmul(q, keys.transpose(-1, -2)) * scale, softcap) + mask  # [B, Hkv, G*T, S]
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


# ----------------------------------------------------------------------------------------------------
# Triton


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: a few splits, so tests exercise the combine


MIN_CHUNK = 128  # keys a split program takes at least (fewer are not worth a program and a partial)


def plan_splits(S: int, programs: int, block_n: int, sm_count: int, min_chunk: int = MIN_CHUNK) -> tuple[int, int]:
    """(num_splits, chunk) for S keys: chunks of >= min_chunk keys (a multiple of block_n), as many as make about
    two programs per multiprocessor; `programs` = the grid without the split axis. The kernel sizes each
    block's chunks from its own length in the same way (`decode_attention_triton._chunk`), so S here only
    bounds the grid."""
    max_splits = max(1, -(-S // max(min_chunk, block_n)))
    want = -(-2 * sm_count // max(programs, 1))
    splits = max(1, min(max_splits, want))
    chunk = -(-(-(-S // splits)) // block_n) * block_n
    return -(-S // chunk), chunk


# float32 products as three TF32 tensor-core products ("tf32x3": float32-level error, 1.5-2.6e-7 of the largest
# output in ops/check_decode_attention.py), not "ieee", which runs on the FMA units over query rows padded to 16:
# H100, demo model shape, 32 rows x 1,024 keys, 30 layers: 1.00 ms against 2.26 ms (docs/benchmarks.md).
_DOT_PRECISION_F32 = "tf32x3"


def launch_plan(B: int, Hkv: int, M: int, D: int, S: int, device: torch.device, num_splits: int | None = None,
                block_n: int | None = None) -> dict[str, int]:
    """Block sizes, number of splits and smallest key chunk of `triton_slot_attention` for these shapes (host-only;
    the kernels size each block's chunks from its positions)."""
    block_d = max(16, _pow2(D))
    block_m = min(64, max(16, _pow2(M)))  # tl.dot needs >= 16 rows
    block_n = block_n or (64 if block_d <= 128 else 32)
    m_blocks = -(-M // block_m)
    if num_splits is None:
        num_splits, _ = plan_splits(S, B * Hkv * m_blocks, block_n, _sm_count(device))
        min_chunk = -(-MIN_CHUNK // block_n) * block_n
    else:  # forced (tests, tuning): chunks as small as one key block, so short contexts use the splits too
        chunk = -(-(-(-S // num_splits)) // block_n) * block_n
        num_splits = -(-S // chunk)
        min_chunk = block_n
    return {"BLOCK_D": block_d, "BLOCK_M": block_m, "BLOCK_N": block_n, "m_blocks": m_blocks,
            "num_splits": num_splits, "min_chunk": min_chunk}


def triton_slot_attention(
    q: torch.Tensor,  # [B, Hkv, G*T, D]
    k_cache: torch.Tensor,  # [num_slots, Hkv, max_len, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [B] int64 (or int32)
    pos: torch.Tensor,  # [B, T] int64 absolute positions
    S: int,  # keys read per row at most (<= max_len); a Python int: bounds the grid (the split count)
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,  # None: plan_splits (tests and the tuning script force it)
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_pdl: bool = False,  # launch with programmatic dependent launch (pipeline.models.pdl)
    sinks: int = 0,  # with a window: the first `sinks` positions stay visible too (StreamingLLM)
    softcap: float | None = None,  # logits -> softcap * tanh(logits / softcap) before the mask (Gemma 2)
    tree: TreeInputs | None = None,  # the fed tokens are a token tree
) -> torch.Tensor:  # [B, Hkv, G*T, D], q's dtype
    from pipeline.models import decode_attention_triton as kern
    from pipeline.models.pdl import launch_kwargs

    B, Hkv, M, D = q.shape
    T = pos.shape[1]
    assert pos.shape[0] == B and slots.shape == (B,), (tuple(pos.shape), tuple(slots.shape), B)
    assert M % T == 0, f"query rows {M} must be G * T (T = {T})"
    assert k_cache.shape[1] == Hkv and k_cache.shape[3] == D and v_cache.shape == k_cache.shape
    assert 0 < S <= k_cache.shape[2], f"S = {S} must be in (0, max_len = {k_cache.shape[2]}]"
    assert q.dtype == k_cache.dtype == v_cache.dtype, (q.dtype, k_cache.dtype, v_cache.dtype)
    assert q.device == k_cache.device == slots.device == pos.device, "q, caches, slots, pos on one device"
    if q.device.type != "cuda" and not kern.interpreted():
        raise RuntimeError("triton_slot_attention on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")

    if tree is not None:
        assert all(t.shape == pos.shape and t.stride() == pos.stride() for t in tree), "tree inputs laid out as pos"
        assert window is None or window >= T, f"a token tree of {T} nodes under a sliding window of {window}"
    rope_pos, bits = tree if tree is not None else (pos, pos)  # unread without a tree
    plan = launch_plan(B, Hkv, M, D, S, q.device, num_splits, block_n)
    BLOCK_D, BLOCK_M, BLOCK_N, m_blocks = plan["BLOCK_D"], plan["BLOCK_M"], plan["BLOCK_N"], plan["m_blocks"]
    num_splits, min_chunk = plan["num_splits"], plan["min_chunk"]
    warps = num_warps or (8 if BLOCK_M * BLOCK_D >= 64 * 128 else 4)
    stages = num_stages or 2
    single = num_splits == 1

    out = torch.empty(B, Hkv, M, D, dtype=q.dtype, device=q.device)
    if single:
        part_acc = part_m = part_l = out  # unused
    else:
        part_acc = torch.empty(B * Hkv, num_splits, M, D, dtype=torch.float32, device=q.device)
        part_m = torch.empty(B * Hkv, num_splits, M, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    launch: dict[str, Any] = {"num_warps": warps, "num_stages": stages, **launch_kwargs(use_pdl)}
    kern.slot_attention_split[(num_splits, B * Hkv, m_blocks)](
        q, k_cache, v_cache, slots, pos, rope_pos, bits, out, part_acc, part_m, part_l,
        M, T, S, min_chunk, num_splits, scale / softcap if softcap else scale * math.log2(math.e), window or 0,
        sinks if window else 0, softcap * math.log2(math.e) if softcap else 0.0,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *pos.stride(), *out.stride(),
        HKV=Hkv, HEAD_D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_WINDOW=window is not None,
        SINGLE=single, DOT_PRECISION=_DOT_PRECISION_F32 if q.dtype == torch.float32 else "tf32",
        DOT_IN_F32=q.dtype == torch.bfloat16 and kern.interpreted(), USE_PDL=use_pdl, SOFTCAP=bool(softcap),
        TREE=tree is not None,
        **launch,
    )
    if not single:
        kern.slot_attention_combine[(B * Hkv, m_blocks)](
            out, part_acc, part_m, part_l, pos, M, T, S, min_chunk, num_splits, *pos.stride(), *out.stride(),
            HKV=Hkv, HEAD_D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, USE_PDL=use_pdl, num_warps=4,
            **launch_kwargs(use_pdl),
        )
    return out


def slot_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor,
    S: int, scale: float, window: int | None = None, kind: str = "auto", sinks: int = 0, softcap: float | None = None,
    tree: TreeInputs | None = None,
) -> torch.Tensor:  # [B, Hkv, G*T, D]
    """Dispatch on `kind` ('auto': Triton on CUDA when it imports, else the reference)."""
    if resolve_attention(kind, q.device) == "triton":
        return triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, sinks=sinks, softcap=softcap,
                                     tree=tree)
    return sdpa_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, sinks=sinks, softcap=softcap,
                               tree=tree)
