"""Linear layers of few rows (decode and verify steps) for the static-shape graph path (`graphs.py`).

A decode step multiplies 1 to a few dozen rows by every weight matrix: the cost is the weight read, and cuBLAS
streams it at about 89% of an H100's copy bandwidth at batch 1, splitting some shapes into a GEMM plus a
reduction kernel (docs/benchmarks.md). `skinny_linear_triton` is a split-K kernel for exactly this case.

`linear(x, w, bias, kind)` is what the graph path calls:

- "torch": `F.linear` (cuBLAS on CUDA).
- "triton": the Triton kernel with the heuristic configuration of its shape (`default_config`); tests.
- "auto": per shape (rows, columns, depth, dtypes, bias), the fastest of `F.linear` and the kernel's candidate
  configurations, timed once on the device as a captured chain of launches over copies of the weight
  (`kernel_timing.chain_ms`: the way a step runs them, each layer's weights evicting the last one's from L2);
  the choice is cached for the process. Shapes are timed the first time they run outside a CUDA-graph
  capture: the graph runner's warm-up, before it captures. A shape first met during a capture takes
  `F.linear` (said once). Where triton is missing or the device is not
  CUDA, "auto" is "torch".

Rows past `MAX_ROWS` always take `F.linear`, and so do float32 weights under "auto". A float32 model's decode (T = 1)
and verify (T = K+1) steps then run the same cuBLAS arithmetic, and its greedy tokens do not depend on whether
speculation is on. Measured on an H100 with the demo target: with the kernel on the decode rows but not the verify
rows, 32 concurrent greedy streams did not give identical tokens with and without speculation.
Forced "triton" on float32 uses IEEE float32 products, not TF32. Inside `torch.compile` the kernel is the opaque
custom op `specserve::skinny_linear`, so the compiled region around it (norms, activations) keeps fusing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from pipeline.models.decode_attention import _sm_count, triton_available

log = logging.getLogger(__name__)

LINEAR_KINDS = ("auto", "triton", "torch")
HALF_DTYPES = (torch.bfloat16, torch.float16)  # "auto" considers the kernel for these weights only
MAX_ROWS = 64
_SMEM_BUDGET = 160 * 1024  # bytes of pipelined tiles per program (H100/A100 have 228/164 KiB per SM)


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 4


def resolve_linear(kind: str, device: torch.device) -> str:
    """'auto' -> 'auto' on CUDA when triton imports, else 'torch'; 'triton' without triton is an error."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"linear must be one of {LINEAR_KINDS}, got {kind!r}")
    if kind == "auto":
        return "auto" if device.type == "cuda" and triton_available() else "torch"
    if kind == "triton" and not triton_available():
        raise ValueError("linear='triton' needs the triton package (pip install triton)")
    return kind


def m_pad(M: int) -> int:
    """Rows as the kernel's tensor-core tile sees them: 16, 32 or 64."""
    assert 1 <= M <= MAX_ROWS, f"rows must be in [1, {MAX_ROWS}], got {M}"
    return 16 if M <= 16 else 32 if M <= 32 else 64


