"""GPU check of the graph path's slot attention: the Triton split-KV kernel against the SDPA reference,
correctness and speed, one table.

    python -m ops.check_decode_attention [--out $OUT] [--quick]

Per case (dtype, head_dim D, G query heads per KV head, T fed tokens, B rows, context, window): a cache of B+1
slots (the last one the scratch slot) with random contents, rows in shuffled slot order at ragged positions (the
longest at `context`, one padding row at position 0 on the scratch slot when B > 1), S rounded up to 256 as the
graph path does. Both implementations run on the same inputs and are compared with a float32 reference; then
each is captured in a CUDA graph of 32 back-to-back calls (one per layer of an 8B model) and the replays are
timed with CUDA events, after a check that a replay reads new inputs (no stale capture). us/call = replay
time / 32. GB/s = the K/V bytes the rows really need (positions 0..pos of each row) / the Triton time.
A second table sweeps the number of key splits for a few decode shapes (auto = `plan_splits`).

Exit status 1 when any case is off (error past max(2 x the reference's own error, dtype tolerance)), or
when a captured replay does not match an eager call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from pipeline.models import decode_attention as da  # noqa: E402

HKV, LAYERS = 8, 32
DEVICE = "cuda"  # the dry run of the case logic sets "cpu" (with TRITON_INTERPRET=1)
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # of the largest output value


def make_inputs(dtype, D: int, G: int, T: int, B: int, context: int, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    num_slots = B + 1
    max_len = context + 256 + 16
    k_cache = torch.randn(num_slots, HKV, max_len, D, device=DEVICE, generator=g).to(dtype)
    v_cache = torch.randn(num_slots, HKV, max_len, D, device=DEVICE, generator=g).to(dtype)
    perm = torch.randperm(B, device=DEVICE, generator=g)
    slots = perm.clone()
    starts = torch.randint(0, context + 1, (B,), device=DEVICE, generator=g)
    starts[0] = context  # the longest row
    if B > 1:
        slots[-1], starts[-1] = B, 0  # a padding row on the scratch slot
    pos = starts[:, None] + torch.arange(T, device=DEVICE)  # [B, T]
    # q as attn_in makes it: [B, T, Hkv, G, D] permuted to [B, Hkv, G*T, D] (a contiguous copy) ...
    q = torch.randn(B, T, HKV, G, D, device=DEVICE, generator=g).to(dtype)
    q = q.permute(0, 2, 3, 1, 4).reshape(B, HKV, G * T, D)
    S = min(-(-(context + T) // 256) * 256, max_len)
    return q, k_cache, v_cache, slots, pos, S


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref).abs().max() / ref.abs().max())


def timed_graph(fn, n_calls: int = LAYERS, reps: int = 20) -> tuple[float, torch.cuda.CUDAGraph, torch.Tensor]:
    """Median microseconds per call of fn captured n_calls times in one CUDA graph; the graph; its last output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n_calls):
            out = fn()
    graph.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3 / n_calls, graph, out


def run_case(dtype, D, G, T, B, context, window, time_it: bool = True) -> dict:
    q, k_cache, v_cache, slots, pos, S = make_inputs(dtype, D, G, T, B, context, seed=D + G + T + B + context)
    scale = 1.0 / math.sqrt(D)
    ref32 = da.sdpa_slot_attention(q.float(), k_cache.float(), v_cache.float(), slots, pos, S, scale, window)
    got = da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window)
    mask = da.sdpa_mask(pos, S, G, window, dtype)
    ref = da.sdpa_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, mask)
    err, ref_err = rel_err(got, ref32), rel_err(ref, ref32)
    splits = da.launch_plan(B, HKV, G * T, D, S, q.device)["num_splits"]
    row = {"dtype": str(dtype).replace("torch.", ""), "D": D, "G": G, "T": T, "B": B, "context": context,
           "window": window, "S": S, "splits": splits, "err": err, "ref_err": ref_err,
           "ok": bool(torch.isfinite(got).all()) and err <= max(2 * ref_err, TOL[dtype])}
    if not time_it:
        return row
    us_t, g_t, out_t = timed_graph(lambda: da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window))
    us_s, _, _ = timed_graph(lambda: da.sdpa_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window, mask))
    # A replay reads new inputs: change q and the positions in place, replay, compare with an eager call.
    q.copy_(torch.randn_like(q))
    shift = pos[:, :1] // 2
    pos.sub_(shift)  # rows move back; still within S
    g_t.replay()
    eager = da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, window)
    torch.cuda.synchronize()
    row["replay_ok"] = bool(torch.equal(out_t, eager))
    row["ok"] &= row["replay_ok"]
    elem = k_cache.element_size()
    first = torch.zeros_like(pos[:, 0]) if window is None else torch.clamp(pos[:, 0] - window + 1, min=0)
    need = int((pos[:, -1] + 1 - first).sum())  # key positions some query of the row sees
    row.update(us_triton=us_t, us_sdpa=us_s, speedup=us_s / us_t, GBps=2 * need * HKV * D * elem / (us_t * 1e-6) / 1e9)
    return row


