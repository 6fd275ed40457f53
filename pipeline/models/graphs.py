"""Static-shape decode/verify path for the fast path's families (Llama, Mistral, Qwen2/3, Gemma 2/3): CUDA graphs
over the preallocated KV cache.

`GraphCausalLM` wraps a `LlamaCausalLM` and implements the same `CausalLM` protocol. A decode (T = 1) or
verify (T = K+1) call is padded to a bucket `(Bb, Tb, Sb)` (batch rows, fed tokens, keys read from the cache)
and runs as one captured CUDA graph: one launch, no host sync inside. Everything else (prefill, shapes past
the largest bucket, positions near the end of the cache) runs on the wrapped eager runner.

Static shapes, step by step:
- Rows past B are padding: they feed token 0 at position 0 into a *scratch slot* (one extra cache slot that
  no request owns), so they never touch a real request's cache.
- Columns past T are padding too: they write K/V at positions past the row's real tokens, which the cache
  protocol already allows (stale entries beyond a row's length are never attended to and get overwritten
  before any query reaches them; base.py).
- Keys: the Triton attention reads each row's keys up to its own position, sizing its split-KV chunks on the
  device, so its graphs do not depend on the context (`Sb` = the cache length): one graph per (Bb, Tb), and
  a context that grows never triggers a capture mid-stream. The SDPA attention (CPU, fallback) reads keys up to
  `Sb`, the row maximum of `position + Tb` rounded up to `kv_block`; a per-row mask hides the rest. The max
  position comes from the host: free when `positions` is a CPU tensor (the engine builds positions from its
  own lists), one deliberate sync when it lives on the device.
- Queries of the G = n_heads / n_kv_heads heads that share a KV head are stacked along the query axis
  (`[B, Hkv, G*T, D]`), so attention reads each cached key once and needs no GQA expansion.
- Attention (`pipeline.models.decode_attention`, `GraphConfig.attention`): on CUDA with triton installed, a
  split-KV Triton kernel that reads each row's slot in place and stops at the row's last visible key
  ('triton'); otherwise the row slots are gathered (`index_select`) and fed to masked SDPA ('sdpa').

Token trees (`forward(..., tree=)`, a whole tree region per call: `TreeMask.first` = 0): the parents go into a static
buffer like the other inputs; inside the graph, `tree_bits` turns them into each node's ancestor bit set and depth
(pointer jumping, no host read), the nodes rotate by their depth (RoPE position = region start + depth) and are
written at their own cache indices, and the attention (Triton or SDPA) lets each node see the prefix and its own
path. A tree call has graphs of its own; `compact` (the accepted path's cache entries moved after verification) is
the runner's, one gather and one scatter over every layer. Other tree calls (a draft model feeding a tree level by
level) run on the eager runner.

Families: what a family changes in the layer (`families.Family`) is read per layer inside the step: each layer's
sliding window and RoPE table (Gemma's alternating sliding and global layers, Gemma 3's local RoPE base), the
attention scale and logit soft-cap, (1 + weight) norms, norms after attention and the MLP, GeGLU, scaled embeddings
and the final soft-cap; all of it is static per layer, so one captured graph holds every layer's variant.

Weights: q/k/v and gate/up projections are fused into one matrix each (the eager runner's parameters become
views into them, so no memory is duplicated). With `compile=True` (default on CUDA) the per-layer pointwise
work (RMSNorm, RoPE, SiLU-gate, residuals) is fused by `torch.compile`; the cache write and attention stay
eager ops inside the graph (no compiled code mutates the cache).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from pipeline.models import fused_linear as fl
from pipeline.models import pdl
from pipeline.models.base import CausalLM
from pipeline.models.decode_attention import resolve_attention, sdpa_mask, sdpa_slot_attention, triton_slot_attention
from pipeline.models.families import ACTIVATIONS
from pipeline.models.llama import FINAL_NORMED, LlamaArgs, LlamaCausalLM, rms_norm, soft_cap
from pipeline.models.rope_write import cache_rows, rope_split, triton_rope_write
from pipeline.models.skinny_linear import linear, resolve_linear
from pipeline.models.tree_attention import TREE_BITS_MAX, TreeMask, tree_bits

log = logging.getLogger(__name__)
_fallback_warned: set[str] = set()


@dataclass(frozen=True)
class GraphConfig:
    batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
    token_buckets: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32)  # T = K+1 of a verify call (a tree:
    # nodes + 1)
    kv_block: int = 256  # keys are read in multiples of this many positions
    graphs: bool | None = None  # capture CUDA graphs; None: when the model is on a CUDA device
    compile: bool | None = None  # torch.compile the per-layer pointwise work; None: when on CUDA
    # "triton": split-KV kernel reading the cache in place; "sdpa": slot gather + masked SDPA (the reference);
    # "auto": triton on CUDA when it imports, else sdpa (pipeline.models.decode_attention)
    attention: str = "auto"
    # Linears of few rows (pipeline.models.skinny_linear): "auto" times F.linear against a split-K Triton kernel
    # once per shape on CUDA and keeps the faster; "torch": F.linear; "triton": the kernel (tests)
    linear: str = "auto"
    # RoPE + cache write as one Triton kernel (pipeline.models.rope_write); None: with the Triton attention
    fused_rope: bool | None = None
    # The fused decoder layer (pipeline.models.fused_linear: norms, activation and residuals inside the linears'
    # kernels, seven Triton kernels a layer) for half-precision weights. True: every call of up to 16 rows
    # (B * T); None: on CUDA with the Triton attention and fused RoPE, for batch-1 calls (one row's decode or
    # verify: 1-3% faster on an H100; at batch 4-16 it measured up to 2% slower); tensor-parallel graphs with the
    # fused all-reduce take it for every call of up to 16 rows (`fused_all_rows`)
    fused_layer: bool | None = None
    # Programmatic dependent launch of the Triton kernels (pipeline.models.pdl); None: where the GPU has it
    pdl: bool | None = None
    # The fused layer's one-row calls (a batch-1 decode or draft step) may multiply on the CUDA cores instead of a
    # tensor-core tile padded to 16 rows; the tuner times both per shape and keeps the faster (the CUDA cores won
    # every linear timed on H100s). False: tensor cores only
    gemv: bool = True
    # With PDL, the fused layer's linears load their first weight tile before waiting for the previous kernel:
    # "auto" for float8 weights only (H100 batch-1 steps: float8 1-6% faster, bf16 up to 2% slower), "on", "off"
    pdl_preload: str = "auto"
    # Tensor parallel with the fused all-reduce (pipeline.models.tp_fused): how long a rank waits for the others'
    # partial sums before it traps (failing its CUDA context, so a dead peer cannot leave it spinning); 0: for ever.
    # Generous: a peer's first call of a shape may compile and tune kernels in between
    tp_spin_timeout_s: float = 120.0
    # "fp8": the fused layer streams float8 (e4m3) copies of the linear weights with a scale per row
    # (fused_linear.quantize_fp8): half the bytes. For drafters only: it changes the model's outputs, which for a
    # drafter moves acceptance and never the served tokens. Needs the fused layer; takes it for every call of up
    # to 16 rows. Calls past that, and prefill, use the model's own weights.
    weights: str = "model"

    def __post_init__(self) -> None:
        if self.pdl_preload not in fl.PRELOADS:
            raise ValueError(f"pdl_preload must be one of {fl.PRELOADS}, got {self.pdl_preload!r}")
        if not self.tp_spin_timeout_s >= 0:
            raise ValueError(f"tp_spin_timeout_s must be >= 0 seconds, got {self.tp_spin_timeout_s!r}")


def bucket(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket >= n, or None when n is past the largest."""
    for b in buckets:
        if b >= n:
            return b
    return None


