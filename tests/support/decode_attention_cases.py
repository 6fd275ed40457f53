"""Cases of tests/pipeline/models/test_decode_attention.py, run in a child process under Triton's CPU interpreter.

Triton's interpreter mode is fixed per process when triton is first imported (TRITON_INTERPRET=1), and a
process in that mode must never run the compiled kernels (the GPU tests of the same pytest run): so the test
module runs this file as `TRITON_INTERPRET=1 python tests/support/decode_attention_cases.py` and reads one JSON line.

Each case compares `triton_slot_attention` with the reference (`sdpa_slot_attention` in float32 over the same,
upcast inputs) on a cache with several slots: rows in arbitrary slot order, ragged positions, padding rows
pointing at a scratch slot at position 0, T in {1, 5}, G in {1, 3, 4}, window on/off (with attention sinks: a
(window, sinks) pair), attention logit soft-capping (Gemma 2), S not a multiple of the chunk, forced split
counts. The 'graph-*' cases run a tiny model's
static path with attention='triton' against attention='sdpa' and the eager runner ('graph-stream': the
self-speculation drafter's StreamingLLM window, `forward(..., stream=)`).
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

# (id, dtype, D, G, T, S, window, num_splits, B[, longest]): B rows, the last one a padding row on the scratch
# slot; the longest row reads keys up to `longest` (default S). longest < S: S is only the grid's capacity, as on
# the graph path (S = the cache length), and the kernels size the chunks from the rows' own positions.
KERNEL_CASES = [
    ("f32-D64-G4-T1", "float32", 64, 4, 1, 200, None, None, 4),
    ("f32-D64-G4-T5", "float32", 64, 4, 5, 200, None, None, 4),
    ("f32-D64-G1-T1-split1", "float32", 64, 1, 1, 200, None, 1, 3),
    ("f32-D64-G3-T5-split4", "float32", 64, 3, 5, 333, None, 4, 4),
    ("f32-D128-G4-T5-win", "float32", 128, 4, 5, 333, 37, None, 4),
    ("f32-D128-G1-T1-win-split3", "float32", 128, 1, 1, 256, 50, 3, 3),
    ("f32-D96-G3-T1", "float32", 96, 3, 1, 130, None, 2, 3),  # head_dim padded to 128
    ("f32-D64-G8-T16", "float32", 64, 8, 16, 300, None, None, 2),  # 128 query rows: two query blocks
    ("bf16-D128-G4-T1", "bfloat16", 128, 4, 1, 333, None, None, 4),
    ("bf16-D128-G4-T5-win", "bfloat16", 128, 4, 5, 333, 64, None, 4),
    ("bf16-D64-G3-T5-split1", "bfloat16", 64, 3, 5, 200, None, 1, 4),
    ("f16-D64-G4-T5", "float16", 64, 4, 5, 256, None, None, 4),
    ("f16-D128-G1-T1-win", "float16", 128, 1, 1, 200, 20, 4, 3),
    ("f32-D64-G4-T1-cap", "float32", 64, 4, 1, 1024, None, 6, 4, 300),  # 6 splits for 1,024 keys; 5 hold 300
    ("f32-D64-G3-T5-cap-auto", "float32", 64, 3, 5, 2000, None, None, 4, 150),
    ("bf16-D128-G4-T5-cap", "bfloat16", 128, 4, 5, 2048, None, 8, 4, 333),
    ("f32-D128-G4-T5-win-cap", "float32", 128, 4, 5, 2048, 64, 8, 4, 333),
    ("f32-D64-G4-T5-sinks", "float32", 64, 4, 5, 333, (37, 4), None, 4),
    ("bf16-D128-G4-T1-sinks-split4", "bfloat16", 128, 4, 1, 2048, (64, 4), 4, 4, 600),
    ("f32-D64-G3-T5-sinks-wide", "float32", 64, 3, 5, 200, (20, 90), 3, 4),  # sinks reach into some windows
    # Gemma 2's logit soft-capping (a cap of 2 against logits of about 4), with and without a window
    ("f32-D64-G4-T5-win-softcap-split3", "float32", 64, 4, 5, 333, 37, 3, 4, None, 2.0),
    ("bf16-D128-G2-T1-softcap", "bfloat16", 128, 2, 1, 200, None, None, 3, None, 2.0),
]
GRAPH_CASES = ["graph-gqa", "graph-window", "graph-stream", "graph-tree", "graph-tree-window"]
# Max error relative to the largest output value. bf16: the interpreter rounds bf16 by truncation (the GPU to
# nearest), so its error is about twice the reference's own bf16 error (seen: 0.6% of the largest value).
TOL = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}


def kernel_case(torch, da, dtype_name: str, D: int, G: int, T: int, S: int, window, num_splits, B: int,
                longest: int | None = None, softcap: float | None = None) -> dict:
    dtype = getattr(torch, dtype_name)
    window, sinks = window if isinstance(window, tuple) else (window, 0)
    g = torch.Generator().manual_seed(D * 1000 + G * 100 + T * 10 + S)
    num_slots, Hkv, max_len = 6, 2, S + 40  # the scratch slot is the last one
    k_cache = torch.randn(num_slots, Hkv, max_len, D, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, Hkv, max_len, D, generator=g).to(dtype)
    slots = torch.tensor([4, 0, 2, 1, 3][: B - 1] + [num_slots - 1])  # arbitrary order; last row: padding
    top = (longest or S) - T  # the longest row reads right up to S (or `longest`)
    starts = torch.tensor([top, 0, top // 3, 7, top - 1][: B - 1] + [0])
    pos = starts[:, None] + torch.arange(T)  # [B, T]
    q = torch.randn(B, G * T, Hkv, D, generator=g).to(dtype).transpose(1, 2)  # non-contiguous [B, Hkv, G*T, D]
    scale = D ** -0.5 * (4.0 if softcap else 1.0)  # soft-capped: logits of about 4, so that the cap matters
    got = da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, num_splits=num_splits,
                                   sinks=sinks, softcap=softcap)
    want = da.sdpa_slot_attention(q.float(), k_cache.float(), v_cache.float(), slots, pos, S, scale, window,
                                  sinks=sinks, softcap=softcap)
    assert got.shape == want.shape and got.dtype == dtype, (got.shape, want.shape, got.dtype)
    err = float((got.float() - want).abs().max() / want.abs().max())
    # The reference itself in the low dtype: its own rounding error, for scale.
    low = da.sdpa_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, sinks=sinks, softcap=softcap)
    ref_err = float((low.float() - want).abs().max() / want.abs().max())
    ok = bool(torch.isfinite(got).all())
    if window is not None:  # the window is really exercised: without it the answer is far off
        unwindowed = da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, None, num_splits=num_splits,
                                              softcap=softcap)
        ok &= float((unwindowed.float() - want).abs().max() / want.abs().max()) > 10 * TOL[dtype_name]
    if softcap:  # the cap really changes the answer
        uncapped = da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, num_splits=num_splits)
        ok &= float((uncapped.float() - want).abs().max() / want.abs().max()) > 10 * TOL[dtype_name]
    if sinks:  # the sinks are really read: without them the answer is far off
        sinkless = da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, num_splits=num_splits)
        ok &= float((sinkless.float() - want).abs().max() / want.abs().max()) > 10 * TOL[dtype_name]
    return {"err": err, "ref_err": ref_err, "tol": TOL[dtype_name], "ok": ok}


def graph_case(torch, name: str) -> dict:
    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.shapes import SHAPES, random_llama

    args = replace(SHAPES["llama-1b"], dim=64, n_layers=2, n_heads=4, n_kv_heads=2 if name == "graph-gqa" else 4,
                   head_dim=16, intermediate_size=128, vocab_size=128,
                   sliding_window={"graph-window": 6, "graph-tree-window": 9}.get(name))
    cfg = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4), token_buckets=(1, 2, 4, 8), kv_block=16)
    models = {
        "triton": GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=5), replace(cfg, attention="triton")),
        "sdpa": GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=5), replace(cfg, attention="sdpa")),
        "eager": random_llama(args, "cpu", torch.float32, seed=5),
    }
    assert models["triton"].attention == "triton" and models["sdpa"].attention == "sdpa"
    if name.startswith("graph-tree"):  # token trees: the kernel's ancestor bits and the fused RoPE's depth positions
        models["triton"] = GraphCausalLM(random_llama(args, "cpu", torch.float32, seed=5),
                                         replace(cfg, attention="triton", fused_rope=True))
        err, argmax_equal, tree_effect = compare_tree_calls(torch, models, "triton", ("sdpa", "eager"))
        return {"err": err, "tol": 1e-4, "ok": argmax_equal and tree_effect > 0.1 and
                models["triton"].stats.graph_calls >= 4, "tree_effect": tree_effect}
    err, argmax_equal = compare_static_paths(torch, models, "triton", ("sdpa", "eager"),
                                             stream=(4, 2) if name == "graph-stream" else None)
    assert models["triton"].stats.graph_calls >= 3
    return {"err": err, "tol": 1e-4, "ok": argmax_equal}


def compare_static_paths(torch, models: dict, subject: str, refs: tuple[str, ...],
                         stream: tuple[int, int] | None = None) -> tuple[float, bool]:
    """Prefill three slots of every model the same way, then feed the same ragged 3-row calls (T = 1, 3, 5; one
    padding row in the batch bucket; `stream`: through that StreamingLLM window) to all: (largest |subject - ref|
    logit difference, argmaxes all equal)."""
    g = torch.Generator().manual_seed(0)
    lengths = {0: 5, 1: 23, 3: 11}  # slot -> prefilled tokens
    for m in models.values():
        m.allocate(4, 64)
    for slot, n in lengths.items():
        prompt = torch.randint(0, 128, (1, n), generator=g)
        for m in models.values():
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    err, argmax_equal = 0.0, True
    for T in (1, 3, 5):
        slots = torch.tensor([3, 0, 1])  # 3 rows -> bucket 4: one padding row on the scratch slot
        tokens = torch.randint(0, 128, (3, T), generator=g)
        positions = torch.tensor([lengths[int(s)] for s in slots])
        kw = {} if stream is None else {"stream": stream}
        out = {k: m.forward(tokens, positions, slots, **kw) for k, m in models.items()}
        for ref in refs:
            err = max(err, float((out[subject] - out[ref]).abs().max()))
            argmax_equal &= bool(torch.equal(out[subject].argmax(-1), out[ref].argmax(-1)))
        lengths = {s: n + 1 for s, n in lengths.items()}  # roll back all but one fed token
    return err, argmax_equal


# Token trees of a verify call (region node 0: the pending token), one per row: a chain of 3, a bushy tree of 5,
# two branches of 7 (the last node hangs under the prefix, as a padding node does)
TREES = ([-1, 0, 1], [-1, 0, 0, 1, 1], [-1, 0, 0, 1, 2, 3, 4])


def tree_rows(torch, T: int, B: int):
    """[B, T] parents: row b takes TREES[b % 3] cut or padded (a padding node under the prefix) to T nodes."""
    rows = []
    for b in range(B):
        tree = TREES[b % len(TREES)][:T]
        rows.append(tree + [-1] * (T - len(tree)))
    return torch.tensor(rows)


def compare_tree_calls(torch, models: dict, subject: str, refs: tuple[str, ...],
                       vocab: int = 128) -> tuple[float, bool, float]:
    """Prefill three slots of every model alike, feed the same 3-row token-tree verify calls (T = 5 and 7, a
    different tree per row, one padding row in the batch bucket) to all, move each row's accepted path
    (`compact`) and feed one more chain step: (largest |subject - ref| logit difference, argmaxes all equal, how
    far the subject's tree logits lie from its own logits for the same tokens fed as a chain: > 0 shows the tree
    mask is in force)."""
    from pipeline.models.tree_attention import TreeMask, compact_indices

    g = torch.Generator().manual_seed(1)
    lengths = {0: 5, 1: 23, 3: 11}  # slot -> prefilled tokens
    for m in models.values():
        m.allocate(4, 64)
    for slot, n in lengths.items():
        prompt = torch.randint(0, vocab, (1, n), generator=g)
        for m in models.values():
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    err, argmax_equal, tree_effect = 0.0, True, 0.0
    slots = torch.tensor([3, 0, 1])  # 3 rows -> bucket 4: one padding row on the scratch slot
    for T in (5, 7):
        tokens = torch.randint(0, vocab, (3, T), generator=g)
        parents = tree_rows(torch, T, 3)
        positions = torch.tensor([lengths[int(s)] for s in slots])
        out = {k: m.forward(tokens, positions, slots, tree=TreeMask(parents)) for k, m in models.items()}
        for ref in refs:
            err = max(err, float((out[subject] - out[ref]).abs().max()))
            argmax_equal &= bool(torch.equal(out[subject].argmax(-1), out[ref].argmax(-1)))
        # the accepted path: node 0, then each row's deepest branch through its last node
        path = torch.full((3, T), -1)
        for b in range(3):
            node, chain = T - 1, []
            while node > 0:
                chain.append(node)
                node = int(parents[b, node])
            path[b, :len(chain)] = torch.tensor(chain[::-1]) - 1  # region index - 1: the pending token stays put
        src, dst = compact_indices(positions + 1, path)
        for m in models.values():
            m.compact(slots, src, dst)
        accepted = (path >= 0).sum(1)
        nxt = torch.randint(0, vocab, (3, 2), generator=g)
        positions = positions + 1 + accepted
        out = {k: m.forward(nxt, positions, slots) for k, m in models.items()}
        for ref in refs:
            err = max(err, float((out[subject] - out[ref]).abs().max()))
            argmax_equal &= bool(torch.equal(out[subject].argmax(-1), out[ref].argmax(-1)))
        lengths = {int(s): int(p) + 1 for s, p in zip(slots, positions)}  # keep one of the two tokens
    chain = models[subject].forward(tokens, torch.tensor([lengths[int(s)] for s in slots]), slots)
    tree = models[subject].forward(tokens, torch.tensor([lengths[int(s)] for s in slots]), slots,
                                   tree=TreeMask(tree_rows(torch, tokens.shape[1], 3)))
    tree_effect = float((chain - tree).abs().max())
    return err, argmax_equal, tree_effect


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    import torch

    from pipeline.models import decode_attention as da
    from pipeline.models import decode_attention_triton as kern

    assert kern.interpreted(), "triton was imported before TRITON_INTERPRET=1 took effect"
    torch.set_num_threads(1)
    results = {}
    for case_id, *params in KERNEL_CASES:
        try:
            results[case_id] = kernel_case(torch, da, *params)
        except Exception as e:  # noqa: BLE001 - reported per case
            results[case_id] = {"error": f"{type(e).__name__}: {e}"}
    for case_id in GRAPH_CASES:
        try:
            results[case_id] = graph_case(torch, case_id)
        except Exception as e:  # noqa: BLE001
            results[case_id] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