def sweep(dtype, D, G, T, B, context) -> list[dict]:
    q, k_cache, v_cache, slots, pos, S = make_inputs(dtype, D, G, T, B, context)
    scale = 1.0 / math.sqrt(D)
    out = []
    for splits in (None, 1, 2, 4, 8, 16, 32):
        if splits is not None and splits > -(-S // 64):
            continue
        us, _, _ = timed_graph(lambda: da.triton_slot_attention(q, k_cache, v_cache, slots, pos, S, scale, None,
                                                                 num_splits=splits))
        out.append({"D": D, "G": G, "T": T, "B": B, "context": context, "splits": splits or "auto", "us": us})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="folder for check_decode_attention.json")
    p.add_argument("--quick", action="store_true", help="fewer cases, no split sweep")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("check_decode_attention: no CUDA device", file=sys.stderr)
        return 2
    import triton

    t0 = time.perf_counter()
    print(f"card {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    bf = torch.bfloat16
    cases = [(bf, D, 4, T, B, ctx, None)
             for D in (128, 64) for T in (1, 5) for B in (1, 8, 16, 32, 64) for ctx in (512,)]
    cases += [(bf, 128, 4, 1, B, 4096, None) for B in (1, 16)]
    cases += [(bf, 128, 4, 5, 16, 2048, 1024), (bf, 128, 4, 1, 1, 2048, 700)]  # sliding window
    cases += [(bf, 128, 8, 16, 4, 512, None), (bf, 64, 1, 1, 4, 300, None), (bf, 128, 3, 5, 3, 700, None)]
    cases += [(torch.float16, 128, 4, 5, 8, 512, None), (torch.float32, 64, 4, 5, 8, 512, None),
              (torch.float32, 128, 1, 1, 2, 1000, 100)]
    if args.quick:
        cases = [c for c in cases if c[4] in (1, 16) or c[6] is not None or c[1] != torch.bfloat16]
    rows = []
    for c in cases:
        try:
            rows.append(run_case(*c))
        except Exception as e:  # noqa: BLE001 - one failing shape must not hide the others
            rows.append({"dtype": str(c[0]), "D": c[1], "G": c[2], "T": c[3], "B": c[4], "context": c[5],
                         "window": c[6], "ok": False, "error": f"{type(e).__name__}: {e}"})
        r = rows[-1]
        print(f"[{time.perf_counter() - t0:5.1f}s] {r}", flush=True)
    sweeps = []
    if not args.quick:
        for B in (1, 8, 16, 32):
            try:
                sweeps += sweep(bf, 128, 4, 1, B, 512)
            except Exception as e:  # noqa: BLE001
                sweeps.append({"B": B, "error": f"{type(e).__name__}: {e}"})
        sweeps += sweep(bf, 128, 4, 1, 1, 4096)

    f = lambda v, p=1: "-" if v is None else (f"{v:.{p}f}" if isinstance(v, float) else str(v))  # noqa: E731
    print("\n| dtype | D | G | T | B | context | window | S | splits | err | sdpa err | triton us | sdpa us "
          "| speedup | GB/s | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['dtype']} | {r['D']} | {r['G']} | {r['T']} | {r['B']} | {r['context']} | {f(r['window'])} | "
                  f"ERROR {r['error'][:150]} |")
            continue
        print(f"| {r['dtype']} | {r['D']} | {r['G']} | {r['T']} | {r['B']} | {r['context']} | {f(r['window'])} "
              f"| {r['S']} | {r['splits']} | {r['err']:.1e} | {r['ref_err']:.1e} | {f(r.get('us_triton'))} "
              f"| {f(r.get('us_sdpa'))} | "
              f"{f(r.get('speedup'), 2)} | {f(r.get('GBps'), 0)} | {'yes' if r['ok'] else 'NO'} |")
    if sweeps:
        print("\nsplit sweep (bf16, D 128, G 4, T 1; us per call in a 32-call graph):")
        print("| B | context | splits | us |\n|---|---|---|---|")
        for s in sweeps:
            print(f"| {s['B']} | {s.get('context', '-')} | {s.get('splits', '-')} | {f(s.get('us'))} |"
                  + (f" ERROR {s['error'][:150]}" if "error" in s else ""))
    bad = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(bad)} passed, {len(bad)} failed")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "check_decode_attention.json").write_text(json.dumps({"rows": rows, "sweeps": sweeps}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
