"""Cases of tests/pipeline/models/test_kernels.py, run in a child process under Triton's CPU interpreter (see
tests/support/decode_attention_cases.py for why a child process): the skinny-linear kernel against F.linear, the
fused RoPE + cache-write kernel against the reference, and the fused-layer linear (each mode) and a tiny bf16
model's fused layer against the eager math, printed as one JSON line.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import replace

# (id, M, N, K, dtype, bias, block_n, block_k, splits, transposed x)
LINEAR_CASES = [
    ("f32-M1-single", 1, 50, 300, "float32", False, 16, 128, 1, False),
    ("f32-M5-bias-split2", 5, 64, 256, "float32", True, 32, 128, 2, False),
    ("bf16-M16-bias-split4", 16, 33, 1024, "bfloat16", True, 16, 128, 4, False),
    ("f32-M17-pad32-ragged-k", 17, 40, 130, "float32", False, 16, 128, 1, True),
    ("f16-M40-pad64-split3", 40, 20, 700, "float16", True, 16, 128, 3, False),
    ("bf16-M3-split8-capped", 3, 48, 1000, "bfloat16", False, 32, 256, 8, True),
]
# (id, B, T, H, Hkv, D, dtype)
ROPE_CASES = [
    ("f32-gqa-T1", 3, 1, 4, 2, 16, "float32"),
    ("bf16-gqa-T5", 2, 5, 6, 3, 64, "bfloat16"),
    ("f32-mha-T3", 2, 3, 4, 4, 32, "float32"),
    ("f16-mqa-T2", 1, 2, 8, 1, 128, "float16"),
    ("f32-D24", 2, 2, 4, 2, 24, "float32"),
    ("bf16-qk-norm-T3", 2, 3, 4, 2, 32, "bfloat16", True),  # Qwen3's q/k RMSNorm before RoPE
    ("bf16-qk-norm-offset-T2", 3, 2, 4, 2, 32, "bfloat16", "offset"),  # Gemma 3's: scaled by (1 + weight)
]
GRAPH_CASES = ["graph-linear-triton"]
# (id, mode, M, N, K, bias): the fused linear (pipeline.models.fused_linear) against the eager math it replaces
FUSED_CASES = [
    ("fused-norm-M1", "norm", 1, 40, 96, False),
    ("fused-norm-bias-M5-ragged-k", "norm", 5, 33, 100, True),
    ("fused-gate-norm-M3", "gate", 3, 24, 128, True),
    ("fused-residual-M17-pad32", "residual", 17, 48, 64, False),
    ("fused-heads-residual-T3", "heads", 6, 40, 96, True),
    ("fused-logits-f32-M40-pad64", "logits", 40, 130, 64, False),
    ("fused-fp8-gate-norm-M2", "fp8-gate", 2, 40, 128, True),
    ("fused-fp8-heads-residual-T3", "fp8-heads", 6, 24, 96, False),
    # Gemma: the (1 + weight) norm and GeGLU's tanh GELU (one row: the CUDA-core product), and `add_norm`
    ("fused-gemma-gate-M1", "gemma-gate", 1, 24, 128, False),
    ("fused-gemma-gate-bias-M3-ragged-k", "gemma-gate", 3, 24, 100, True),
    ("fused-add-norm-M5", "add-norm", 5, 72, 72, False),
]
PRELOAD_CASES = ["fused-preload-bit-identical"]
GEMV_CASES = ["fused-gemv-one-row", "fused-gemv-fp8-widen-bits"]
FUSED_GRAPH_CASES = ["graph-fused-layer-bf16", "graph-fused-layer-bias-window-bf16", "graph-fused-layer-fp8",
                     "graph-fused-layer-qk-norm-bf16", "graph-fused-layer-gemma2-bf16", "graph-fused-layer-gemma3-bf16"]
# Tiny Gemma configs for the fused layer (config.json keys, read as a checkpoint's are): a sliding layer (window 8:
# the calls run past it), then a global one; caps small enough to change the logits; Gemma 3's sliding layer has
# its own RoPE base and its global layer linear scaling.
_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
             layer_types=["sliding_attention", "full_attention"])
TINY_GEMMA = {
    "gemma2": dict(_TINY, model_type="gemma2", attn_logit_softcapping=1.0, final_logit_softcapping=2.0),
    "gemma3": dict(_TINY, model_type="gemma3_text", rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}}),
}
# (id, ranks, rows): the tensor-parallel fused all-reduce (pipeline.models.tp_fused), ranks simulated in one process
TP_FUSED_CASES = [("tp-fused-2-ranks", 2, 1), ("tp-fused-3-ranks-5-rows", 3, 5)]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


def cost(case_id: str) -> int:
    """Rough time of a case under the interpreter (tens of seconds on one loaded core), to split the cases into parts
    of about equal length: the tiny models' static paths and the one-row products of every mode are most of it."""
    costs = {"graph-linear-triton": 15, "fused-gemv-one-row": 6, "fused-preload-bit-identical": 2}
    return costs.get(case_id, 8 if case_id in FUSED_GRAPH_CASES else 1)


