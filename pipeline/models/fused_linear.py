"""Linears of few rows with their neighbours fused in: the graph path's fused decoder layer (`graphs.py`).

A decode or verify step of a bf16 Llama spends almost all its time streaming weights, in many small kernels:
per layer RMSNorm, q/k/v, RoPE/cache write, attention, output projection, residual add, RMSNorm, gate/up,
SiLU-gate, down projection, residual add. Each kernel pays a fixed ramp (launch, first loads in flight, the
tail of its last wave), which at batch 1 is a large share of a small matrix's few microseconds of bandwidth.
`fused_linear` folds the pointwise work into the matrix products, so a layer is seven kernels:

    qkv  = linear(rms_norm(x))                    NORM
    q    = rope + cache write                     (rope_write)
    y    = attention (split-KV + combine)         (decode_attention)
    x   += linear(y)            in place          heads layout, RESIDUAL
    h    = silu(gate) * up of linear(rms_norm(x)) NORM, GATE
    x   += linear(h)            in place          RESIDUAL

(Gemma: the norms run by (1 + weight), the gate is GeGLU's tanh GELU, and the output and down projections write
their result, which `add_norm` normalises into the residual stream: nine kernels a layer)
and all of them are Triton kernels launched with programmatic dependent launch where the GPU has it
(`pipeline.models.pdl`): each one's launch and start-up overlaps its predecessor's epilogue.

Measured on an H100 (`python -m ops.gpu_bench --attention auto,kernels`; docs/benchmarks.md): batch-1 steps
3-9% faster than the unfused layer (8B decode 5.72 vs 6.09 ms, 1B-shaped drafter with a 32k vocabulary
1.14 vs 1.24 ms, its 5-token verify 1.27 vs 1.31 ms); at batch 4-16 up to 2% slower, so the graph path takes
it for batch-1 calls by default (`GraphConfig.fused_layer`). Without PDL it is about 1% slower than the
unfused layer: fewer kernels alone do not pay, the small GEMVs' own ramp is the cost. Its linears alone, as a
captured chain, stream at or near the bandwidth floor (`python -m ops.linear_chain_bench`).

The arithmetic rounds where the eager layer rounds (each linear's output, SiLU, the product, the residual
sum), with float32 accumulation. The RMSNorm is the exception: x times the norm weight is rounded once and the
rows' 1/rms multiplies the float32 sums, one rounding fewer than the eager `rms_norm` (and half the K loop's
per-element work: H100 batch-1 steps 0.5-2.5% faster than the eager roundings). Results match the eager path
to bf16 tolerance (tests/pipeline/models/test_kernels.py, tests/gpu/test_gpu_graphs.py). For half-precision
weights and up to `MAX_ROWS` rows; float32 models keep the unfused path (whose cuBLAS arithmetic the float32
decode/verify equality relies on, see `skinny_linear`).

Float8 weights (`quantize_fp8`, `GraphConfig(weights="fp8")`): a drafter's matrices can be streamed as e4m3 with
a float32 scale per row, widened to bf16 in the kernel; half the bytes. A drafter's precision moves acceptance,
never the output. H100, batch-1 steps against bf16: 8B-sized 39% faster, 1B-sized 27-28%.

Tensor parallel (`push=`, `pipeline.models.tp_fused`): a row-parallel linear sends its float32 partial to every
rank's symmetric-memory buffer from its epilogue instead of writing `out` (the data is its own flag).

One-row calls (`gemv=True`, the default; `GraphConfig.gemv`): a batch-1 decode or draft step multiplies one row,
which the tensor-core tile pads to 16. Instead each program multiplies on the CUDA cores into [BLOCK_K, BLOCK_N]
float32 partial sums (reduced once, after the loop), loading the weight tile `ahead` steps on and x's next tile
before each step's products. This matters most for float8 weights: widened for a tensor-core product they streamed
no faster than bf16 at a 1B's sizes (H100: a layer's four linears 59.8 us either way; on the CUDA cores 41.8 in
float8, 51.5 in bf16; the 8B's 157.9 -> 156.3). Calls of 2 or more rows keep the tensor cores; for one-row calls the
tuner times both products and keeps the faster (the CUDA cores won every linear timed on H100s, the tensor cores
came within 1-3% at TP=2). Float8 weights are widened there by two integer operations on their bits
(`fused_linear_triton._widen`), not the hardware conversions, whose throughput bounded the loop: the same bits, the
1B's float8 layer 37.1 -> 33.3 us and the 8B's 100.0 -> 90.9 on an H100.

With PDL the first K tile of the weight may be loaded before the kernel waits for its predecessor (`preload`,
`GraphConfig.pdl_preload`): "auto", the default, does it for float8 weights only. H100, batch-1 steps: float8 1B
1-2% faster at T=1 (the 8B-sized 0.7% slower) and 3-6% faster at T=5; bf16 1-2% slower at T=1 and mixed at T=5,
and at TP=4 on H200s (where a linear waits longer, for the sum) 0.7% slower at T=1 and 3.9% at T=5.

Configuration: one program owns BLOCK_N output columns over the whole depth (no split-K: the epilogue needs
the finished sum). `config_for` times a few (BLOCK_N, BLOCK_K) candidates once per shape on CUDA during the
graph warm-up, as a captured chain of launches over distinct copies of the weight (`kernel_timing`: the way
a step runs them); elsewhere it takes `default_config` (`gemv_candidates` and `gemv_default` for one-row calls).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pipeline.models.decode_attention import _pow2, _sm_count
from pipeline.models.pdl import launch_kwargs

log = logging.getLogger(__name__)

MAX_ROWS = 64
GATE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gate epilogue's activations (families.ACTIVATIONS' names)
HALF_DTYPES = (torch.bfloat16, torch.float16)
_SMEM_BUDGET = 160 * 1024
# `preload`: load each program's first K tile of the weight before the PDL wait (weights are never written by a
# kernel), so its HBM latency overlaps the previous kernel's tail instead of following the wait: "auto" for float8
# weights only (what measured faster, see the module doc), "on", "off".
PRELOADS = ("auto", "on", "off")


def gemv(M: int, enabled: bool = True) -> bool:
    """Whether a call of M rows may take the CUDA-core product (one row, where `enabled`): the tuner times it
    against the tensor cores' for each one-row shape (`config_for`); `FusedConfig.gemv` says which one a
    configuration is."""
    return M == 1 and enabled


# The graph path takes the fused layer for calls of at most this many rows (B * T): one 16-row tensor-core
# tile. A 20-row call (padded to 32) ran 1.3x slower than the unfused layer on an H100.
LAYER_MAX_ROWS = 16


@dataclass(frozen=True)
class FusedConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    ahead: int = 1  # with gemv: weight tiles loaded ahead of the one multiplied (1 or 2)
    gemv: bool = False  # the product on the CUDA cores (one-row calls only), not on the tensor cores


def m_pad(M: int) -> int:
    """Rows as the tensor-core tile sees them: 16, 32 or 64."""
    assert 1 <= M <= MAX_ROWS, f"rows must be in [1, {MAX_ROWS}], got {M}"
    return 16 if M <= 16 else 32 if M <= 32 else 64


def _block_k(K: int) -> int:
    for b in (256, 128, 64, 32, 16):
        if K % b == 0 and K >= 2 * b:
            return b
    return 64 if K > 64 else 16


def _stages(M: int, block_n: int, block_k: int, gate: bool, itemsize: int) -> int:
    per_stage = (block_k * block_n * (2 if gate else 1) + m_pad(M) * block_k) * itemsize
    return max(2, min(4, _SMEM_BUDGET // per_stage))


def default_config(M: int, N: int, K: int, sm_count: int, gate: bool = False, itemsize: int = 2) -> FusedConfig:
    """32 columns a program while that still makes 0.7 programs per multiprocessor, else 16; the deepest K tile
    that divides K. (The best or within 2% of it for every linear of the 8B, 1B and 8B-at-TP=2 layers timed in
    a chain on an H100: `python -m ops.linear_chain_bench --configs`.)"""
    block_n = 32 if -(-N // 32) >= 0.7 * sm_count else 16
    block_k = _block_k(K)
    return FusedConfig(block_n, block_k, 4, _stages(M, block_n, block_k, gate, itemsize))


def candidates(M: int, N: int, K: int, sm_count: int, gate: bool = False, itemsize: int = 2) -> list[FusedConfig]:
    out = []
    for block_n in (16, 32, 64):
        if block_n > 16 and -(-N // block_n) < sm_count // 2:
            continue  # too few programs to keep the memory system busy
        block_ks = {_block_k(K), 128 if K % 128 == 0 else _block_k(K)}
        if itemsize == 1 and K % 512 == 0 and K >= 1024:  # float8 rows: deeper tiles for the same bytes
            block_ks.add(512)
        for block_k in sorted(block_ks):
            out.append(FusedConfig(block_n, block_k, 4, _stages(M, block_n, block_k, gate, itemsize)))
    return out


def gemv_candidates(N: int, K: int, sm_count: int, gate: bool = False) -> list[FusedConfig]:
    """One-row (`gemv`) configurations: 16 or 32 columns (while they make half a program per multiprocessor),
    128-1024 deep, 4 or 8 warps, at most 64 float32 partial sums a thread (half that with gate/up's two), one tile
    ahead: 12 a shape (8 for gate/up). What won or came within 2% in every chain timing on H100s (the 1B's and the
    8B's linears at TP=1 and 2, bf16 and float8): 64 columns, 64 deep and two
    tiles ahead never did (two ahead: 0.2-0.7 us slower a linear), and they made the 8B's first step take 73 s to
    tune on a fresh machine (Triton compiles each candidate once; it keeps them on disk)."""
    out = []
    for warps in (4, 8):
        budget = (64 if not gate else 32) * 32 * warps  # partial sums a program
        for block_n in (16, 32):
            if block_n > 16 and -(-N // block_n) < sm_count // 2:
                continue
            for block_k in (128, 256, 512, 1024):
                if block_n * block_k <= budget and block_k <= max(128, _pow2(K)):
                    out.append(FusedConfig(block_n, block_k, warps, 1, 1, True))
    return out


def tuning_candidates(M: int, N: int, K: int, sm_count: int, gate: bool, itemsize: int,
                      use_gemv: bool = True) -> list[FusedConfig]:
    """What `config_for` times for a shape: the tensor cores' candidates, and for one-row calls (`gemv`, unless
    `use_gemv` is off) the CUDA cores' too (neither wins every shape: at TP=2 an 8B's gate/up ran 1% slower on the
    CUDA cores on an H100)."""
    return ((gemv_candidates(N, K, sm_count, gate) if gemv(M, use_gemv) else [])
            + candidates(M, N, K, sm_count, gate, itemsize))


def gemv_default(N: int, K: int, sm_count: int) -> FusedConfig:
    """16 columns, 512 deep (at most K rounded up to a power of two), 8 warps, one tile ahead: what the chain
    timings chose for most of the 1B's one-row linears on an H100 (the tuner times `gemv_candidates` on CUDA)."""
    return FusedConfig(16, 512 if K >= 512 else max(64, _pow2(K)), 8, 1, 1, True)


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8 [N, K] float8 e4m3, scale [N] float32) with w ~= w8 * scale[:, None]: one scale per output row, its
    absolute maximum mapped to e4m3's largest value (round to nearest). For drafter weights: half the bytes of
    bf16 at about 2-3 significant bits less, which changes how often drafts are accepted, never the output."""
    amax = w.detach().float().abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    w8 = (w.detach().float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return w8.contiguous(), scale.contiguous()


@dataclass(frozen=True)
class Push:
    """Tensor parallel, a producer: the float32 result goes into slot `rank` of every rank's partials of a site
    (peer memory), a result of -0.0 sent as +0.0 (-0.0 marks a partial not yet written)."""
    peer_parts: torch.Tensor  # [R] int64: the address of each rank's partials [R, rows, C] of the site
    rank: int
    rows: int  # the partials' row capacity (their rank stride is rows * C)
    width: int  # C, the partials' columns


def _launch(x: torch.Tensor, M: int, K: int, row: tuple[int, int, int], col: tuple[int, int],
            w: torch.Tensor, bias: Optional[torch.Tensor], norm_w: Optional[torch.Tensor], eps: float, gate: bool,
            residual: Optional[torch.Tensor], out: Optional[torch.Tensor], use_pdl: bool,
            config: Optional[FusedConfig], w_scale: Optional[torch.Tensor] = None,
            push: Optional[Push] = None, preload: str = "auto", use_gemv: bool = True,
            norm_offset: bool = False, act: str = "silu") -> torch.Tensor:
    assert preload in PRELOADS, f"preload must be one of {PRELOADS}, got {preload!r}"
    assert act in GATE_ACTIVATIONS, f"act must be one of {GATE_ACTIVATIONS}, got {act!r}"
    assert config is None or not config.gemv or M == 1, f"the CUDA-core product (gemv) is for one-row calls, not {M}"
    from pipeline.models import fused_linear_triton as kern

    assert w.shape[1] == K and w.stride(1) == 1, f"w must be [N, {K}] with unit column stride, got {tuple(w.shape)}"
    assert (w.dtype == FP8) == (w_scale is not None), "float8 weights come with their row scales, and only they"
    assert w_scale is None or w_scale.shape == (w.shape[0],) and w_scale.dtype == torch.float32
    N = w.shape[0] // 2 if gate else w.shape[0]
    assert not gate or w.shape[0] % 2 == 0, "gate needs [gate rows; up rows]"
    if x.device.type != "cuda" and not kern.interpreted():
        raise RuntimeError("fused_linear on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")
    assert push is None or (not gate and residual is None and M <= push.rows), "push: a plain linear of few rows"
    assert push is None or push.width == N, "push: the partials are as wide as the linear's output"
    assert norm_w is None or out is None or out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), \
        "a normed linear reads x after writing out: out must not share x's storage"
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype, device=x.device) if push is None else x.new_empty(0)
    assert push is not None or (out.shape == (M, N) and out.stride(1) == 1), (tuple(out.shape), (M, N))
    c = config or config_for(x, M, N, K, w, bias, norm_w, gate, residual, w_scale, use_pdl, preload, use_gemv)
    XT, s_xb, s_xt = row
    XD, s_xj = col
    dummy = x
    n_ranks = push.peer_parts.shape[0] if push is not None else 1
    kern.fused_linear_kernel[(-(-N // c.block_n),)](
        x, norm_w if norm_w is not None else dummy, w, w_scale if w_scale is not None else dummy,
        bias if bias is not None else dummy,
        residual if residual is not None else dummy, out,
        push.peer_parts if push is not None else dummy,
        M, N, K, N if gate else 0, XT,
        s_xb, s_xt, s_xj, w.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0) if push is None else 0, N, push.rank * push.rows * N if push is not None else 0,
        float(eps),
        XD=XD, M_PAD=m_pad(M), BLOCK_N=c.block_n, BLOCK_K=c.block_k, NORM=norm_w is not None, GATE=gate,
        RESIDUAL=residual is not None, HAS_BIAS=bias is not None, HAS_SCALE=w_scale is not None,
        EVEN_K=K % c.block_k == 0,
        R_PAD=_pow2(M), NORM_CHUNK=max(16, min(_pow2(K), 8192 // _pow2(M))),
        USE_PDL=use_pdl, PRELOAD=preload == "on" or (preload == "auto" and w.dtype == FP8),
        GEMV=c.gemv, AHEAD=c.ahead, DOT_IN_F32=kern.interpreted() and x.dtype == torch.bfloat16,
        PUSH=push is not None, N_RANKS=n_ranks, NORM_OFFSET=norm_offset and norm_w is not None,
        GELU=gate and act == "gelu_pytorch_tanh",
        num_warps=c.num_warps, num_stages=c.num_stages, **launch_kwargs(use_pdl),
    )
    return out


def fused_linear(
    x: torch.Tensor,  # [M, K], unit column stride
    w: torch.Tensor,  # [N, K]; with gate, [2 I, K] (gate rows, then up rows)
    bias: Optional[torch.Tensor] = None,
    *,
    norm_w: Optional[torch.Tensor] = None,  # RMSNorm x first (weight [K])
    eps: float = 1e-6,
    gate: bool = False,  # y = silu(x @ gate^T) * (x @ up^T), [M, I]
    residual: Optional[torch.Tensor] = None,  # y = residual + linear; may be `out` (in place)
    out: Optional[torch.Tensor] = None,  # [M, N] written (any float dtype); None: a new tensor of x's dtype
    use_pdl: bool = False,
    config: Optional[FusedConfig] = None,
    w_scale: Optional[torch.Tensor] = None,  # [rows of w] float32, with float8 w (quantize_fp8)
    push: Optional[Push] = None,  # tensor parallel: send the result to every rank's partials of a site, not to out
    preload: str = "auto",  # with PDL, the first weight tile before the wait: auto (float8 weights only), on, off
    gemv: bool = True,  # one-row calls may take the CUDA-core product (the tuner times both)
    norm_offset: bool = False,  # with norm_w: the norm scales by (1 + weight) (Gemma)
    act: str = "silu",  # with gate: the gate's activation, "silu" or "gelu_pytorch_tanh" (GeGLU)
) -> torch.Tensor:
    M, K = x.shape
    assert x.stride(1) == 1, "x needs unit column stride"
    return _launch(x, M, K, (1, x.stride(0), 0), (1, 1), w, bias, norm_w, eps, gate, residual, out, use_pdl, config,
                   w_scale, push, preload, gemv, norm_offset, act)


def add_norm(
    x: torch.Tensor,  # [M, C] residual stream, updated in place
    y: torch.Tensor,  # [M, C] a linear's output
    norm_w: torch.Tensor,  # [C]
    eps: float,
    use_pdl: bool = False,
) -> torch.Tensor:  # x
    """x += rms_norm(y) * (1 + norm_w) in place, one launch (Gemma's norms after attention and after the MLP):
    `llama.rms_norm(y, norm_w, eps, unit_offset=True)` added to x, rounded as the eager path rounds."""
    from pipeline.models import fused_linear_triton as kern

    M, C = x.shape
    assert y.shape == (M, C) and x.stride(1) == 1 and y.stride(1) == 1 and norm_w.shape == (C,), (x.shape, y.shape)
    if x.device.type != "cuda" and not kern.interpreted():
        raise RuntimeError("add_norm on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")
    block = _pow2(C)
    kern.add_norm_kernel[(M,)](x, y, norm_w, C, x.stride(0), y.stride(0), float(eps), BLOCK_C=block, USE_PDL=use_pdl,
                               num_warps=8 if block >= 4096 else 4, **launch_kwargs(use_pdl))
    return x


def fused_linear_heads(
    y: torch.Tensor,  # [B, Hkv, G*T, D] contiguous: attention output, query index g*T + t
    T: int,
    w: torch.Tensor,  # [N, H*D]
    bias: Optional[torch.Tensor] = None,
    *,
    residual: Optional[torch.Tensor] = None,  # [B*T, N]
    out: Optional[torch.Tensor] = None,
    use_pdl: bool = False,
    config: Optional[FusedConfig] = None,
    w_scale: Optional[torch.Tensor] = None,
    push: Optional[Push] = None,
    preload: str = "auto",
    gemv: bool = True,
) -> torch.Tensor:  # [B*T, N]: linear(y as [B, T, H*D]), without the permute's copy
    B, Hkv, GT, D = y.shape
    assert y.is_contiguous() and GT % T == 0, (tuple(y.shape), T)
    K = Hkv * GT // T * D
    return _launch(y, B * T, K, (T, y.stride(0), D), (D, T * D), w, bias, None, 0.0, False, residual, out,
                   use_pdl, config, w_scale, push, preload, gemv)


# ----------------------------------------------------------------------------------------------------
# per-shape choice


_choices: dict[tuple, FusedConfig] = {}


def config_for(x: torch.Tensor, M: int, N: int, K: int, w: torch.Tensor, bias, norm_w, gate: bool,
               residual, w_scale: Optional[torch.Tensor] = None, use_pdl: bool = False, preload: str = "auto",
               use_gemv: bool = True) -> FusedConfig:
    """The configuration of this shape: timed once on CUDA (outside a graph capture) the way the graph path runs
    it (`kernel_timing.chain_ms`), else the default."""
    one_row = gemv(M, use_gemv)
    key = (m_pad(M), N, K, w.dtype, gate, norm_w is not None, residual is not None, bias is not None, x.device,
           preload, one_row)  # preload: the setting (its effect depends on w's dtype)
    got = _choices.get(key)
    if got is not None:
        return got
    sms = _sm_count(x.device)
    fallback = gemv_default(N, K, sms) if one_row else default_config(M, N, K, sms, gate, w.element_size())
    if x.device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return _choices.setdefault(key, fallback)
    from pipeline.models.kernel_timing import chain_ms, weight_copies

    xs = torch.randn(M, K, dtype=x.dtype, device=x.device)
    out = torch.zeros(M, N, dtype=x.dtype, device=x.device)
    ws = weight_copies(w)
    best, best_ms = None, float("inf")
    for c in tuning_candidates(M, N, K, sms, gate, w.element_size(), use_gemv):
        try:
            ms = chain_ms(lambda wi: fused_linear(
                xs, wi, bias, norm_w=norm_w, gate=gate, residual=out if residual is not None else None,
                out=out, config=c, w_scale=w_scale, use_pdl=use_pdl, preload=preload, gemv=use_gemv), ws)
        except Exception as e:  # noqa: BLE001 - a configuration that does not build/fit is skipped
            log.debug("fused_linear %s failed for %s: %s", c, key[:3], e)
            continue
        if ms < best_ms:
            best, best_ms = c, ms
    return _choices.setdefault(key, best or fallback)


def chosen() -> dict[str, str]:
    """What was chosen per shape so far, for benchmark reports."""
    return {f"Mpad{k[0]} N{k[1]} K{k[2]} {str(k[3]).removeprefix('torch.')}{' gate' if k[4] else ''}"
            f"{' norm' if k[5] else ''}{' res' if k[6] else ''}{' M1' if k[10] else ''}":
            f"{c.block_n}x{c.block_k}/w{c.num_warps}/s{c.num_stages}{f' gemv/ahead{c.ahead}' if c.gemv else ''}"
            for k, c in _choices.items()}