def plan_shape(B: int, T: int, max_pos: int, max_len: int, cfg: GraphConfig,
               whole_cache: bool = False) -> tuple[int, int, int] | None:
    """(Bb, Tb, Sb) for a call of B rows x T tokens whose largest start position is max_pos; None: eager.
    whole_cache: Sb = max_len whatever the positions (the Triton attention sizes its work from the rows' own
    positions on the device, so one graph per (Bb, Tb) serves every context length)."""
    Bb, Tb = bucket(B, cfg.batch_buckets), bucket(T, cfg.token_buckets)
    if Bb is None or Tb is None or max_pos + Tb > max_len:
        return None
    if whole_cache:
        return Bb, Tb, max_len
    need = max_pos + Tb  # keys [0, need) cover every (padded) query position
    return Bb, Tb, min(-(-need // cfg.kv_block) * cfg.kv_block, max_len)


# ----------------------------------------------------------------------------------------------------
# The per-layer math, as free functions of tensors (so one compiled version serves every layer)


def qkv_proj(
    x: torch.Tensor,  # [B, T, C]
    norm_w: torch.Tensor,  # [C]
    wqkv: torch.Tensor,  # [(H + 2 Hkv) D, C]
    bqkv: torch.Tensor | None,
    eps: float,
    linear_kind: str = "torch",
    offset: bool = False,  # the norms scale by (1 + weight) (Gemma)
) -> torch.Tensor:  # [B, T, (H + 2 Hkv) D]
    return linear(rms_norm(x, norm_w, eps, offset), wqkv, bqkv, linear_kind)


def attn_in(
    x: torch.Tensor,  # [B, T, C]
    norm_w: torch.Tensor,  # [C]
    wqkv: torch.Tensor,  # [(H + 2 Hkv) D, C]
    bqkv: torch.Tensor | None,
    cos: torch.Tensor,  # [B, T, 1, D]
    sin: torch.Tensor,  # [B, T, 1, D]
    eps: float,
    n_heads: int,
    n_kv_heads: int,
    linear_kind: str = "torch",
    q_norm: torch.Tensor | None = None,  # [D] per-head q/k norm weights (Qwen3, Gemma 3); None: none
    k_norm: torch.Tensor | None = None,
    offset: bool = False,  # the norms scale by (1 + weight) (Gemma)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # q [B, Hkv, G*T, D]; k, v [B*T*Hkv, D]
    qkv = qkv_proj(x, norm_w, wqkv, bqkv, eps, linear_kind, offset)
    return rope_split(qkv, cos, sin, n_heads, n_kv_heads, q_norm, k_norm, eps, offset)


def attn_out_mlp(
    x: torch.Tensor,  # [B, T, C] residual stream
    y: torch.Tensor,  # [B, Hkv, G*T, D] attention output
    wo: torch.Tensor,
    bo: torch.Tensor | None,
    norm_w: torch.Tensor,
    w13: torch.Tensor,  # [2 I, C]: gate rows, then up rows
    b13: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    eps: float,
    linear_kind: str = "torch",
    post_attn_norm: torch.Tensor | None = None,  # [C] norm of the attention output before the residual add (Gemma)
    post_ffn_norm: torch.Tensor | None = None,  # [C] the same for the MLP output
    act: str = "silu",  # the gate's activation (families.ACTIVATIONS)
    offset: bool = False,  # the norms scale by (1 + weight) (Gemma)
) -> torch.Tensor:  # [B, T, C]
    B, T, C = x.shape
    Hkv, GT, D = y.shape[1:]
    G = GT // T
    y = y.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hkv * G * D)  # [B, T, H*D]
    o = linear(y, wo, bo, linear_kind)
    x = x + (o if post_attn_norm is None else rms_norm(o, post_attn_norm, eps, offset))
    gate, up = linear(rms_norm(x, norm_w, eps, offset), w13, b13, linear_kind).chunk(2, dim=-1)  # [B, T, I] each
    h = linear(ACTIVATIONS[act](gate) * up, w2, b2, linear_kind)
    return x + (h if post_ffn_norm is None else rms_norm(h, post_ffn_norm, eps, offset))


def final_logits(x: torch.Tensor, norm_w: torch.Tensor, w_out: torch.Tensor, eps: float,
                 linear_kind: str = "torch", offset: bool = False, softcap: float | None = None) -> torch.Tensor:
    logits = linear(rms_norm(x, norm_w, eps, offset), w_out, None, linear_kind)
    return soft_cap(logits, softcap).float()  # [B, T, V] float32


@dataclass
class _LayerWeights:
    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    bqkv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    ffn_norm: torch.Tensor
    w13: torch.Tensor
    b13: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # [D] per-head norms before RoPE (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [C] norms of the attention and MLP outputs (Gemma)
    post_ffn_norm: torch.Tensor | None = None
    window: int | None = None  # this layer's sliding window (None: global)
    local_rope: bool = False  # this layer rotates by the sliding layers' own RoPE base (Gemma 3)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenate the linears' weights (and biases) row-wise, then make each linear's parameters views into
    the fused tensors, so the eager runner keeps working and no memory is duplicated."""
    weight = torch.cat([m.weight.detach() for m in linears])
    bias = torch.cat([m.bias.detach() for m in linears]) if linears[0].bias is not None else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row : row + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row : row + n], requires_grad=False)
        row += n
    return weight, bias


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph, or None when shapes are static but not captured (CPU)
    logits: torch.Tensor  # [Bb, Tb, V] float32, the static output (shared by the graphs of one (Bb, Tb))
    features: Optional[torch.Tensor] = None  # [Bb, Tb, len(layers) * C]: a features graph's states (`forward_features`)


@dataclass
class GraphStats:
    graph_calls: int = 0  # forwards served by the static path (captured or not)
    fused_runs: int = 0  # static-path runs (captures, uncaptured calls) that took the fused layer
    eager_calls: int = 0  # forwards passed to the wrapped eager runner (prefill, too large)
    captures: int = 0
    capture_s: float = 0.0  # host seconds spent capturing (warm-up runs, capture, first replay)
    host_syncs: int = 0  # forwards whose positions lived on the device (one sync each to bucket them)
    shapes: dict = field(default_factory=dict)  # (Bb, Tb, Sb) -> calls


def graph_path_reason(a: LlamaArgs) -> str | None:
    """None when the static-shape path computes this model's layers, else what it lacks (one line). It computes
    every fast-path family (`families.FAMILIES`); an activation outside the fused gate's is the one gap."""
    if a.activation not in fl.GATE_ACTIVATIONS:
        return f"the graph path has no {a.activation} MLP"
    return None


def graph_features(a: LlamaArgs) -> str:
    """What the graph path computes for this model beyond Llama's layer, for the path-choice log line ('' for
    Llama's own)."""
    f = a.family
    used = [what for what, on in (
        ("q/k norms", f.qk_norm),
        ("(1 + weight) norms", f.unit_offset_norm),
        ("post-attention/MLP norms", f.sandwich_norms),
        ("scaled embeddings", f.embed_scale),
        ("GeGLU", a.activation == "gelu_pytorch_tanh"),
        ("attention soft-capping", a.attn_softcap is not None),
        ("final logit soft-capping", a.final_softcap is not None),
        ("per-layer sliding windows", len({a.window(i) for i in range(a.n_layers)}) > 1),
        ("a sliding window", len({a.window(i) for i in range(a.n_layers)}) == 1 and a.sliding_window is not None),
        ("per-layer RoPE bases", a.local_rope_theta is not None),
    ) if on]
    return ", ".join(used)


class GraphCausalLM:
    """`CausalLM` for decode and verify shapes over static buckets, CUDA-graph captured on CUDA."""

    def __init__(self, runner: LlamaCausalLM, config: GraphConfig | None = None) -> None:
        reason = graph_path_reason(runner.args)
        if reason is not None:
            raise ValueError(f"{runner.info.name}: {reason}")
        self.runner = runner
        self.info = runner.info
        self.args = runner.args
        self.device, self.dtype = runner.device, runner.dtype
        self.config = cfg = config or GraphConfig()
        assert list(cfg.batch_buckets) == sorted(cfg.batch_buckets), "batch_buckets must be increasing"
        assert list(cfg.token_buckets) == sorted(cfg.token_buckets), "token_buckets must be increasing"
        on_cuda = self.device.type == "cuda"
        self.use_graphs = on_cuda if cfg.graphs is None else cfg.graphs
        use_compile = on_cuda if cfg.compile is None else cfg.compile
        if self.use_graphs and not on_cuda:
            raise ValueError(f"CUDA graphs need a CUDA model, this one is on {self.device}")
        self.attention = resolve_attention(cfg.attention, self.device)
        self.linear_kind = resolve_linear(cfg.linear, self.device)
        self.fused_layer = self._resolve_fused_layer(on_cuda)
        # The fused layer for every call of up to 16 rows even where `fused_layer` is None (the tensor-parallel
        # wrapper sets it with its fused all-reduce: the other path's sums cost far more than the layer saves).
        self.fused_all_rows = False
        if cfg.weights not in ("model", "fp8"):
            raise ValueError(f"weights must be 'model' or 'fp8', got {cfg.weights!r}")
        if cfg.weights == "fp8" and not self.fused_layer:
            raise ValueError("weights='fp8' needs the fused layer (Triton attention, fused RoPE, bf16/fp16 weights)")
        if cfg.weights == "fp8" and on_cuda and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError("weights='fp8' needs a GPU with float8 support (compute capability 8.9 or later)")
        self.use_pdl = (pdl.enabled(self.device) if cfg.pdl is None else cfg.pdl) and self.attention == "triton"
        self.stats = GraphStats()
        self._scale = runner.args.attn_scale or 1.0 / math.sqrt(runner.args.head_dim)  # attention logits' scale
        self._graphs: dict[tuple, _Graph] = {}  # (Bb, Tb, Sb) [+ stream window, layers, "tree"] -> its graph
        self._pool = None
        m = runner.model
        self._layers = []
        for layer in m.layers:
            at, ff = layer.attention, layer.feed_forward
            wqkv, bqkv = _fuse([at.wq, at.wk, at.wv])
            w13, b13 = _fuse([ff.w1, ff.w3])
            i = len(self._layers)
            sandwich = runner.args.family.sandwich_norms
            self._layers.append(_LayerWeights(
                layer.attention_norm.weight, wqkv, bqkv, at.wo.weight, at.wo.bias,
                layer.ffn_norm.weight, w13, b13, ff.w2.weight, ff.w2.bias,
                q_norm=at.q_norm.weight if at.q_norm is not None else None,
                k_norm=at.k_norm.weight if at.k_norm is not None else None,
                post_attn_norm=layer.post_attention_norm.weight if sandwich else None,
                post_ffn_norm=layer.post_ffn_norm.weight if sandwich else None,
                window=runner.args.window(i), local_rope=runner.args.local_rope(i),
            ))
        # weights='fp8': per layer {name: (float8 weight, row scales)}, and the output layer's
        self._fp8: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        self._fp8_out: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.weights == "fp8":
            self._fp8 = [{n: fl.quantize_fp8(getattr(w, n)) for n in ("wqkv", "wo", "w13", "w2")} for w in self._layers]
            self._fp8_out = fl.quantize_fp8(m.output.weight)
        self._attn_in: Callable = attn_in
        self._qkv_proj: Callable = qkv_proj
        self._attn_out_mlp: Callable = attn_out_mlp
        self._final_logits: Callable = final_logits
        if use_compile:
            # Sizes 1 are specialised (decode T = 1, batch 1) and every model shape compiles its own versions:
            # allow more than dynamo's default 8 versions per function.
            dyn = torch._dynamo.config
            name = "recompile_limit" if hasattr(dyn, "recompile_limit") else "cache_size_limit"
            setattr(dyn, name, max(getattr(dyn, name), 64))
            self._attn_in = torch.compile(attn_in, fullgraph=True)
            self._qkv_proj = torch.compile(qkv_proj, fullgraph=True)
            self._attn_out_mlp = torch.compile(attn_out_mlp, fullgraph=True)
            self._final_logits = torch.compile(final_logits, fullgraph=True)
        self._tp_sites = None  # tensor parallel: pipeline.models.tp_fused.SiteBuffers (set by tensor_parallel_graphs)
        self._bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._outs: dict[tuple[int, int], torch.Tensor] = {}  # (Bb, Tb) -> static logits, shared by every Sb
        self._static_outs: dict[tuple, torch.Tensor] = {}  # (B, T) -> logits of `forward_static`; (B, T, layers) ->
        self._taps: list[tuple[int, torch.Tensor]] | None = None  # its features (`forward_static_features`), while
        # it runs: (layer, the view of the buffer it goes to)
        if runner.num_slots > 0:
            self.allocate(runner.num_slots, runner.max_len)

    def _resolve_fused_layer(self, on_cuda: bool) -> bool:
        cfg = self.config
        why = None
        if self.attention != "triton":
            why = "the Triton attention"
        elif cfg.fused_rope is False:
            why = "the fused RoPE/cache write"
        elif self.dtype not in fl.HALF_DTYPES:
            why = f"half-precision weights (this model is {self.dtype})"
        if cfg.fused_layer is None:
            return on_cuda and why is None
        if cfg.fused_layer and why is not None:
            raise ValueError(f"fused_layer=True needs {why}")
        return cfg.fused_layer

    # -- the protocol ------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return max(self.runner.num_slots - 1, 0)  # the last runner slot is the scratch slot

    @property
    def max_len(self) -> int:
        return self.runner.max_len

    def allocate(self, num_slots: int, max_len: int) -> None:
        self._graphs.clear()  # captured graphs point at the old cache
        self._pool = None  # and a fresh memory pool for the new ones (the old one may still hold their outputs)
        self._outs.clear()
        self.runner.allocate(num_slots + 1, max_len)
        Bmax, Tmax = self.config.batch_buckets[-1], self.config.token_buckets[-1]
        # The graphs' inputs, one block: tokens [Bmax, Tmax], positions [Bmax], slots [Bmax] (the scratch slot).
        # A call writes its host inputs (positions and slots; tokens too when on the host) into a host mirror of
        # it and sends them in one copy (`_set_inputs`).
        self._inputs = torch.zeros(Bmax * Tmax + 2 * Bmax, dtype=torch.int64, device=self.device)
        self._host_inputs = torch.zeros(Bmax * Tmax + 2 * Bmax, dtype=torch.int64)
        self._bufs = _input_views(self._inputs, Bmax, Tmax)
        self._host_bufs = _input_views(self._host_inputs, Bmax, Tmax)
        for _, _, slot_view in (self._bufs, self._host_bufs):
            slot_view.fill_(num_slots)
        # A tree call's parents (region index, -1: the prefix)
        self._parents = torch.full((Bmax, Tmax), -1, dtype=torch.int64, device=self.device)
        self._arange = torch.arange(max(max_len, Tmax), device=self.device)

    def cache_bytes(self) -> int:
        return self.runner.cache_bytes()

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B] int64 position of tokens[:, 0] (CPU: no sync)
        slots: torch.Tensor,  # [B] int64 distinct slots < num_slots
        logits_from: int = 0,
        stream: tuple[int, int] | None = None,  # (window, sinks): StreamingLLM attention (pipeline.models.llama)
        tree: TreeMask | None = None,  # the fed tokens are a token tree's nodes (pipeline.models.tree_attention)
    ) -> torch.Tensor:  # [B, T - logits_from, V] float32
        assert self._bufs is not None, "call allocate(num_slots, max_len) before forward"
        assert stream is None or self.args.sliding_window is None, "a streaming window on a sliding-window model"
        B, T = tokens.shape
        assert 0 <= logits_from < T, f"logits_from must be in [0, {T}), got {logits_from}"
        if positions.device.type != "cpu":
            self.stats.host_syncs += 1
        max_pos = int(positions.max())  # free on CPU; the deliberate sync otherwise
        shape = self.shape_for(B, T, max_pos) if self._tree_fits(tree, stream) else None
        if shape is None:
            self.stats.eager_calls += 1
            return self.runner.forward(tokens, positions, slots, logits_from, tree=tree, stream=stream)
        Bb, Tb, Sb = shape
        tok_buf, pos_buf, slot_buf = self._bufs
        self._set_inputs(tokens, positions, slots, Bb, Tb, tree)
        key = shape if stream is None else (*shape, *stream)  # a streaming window's graphs are its own
        key = key if tree is None else (*key, "tree")  # and a tree's
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._graphs[key] = self._capture_or_fall_back(shape, stream, tree=tree is not None)
        elif entry.graph is not None:
            entry.graph.replay()
        else:
            self._static_forward(tok_buf[:Bb, :Tb], pos_buf[:Bb], slot_buf[:Bb], Sb, entry.logits, stream,
                                 tree is not None)
        self.stats.graph_calls += 1
        self.stats.shapes[shape] = self.stats.shapes.get(shape, 0) + 1
        return self._result(entry.logits[:B, logits_from:T])

    def forward_features(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                         layers: tuple[int, ...], logits_from: int = 0,
                         tree: TreeMask | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaCausalLM.forward_features`: a decode or verify call where `forward_static` runs takes its kernels
        (uncaptured: the captured graphs return logits only), so the step path and the device loop compute a
        head's features alike; anything else runs on the eager runner (the same cache)."""
        B, T = tokens.shape
        host_rows = positions.device.type == "cpu" and slots.device.type == "cpu"
        shape = self.shape_for(B, T, int(positions.max())) if host_rows and self._tree_fits(tree) else None
        if shape is not None:
            # Host rows (the engine's step path, a target worker): a graph per shape and layers, as `forward`'s
            Bb, Tb, Sb = shape
            self._set_inputs(tokens, positions, slots, Bb, Tb, tree)
            key = (*shape, layers) if tree is None else (*shape, layers, "tree")
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._graphs[key] = self._capture_or_fall_back(shape, layers=layers, tree=tree is not None)
            elif entry.graph is not None:
                entry.graph.replay()
            else:  # static shapes, not captured (CPU)
                tok_buf, pos_buf, slot_buf = self._bufs
                self._capture_taps((tok_buf[:Bb, :Tb], pos_buf[:Bb], slot_buf[:Bb], Sb, entry.logits, None,
                                    tree is not None), entry.logits, entry.features, layers)
            self.stats.graph_calls += 1
            self.stats.shapes[shape] = self.stats.shapes.get(shape, 0) + 1
            return entry.logits[:B, logits_from:T].clone(), entry.features[:B, :T].clone()
        if (logits_from == 0 and self.device_resident() and shape is not None):
            dev = self.device
            logits, feats = self.forward_static_features(tokens.to(dev), positions.to(dev), slots.to(dev), layers)
            return logits.clone(), feats.clone()
        self.stats.eager_calls += 1
        return self.runner.forward_features(tokens, positions, slots, layers, logits_from, tree=tree)

    supports_tree = True  # `forward(..., tree=)`, `forward_features(..., tree=)` and `compact`

    def _tree_fits(self, tree: TreeMask | None, stream: tuple[int, int] | None = None) -> bool:
        """Whether a call with `tree` may take the static path: no tree, or a whole region (first = 0) of at most
        TREE_BITS_MAX nodes without a streaming window; anything else is the eager runner's."""
        return tree is None or (tree.first == 0 and stream is None and tree.parents.shape[1] <= TREE_BITS_MAX)

    def compact(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """`LlamaCausalLM.compact` on the runner's cache (one gather and one scatter over every layer)."""
        self.runner.compact(slots, src, dst)

    def device_resident(self) -> bool:
        """Whether `forward_static` may run: a forward whose positions stay on the device with no host read (the
        Triton attention reads each row's keys up to its own position), which a caller can capture whole."""
        return self.attention == "triton" and self.use_graphs

    def forward_static(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One forward of B rows x T tokens with every input on the device, no padding and no host read, returning
        logits [B, T, V] in a buffer of this shape that the next call of the same shape overwrites. For callers that
        capture a larger piece of work as their own CUDA graph (`pipeline.device_loop`)."""
        assert self.device_resident(), "forward_static needs the Triton attention on the CUDA-graph path"
        B, T = tokens.shape
        out = self._static_outs.get((B, T))
        if out is None:
            vocab = self.runner.model.output.weight.shape[0]
            out = self._static_outs[(B, T)] = torch.empty(B, T, vocab, device=self.device)
        self._static_forward(tokens, positions, slots, self.max_len, out)
        return out

    def forward_static_features(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                                layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward_static` that also returns the hidden states `LlamaCausalLM.forward_features` names ([B, T,
        len(layers) * C], in a buffer of this shape and layers that the next such call overwrites): what a feature
        head reads (`pipeline.device_loop`)."""
        B, T = tokens.shape
        C = self.args.dim
        feats = self._static_outs.get((B, T, layers))
        if feats is None:
            feats = self._static_outs[(B, T, layers)] = torch.empty(B, T, len(layers) * C, device=self.device,
                                                                     dtype=self.dtype)
        self._taps = [(layer, feats[..., j * C:(j + 1) * C]) for j, layer in enumerate(layers)]  # a layer may repeat
        try:
            logits = self.forward_static(tokens, positions, slots)
        finally:
            self._taps = None
        return logits, feats

    def _tap(self, i: int, x: torch.Tensor, B: int, T: int) -> None:
        """Inside a forward for `forward_static_features`: keep the residual stream x entering layer i (i =
        n_layers: the last layer's output; after it, the final normed state as `FINAL_NORMED`)."""
        for layer, out in self._taps or ():
            if layer == i:
                out.copy_(x.view(B, T, -1))
            elif layer == FINAL_NORMED and i == self.args.n_layers:
                out.copy_(self.runner.model.norm(x.view(B, T, -1)))

    def _result(self, logits: torch.Tensor) -> torch.Tensor:
        """What `forward` returns for a view of a graph's static logits: a copy (the next replay overwrites them).
        The tensor-parallel wrapper gathers from the view instead, which copies anyway."""
        return logits.clone()

    def _set_inputs(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, Bb: int, Tb: int,
                    tree: TreeMask | None = None) -> None:
        """The graph inputs of a call padded to (Bb, Tb): padding tokens and positions 0, padding rows in the
        scratch slot. Host positions and slots (the engine's and the draft model's) are written into the host
        mirror and sent in one copy, with the tokens when those are on the host too (otherwise the tokens are one
        device copy): one or three operations in the step instead of six. A pageable host-to-device copy returns
        once the driver has staged it, so the mirror can be written again by the next call at once."""
        B, T = tokens.shape
        host_rows = positions.device.type == "cpu" and slots.device.type == "cpu"
        host_tokens = host_rows and tokens.device.type == "cpu"
        tok_buf = self._host_bufs[0] if host_tokens else self._bufs[0]
        _, pos_buf, slot_buf = self._host_bufs if host_rows else self._bufs
        tok_buf[:Bb, :Tb].zero_()
        tok_buf[:B, :T].copy_(tokens, non_blocking=not host_tokens)
        pos_buf[B:Bb].zero_()
        pos_buf[:B].copy_(positions, non_blocking=not host_rows)
        slot_buf[B:Bb].fill_(self.num_slots)  # padding rows -> the scratch slot
        slot_buf[:B].copy_(slots, non_blocking=not host_rows)
        if host_rows:
            start = 0 if host_tokens else self._bufs[0].numel()  # the block: tokens, then positions and slots
            self._inputs[start:].copy_(self._host_inputs[start:], non_blocking=True)
        if tree is not None:  # padding nodes and rows hang under the prefix
            self._parents[:Bb, :Tb].fill_(-1)
            self._parents[:B, :T].copy_(tree.parents, non_blocking=True)

    __call__ = forward
    supports_stream = True  # `forward(..., stream=(window, sinks))`, captured per window

    @torch.inference_mode()  # as `forward`: a capture here may reuse a logits buffer a forward made (inference tensor)
    def warmup(self, max_batch: int, max_tokens: int | None = None, layers: tuple[int, ...] = (),
               tree: bool = False) -> int:
        """Capture now every graph that calls of up to `max_batch` rows x `max_tokens` tokens (None: any token
        bucket) would use (with the Triton attention, every one; with SDPA, those of the shortest contexts),
        instead of on first use in the middle of serving: a capture costs tens of milliseconds (more with a
        compilation or the linears' tuning), which a stream would see as a stall. Rows point at the scratch slot.
        With `layers`, the graphs of `forward_features` for those layers instead (what a feature head reads); with
        `tree`, those of token-tree calls (a tree's verify pass). Returns the number of graphs captured; 0 without
        CUDA graphs."""
        assert self._bufs is not None, "call allocate(num_slots, max_len) before warmup"
        if not self.use_graphs:
            return 0
        cfg, before = self.config, self.stats.captures
        top_b = bucket(max_batch, cfg.batch_buckets) or cfg.batch_buckets[-1]
        top_t = (max_tokens and bucket(max_tokens, cfg.token_buckets)) or cfg.token_buckets[-1]
        batches = [b for b in cfg.batch_buckets if b <= top_b]
        tokens = [t for t in cfg.token_buckets if t <= top_t]
        tok_buf, pos_buf, slot_buf = self._bufs
        for Bb in batches:
            for Tb in tokens:
                shape = self.shape_for(Bb, Tb, 0)
                if shape is None:
                    continue
                key = (*shape, layers) if layers else shape  # the keys `forward` and `forward_features` use
                key = (*key, "tree") if tree else key
                if key in self._graphs:
                    continue
                tok_buf[:Bb, :Tb].zero_()
                pos_buf[:Bb].zero_()
                slot_buf[:Bb].fill_(self.num_slots)  # the scratch slot: no request's cache is touched
                self._parents[:Bb, :Tb].fill_(-1)  # a tree of siblings (any tree: the graph reads the buffer)
                self._graphs[key] = self._capture_or_fall_back(shape, layers=layers, tree=tree)
        return self.stats.captures - before

    def shape_for(self, B: int, T: int, max_pos: int) -> tuple[int, int, int] | None:
        """The graph (bucket) that serves a call of B rows x T tokens starting at most at max_pos; None: eager.
        With the Triton attention the keys are not bucketed: one graph per (Bb, Tb) for every context."""
        return plan_shape(B, T, max_pos, self.max_len, self.config, whole_cache=self.attention == "triton")

    # -- capture -------------------------------------------------------------------------------------------
    def _capture_or_fall_back(self, shape: tuple[int, int, int], stream: tuple[int, int] | None = None,
                              layers: tuple[int, ...] = (), tree: bool = False) -> _Graph:
        """`_capture`; with attention 'auto', a Triton kernel that fails to build or run (in the warm-up, before
        any capture) switches this runner to the SDPA attention, said once, instead of failing the request."""
        try:
            return self._capture(shape, stream, layers, tree)
        except Exception:
            if self.config.attention != "auto" or self.attention != "triton":
                raise
            log.warning("Triton slot attention failed for shape %s; using SDPA attention from now on", shape,
                        exc_info=True)
            self.attention = "sdpa"
            self.linear_kind = "torch" if self.config.linear == "auto" else self.linear_kind
            self.fused_layer = self.use_pdl = False
            return self._capture(shape, stream, layers, tree)

    def _capture(self, shape: tuple[int, int, int], stream: tuple[int, int] | None = None,
                 layers: tuple[int, ...] = (), tree: bool = False) -> _Graph:
        """Run the shape once (its result is this call's answer) and, on CUDA, capture it for replays. With
        `layers`, the graph also writes the states entering those layers (`_tap`) into its own buffer; with `tree`,
        it reads the parents buffer (a token tree's call)."""
        Bb, Tb, Sb = shape
        tok_buf, pos_buf, slot_buf = self._bufs
        out = self._outs.get((Bb, Tb))
        if out is None:
            vocab = self.runner.model.output.weight.shape[0]
            out = self._outs[(Bb, Tb)] = torch.empty(Bb, Tb, vocab, device=self.device)
        args = (tok_buf[:Bb, :Tb], pos_buf[:Bb], slot_buf[:Bb], Sb, out, stream, tree)
        feats = None
        if layers:
            feats = torch.empty(Bb, Tb, len(layers) * self.args.dim, device=self.device, dtype=self.dtype)
        return self._capture_taps(args, out, feats, layers)

    def _capture_taps(self, args: tuple, out: torch.Tensor, feats: Optional[torch.Tensor],
                      layers: tuple[int, ...]) -> _Graph:
        """`_capture` of `_static_forward(*args)`, with the states entering `layers` written into `feats`."""
        if layers:
            C = self.args.dim
            self._taps = [(layer, feats[..., j * C:(j + 1) * C]) for j, layer in enumerate(layers)]
        try:
            return self._capture_forward(args, out, feats)
        finally:
            self._taps = None

    def _capture_forward(self, args: tuple, out: torch.Tensor, feats: Optional[torch.Tensor]) -> _Graph:
        if not self.use_graphs:
            self._static_forward(*args)
            return _Graph(None, out, feats)
        t0 = time.perf_counter()
        # Warm up on a side stream (compilation, cuBLAS workspaces), as torch.cuda.graphs recommends. The
        # warm-up writes this call's own K/V, which the replay writes again (same values, same places).
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._static_forward(*args)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._static_forward(*args)
        graph.replay()
        self.stats.captures += 1
        self.stats.capture_s += time.perf_counter() - t0
        return _Graph(graph, out, feats)

    def _static_forward(
        self,
        tokens: torch.Tensor,  # [B, T] (already padded)
        positions: torch.Tensor,  # [B]
        slots: torch.Tensor,  # [B]
        S: int,  # keys read per row
        out: torch.Tensor,  # [B, T, V] float32, written
        stream: tuple[int, int] | None = None,  # (window, sinks): StreamingLLM attention
        tree: bool = False,  # the fed tokens are a token tree's nodes (parents in `_parents[:B, :T]`)
    ) -> None:
        a = self.args
        B, T = tokens.shape
        window, sinks = stream or (a.sliding_window, 0)
        pos, tree_in = self._positions(positions, T, tree)
        rope_pos = pos if tree_in is None else tree_in[0]
        if self.fused_layer and B * T <= fl.LAYER_MAX_ROWS and (self.config.fused_layer or self._fp8 or B == 1
                                                                 or self.fused_all_rows):
            self.stats.fused_runs += 1
            return self._fused_forward(tokens, pos, tree_in, slots, S, out, stream)
        Hkv, D, L = a.n_kv_heads, a.head_dim, self.max_len
        G = a.n_heads // Hkv
        lk = self.linear_kind
        r, off = self.runner, a.family.unit_offset_norm
        scale = self._scale
        triton = self.attention == "triton"
        fused_rope = triton if self.config.fused_rope is None else self.config.fused_rope
        if not fused_rope:
            ropes = {False: (r._cos[rope_pos].unsqueeze(2), r._sin[rope_pos].unsqueeze(2))}  # cos, sin [B, T, 1, D]
            if r.local_inv_freq is not None:  # the sliding layers' own base (Gemma 3)
                ropes[True] = (r._local_cos[rope_pos].unsqueeze(2), r._local_sin[rope_pos].unsqueeze(2))
            rows = cache_rows(slots, pos, Hkv, L)  # [B * T * Hkv], in k/v order
        masks: dict[int | None, torch.Tensor] = {}  # window -> [B, 1, G*T, S] (SDPA), shared by the layers

        x = r.model.embed(tokens)  # [B, T, C]
        for i, (w, k_cache, v_cache) in enumerate(zip(self._layers, r.k_caches, r.v_caches)):
            self._tap(i, x, B, T)
            win = window if stream is not None else w.window
            if fused_rope:
                qkv = self._qkv_proj(x, w.attn_norm, w.wqkv, w.bqkv, a.norm_eps, lk, off)
                cos_t, sin_t = (r._local_cos, r._local_sin) if w.local_rope else (r._cos, r._sin)
                q = triton_rope_write(qkv, cos_t, sin_t, pos, slots, k_cache, v_cache, a.n_heads,
                                      q_norm=w.q_norm, k_norm=w.k_norm, eps=a.norm_eps, norm_offset=off,
                                      rope_pos=rope_pos)
            else:
                cos, sin = ropes[w.local_rope]
                q, k, v = self._attn_in(x, w.attn_norm, w.wqkv, w.bqkv, cos, sin, a.norm_eps, a.n_heads, Hkv, lk,
                                        w.q_norm, w.k_norm, off)
                k_cache.view(-1, D).index_copy_(0, rows, k)
                v_cache.view(-1, D).index_copy_(0, rows, v)
            if triton:
                y = triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, win, sinks=sinks,
                                          softcap=a.attn_softcap, tree=tree_in)
            else:
                if win not in masks:
                    masks[win] = sdpa_mask(pos, S, G, win, self.dtype, sinks, tree_in)
                y = sdpa_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, win, masks[win],
                                        softcap=a.attn_softcap)
            x = self._attn_out_mlp(x, y, w.wo, w.bo, w.ffn_norm, w.w13, w.b13, w.w2, w.b2, a.norm_eps, lk,
                                   w.post_attn_norm, w.post_ffn_norm, a.activation, off)
        self._tap(a.n_layers, x, B, T)
        m = r.model
        out.copy_(self._final_logits(x, m.norm.weight, m.output.weight, a.norm_eps, lk, off, a.final_softcap))

    def _positions(self, positions: torch.Tensor, T: int, tree: bool) -> tuple[torch.Tensor, Any]:
        """The fed tokens' cache indices [B, T], and a tree call's `TreeInputs` (RoPE positions by depth, ancestor
        bit sets) from the parents buffer (None without a tree)."""
        pos = positions[:, None] + self._arange[:T]  # [B, T]
        if not tree:
            return pos, None
        bits, depth = tree_bits(self._parents[:positions.shape[0], :T])
        return pos, (positions[:, None] + depth, bits)

    def _fused_forward(self, tokens: torch.Tensor, pos: torch.Tensor, tree_in: Any, slots: torch.Tensor, S: int,
                       out: torch.Tensor, stream: tuple[int, int] | None = None) -> None:
        """`_static_forward` as the fused layer (pipeline.models.fused_linear): seven Triton kernels a layer,
        chained with programmatic dependent launch where available; the residual stream is updated in place.
        Tensor parallel with `_tp_sites` (pipeline.models.tp_fused): the output and down projections push their
        partials to every rank instead of adding them, and one small kernel each adds every rank's partials to x."""
        a, r = self.args, self.runner
        B, T = tokens.shape
        eps, p = a.norm_eps, self.use_pdl
        kw = {"preload": self.config.pdl_preload, "gemv": self.config.gemv}  # every fused linear's launch options
        tp = self._tp_sites
        window, sinks = stream or (a.sliding_window, 0)
        off = a.family.unit_offset_norm
        rope_pos = pos if tree_in is None else tree_in[0]
        x = r.model.embed(tokens).view(B * T, -1)  # [B*T, C], a fresh tensor: updated in place

        def add_to_x(site: int) -> dict:  # x += this linear's result (TP: pushed as `site`'s partial, see below)
            return {"push": tp.push(site)} if tp is not None else {"residual": x, "out": x}

        for i, (w, k_cache, v_cache) in enumerate(zip(self._layers, r.k_caches, r.v_caches)):
            self._tap(i, x, B, T)
            q8 = self._fp8[i] if self._fp8 else {}
            mat = lambda name: q8.get(name, (getattr(w, name), None))  # noqa: E731 - (weight, float8 row scales)
            wqkv, s_qkv = mat("wqkv")
            qkv = fl.fused_linear(x, wqkv, w.bqkv, norm_w=w.attn_norm, eps=eps, use_pdl=p, w_scale=s_qkv,
                                  norm_offset=off, **kw)
            cos_t, sin_t = (r._local_cos, r._local_sin) if w.local_rope else (r._cos, r._sin)
            q = triton_rope_write(qkv.view(B, T, -1), cos_t, sin_t, pos, slots, k_cache, v_cache, a.n_heads,
                                  use_pdl=p, q_norm=w.q_norm, k_norm=w.k_norm, eps=eps, norm_offset=off,
                                  rope_pos=rope_pos)
            y = triton_slot_attention(q, k_cache, v_cache, slots, pos, S, self._scale,
                                      window if stream is not None else w.window, use_pdl=p, sinks=sinks,
                                      softcap=a.attn_softcap, tree=tree_in)
            wo, s_o = mat("wo")
            if w.post_attn_norm is None:
                fl.fused_linear_heads(y, T, wo, w.bo, use_pdl=p, w_scale=s_o, **add_to_x(2 * i), **kw)
                if tp is not None:
                    tp.reduce_into(x, 2 * i, p)
            else:  # Gemma: the output row is normalised before it joins x (no tensor-parallel fused layer here)
                o = fl.fused_linear_heads(y, T, wo, w.bo, use_pdl=p, w_scale=s_o, **kw)
                fl.add_norm(x, o, w.post_attn_norm, eps, use_pdl=p)
            w13, s_13 = mat("w13")
            h = fl.fused_linear(x, w13, w.b13, norm_w=w.ffn_norm, eps=eps, gate=True, use_pdl=p, w_scale=s_13,
                                norm_offset=off, act=a.activation, **kw)
            w2, s_2 = mat("w2")
            if w.post_ffn_norm is None:
                fl.fused_linear(h, w2, w.b2, use_pdl=p, w_scale=s_2, **add_to_x(2 * i + 1), **kw)
                if tp is not None:
                    tp.reduce_into(x, 2 * i + 1, p)
            else:
                fl.add_norm(x, fl.fused_linear(h, w2, w.b2, use_pdl=p, w_scale=s_2, **kw), w.post_ffn_norm, eps,
                            use_pdl=p)
        self._tap(a.n_layers, x, B, T)
        m = r.model
        w_out, s_out = self._fp8_out or (m.output.weight, None)
        if a.final_softcap is None:
            fl.fused_linear(x, w_out, norm_w=m.norm.weight, eps=eps, out=out.view(B * T, -1), use_pdl=p,
                            w_scale=s_out, norm_offset=off, **kw)
        else:  # the cap in the model's dtype, as the eager `Transformer.logits`
            logits = fl.fused_linear(x, w_out, norm_w=m.norm.weight, eps=eps, use_pdl=p, w_scale=s_out,
                                     norm_offset=off, **kw)
            out.view(B * T, -1).copy_(soft_cap(logits, a.final_softcap))