def part_of(runs: list, argv: list[str]) -> list:
    """The runs of `--part I/N` (all without it): the costliest first, each to the part with the least so far."""
    if "--part" not in argv:
        return runs
    part, parts = (int(x) for x in argv[argv.index("--part") + 1].split("/"))
    loads, mine = [0] * parts, []
    for case_id, fn in sorted(runs, key=lambda run: -cost(run[0])):
        p = loads.index(min(loads))
        loads[p] += cost(case_id)
        if p == part:
            mine.append((case_id, fn))
    return mine


def linear_case(torch, sl, M, N, K, dtype_name, bias, block_n, block_k, splits, transposed) -> dict:
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(M * 100 + N)
    x = (torch.randn(K, M, generator=g).to(dtype).t() if transposed else torch.randn(M, K, generator=g).to(dtype))
    w = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    got = sl.skinny_linear(x, w, b, sl.SkinnyConfig(block_n, block_k, splits))
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert got.shape == (M, N) and got.dtype == dtype, (got.shape, got.dtype)
    err = float((got.float() - want).abs().max() / want.abs().max())
    return {"err": err, "tol": TOL[dtype_name], "ok": bool(torch.isfinite(got).all())}


def rope_case(torch, rw, B, T, H, Hkv, D, dtype_name, qk_norm: bool | str = False) -> dict:
    from pipeline.models.llama import rope_inv_freq

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(B * 1000 + T * 100 + D)
    num_slots, L = 5, 40
    inv = rope_inv_freq(D, 10000.0, None)
    emb = torch.cat([torch.outer(torch.arange(L).float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 4, 1][:B])
    pos = torch.tensor([17, 2, 30, 9][:B])[:, None] + torch.arange(T)
    caches = {k: (torch.randn(num_slots, Hkv, L, D, generator=g).to(dtype),
                  torch.randn(num_slots, Hkv, L, D, generator=g).to(dtype)) for k in ("ref",)}
    caches["tri"] = (caches["ref"][0].clone(), caches["ref"][1].clone())
    up = (caches["ref"][0].float(), caches["ref"][1].float())  # the float32 reference
    norms = {}
    if qk_norm:  # the reference norms in float32 from the same weights; scaled rows so the norm matters
        qkv = (qkv.float() * (1 + 3 * torch.rand(B, T, 1, generator=g))).to(dtype)
        offset = qk_norm == "offset"  # Gemma's (1 + weight) norms: weights near 0
        norms = {"q_norm": (float(not offset) + 0.5 * torch.randn(D, generator=g)).to(dtype),
                 "k_norm": (float(not offset) + 0.5 * torch.randn(D, generator=g)).to(dtype), "eps": 1e-6,
                 "norm_offset": offset}
    want = rw.torch_rope_write(qkv.float(), cos.float(), sin.float(), pos, slots, *up, H,
                               **{k: v.float() if isinstance(v, torch.Tensor) else v for k, v in norms.items()})
    got = rw.triton_rope_write(qkv, cos, sin, pos, slots, *caches["tri"], H, **norms)
    scale = float(want.abs().max())
    err = max(float((got.float() - want).abs().max()) / scale,
              float((caches["tri"][0].float() - up[0]).abs().max()) / scale,
              float((caches["tri"][1].float() - up[1]).abs().max()) / scale)
    untouched = torch.ones(num_slots, L, dtype=torch.bool)
    untouched[slots[:, None], pos] = False
    ok = bool(torch.equal(caches["tri"][0].transpose(1, 2)[untouched], caches["ref"][0].transpose(1, 2)[untouched]))
    return {"err": err, "tol": TOL[dtype_name], "ok": ok}


def fused_case(torch, fl, mode, M, N, K, bias) -> dict:
    """One mode of `fused_linear` in bf16 against the eager layer's own bf16 math
    (tests/pipeline/models/test_kernels.py)."""
    got, want = _fused_run(torch, fl, mode, M, N, K, bias)
    assert got.shape == want.shape, (got.shape, want.shape)
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    # Against a float32 reference the gate's four bf16 roundings (gate, up, SiLU, product) and the interpreter's
    # coarse dots add up to ~2.5%; a missing row scale would be off by orders of magnitude.
    tol = 3e-2 if mode == "fp8-gate" else TOL["bfloat16"]
    return {"err": err, "tol": tol, "ok": bool(torch.isfinite(got).all())}


def preload_case(torch, fl) -> dict:
    """`fused_linear`'s first weight tile loaded before the (PDL) wait, peeled from the K loop (`preload`): the same
    bits as the plain loop in every mode, even and ragged K, one tile or many."""
    worst, runs = 0.0, 0
    for mode, M, N, K, bias in (("norm", 5, 33, 100, True), ("norm", 1, 40, 96, False), ("gate", 3, 24, 128, True),
                                ("heads", 6, 40, 96, True), ("logits", 3, 20, 16, False),
                                ("fp8-gate", 2, 40, 128, True), ("fp8-heads", 6, 24, 96, False)):
        outs = [_fused_run(torch, fl, mode, M, N, K, bias, preload=preload)[0].float() for preload in ("off", "on")]
        worst = max(worst, float((outs[0] - outs[1]).abs().max()))
        runs += 1
    return {"err": worst, "tol": 0.0, "ok": runs == 7}


def gemv_case(torch, fl) -> dict:
    """One-row calls on the CUDA cores (`fused_linear(..., gemv=True)`), in every mode (ragged K, bias, float8; K
    spanning several 32-deep tiles, so the tiles loaded ahead are exercised): against the eager math within its
    mode's tolerance, against the tensor-core path within float32 summation order, and the same bits with the first
    tile loaded before the wait (`preload`) and with two tiles ahead instead of one."""
    worst, vs_tc, runs = 0.0, 0.0, 0
    saved = fl.gemv_default
    try:
        for mode, N, K, bias in (("norm", 40, 96, False), ("norm", 33, 100, True), ("gate", 24, 128, True),
                                 ("residual", 48, 64, False), ("heads", 40, 96, True), ("logits", 130, 64, False),
                                 ("fp8-gate", 40, 128, True), ("fp8-heads", 24, 96, False)):
            outs = {}
            for gemv, preload, ahead in (("on", "off", 1), ("on", "on", 1), ("on", "off", 2), ("on", "on", 2),
                                         ("off", "off", 1)):
                fl.gemv_default = lambda N, K, sms, a=ahead: fl.FusedConfig(16, 32, 4, 1, a, True)  # 2-4 K tiles of 32
                fl._choices.clear()
                outs[gemv, preload, ahead], want = _fused_run(torch, fl, mode, 1, N, K, bias, preload=preload,
                                                              gemv=gemv == "on")
            got = outs["on", "off", 1].float()
            tol = 3e-2 if mode == "fp8-gate" else TOL["bfloat16"]
            err = float((got - want.float()).abs().max() / want.float().abs().max())
            assert err <= tol, (mode, N, K, err)
            for key in (("on", "on", 1), ("on", "off", 2), ("on", "on", 2)):  # the same products in the same order
                assert torch.equal(outs["on", "off", 1], outs[key]), (mode, key, "changed the bits")
            worst = max(worst, err)
            vs_tc = max(vs_tc, float((got - outs["off", "off", 1].float()).abs().max() / want.float().abs().max()))
            runs += 1
    finally:
        fl.gemv_default = saved
        fl._choices.clear()
    # against the tensor cores: within one bf16 ulp of the largest output
    return {"err": worst, "tol": TOL["bfloat16"], "vs_tensor_cores": vs_tc, "ok": runs == 8 and vs_tc <= 5e-3}


def fp8_widen_case(torch, fl, device: str = "cpu") -> dict:
    """One-row float8 calls widen e4m3 by its bits (`fused_linear_triton._widen`), checked against torch's own e4m3
    conversion, exactly:
    - every finite e4m3 code (both zeros, subnormals, 448) in one column, x one-hot on it, row scales 1: each output
      is its row's code, which bf16 holds exactly, so it must equal torch's float value of that code (a subnormal
      flushed to zero or a lost sign shows);
    - every code among weights times x of +-1 over 64 columns, where every float32 partial sum is a multiple of
      2**-9 below 2**15, so exact in any order: the outputs must equal the float64 sums of x * float(w8), times the
      row scales in float32, rounded to float16 (not bf16: Triton's interpreter rounds float32 to bf16 toward zero);
    - normed and gated on random x: within rounding of the float32 math on the dequantized weights.
    Control: one weight's sign flipped changes the output bits."""
    import torch.nn.functional as F

    from pipeline.models.graphs import rms_norm

    cfg = fl.FusedConfig(16, 16, 4, 1, 1, gemv=True)  # 4 tiles deep: the tiles loaded ahead are exercised too
    bf, N, K = torch.bfloat16, 48, 64
    g = torch.Generator().manual_seed(8)
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254: all but NaN
    one_col = torch.randint(256, (len(codes), K), generator=g, dtype=torch.uint8)
    one_col[:, 5] = codes
    w_codes = one_col.view(torch.float8_e4m3fn).to(device)
    w_codes.view(torch.uint8)[w_codes.view(torch.uint8) & 0x7F == 0x7F] = 0  # no NaN anywhere
    hot = torch.zeros(1, K, dtype=bf, device=device)
    hot[0, 5] = 1
    got_codes = fl.fused_linear(hot, w_codes, w_scale=torch.ones(len(codes), device=device), config=cfg)
    codes_exact = torch.equal(got_codes[0].float(), w_codes[:, 5].float())
    pick = torch.cat([codes, codes[torch.randint(len(codes), (2 * N * K - len(codes),), generator=g)]])
    w8 = pick[torch.randperm(len(pick), generator=g)].view(torch.float8_e4m3fn).view(2 * N, K).to(device)
    scale = (torch.rand(2 * N, generator=g) * 1e-3 + 1e-4).to(device)
    signs = (torch.randint(2, (1, K), generator=g) * 2 - 1).to(torch.float16).to(device)  # x of +-1
    got = fl.fused_linear(signs, w8[:N], w_scale=scale[:N], config=cfg)
    sums = (signs.double() @ w8[:N].double().T).float()  # exact: multiples of 2**-9 below 2**15
    sums_exact = torch.equal(got, (sums * scale[:N]).to(torch.float16))
    w_ctl = w8.clone()
    w_ctl.view(torch.uint8)[3, int(w8[3].float().abs().argmax())] ^= 0x80
    control = fl.fused_linear(signs, w_ctl[:N], w_scale=scale[:N], config=cfg)
    x = torch.randn(1, K, generator=g).to(bf).to(device)
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(bf).to(device)
    gated = fl.fused_linear(x, w8, w_scale=scale, norm_w=nw, eps=1e-5, gate=True, config=cfg)
    wd = w8.float() * scale[:, None]
    gate, up = F.linear(rms_norm(x, nw, 1e-5).float(), wd).chunk(2, dim=-1)
    want = F.silu(gate) * up
    worst = float((gated.float() - want).abs().max() / want.abs().max())
    exact = codes_exact and sums_exact
    return {"err": worst, "tol": 3e-2, "ok": exact and not torch.equal(control, got), "exact": exact,
            "codes_exact": codes_exact, "sums_exact": sums_exact}


def _fused_run(torch, fl, mode, M, N, K, bias, **kw):
    """(fused_linear's output, the eager math's) for one mode, on inputs seeded by the shape (`kw`: fused_linear's
    launch options, preload and gemv)."""
    import torch.nn.functional as F

    from pipeline.models.graphs import rms_norm

    bf = torch.bfloat16
    g = torch.Generator().manual_seed(M * 1000 + N)
    rows = 2 * N if mode.endswith("gate") else N
    w = (torch.randn(rows, K, generator=g) / K**0.5).to(bf)
    b = torch.randn(rows, generator=g).to(bf) if bias else None
    nw = (1 + 0.1 * torch.randn(K, generator=g)).to(bf)
    x = torch.randn(M, K, generator=g).to(bf)
    if mode == "norm":
        got, want = fl.fused_linear(x, w, b, norm_w=nw, eps=1e-5, **kw), F.linear(rms_norm(x, nw, 1e-5), w, b)
    elif mode == "gate":
        got = fl.fused_linear(x, w, b, norm_w=nw, eps=1e-5, gate=True, **kw)
        gate, up = F.linear(rms_norm(x, nw, 1e-5), w, b).chunk(2, dim=-1)
        want = F.silu(gate) * up
    elif mode == "gemma-gate":  # Gemma's norm weights sit near 0: the norm scales by (1 + weight)
        nw = (0.1 * torch.randn(K, generator=g)).to(bf)
        got = fl.fused_linear(x, w, b, norm_w=nw, eps=1e-6, gate=True, norm_offset=True, act="gelu_pytorch_tanh",
                              **kw)
        gate, up = F.linear(rms_norm(x, nw, 1e-6, True), w, b).chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
    elif mode == "add-norm":  # x += rms_norm(y) * (1 + weight)
        nw = (0.1 * torch.randn(N, generator=g)).to(bf)
        y, res = torch.randn(M, N, generator=g).to(bf), torch.randn(M, N, generator=g).to(bf)
        got = fl.add_norm(res.clone(), y, nw, 1e-6)
        want = res + rms_norm(y, nw, 1e-6, True)
    elif mode == "residual":
        res = torch.randn(M, N, generator=g).to(bf)
        got = res.clone()
        fl.fused_linear(x, w, b, residual=got, out=got, **kw)  # in place, as the layer does
        want = res + F.linear(x, w, b)
    elif mode == "heads":  # attention output [B, Hkv, G*T, D] read as [B*T, H*D]
        B, T, Hkv, D = (1, 1, 2, 16) if M == 1 else (2, 3, 2, 16)
        y = torch.randn(B, Hkv, K // (Hkv * D) * T, D, generator=g).to(bf)
        res = torch.randn(B * T, N, generator=g).to(bf)
        got = fl.fused_linear_heads(y, T, w, b, residual=res, **kw)
        flat = y.view(B, Hkv, -1, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, K)
        want = res + F.linear(flat, w, b)
    elif mode.startswith("fp8"):  # float8 weights with row scales, against float32 math on their dequantized values
        w8, scale = fl.quantize_fp8(w)
        wd = w8.float() * scale[:, None]
        b32 = None if b is None else b.float()
        if mode == "fp8-gate":
            got = fl.fused_linear(x, w8, b, norm_w=nw, eps=1e-5, gate=True, w_scale=scale, **kw)
            gate, up = F.linear(rms_norm(x, nw, 1e-5).float(), wd, b32).chunk(2, dim=-1)
            want = F.silu(gate) * up
        else:
            B, T, Hkv, D = (1, 1, 2, 16) if M == 1 else (2, 3, 2, 16)
            y = torch.randn(B, Hkv, K // (Hkv * D) * T, D, generator=g).to(bf)
            res = torch.randn(B * T, N, generator=g).to(bf)
            got = fl.fused_linear_heads(y, T, w8, b, residual=res, w_scale=scale, **kw)
            flat = y.view(B, Hkv, -1, T, D).permute(0, 3, 1, 2, 4).reshape(B * T, K).float()
            want = res.float() + F.linear(flat, wd, b32)
        # and the quantization itself: within e4m3's rounding (2**-4 relative) of the bf16 weights
        assert float(((wd.float() - w.float()).abs() / scale[:, None].mul(fl.FP8_MAX)).max()) <= 2**-4
    else:  # the output layer: bf16 logits returned as float32
        got = torch.full((M, N), float("nan"))
        fl.fused_linear(x, w, b, norm_w=nw, eps=1e-5, out=got, **kw)
        want = F.linear(rms_norm(x, nw, 1e-5), w, b).float()
    return got, want


def tp_fused_case(torch, fl, R: int, M: int, device: str = "cpu") -> dict:
    """R ranks of a row-parallel output projection and MLP, simulated in one process: each rank pushes its
    partials into every rank's site buffers (`SiteBuffers` over plain memory, peer addresses in one address
    space), then adds them to its residual stream (`reduce_into`), three steps in a row. The last rank's
    producers run 32-column programs where the others run 16 (ranks may tune differently; the reduce waits per
    element, so they agree). Against the unsharded eager bf16 math; every rank must hold the same residual
    bits, and every partial slot must be empty again (-0.0) after each step's reduces. The negative control drops
    one rank's partial from the reference. On CUDA the ranks share one GPU (its stream orders them)."""
    import torch.nn.functional as F

    from pipeline.models.graphs import rms_norm
    from pipeline.models.tp_fused import SiteBuffers

    bf, C, I, Kin, eps = torch.bfloat16, 64, 48, 32, 1e-5
    g = torch.Generator().manual_seed(R * 10 + M)
    wo = (torch.randn(C, Kin * R, generator=g) / (Kin * R) ** 0.5).to(device, bf)  # row-parallel: columns split
    w13 = (torch.randn(2 * I * R, C, generator=g) / C**0.5).to(device, bf)  # column-parallel gate/up
    w2 = (torch.randn(C, I * R, generator=g) / (I * R) ** 0.5).to(device, bf)
    nw = (1 + 0.1 * torch.randn(C, generator=g)).to(device, bf)
    bufs = [torch.zeros(SiteBuffers.nbytes(R, 16, C, 4), dtype=torch.uint8, device=device) for _ in range(R)]
    sites = [SiteBuffers(b, [b_.data_ptr() for b_ in bufs], r, 16, C, 4) for r, b in enumerate(bufs)]
    gate_r = lambda r: torch.cat([w13[r * I:(r + 1) * I], w13[(R + r) * I:(R + r + 1) * I]])  # noqa: E731
    x = torch.randn(M, C, generator=g).to(device, bf)
    cfg = {False: fl.FusedConfig(16, 16, 4, 2), True: fl.FusedConfig(32, 16, 4, 2)}  # by "is the last rank"
    err = wrong = 0.0
    same = True
    for step in range(3):
        y = torch.randn(M, Kin * R, generator=g).to(device, bf)
        # the eager, unsharded reference: x += wo y; x += w2 silu-gate(norm(x))
        ref1 = x + F.linear(y, wo)
        gate, up = F.linear(rms_norm(ref1, nw, eps), w13).chunk(2, dim=-1)  # [gate rows of all ranks; up rows]
        ref2 = ref1 + F.linear(F.silu(gate) * up, w2)
        short = x + F.linear(y[:, :Kin], wo[:, :Kin])  # rank 0's partial only
        xs = [x.clone() for _ in sites]

        def row_parallel(site: int, inp: list, w: torch.Tensor, k: int) -> None:
            for r, s in enumerate(sites):  # producers
                fl.fused_linear(inp[r], w[:, r * k:(r + 1) * k].contiguous(), config=cfg[r == R - 1],
                                push=s.push(site))
            for r, s in enumerate(sites):
                s.reduce_into(xs[r], site)

        row_parallel(0, [y[:, r * Kin:(r + 1) * Kin].contiguous() for r in range(R)], wo, Kin)  # output projection
        x1 = [t.clone() for t in xs]
        h = [fl.fused_linear(xs[r], gate_r(r), norm_w=nw, eps=eps, gate=True) for r in range(R)]
        row_parallel(1, h, w2, I)  # down projection
        same = same and all(torch.equal(x1[0], a) and torch.equal(xs[0], b) for a, b in zip(x1, xs))
        scale = float(ref2.float().abs().max())
        err = max(err, float((x1[0].float() - ref1.float()).abs().max()) / scale,
                  float((xs[0].float() - ref2.float()).abs().max()) / scale)
        wrong = max(wrong, float((x1[0].float() - short.float()).abs().max()) / scale)
        x = xs[0]
    emptied = all(bool((s.parts.view(torch.int32) == -(1 << 31)).all()) for s in sites)
    return {"err": err, "tol": TOL["bfloat16"], "negative_control": wrong, "ok": same and emptied and wrong > 0.1}


def tp_missing_rank_main(all_push: bool, spin_timeout_s: float = 1.0) -> int:
    """A child process (CUDA): two ranks simulated on one GPU (`tp_fused_case`'s layout). Rank 0 pushes its
    output-projection partial, rank 1 does too only with `all_push`, then rank 0 reduces. With a rank missing the
    reduce must trap after `spin_timeout_s` (`GraphConfig.tp_spin_timeout_s` in a model) and the process fail, not
    hang. Prints "reduced" once the reduce has finished."""
    import torch

    import pipeline.models.fused_linear as fl
    from pipeline.models.tp_fused import SiteBuffers

    C, K = 64, 32
    bufs = [torch.zeros(SiteBuffers.nbytes(2, 16, C, 2), dtype=torch.uint8, device="cuda") for _ in range(2)]
    sites = [SiteBuffers(b, [b_.data_ptr() for b_ in bufs], r, 16, C, 2, spin_timeout_s) for r, b in enumerate(bufs)]
    x = torch.ones(1, K, dtype=torch.bfloat16, device="cuda")
    w = torch.ones(C, K, dtype=torch.bfloat16, device="cuda")
    for r in range(2 if all_push else 1):
        fl.fused_linear(x, w, push=sites[r].push(0))
    res = torch.zeros(1, C, dtype=torch.bfloat16, device="cuda")
    sites[0].reduce_into(res, 0)
    torch.cuda.synchronize()
    assert bool((res == 2 * K).all()), res
    print("reduced", flush=True)
    return 0


def fused_graph_case(torch, case: str) -> dict:
    """A tiny bf16 model's static path with the fused layer against the unfused static path (same kernels
    otherwise) and the eager runner: logits within bf16 tolerance of the largest logit, the fused layer used.
    fp8: weights that float8 holds exactly; the float8 layer must then give the bf16 fused layer's logits."""
    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.llama import LlamaArgs
    from pipeline.models.shapes import SHAPES, random_llama
    from tests.support.decode_attention_cases import compare_static_paths

    bias_window = case.endswith("bias-window-bf16")
    fp8 = case.endswith("fp8")
    # fp8: one layer (the float8 layer is checked bit for bit; the interpreter emulates float8 slowly);
    # qk-norm: Qwen3's family (q/k RMSNorm before RoPE, in the fused RoPE/cache-write kernel)
    base = SHAPES["qwen3-8b"] if case.endswith("qk-norm-bf16") else SHAPES["llama-1b"]
    args = replace(base, dim=64, n_layers=1 if fp8 else 2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=128, sliding_window=8 if bias_window else None)
    gemma = next((f for f in TINY_GEMMA if f"-{f}-" in case), None)
    if gemma is not None:  # Gemma 2 / 3: every family feature of the fused layer (pipeline.models.families)
        args = LlamaArgs.from_hf(TINY_GEMMA[gemma])
    cfg = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4, 8), kv_block=16,
                      attention="triton", linear="torch", fused_rope=True)

    def model():
        m = random_llama(args, "cpu", torch.bfloat16, seed=7)
        if bias_window:  # q/k/v biases (Qwen2-like) on every layer
            g = torch.Generator().manual_seed(8)
            for layer in m.model.layers:
                for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv):
                    b = 0.1 * torch.randn(lin.out_features, generator=g)
                    lin.bias = torch.nn.Parameter(b.to(torch.bfloat16), requires_grad=False)
        if fp8:  # weights float8 holds exactly: e4m3 codes times a power of two, each row reaching 448
            for name, p in m.model.named_parameters():
                if p.dim() == 2:  # the tied embedding table too: it is the output layer
                    codes = (p.float() / p.float().abs().amax(1, keepdim=True) * 448).to(torch.float8_e4m3fn).float()
                    codes[:, 0] = 448.0
                    p.data.copy_((codes * 2.0 ** -(int(math.log2(448 * p.shape[1] ** 0.5)) + 1)).to(torch.bfloat16))
        return m

    if fp8:  # the float8 copies are exact here: the same logits as the bf16 fused layer, bit for bit
        models = {"fused": GraphCausalLM(model(), replace(cfg, fused_layer=True, weights="fp8")),
                  "fused-bf16": GraphCausalLM(model(), replace(cfg, fused_layer=True))}
        exact, _ = compare_static_paths(torch, models, "fused", ("fused-bf16",))
        return {"err": exact, "tol": 0.0, "ok": models["fused"].stats.fused_runs >= 3}
    models = {
        "fused": GraphCausalLM(model(), replace(cfg, fused_layer=True)),
        "unfused": GraphCausalLM(model(), replace(cfg, fused_layer=False)),
        "eager": model(),
    }
    # Logits of magnitude 1-3. The interpreter's bf16 dots are coarser than the GPU's: the unfused path with the
    # Triton linears is itself 0.08 from the eager runner here. Negative controls (a wrong norm epsilon in the
    # MLP, swapped attention heads) land at 1.7 and 5.1. Gemma: against the eager runner only (the interpreter's
    # time; the unfused static path is tests/pipeline/models/test_families.py's): 0.05 from it; negative controls
    # (the fused layer without the attention or final soft-cap, SiLU for GeGLU, no windows, one RoPE base, weight
    # for (1 + weight) norms) land at 0.5-5.3.
    if gemma is not None:
        del models["unfused"]
    err, _ = compare_static_paths(torch, models, "fused", ("eager",) if gemma else ("unfused", "eager"))
    used = models["fused"].stats.fused_runs
    unfused = models.get("unfused")
    return {"err": err, "tol": 0.25, "ok": used >= 3 and (unfused is None or unfused.stats.fused_runs == 0),
            "fused_runs": used}


