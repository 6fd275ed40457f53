"""RoPE plus the KV-cache write of a decode/verify step, for the static-shape graph path (`graphs.py`).

Input: the fused q/k/v projection `qkv [B, T, (H + 2 Hkv) D]` of B rows of T tokens at positions `pos [B, T]`,
row b owning cache slot `slots[b]`. Output: the rotated queries stacked per KV head, `q [B, Hkv, G*T, D]`
(query index g*T + t, as `decode_attention` takes them); the rotated keys and the values are written into
`k_cache`/`v_cache [num_slots, Hkv, max_len, D]` at `[slots[b], :, pos[b, t]]`. A token tree's nodes rotate by
their own RoPE positions (`rope_pos`: region start + depth) and are written at their cache indices `pos`.

- `torch_rope_write`: the reference (split, `apply_rope`, permute, two `index_copy_`).
- `triton_rope_write`: one Triton launch (`rope_write_triton`), float32 math and one rounding (as
  `torch.compile` computes the reference's pointwise work). CPU tensors need Triton's interpreter (tests).
"""

from __future__ import annotations

import torch

from pipeline.models.decode_attention import _pow2
from pipeline.models.llama import apply_rope, rms_norm


def rope_split(
    qkv: torch.Tensor,  # [B, T, (H + 2 Hkv) D]
    cos: torch.Tensor,  # [B, T, 1, D]
    sin: torch.Tensor,
    n_heads: int,
    n_kv_heads: int,
    q_norm: torch.Tensor | None = None,  # [D]: RMSNorm weight over each query head before RoPE (Qwen3); None: none
    k_norm: torch.Tensor | None = None,  # [D]: the same for the keys
    eps: float = 0.0,  # the q/k norms' epsilon
    norm_offset: bool = False,  # the q/k norms scale by (1 + weight) (Gemma 3)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [B, Hkv, G*T, D]; k, v [B*T*Hkv, D]
    """Split the fused projection, (norm and) rotate q and k, stack the queries per KV head (pure: no cache
    write)."""
    B, T, _ = qkv.shape
    D = cos.shape[-1]
    G = n_heads // n_kv_heads
    q, k, v = qkv.split([n_heads * D, n_kv_heads * D, n_kv_heads * D], dim=-1)
    q, k = q.reshape(B, T, n_heads, D), k.reshape(B, T, n_kv_heads, D)  # head h = j*G + g
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps, norm_offset), rms_norm(k, k_norm, eps, norm_offset)
    q = apply_rope(q, cos, sin)  # [B, T, H, D]
    k = apply_rope(k, cos, sin)  # [B, T, Hkv, D]
    q = q.view(B, T, n_kv_heads, G, D).permute(0, 2, 3, 1, 4).reshape(B, n_kv_heads, G * T, D)
    return q, k.reshape(B * T * n_kv_heads, D), v.reshape(B * T * n_kv_heads, D)


def cache_rows(slots: torch.Tensor, pos: torch.Tensor, n_kv_heads: int, max_len: int) -> torch.Tensor:
    """Row of the flattened cache `[num_slots * Hkv * max_len, D]` that token (b, t), KV head j writes,
    in `rope_split`'s k/v order: [B * T * Hkv]."""
    heads = torch.arange(n_kv_heads, device=pos.device)
    return ((slots[:, None, None] * n_kv_heads + heads) * max_len + pos[:, :, None]).reshape(-1)


def torch_rope_write(
    qkv: torch.Tensor,  # [B, T, (H + 2 Hkv) D]
    cos_table: torch.Tensor,  # [max_len, D]
    sin_table: torch.Tensor,
    pos: torch.Tensor,  # [B, T] int64
    slots: torch.Tensor,  # [B] int64
    k_cache: torch.Tensor,  # [num_slots, Hkv, max_len, D]
    v_cache: torch.Tensor,
    n_heads: int,
    q_norm: torch.Tensor | None = None,  # [D] q/k norm weights (Qwen3); None: none
    k_norm: torch.Tensor | None = None,
    eps: float = 0.0,
    norm_offset: bool = False,  # the q/k norms scale by (1 + weight) (Gemma 3)
    rope_pos: torch.Tensor | None = None,  # [B, T] int64 RoPE positions where they differ from `pos` (a token tree)
) -> torch.Tensor:  # [B, Hkv, G*T, D]
    _, Hkv, L, D = k_cache.shape
    rp = pos if rope_pos is None else rope_pos
    q, k, v = rope_split(qkv, cos_table[rp].unsqueeze(2), sin_table[rp].unsqueeze(2), n_heads, Hkv, q_norm, k_norm,
                         eps, norm_offset)
    rows = cache_rows(slots, pos, Hkv, L)
    k_cache.view(-1, D).index_copy_(0, rows, k)
    v_cache.view(-1, D).index_copy_(0, rows, v)
    return q


def triton_rope_write(
    qkv: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int, use_pdl: bool = False,
    q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0,
    norm_offset: bool = False, rope_pos: torch.Tensor | None = None,
) -> torch.Tensor:  # [B, Hkv, G*T, D]; torch_rope_write's signature (use_pdl: pipeline.models.pdl; q/k norms: Qwen3,
    # Gemma 3)
    from pipeline.models import rope_write_triton as kern
    from pipeline.models.pdl import launch_kwargs

    B, T, width = qkv.shape
    _, Hkv, _, D = k_cache.shape
    assert width == (n_heads + 2 * Hkv) * D, f"qkv width {width} != (H + 2 Hkv) D = {(n_heads + 2 * Hkv) * D}"
    assert n_heads % Hkv == 0 and D % 2 == 0, (n_heads, Hkv, D)
    assert qkv.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and cos_table.stride(1) == 1
    assert sin_table.stride() == cos_table.stride(), "cos and sin tables must share strides"
    if qkv.device.type != "cuda" and not kern.interpreted():
        raise RuntimeError("triton_rope_write on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")
    rope_pos = pos if rope_pos is None else rope_pos
    assert rope_pos.shape == pos.shape and rope_pos.stride() == pos.stride(), "rope_pos must be laid out as pos"
    qkv2 = qkv.reshape(B * T, width)
    q = torch.empty(B, Hkv, (n_heads // Hkv) * T, D, dtype=qkv.dtype, device=qkv.device)
    assert (q_norm is None) == (k_norm is None), "q and k norms come together"
    norms = (q_norm, k_norm) if q_norm is not None else (cos_table, cos_table)  # unread without QK_NORM
    kern.rope_cache_write_kernel[(B * T,)](
        qkv2, cos_table, sin_table, pos, rope_pos, slots, k_cache, v_cache, q, *norms,
        T, float(eps), qkv2.stride(0), cos_table.stride(0), *pos.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *q.stride()[:3],
        H=n_heads, HKV=Hkv, D=D, HALF_P=_pow2(D // 2), HEADS_P=_pow2(n_heads + Hkv), KV_P=_pow2(Hkv), D_P=_pow2(D),
        USE_PDL=use_pdl, QK_NORM=q_norm is not None, NORM_OFFSET=norm_offset, num_warps=4, **launch_kwargs(use_pdl),
    )
    return q