def _input_views(block: torch.Tensor, Bmax: int, Tmax: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [Bmax, Tmax], positions [Bmax], slots [Bmax]) over one int64 block."""
    n = Bmax * Tmax
    return block[:n].view(Bmax, Tmax), block[n:n + Bmax], block[n + Bmax:n + 2 * Bmax]


def maybe_graphs(model: CausalLM, config: GraphConfig | None = None) -> CausalLM:
    """Wrap a Llama-family runner in `GraphCausalLM`; any other runner, and a fast-path runner whose family the
    graph path lacks (`graph_path_reason`), is returned as is (said once)."""
    if isinstance(model, GraphCausalLM):
        return model
    if isinstance(model, LlamaCausalLM):
        reason = graph_path_reason(model.args)
        if reason is None:
            return GraphCausalLM(model, config)
        if model.info.name not in _fallback_warned:
            _fallback_warned.add(model.info.name)
            log.warning("%s: eager fast path, no static-shape graphs (%s)", model.info.name, reason)
        return model
    name = getattr(model.info, "architecture", type(model).__name__)
    if name not in _fallback_warned:
        _fallback_warned.add(name)
        log.warning("%s is not a Llama-family fast-path model: no static-shape graph path, using the generic runner",
                    name)
    return model


def graphs_on_cuda(model: CausalLM, config: GraphConfig | None = None) -> CausalLM:
    """`maybe_graphs` for a model on a CUDA device; a model elsewhere is returned unchanged."""
    if torch.device(getattr(model, "device", "cpu")).type != "cuda":
        return model
    return maybe_graphs(model, config)
