"""Where the float32 graph path of Gemma 2 / Gemma 3 leaves HF's logits: every piece against a reference, one table.

    python -m ops.check_family_numerics --device cuda --out DIR          # a GPU: about 2 minutes on an H100
    python -m ops.check_family_numerics --device cpu --quick --out DIR  # Triton's interpreter (TRITON_INTERPRET=1)

A diagnostic, not a test: it always exits 0, prints one table and writes it to DIR/family_numerics.json.
Per row: max |got - ref|, relative error ||got - ref|| / ||ref|| (as tests/gpu/test_gpu_families.py's `_rel`), and
the fraction of rows whose argmax agrees. Sections, most telling first:

- `attn`: the Triton slot attention alone (`triton_slot_attention`) against a plain float64 torch attention with the
  same soft-cap and window, on random q/k/v: head_dim 16 (the tiny models) and 256 (Gemma 2's), T = 1, 5 and 16,
  the cache length as S (as the graph path passes it; 48, as in the GPU test, for the short contexts) and rows up
  to 10..300 positions (one key block, several, past
  the window, past one split's chunk), automatic splits, one split (no combine) and four forced splits. A row is
  the worst over the contexts (named in `worst`).
- `attn-prec`: the same soft-capped cases with the float32 dot products as "ieee" and "tf32" instead of the
  kernel's "tf32x3" (`decode_attention._DOT_PRECISION_F32`, patched for the row): does TF32 rounding, which the
  soft-capped softmax could amplify, explain an error?
- `model`: tiny random-weight float32 models (tests.support.families / tests.support.models; hidden 64, sliding
  window 16 on Gemma's layers 0 and 2) against HF's forward (`attn_implementation="eager"`, float32, on the CPU):
  Gemma 2 with both caps, without the attention cap, without the final cap, without either; Gemma 3; Llama (the
  control). Each prompt is prefilled by the eager runner (row `prefill`), then ragged 3-row and 1-row calls of T =
  1, 2 and 5 (a rollback among them) run past the window, past one key block (64) and past one split's chunk (128)
  on each path: `eager` (the fast path's runner), `static-*` (GraphCausalLM's static forward, uncaptured:
  `graphs=False`), `graph-*` (captured CUDA graphs); `-triton` / `-sdpa` the attention, `-torchrope` without the
  fused RoPE/cache-write kernel, `-compile` with torch.compile'd pointwise work, `-ieee` the attention's float32
  products as IEEE. `hf-device` is HF itself on the device. `vs_eager` compares with the eager runner's logits.
  Columns T13, T1, T2-5: the relative error of the ragged prefill call (T = 13, the static path's bucket 16), of
  the decode calls and of the verify calls. `*-test-script`: tests/gpu/test_gpu_families.py's own check
  (`check_against_hf`: a 48-position cache; max abs only, which the test holds under 1e-4); `hf-default-attn`:
  HF as the test loads it (its default attention) against the eager reference.
- `rope`, `inductor`, `fused`: the other Triton code on the path: the fused RoPE/cache-write kernel against its
  torch reference (with Gemma 3's (1 + weight) q/k norms or without), torch.compile'd pointwise functions of the
  graph path (GeGLU, sandwich and (1 + weight) norms, the final soft-cap) against the same functions uncompiled, and
  the bf16 fused layer's Gemma pieces (`add_norm`, the GeGLU gate linear).

`--budget-s` (default 120) starts no case after that many seconds (those rows say `skipped (budget)`); `--sections`
picks sections.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
import traceback
from pathlib import Path

import torch

VOCAB = 96  # tests.support.families' vocabulary
HIDDEN = 64  # as tests/gpu/test_gpu_families.py: the fused tiles see more than one block of columns
BAD_REL = 1e-4  # a float32 row past this relative error is flagged
BF16_TOL = 2e-2  # a bf16 row's (tests/support/graph_kernel_cases.py's tolerance)


# ----------------------------------------------------------------------------------------------------
# metrics


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    """max abs error, relative error (test_gpu_families._rel) and argmax agreement over the last axis."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    diff = got - want
    rel = float(diff.norm() / want.norm()) if float(want.norm()) > 0 else float(diff.norm())
    argmax = float((got.argmax(-1) == want.argmax(-1)).double().mean()) if got.dim() > 0 else 1.0
    return {"max_abs": float(diff.abs().max()), "rel": rel, "argmax": argmax}