def graph_case(torch) -> dict:
    """A tiny model's static path with every kernel on (Triton linears, fused RoPE/cache write, attention)
    against the reference path and the eager runner."""
    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.shapes import SHAPES, random_llama

    args = replace(SHAPES["llama-1b"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=128)
    cfg = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4, 8), kv_block=16)
    models = {
        "kernels": GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=5),
                                 replace(cfg, attention="triton", linear="triton", fused_rope=True)),
        "reference": GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=5),
                                   replace(cfg, attention="sdpa", linear="torch")),
        "eager": random_llama(args, "cpu", torch.float32, seed=5),
    }
    from tests.support.decode_attention_cases import compare_static_paths

    err, argmax_equal = compare_static_paths(torch, models, "kernels", ("reference", "eager"))
    return {"err": err, "tol": 1e-4, "ok": argmax_equal and models["kernels"].stats.graph_calls >= 3}


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    from pipeline.models import fused_linear as fl
    from pipeline.models import rope_write as rw
    from pipeline.models import skinny_linear as sl
    from pipeline.models import skinny_linear_triton as kern

    assert kern.interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    torch.set_num_threads(1)
    results = {}
    runs = [(c[0], lambda c=c: linear_case(torch, sl, *c[1:])) for c in LINEAR_CASES]
    runs += [(c[0], lambda c=c: rope_case(torch, rw, *c[1:])) for c in ROPE_CASES]
    runs += [(c, lambda: graph_case(torch)) for c in GRAPH_CASES]
    runs += [(c[0], lambda c=c: fused_case(torch, fl, *c[1:])) for c in FUSED_CASES]
    runs += [(c, lambda: preload_case(torch, fl)) for c in PRELOAD_CASES]
    runs += [("fused-gemv-one-row", lambda: gemv_case(torch, fl)),
             ("fused-gemv-fp8-widen-bits", lambda: fp8_widen_case(torch, fl))]
    runs += [(c, lambda c=c: fused_graph_case(torch, c)) for c in FUSED_GRAPH_CASES]
    runs += [(c[0], lambda c=c: tp_fused_case(torch, fl, *c[1:])) for c in TP_FUSED_CASES]
    for case_id, fn in part_of(runs, sys.argv[1:]):
        t0 = time.perf_counter()
        try:
            results[case_id] = fn()
        except Exception as e:  # noqa: BLE001 - reported per case
            results[case_id] = {"error": f"{type(e).__name__}: {e}"}
        results[case_id]["s"] = round(time.perf_counter() - t0, 2)  # the interpreter is slow: where time goes
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