def _stages(M: int, block_n: int, block_k: int, itemsize: int) -> int:
    per_stage = (block_k * block_n + m_pad(M) * block_k) * itemsize
    return max(2, min(4, _SMEM_BUDGET // per_stage))


def _split_depth(K: int, splits: int, block_k: int) -> int:
    """K per split, a multiple of block_k (the last split may be shorter)."""
    return -(-(-(-K // splits)) // block_k) * block_k


def default_config(M: int, N: int, K: int, sm_count: int, itemsize: int = 2) -> SkinnyConfig:
    """About two programs per multiprocessor: 32 columns a program, fewer columns then split-K when N is small."""
    block_k = 256 if K >= 256 else 128
    block_n = 32 if -(-N // 32) >= sm_count else 16
    splits = 1
    while -(-N // block_n) * splits < 2 * sm_count and K // (2 * splits) >= 2 * block_k and splits < 8:
        splits *= 2
    return SkinnyConfig(block_n, block_k, splits, 4, _stages(M, block_n, block_k, itemsize))


def candidates(M: int, N: int, K: int, sm_count: int, itemsize: int = 2) -> list[SkinnyConfig]:
    """The configurations "auto" times: 16/32/64 columns, 128/256-deep tiles, 1/2/4/8 splits where each
    split keeps at least two tiles and the grid stays under 16 programs per multiprocessor."""
    out = []
    for block_n in (16, 32, 64):
        for block_k in (128, 256):
            for splits in (1, 2, 4, 8):
                if splits > 1 and K // splits < 2 * block_k:
                    continue
                if -(-N // block_n) * splits > 16 * sm_count:
                    continue
                warps = 8 if block_n * block_k >= 64 * 256 else 4
                out.append(SkinnyConfig(block_n, block_k, splits, warps, _stages(M, block_n, block_k, itemsize)))
    return out


def skinny_linear(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K]
    bias: Optional[torch.Tensor],
    config: SkinnyConfig,
) -> torch.Tensor:  # [M, N], x's dtype
    from pipeline.models import skinny_linear_triton as kern

    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K, f"x has {K} columns, w has {w.shape[1]}"
    assert x.device == w.device, (x.device, w.device)
    if x.device.type != "cuda" and not kern.interpreted():
        raise RuntimeError("skinny_linear on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before triton is first imported")
    c = config
    depth = _split_depth(K, c.splits, c.block_k)
    splits = -(-K // depth)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    single = splits == 1
    part = y if single else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else y  # unused when HAS_BIAS is off
    kern.skinny_linear_kernel[(-(-N // c.block_n), splits)](
        x, w, b, y, part, M, N, K, depth, *x.stride(), *w.stride(), *y.stride(),
        M_PAD=m_pad(M), BLOCK_N=c.block_n, BLOCK_K=c.block_k, SINGLE=single, HAS_BIAS=bias is not None,
        EVEN_K=K % depth == 0 and depth % c.block_k == 0,
        DOT_IN_F32=kern.interpreted() and w.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
        num_warps=c.num_warps, num_stages=c.num_stages,
    )
    if not single:
        block = 1024
        kern.skinny_linear_reduce[(-(-(M * N) // block),)](
            part, b, y, M, N, splits, *y.stride(), BLOCK=block, HAS_BIAS=bias is not None, num_warps=4,
        )
    return y


# ----------------------------------------------------------------------------------------------------
# "auto": time once per shape

_Key = tuple  # (M, N, K, x dtype, w dtype, has bias, device)


def _key(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> _Key:
    return (x.shape[0], w.shape[0], x.shape[1], x.dtype, w.dtype, bias is not None, x.device)

_choices: dict[_Key, Optional[SkinnyConfig]] = {}  # None: F.linear
_timings: dict[_Key, dict[str, float]] = {}  # key -> {candidate: ms}, for reports (ops/check_skinny_linear.py)
_warned_capture = False


def tune(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], reps: int = 7) -> Optional[SkinnyConfig]:
    """The fastest of F.linear and the kernel's candidates for this shape (None: F.linear), timed now as a step
    runs them (`kernel_timing.chain_ms`)."""
    from pipeline.models.kernel_timing import chain_ms, weight_copies

    M, K = x.shape
    N = w.shape[0]
    key = _key(x, w, bias)
    ws = weight_copies(w)
    timings = {"torch": chain_ms(lambda wi: F.linear(x, wi, bias), ws, reps=reps)}
    best, best_ms = None, timings["torch"]
    for c in candidates(M, N, K, _sm_count(x.device), w.element_size()):
        try:
            ms = chain_ms(lambda wi: skinny_linear(x, wi, bias, c), ws, reps=reps)
        except Exception as e:  # noqa: BLE001 - a configuration that does not build/fit is skipped
            log.debug("skinny_linear %s failed for %s: %s", c, key[:3], e)
            continue
        timings[f"{c.block_n}x{c.block_k}/{c.splits}"] = ms
        if ms < best_ms:
            best, best_ms = c, ms
    _timings[key] = timings
    return best


def _choose(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[SkinnyConfig]:
    global _warned_capture
    key = _key(x, w, bias)
    if key in _choices:
        return _choices[key]
    if torch.cuda.is_current_stream_capturing():
        if not _warned_capture:
            _warned_capture = True
            log.warning("skinny_linear: shape %s first met inside a CUDA-graph capture; using F.linear for it",
                        key[:3])
        return None
    choice = _choices[key] = tune(x, w, bias)
    return choice


@torch.library.custom_op("specserve::skinny_linear", mutates_args=())
def _skinny_linear_op(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor], kind: str) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if kind == "triton":
        config: Optional[SkinnyConfig] = default_config(x2.shape[0], w.shape[0], x2.shape[1],
                                                        _sm_count(x.device), w.element_size())
    else:
        config = _choose(x2, w, bias)
    y = F.linear(x2, w, bias) if config is None else skinny_linear(x2, w, bias, config)
    return y.view(*x.shape[:-1], w.shape[0])


@_skinny_linear_op.register_fake
def _(x, w, bias, kind):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None, kind: str = "torch") -> torch.Tensor:
    """`F.linear(x, w, bias)`; kind ('torch', 'triton', 'auto') as resolved by `resolve_linear`."""
    rows = x.numel() // x.shape[-1]
    if kind == "torch" or rows > MAX_ROWS or rows == 0 or (kind == "auto" and w.dtype not in HALF_DTYPES):
        return F.linear(x, w, bias)
    return _skinny_linear_op(x, w, bias, kind)


def chosen() -> dict[str, dict]:
    """What "auto" chose per shape so far, with its timings (ms): for benchmark reports."""
    out = {}
    for key, c in _choices.items():
        M, N, K = key[:3]
        name = "torch" if c is None else f"{c.block_n}x{c.block_k}/{c.splits}"
        out[f"M{M} N{N} K{K}"] = {"choice": name, "timings_ms": _timings.get(key, {})}
    return out
