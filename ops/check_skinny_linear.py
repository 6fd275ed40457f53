"""GPU check of the graph path's few-row linears: the split-K Triton kernel against F.linear
(cuBLAS), correctness and speed per weight shape, one table.

    python -m ops.check_skinny_linear [--out $OUT] [--rows 1,5,16] [--sets 8b,1b,8b-tp2,8b-tp4,70b-tp4]
    python -m ops.check_skinny_linear --sets demo --dtype float32 --rows 1,32,160   # the float32 demo target

Per weight matrix of the model shapes (random, bf16 unless --dtype) and row count M: `skinny_linear.tune` times
F.linear and every candidate configuration of the kernel as a captured chain of launches over copies of the weight
(in a model the previous layer's weights have evicted this one from L2), median of 7. GB/s = weight bytes / time;
"x copy" divides by the card's copy bandwidth (bytes read + written / time of a 4 GiB device-to-device copy). The
best kernel and F.linear are both compared with a float64 product of the same inputs.

Exit status 1 when a kernel's error passes 2x F.linear's own error and `FLOOR` (1e-2 of the largest output for
bf16/fp16, 1e-5 for float32).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.models import skinny_linear as sl  # noqa: E402
from pipeline.models.kernel_timing import copy_GBps  # noqa: E402

# (set, name, N, K): the per-rank weight shapes of Llama-3 8B / 3.2 1B / 3 70B (fused qkv and gate/up, as the
# graph path holds them)
SETS = {
    "8b": [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
           ("lm_head", 128256, 4096)],
    "1b": [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192),
           ("lm_head", 128256, 2048)],
    "8b-tp2": [("qkv", 3072, 4096), ("o", 4096, 2048), ("gate_up", 14336, 4096), ("down", 4096, 7168),
               ("lm_head", 64128, 4096)],
    "8b-tp4": [("qkv", 1536, 4096), ("o", 4096, 1024), ("gate_up", 7168, 4096), ("down", 4096, 3584),
               ("lm_head", 32064, 4096)],
    "70b-tp4": [("qkv", 2560, 8192), ("o", 8192, 2048), ("gate_up", 14336, 8192), ("down", 8192, 7168),
                ("lm_head", 32064, 8192)],
    # the demo target, SmolLM2-135M (float32 in the demo: --dtype float32 --rows 1,32,160)
    "demo": [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
             ("lm_head", 49152, 576)],
}
DEFAULT_SETS = "8b,1b,8b-tp2,8b-tp4,70b-tp4"
# A kernel is off when its error passes max(2x F.linear's own, this) of the largest output: bf16/fp16 products
# round to their dtype; float32 ones (tf32x3 against cuBLAS's FMA) must stay at float32 rounding level.
FLOOR = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--rows", default="1,5,16")
    p.add_argument("--sets", default=DEFAULT_SETS, help=f"of {','.join(SETS)}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    bw = copy_GBps()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw:.0f} GB/s", flush=True)
    rows, bad = [], 0
    for set_name in args.sets.split(","):
        for name, N, K in SETS[set_name]:
            w = torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5
            for M in (int(m) for m in args.rows.split(",")):
                x = torch.randn(M, K, device="cuda", dtype=dtype)
                best = sl.tune(x, w, None)
                timings = sl._timings[sl._key(x, w, None)]
                ref = F.linear(x.double(), w.double())
                scale = float(ref.abs().max())
                torch_err = float((F.linear(x, w).float() - ref).abs().max()) / scale
                kernel = best or sl.default_config(M, N, K, torch.cuda.get_device_properties(0).multi_processor_count)
                err = float((sl.skinny_linear(x, w, None, kernel).float() - ref).abs().max()) / scale
                ok = err <= max(2 * torch_err, FLOOR[dtype])
                bad += not ok
                tri = {k: v for k, v in timings.items() if k != "torch"}
                name_best = min(tri, key=tri.get) if tri else "-"
                gb = N * K * w.element_size() / 1e9
                row = {"set": set_name, "weight": name, "N": N, "K": K, "M": M, "torch_ms": timings["torch"],
                       "triton_ms": tri.get(name_best), "triton_config": name_best, "choice": "torch" if best is None
                       else name_best, "torch_GBps": gb / (timings["torch"] / 1e3),
                       "triton_GBps": gb / (tri[name_best] / 1e3) if tri else None, "err": err,
                       "torch_err": torch_err, "ok": ok}
                rows.append(row)
                print(f"{set_name:8s} {name:8s} N={N:6d} K={K:5d} M={M:3d}: torch {timings['torch'] * 1e3:7.1f} us "
                      f"({row['torch_GBps'] / bw:.2f} x copy), triton {name_best} "
                      f"{(tri.get(name_best) or float('nan')) * 1e3:7.1f} us "
                      f"({(row['triton_GBps'] or 0) / bw:.2f} x copy), err {err:.1e} (torch {torch_err:.1e})"
                      f"{'' if ok else '  <-- OFF'}", flush=True)
            del w
    print("\n| set | weight | N x K | M | F.linear us | x copy bw | Triton us (config) | x copy bw | speedup |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = r["triton_ms"]
        print(f"| {r['set']} | {r['weight']} | {r['N']}x{r['K']} | {r['M']} | {r['torch_ms'] * 1e3:.1f} | "
              f"{r['torch_GBps'] / bw:.2f} | {t * 1e3:.1f} ({r['triton_config']}) | {r['triton_GBps'] / bw:.2f} | "
              f"{r['torch_ms'] / t:.2f}x |" if t else f"| {r['set']} | {r['weight']} | - |")
    for s in SETS:
        mine = [r for r in rows if r["set"] == s and r["M"] == 1]
        if mine:
            tot_t = sum(r["torch_ms"] for r in mine)
            tot_k = sum(min(r["torch_ms"], r["triton_ms"] or 1e9) for r in mine)
            print(f"{s}, M=1, one of each weight: F.linear {tot_t * 1e3:.0f} us, best of both {tot_k * 1e3:.0f} us")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "skinny_linear.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "copy_GBps": bw, "rows": rows}, indent=1))
    print("all within tolerance" if not bad else f"{bad} case(s) off")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