def worst(results: list[tuple[str, dict]]) -> dict:
    """The row of the largest relative error among (label, metrics), with the label as `worst`."""
    label, m = max(results, key=lambda r: (r[1]["rel"], r[1]["max_abs"]))
    return {**m, "argmax": min(r[1]["argmax"] for r in results), "worst": label}


# ----------------------------------------------------------------------------------------------------
# attention kernel alone


def reference_attention(q, k_cache, v_cache, slots, pos, scale, window, softcap):
    """Plain float64 attention over each row's slot: q [B, Hkv, G*T, D] (query row g*T + t at pos[b, t])."""
    B, Hkv, M, D = q.shape
    T = pos.shape[1]
    keys, values = k_cache[slots].double(), v_cache[slots].double()  # [B, Hkv, L, D]
    scores = q.double() @ keys.transpose(-1, -2) * scale  # [B, Hkv, M, L]
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = pos[:, torch.arange(M, device=pos.device) % T]  # [B, M]
    kpos = torch.arange(keys.shape[2], device=pos.device)
    allowed = kpos[None, None, :] <= qpos[:, :, None]  # [B, M, L]
    if window is not None:
        allowed &= kpos[None, None, :] > qpos[:, :, None] - window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.softmax(scores, dim=-1) @ values.double()


