"""Cases of tests/test_graph_kernels.py, run in a child process under Triton's CPU interpreter (see
tests/_decode_attention_cases.py for why a child process): the skinny-linear kernel against F.linear and the
fused RoPE + cache-write kernel against the reference, printed as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
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
]
GRAPH_CASES = ["graph-linear-triton"]
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


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


def rope_case(torch, rw, B, T, H, Hkv, D, dtype_name) -> dict:
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
    want = rw.torch_rope_write(qkv.float(), cos.float(), sin.float(), pos, slots, *up, H)
    got = rw.triton_rope_write(qkv, cos, sin, pos, slots, *caches["tri"], H)
    scale = float(want.abs().max())
    err = max(float((got.float() - want).abs().max()) / scale,
              float((caches["tri"][0].float() - up[0]).abs().max()) / scale,
              float((caches["tri"][1].float() - up[1]).abs().max()) / scale)
    untouched = torch.ones(num_slots, L, dtype=torch.bool)
    untouched[slots[:, None], pos] = False
    ok = bool(torch.equal(caches["tri"][0].transpose(1, 2)[untouched], caches["ref"][0].transpose(1, 2)[untouched]))
    return {"err": err, "tol": TOL[dtype_name], "ok": ok}


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
    from _decode_attention_cases import compare_static_paths

    err, argmax_equal = compare_static_paths(torch, models, "kernels", ("reference", "eager"))
    return {"err": err, "tol": 1e-4, "ok": argmax_equal and models["kernels"].stats.graph_calls >= 3}


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    from pipeline.models import rope_write as rw
    from pipeline.models import skinny_linear as sl
    from pipeline.models import skinny_linear_triton as kern

    assert kern.interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    torch.set_num_threads(1)
    results = {}
    runs = [(c[0], lambda c=c: linear_case(torch, sl, *c[1:])) for c in LINEAR_CASES]
    runs += [(c[0], lambda c=c: rope_case(torch, rw, *c[1:])) for c in ROPE_CASES]
    runs += [(c, lambda: graph_case(torch)) for c in GRAPH_CASES]
    for case_id, fn in runs:
        try:
            results[case_id] = fn()
        except Exception as e:  # noqa: BLE001 - reported per case
            results[case_id] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