def attention_inputs(D: int, T: int, context: int, S: int, device, seed: int):
    """A cache of 4 slots (the last the scratch slot) of S positions; rows in slots [2, 0, 1] at positions ending at
    `context`, context // 3 and 7 (at least T), one padding row at position 0 on the scratch slot. q scaled so that the
    logits reach ~10 (a cap of 5 changes them)."""
    G, Hkv, num_slots = 2, 2, 4
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_slots, Hkv, S, D, generator=g)
    v_cache = torch.randn(num_slots, Hkv, S, D, generator=g)
    last = [max(n, T) for n in (context, context // 3, min(7, context))]  # each row's last query position + 1
    starts = torch.tensor([n - T for n in last] + [0])
    pos = starts[:, None] + torch.arange(T)  # [4, T]
    slots = torch.tensor([2, 0, 1, num_slots - 1])
    q = 3.0 * torch.randn(4, Hkv, G * T, D, generator=g)
    return [t.to(device) for t in (q, k_cache, v_cache, slots, pos)]


@contextlib.contextmanager
def dot_precision(value: str | None):
    """`decode_attention._DOT_PRECISION_F32` set to `value` inside (None: unchanged)."""
    from pipeline.models import decode_attention as da

    old = da._DOT_PRECISION_F32
    if value is not None:
        da._DOT_PRECISION_F32 = value
    try:
        yield
    finally:
        da._DOT_PRECISION_F32 = old


def attention_rows(device: torch.device, quick: bool, deadline: float, precision_sweep: bool = False) -> list[dict]:
    """The kernel's grid of cases (`attn`), or with `precision_sweep` the soft-capped ones at "ieee" and "tf32"."""
    from pipeline.models.decode_attention import triton_slot_attention

    contexts = (10, 100) if quick else (10, 40, 100, 300)
    caps = (None, 5.0) if quick else (None, 5.0, 50.0)
    splits = ((None, "auto"), (3, "split3")) if quick else ((None, "auto"), (1, "split1"), (4, "split4"))
    # S: the cache length, as the graph path passes it; 48 (the GPU test's cache, shorter than a key block) for the
    # short contexts
    long_S = 320 if not quick else 128
    scale = 24 ** -0.5  # the tiny Gemmas' query_pre_attn_scalar
    rows = []
    # head_dim 16 (the tiny models) over the whole grid; 256 (Gemma 2/3's) windowed, capped at 50 (Gemma 2's) or not
    # (Gemma 3): each constexpr combination is a Triton compilation, a second or so on the GPU
    grid = [(16, T, w, c, None) for T in (1, 5) for w in (None, 16) for c in caps]
    grid += [(16, 16, w, c, None) for w in (None, 16) for c in caps[:2]]  # T = 16: 32 query rows, a taller block
    if not quick:
        grid += [(256, T, 16, c, None) for T in (1, 5) for c in (None, 50.0)]
    if precision_sweep:
        grid = [(D, T, 16, 5.0 if D == 16 else 50.0, p) for D in ((16,) if quick else (16, 256)) for T in (1, 5)
                for p in ("ieee", "tf32")]
    for D, T, window, cap, prec in grid:
        name = f"D{D} T{T} win{window or '-'} cap{cap or '-'}"
        if time.monotonic() > deadline:
            rows.append({"section": "attn", "case": name, "variant": prec or "tf32x3", "error": "skipped (budget)"})
            continue
        results = []
        try:
            with dot_precision(prec):
                for context in contexts:
                    S = 48 if context <= 40 else long_S
                    q, k, v, slots, pos = attention_inputs(D, T, context, S, device, seed=D + T + context)
                    want = reference_attention(q, k, v, slots, pos, scale, window, cap)
                    for n, label in splits if prec is None else splits[:1]:
                        got = triton_slot_attention(q, k, v, slots, pos, S, scale, window, num_splits=n, softcap=cap)
                        results.append((f"ctx{context}/{label}", compare(got, want)))
            rows.append({"section": "attn-prec" if prec else "attn", "case": name,
                         "variant": prec or "tf32x3", **worst(results)})
        except Exception as e:  # noqa: BLE001 - a diagnostic: the row says what failed
            rows.append({"section": "attn-prec" if prec else "attn", "case": name, "variant": prec or "tf32x3",
                         "error": _err(e)})
    if not precision_sweep:  # the reference sees the cap and the window: a kernel without them is far off
        S = long_S
        q, k, v, slots, pos = attention_inputs(16, 5, contexts[-1], S, device, seed=0)
        want = reference_attention(q, k, v, slots, pos, scale, 16, 5.0)
        for label, kw in (("cap dropped", dict(window=16)), ("window dropped", dict(softcap=5.0))):
            try:
                got = triton_slot_attention(q, k, v, slots, pos, S, scale, **kw)
                rows.append({"section": "attn", "case": f"control: {label} (must be BAD)", "variant": "tf32x3",
                             **compare(got, want)})
            except Exception as e:  # noqa: BLE001
                rows.append({"section": "attn", "case": f"control: {label}", "variant": "tf32x3", "error": _err(e)})
    return rows


# ----------------------------------------------------------------------------------------------------
# other kernels: fused RoPE/cache write, compiled pointwise work, the bf16 fused layer's Gemma pieces


def rope_rows(device: torch.device) -> list[dict]:
    from pipeline.models.rope_write import torch_rope_write, triton_rope_write

    rows = []
    for D, T, norm in [(16, 1, False), (16, 5, False), (16, 5, True), (256, 1, False), (256, 5, True)]:
        name = f"D{D} T{T}" + (" qk-norm(1+w)" if norm else "")
        try:
            g = torch.Generator().manual_seed(D + T)
            H, Hkv, L, B = 4, 2, 160, 3
            qkv = torch.randn(B, T, (H + 2 * Hkv) * D, generator=g).to(device)
            angles = torch.randn(L, D // 2, generator=g) * 3
            cos = torch.cat([angles.cos()] * 2, -1).to(device)
            sin = torch.cat([angles.sin()] * 2, -1).to(device)
            pos = (torch.tensor([120, 3, 40])[:, None] + torch.arange(T)).to(device)
            slots = torch.tensor([2, 0, 1], device=device)
            qn, kn = ((0.1 * torch.randn(D, generator=g)).to(device) for _ in range(2)) if norm else (None, None)
            caches = [torch.zeros(4, Hkv, L, D, device=device) for _ in range(4)]
            got = triton_rope_write(qkv, cos, sin, pos, slots, caches[0], caches[1], H, q_norm=qn, k_norm=kn,
                                    eps=1e-6, norm_offset=norm)
            want = torch_rope_write(qkv, cos, sin, pos, slots, caches[2], caches[3], H, q_norm=qn, k_norm=kn,
                                    eps=1e-6, norm_offset=norm)
            m = worst([("q", compare(got, want)), ("k cache", compare(caches[0], caches[2])),
                       ("v cache", compare(caches[1], caches[3]))])
            rows.append({"section": "rope", "case": name, "variant": "triton", **m})
        except Exception as e:  # noqa: BLE001
            rows.append({"section": "rope", "case": name, "variant": "triton", "error": _err(e)})
    return rows


def inductor_rows(device: torch.device) -> list[dict]:
    """The graph path's pointwise functions, torch.compile'd (Triton on CUDA, C++ on the CPU) against eager."""
    from pipeline.models import graphs as gr

    g = torch.Generator().manual_seed(0)
    C, I, H, Hkv, D, B, T = HIDDEN, 2 * HIDDEN, 4, 2, 16, 4, 5

    def r(*shape, s=1.0):
        return (s * torch.randn(*shape, generator=g)).to(device)

    x, y = r(B, T, C, s=3.0), r(B, Hkv, (H // Hkv) * T, D)
    wqkv, wo, w13, w2, out_w = r((H + 2 * Hkv) * D, C, s=C**-0.5), r(C, H * D, s=0.25), r(2 * I, C, s=C**-0.5), \
        r(C, I, s=I**-0.5), r(VOCAB, C, s=C**-0.5)
    norms = [r(C, s=0.1) for _ in range(4)]
    cases = {
        "qkv_proj (1+w) norm": (gr.qkv_proj, (x, norms[0], wqkv, None, 1e-6, "torch", True)),
        "attn_out_mlp gemma (GeGLU, post norms)": (gr.attn_out_mlp, (x, y, wo, None, norms[1], w13, None, w2, None,
                                                                      1e-6, "torch", norms[2], norms[3],
                                                                      "gelu_pytorch_tanh", True)),
        "final_logits cap 2": (gr.final_logits, (x, norms[0], out_w, 1e-6, "torch", True, 2.0)),
        "final_logits cap 30": (gr.final_logits, (x, norms[0], out_w * 20, 1e-6, "torch", True, 30.0)),
        "final_logits no cap": (gr.final_logits, (x, norms[0], out_w, 1e-6, "torch", True, None)),
    }
    rows = []
    for name, (fn, args) in cases.items():
        try:
            want = fn(*args)
            got = torch.compile(fn, fullgraph=True)(*args)
            rows.append({"section": "inductor", "case": name, "variant": "compiled", **compare(got, want)})
        except Exception as e:  # noqa: BLE001
            rows.append({"section": "inductor", "case": name, "variant": "compiled", "error": _err(e)})
    return rows


def fused_rows(device: torch.device) -> list[dict]:
    """The bf16 fused layer's Gemma pieces (not on the float32 path; for completeness) against the eager math."""
    import torch.nn.functional as F

    from pipeline.models import fused_linear as fl
    from pipeline.models.decode_attention import _sm_count
    from pipeline.models.llama import rms_norm

    rows = []
    g = torch.Generator().manual_seed(1)
    for M, dtype in [(1, torch.bfloat16), (5, torch.bfloat16), (5, torch.float32)]:
        name = f"add_norm M{M} {str(dtype)[6:]}"
        try:  # against the eager math in the same dtype (as the fused layer's tests)
            nw = (0.1 * torch.randn(HIDDEN, generator=g)).to(dtype).to(device)
            yv, res = (torch.randn(M, HIDDEN, generator=g).to(dtype).to(device) for _ in range(2))
            got = fl.add_norm(res.clone(), yv, nw, 1e-6)
            rows.append({"section": "fused", "case": name, "variant": "triton", "tol": BF16_TOL,
                         **compare(got, res + rms_norm(yv, nw, 1e-6, True))})
        except Exception as e:  # noqa: BLE001
            rows.append({"section": "fused", "case": name, "variant": "triton", "error": _err(e)})
    for M in (1, 3):
        name = f"GeGLU gate linear (1+w) norm M{M} bf16"
        try:
            K, N = 128, 48
            bf = torch.bfloat16
            w = (torch.randn(N, K, generator=g) / K**0.5).to(bf).to(device)
            nw = (0.1 * torch.randn(K, generator=g)).to(bf).to(device)
            x = torch.randn(M, K, generator=g).to(bf).to(device)
            sms = _sm_count(x.device)  # the default configuration: no tuning (it times many compilations)
            config = fl.gemv_default(N, K, sms) if fl.gemv(M) else fl.default_config(M, N, K, sms, True, 2)
            got = fl.fused_linear(x, w, None, norm_w=nw, eps=1e-6, gate=True, norm_offset=True, act="gelu_pytorch_tanh",
                                  config=config)
            gate, up = F.linear(rms_norm(x, nw, 1e-6, True), w).chunk(2, dim=-1)
            rows.append({"section": "fused", "case": name, "variant": "triton", "tol": BF16_TOL,
                         **compare(got, F.gelu(gate, approximate="tanh") * up)})
        except Exception as e:  # noqa: BLE001
            rows.append({"section": "fused", "case": name, "variant": "triton", "error": _err(e)})
    return rows


# ----------------------------------------------------------------------------------------------------
# whole models against HF


def model_dirs(root: Path) -> dict[str, Path]:
    """Folder makers of the tiny models, by case name (made on first use)."""
    import transformers

    from tests.support.families import make_tiny_family
    from tests.support.models import make_tiny_llama

    transformers.utils.logging.disable_progress_bar()

    def family(kind: str, **overrides):
        return lambda: make_tiny_family(root / kind_name(kind, overrides), kind, hidden=HIDDEN, overrides=overrides)

    def kind_name(kind, overrides):
        return kind + "".join(f"-{k}" for k in sorted(overrides))

    return {
        "gemma2 (attn cap 5, final cap 2)": family("gemma2"),
        "llama (control)": lambda: make_tiny_llama(root / "llama", vocab_size=VOCAB, hidden=HIDDEN, layers=3,
                                                   eos_token_id=None),
        "gemma3": family("gemma3"),
        "gemma2 no attn cap": family("gemma2", attn_logit_softcapping=None),
        "gemma2 no final cap": family("gemma2", final_logit_softcapping=None),
        "gemma2 no caps": family("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None),
    }


def call_script(quick: bool) -> tuple[list[int], int, list[tuple[tuple[int, ...], int, int]]]:
    """(prompt lengths of rows 0-2, cache length, steps): a step is (rows, T, positions rolled back first). Row 0
    runs past one key block (64) and, in the full run, past one split's chunk (128)."""
    steps = [((0, 1, 2), 1, 0), ((0, 1, 2), 5, 0), ((2, 0, 1), 1, 0), ((1, 2, 0), 5, 0), ((0, 2), 5, 3),
             ((0,), 1, 0), ((0,), 5, 0), ((0, 1, 2), 2, 0)]
    if quick:
        return [66, 18, 30], 96, steps[:5]
    return [131, 18, 70], 192, steps


FIRST = [9, 4, 13]  # the ragged first chunk of the prompts, one call (as check_against_hf's prefill: T = 13)
KINDS = {"T13": "the ragged 3-row prefill call of T = 13 (static path: bucket 16)", "T1": "decode calls",
         "T2-5": "verify calls of T = 2 and 5"}


@torch.no_grad()
def run_script(forward, prompts: list[list[int]], steps, seed: int = 1) -> tuple[list, list]:
    """Feed the script to `forward(tokens, positions, slots) -> [B, T, V]`: the prompts' first FIRST tokens as one
    ragged call (padded with token VOCAB - 1), the rest of each prompt as one call per row (longer than every token
    bucket: the eager runner), then `steps`. Returns (prompt calls, calls); a call is (kind, the rows' token
    sequences after it, the rows' start positions, the rows' fed lengths, logits [B, T, V] on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    slots = [2, 0, 1]
    T0 = max(FIRST)
    tokens = torch.tensor([p[:n] + [VOCAB - 1] * (T0 - n) for p, n in zip(prompts, FIRST)])
    out = forward(tokens, torch.zeros(3, dtype=torch.long), torch.tensor(slots)).cpu()
    calls = [("T13", [p[:n] for p, n in zip(prompts, FIRST)], [0, 0, 0], FIRST, out)]
    rests = []
    for b, (p, n) in enumerate(zip(prompts, FIRST)):
        out = forward(torch.tensor([p[n:]]), torch.tensor([n]), torch.tensor([slots[b]])).cpu()
        rests.append(("prefill", [p], [n], [len(p) - n], out))
    seqs = [list(p) for p in prompts]
    pos = [len(p) for p in prompts]
    for rows, T, back in steps:
        for b in rows:
            pos[b] -= back
        new = [torch.randint(0, VOCAB, (T,), generator=g).tolist() for _ in rows]
        starts = [pos[b] for b in rows]
        out = forward(torch.tensor(new), torch.tensor(starts), torch.tensor([slots[b] for b in rows])).cpu()
        for b, toks in zip(rows, new):
            seqs[b] = seqs[b][:pos[b]] + toks
            pos[b] += T
        calls.append(("T1" if T == 1 else "T2-5", [list(seqs[b]) for b in rows], starts, [T] * len(rows), out))
    return rests, calls


def hf_reference(path: Path, device: torch.device | None = None):
    """HF's model of the folder in float32 with its eager attention (the soft-caps written out)."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval().to(device or "cpu")


@torch.no_grad()
def hf_logits(hf, seq: list[int]) -> torch.Tensor:
    return hf(torch.tensor([seq], device=hf.device)).logits[0].float().cpu()


def hf_calls(hf, calls: list) -> list:
    """HF's logits for the rows of `calls` (fresh runs of each row's sequence), in `run_script`'s call format."""
    return [(kind, seqs, starts, lens, [hf_logits(hf, s)[p:p + n] for s, p, n in zip(seqs, starts, lens)])
            for kind, seqs, starts, lens, _ in calls]


def fed_rows(calls: list, kinds: tuple[str, ...] | None = None) -> torch.Tensor:
    """The logits of the fed tokens of `calls` (of `kinds`), concatenated: [N, V]."""
    return torch.cat([out[i][:n] for kind, _, _, lens, out in calls if kinds is None or kind in kinds
                      for i, n in enumerate(lens)])


def variants(device: torch.device, quick: bool) -> list[tuple[str, dict | None, str | None]]:
    """(name, GraphConfig changes or None for the eager runner, attention dot precision or None)."""
    cuda = device.type == "cuda"
    static = dict(graphs=False, compile=False)
    out = [("eager", None, None), ("static-sdpa", dict(static, attention="sdpa"), None),
           ("static-triton", dict(static, attention="triton"), None),
           ("static-triton-torchrope", dict(static, attention="triton", fused_rope=False), None)]
    if cuda or not quick:
        out += [("static-triton-ieee", dict(static, attention="triton"), "ieee"),
                ("static-triton-compile", dict(graphs=False, compile=True, attention="triton"), None)]
    if cuda:
        out += [("graph-triton-nocompile", dict(graphs=True, compile=False, attention="triton"), None),
                ("graph-triton", dict(graphs=True, compile=True, attention="triton"), None),  # the CUDA default
                ("graph-triton-ieee", dict(graphs=True, compile=True, attention="triton"), "ieee"),
                ("graph-sdpa", dict(graphs=True, compile=True, attention="sdpa"), None)]
    return out


def model_rows(name: str, make, device: torch.device, quick: bool, deadline: float) -> list[dict]:
    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.loader import load_model

    lengths, max_len, steps = call_script(quick)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    path = make()
    hf = hf_reference(path)
    rows: list[dict] = []
    ref_rests = ref_calls = eager_calls = None

    def metrics(calls) -> dict:
        m = compare(fed_rows(calls), fed_rows(ref_calls))
        for kind in KINDS:
            m[kind] = compare(fed_rows(calls, (kind,)), fed_rows(ref_calls, (kind,)))["rel"]
        if eager_calls is not None:
            m["vs_eager"] = compare(fed_rows(calls), fed_rows(eager_calls))["rel"]
        return m

    todo = variants(device, quick)
    if device.type == "cuda":
        todo.insert(1, ("hf-device", "hf", None))
    for vname, changes, prec in todo:
        if time.monotonic() > deadline:
            rows.append({"section": "model", "case": name, "variant": vname, "error": "skipped (budget)"})
            continue
        try:
            with dot_precision(prec):
                if changes == "hf":
                    calls = hf_calls(hf_reference(path, device), ref_calls)
                else:
                    runner, _ = load_model(path, device, "float32")
                    model = runner if changes is None else GraphCausalLM(runner, GraphConfig(**changes))
                    model.allocate(3, max_len)
                    rests, calls = run_script(model.forward, prompts, steps)
            if ref_calls is None:  # HF's logits of the same sequences (the script's tokens do not depend on outputs)
                ref_rests, ref_calls = hf_calls(hf, rests), hf_calls(hf, calls)
                rows.append({"section": "model", "case": name, "variant": "prefill rest (eager)",
                             **compare(fed_rows(rests), fed_rows(ref_rests))})
            row = {"section": "model", "case": name, "variant": vname, **metrics(calls)}
            if changes not in (None, "hf"):
                st = model.stats
                row["note"] = f"graph calls {st.graph_calls}, captures {st.captures}, eager {st.eager_calls}"
                assert st.graph_calls > 0, "no call took the static path"
            if vname == "eager":
                eager_calls = calls
            rows.append(row)
        except Exception as e:  # noqa: BLE001
            rows.append({"section": "model", "case": name, "variant": vname, "error": _err(e)})
    rows += test_script_rows(name, path, hf, device, deadline)
    return rows


def test_script_rows(name: str, path: Path, hf, device: torch.device, deadline: float) -> list[dict]:
    """The GPU test's own script (tests.pipeline.models.test_models.check_against_hf: a 48-position cache, a ragged
    prefill of T = 13, T = 1-4 steps, a rollback; its largest |logits - HF|, which the test holds under 1e-4) on the
    graph path as tests/gpu/test_gpu_families.py builds it; and HF's default attention against its eager one (the
    reference the test compared with)."""
    import transformers

    from pipeline.models.graphs import GraphCausalLM, GraphConfig
    from pipeline.models.loader import load_model

    rows = []
    try:
        default = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        impl = default.config._attn_implementation
        seq = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(3)).tolist()
        rows.append({"section": "model", "case": name, "variant": "hf-default-attn", "note": f"HF chose {impl}",
                     **compare(hf_logits(default, seq), hf_logits(hf, seq))})
    except Exception as e:  # noqa: BLE001
        rows.append({"section": "model", "case": name, "variant": "hf-default-attn", "error": _err(e)})
    kinds = [("triton", True), ("sdpa", True)] if device.type == "cuda" else [("triton", False)]
    for attention, captured in kinds:
        vname = f"{'graph' if captured else 'static'}-{attention} test-script"
        if time.monotonic() > deadline:
            rows.append({"section": "model", "case": name, "variant": vname, "error": "skipped (budget)"})
            continue
        try:
            from tests.pipeline.models.test_models import check_against_hf

            cfg = GraphConfig(attention=attention) if captured else GraphConfig(attention=attention, graphs=False)
            graph = GraphCausalLM(load_model(path, device, "float32")[0], cfg)
            worst_abs = check_against_hf(graph, hf, VOCAB)
            rows.append({"section": "model", "case": name, "variant": vname, "max_abs": worst_abs, "tol": 1e-4,
                         "note": f"max abs only; graph calls {graph.stats.graph_calls}"})
        except Exception as e:  # noqa: BLE001
            rows.append({"section": "model", "case": name, "variant": vname, "error": _err(e)})
    return rows


# ----------------------------------------------------------------------------------------------------
# the table


def _err(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}{where}"


def print_table(rows: list[dict]) -> None:
    head = f"{'section':9} {'case':40} {'variant':26} {'max_abs':>9} {'rel':>9} {'argmax':>6} {'T13':>9} {'T1':>9} " \
           f"{'T2-5':>9} {'vs_eager':>9}  flag / worst / note"
    print(head)
    print("-" * len(head))

    def num(v):
        return f"{v:9.2e}" if isinstance(v, float) else f"{'':9}"

    for r in rows:
        if "error" in r:
            print(f"{r['section']:9} {r['case'][:40]:40} {r['variant'][:26]:26} {r['error']}")
            continue
        flag = "BAD" if (r.get("rel", r["max_abs"]) > r.get("tol", BAD_REL)
                         or (r["section"] == "model" and r.get("argmax", 1.0) < 1.0)) else ""
        extra = " ".join(x for x in (flag, r.get("worst", ""), r.get("note", "")) if x)
        argmax = f"{r['argmax']:6.3f}" if "argmax" in r else f"{'':6}"
        print(f"{r['section']:9} {r['case'][:40]:40} {r['variant'][:26]:26} {num(r['max_abs'])} {num(r.get('rel'))} "
              f"{argmax} {num(r.get('T13'))} {num(r.get('T1'))} {num(r.get('T2-5'))} {num(r.get('vs_eager'))}"
              f"  {extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda or cpu (cpu: Triton's interpreter)")
    ap.add_argument("--out", default=None, help="folder for family_numerics.json")
    ap.add_argument("--quick", action="store_true", help="fewer and smaller cases (the CPU run)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="start no case after this many seconds")
    ap.add_argument("--sections", default="attn,model0,prec,kernels,models",
                    help="comma-separated: attn, model0 (Gemma 2, Llama, Gemma 3), prec, kernels, models (Gemma 2 "
                    "without one cap or both)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":  # before triton's first import: the mode is fixed per process
        os.environ.setdefault("TRITON_INTERPRET", "1")
        torch.set_num_threads(1)
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    wanted = set(args.sections.split(","))
    rows: list[dict] = []
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "quick": args.quick,
            "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    for mod in ("triton", "transformers"):
        try:
            meta[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            meta[mod] = f"missing ({type(e).__name__})"
    print(json.dumps(meta))
    with tempfile.TemporaryDirectory(prefix="family-numerics-") as tmp:
        makers = model_dirs(Path(tmp))
        names = list(makers)
        sections = [
            ("attn", lambda: attention_rows(device, args.quick, deadline)),
            ("model0", lambda: [r for n in names[:3] for r in model_rows(n, makers[n], device, args.quick, deadline)]),
            # the interpreter ignores the dot precision: GPU only
            ("prec", lambda: attention_rows(device, args.quick, deadline, True) if device.type == "cuda" else []),
            ("kernels", lambda: rope_rows(device) + inductor_rows(device) + fused_rows(device)),
            ("models", lambda: [r for n in names[3:] for r in model_rows(n, makers[n], device, args.quick, deadline)]),
        ]
        for key, section in sections:
            if key not in wanted:
                continue
            if time.monotonic() > deadline:
                rows.append({"section": key, "case": "(whole section)", "variant": "-", "error": "skipped (budget)"})
                continue
            t = time.monotonic()
            try:
                rows += section()
            except Exception as e:  # noqa: BLE001
                rows.append({"section": key, "case": "(whole section)", "variant": "-", "error": _err(e)})
            print(f"[{key}: {time.monotonic() - t:.1f} s]", flush=True)
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    print_table(rows)
    print(f"elapsed {meta['elapsed_s']} s. BAD: rel > {BAD_REL:g} (bf16 rows: {BF16_TOL:g}) or a model row's argmax "
          f"differs. Model columns T13, T1, T2-5: rel of " + "; ".join(KINDS.values()))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "family_numerics.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - a diagnostic exits 0 whatever happens
        traceback.print_exc()
        raise SystemExit(0)
