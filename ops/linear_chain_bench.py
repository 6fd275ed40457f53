"""Where the fused decoder layer's linears lose time against the bandwidth floor, one GPU.

    python -m ops.linear_chain_bench --out $OUT                      # 8b, 1b, 8b-tp2 per-rank shapes, M = 1, 5
    python -m ops.linear_chain_bench --sets 1b --rows 1 --variants late,nonorm
    python -m ops.linear_chain_bench --sets 8b-tp2 --configs        # also every candidate configuration
    python -m ops.linear_chain_bench --sets 1b,8b --rows 1 --weights bf16,fp8 --gemv off   # tensor cores only

A batch-1 step is a chain of small kernels; each pays its bytes over bandwidth plus a fixed cost (launch, the
first loads in flight, the last wave's tail). This script times the chain without attention or RoPE, so the
linears' share is seen alone, the way the graph path runs them: `fused_linear` kernels captured in one CUDA
graph, launched with programmatic dependent launch, `--layers` layers of distinct random weights (larger than
L2, so every layer streams from memory).

- "layer": per layer, q/k/v (RMSNorm prologue), output projection (residual epilogue, in place), gate/up
  (RMSNorm prologue, SiLU-gate epilogue), down projection (residual epilogue, in place): the fused layer's
  four linears in its order. The output projection reads the q part of q/k/v as its input (same shape as the
  attention output).
- "qkv", "o", "gate_up", "down": a chain of that kernel alone, so each kernel's cost is seen apart.
- "sweep": plain linears, K = 4096, N from 1024 to 16384; a least-squares line through (bytes, time per kernel)
  gives the fixed cost per kernel (intercept, us) and the streaming bandwidth (1 / slope).

Variants (`--variants`): "late" (the layer as the graph path runs it: the RMSNorm prologue multiplies x by the norm
weight in the K loop, and the sums by each row's 1/rms after it), "nopdl" (launched without PDL), "nonorm" (no
RMSNorm prologue at all: what the norm costs). `--weights fp8` times the same layers with float8 weights and row
scales (a drafter's, `GraphConfig(weights="fp8")`; the set is named "<set>-fp8"). One-row calls may take the
CUDA-core product unless `--gemv off` (`GraphConfig.gemv`).
floor = weight bytes / copy bandwidth of the card (`kernel_timing.copy_GBps`: a 4 GiB device-to-device
copy, bytes read + written over time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

from pipeline.models import fused_linear as fl  # noqa: E402
from pipeline.models import pdl  # noqa: E402
from pipeline.models.kernel_timing import captured_ms, copy_GBps  # noqa: E402

# (hidden, q width, k+v width, intermediate) of each rank's shard
SETS = {
    "8b": (4096, 4096, 2048, 14336),
    "1b": (2048, 2048, 1024, 8192),
    "8b-tp2": (4096, 2048, 1024, 7168),
    "8b-tp4": (4096, 1024, 512, 3584),
}
KINDS = ("layer", "qkv", "o", "gate_up", "down")
VARIANTS = ("late", "nopdl", "nonorm")


def log(msg: str) -> None:
    print(msg, flush=True)


def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(torch.bfloat16)


class Layers:
    """`n` layers of random weights of one set's per-rank shapes (`fp8`: float8 with row scales, as a drafter's)."""

    def __init__(self, name: str, n: int, fp8: bool = False):
        D, Q, KV, I = SETS[name]
        self.D, self.Q, self.I = D, Q, I
        self.qkv = [rand(Q + KV, D, scale=D ** -0.5) for _ in range(n)]
        self.o = [rand(D, Q, scale=Q ** -0.5) for _ in range(n)]
        self.gu = [rand(2 * I, D, scale=D ** -0.5) for _ in range(n)]
        self.down = [rand(D, I, scale=I ** -0.5) for _ in range(n)]
        self.n1 = [1 + 0.05 * rand(D) for _ in range(n)]
        self.n2 = [1 + 0.05 * rand(D) for _ in range(n)]
        self.scales: dict[int, torch.Tensor] = {}  # id(weight) -> its float8 row scales
        if fp8:
            for ws in (self.qkv, self.o, self.gu, self.down):
                for i, w in enumerate(ws):
                    ws[i], scale = fl.quantize_fp8(w)
                    self.scales[id(ws[i])] = scale

    def bytes(self, kind: str) -> int:
        per = {"qkv": self.qkv[0], "o": self.o[0], "gate_up": self.gu[0], "down": self.down[0]}
        if kind == "layer":
            return sum(w.numel() * w.element_size() for w in per.values())
        return per[kind].numel() * per[kind].element_size()

    def chain(self, kind: str, M: int, use_pdl: bool, norm: bool,
              config: fl.FusedConfig | None = None, gemv: bool = True) -> Callable[[], None]:
        x = rand(M, self.D)
        qkv = torch.zeros(M, self.qkv[0].shape[0], dtype=torch.bfloat16, device="cuda")
        h = torch.empty(M, self.I, dtype=torch.bfloat16, device="cuda")
        q = qkv[:, : self.Q]

        sc = self.scales.get

        def run() -> None:
            for i in range(len(self.qkv)):
                if kind in ("layer", "qkv"):
                    fl.fused_linear(x, self.qkv[i], norm_w=self.n1[i] if norm else None, out=qkv, use_pdl=use_pdl,
                                    config=config, w_scale=sc(id(self.qkv[i])), gemv=gemv)
                if kind in ("layer", "o"):
                    fl.fused_linear(q, self.o[i], residual=x, out=x, use_pdl=use_pdl, config=config,
                                    w_scale=sc(id(self.o[i])), gemv=gemv)
                if kind in ("layer", "gate_up"):
                    fl.fused_linear(x, self.gu[i], norm_w=self.n2[i] if norm else None, gate=True, out=h,
                                    use_pdl=use_pdl, config=config, w_scale=sc(id(self.gu[i])), gemv=gemv)
                if kind in ("layer", "down"):
                    fl.fused_linear(h, self.down[i], residual=x, out=x, use_pdl=use_pdl, config=config,
                                    w_scale=sc(id(self.down[i])), gemv=gemv)

        return run


def sweep(M: int, use_pdl: bool, total_mb: int = 1024, gemv: bool = True) -> dict:
    """Fixed cost and streaming bandwidth of plain linears, from a line through (bytes, us per kernel)."""
    K, pts = 4096, []
    for N in (1024, 2048, 4096, 8192, 16384):
        n = max(8, total_mb * (1 << 20) // (N * K * 2))
        ws = [rand(N, K, scale=K ** -0.5) for _ in range(n)]
        x, y = rand(M, K), torch.empty(M, N, dtype=torch.bfloat16, device="cuda")

        def run() -> None:
            for w in ws:
                fl.fused_linear(x, w, out=y, use_pdl=use_pdl, gemv=gemv)

        pts.append((N * K * 2, captured_ms(run, reps=20) * 1e3 / n))
        ws.clear()
        torch.cuda.empty_cache()
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    slope = sum((b - mx) * (t - my) for b, t in pts) / sum((b - mx) ** 2 for b, _ in pts)
    return {"points_bytes_us": pts, "fixed_us": my - slope * mx, "stream_GBps": 1e-3 / slope}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sets", default="8b,1b,8b-tp2")
    p.add_argument("--rows", default="1,5", help="rows per call (1: decode, 5: a 4-draft verify)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--kinds", default=",".join(KINDS))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--configs", action="store_true", help="also time every candidate configuration per kernel")
    p.add_argument("--weights", default="bf16", help="bf16, fp8 (float8 e4m3 with row scales, a drafter's), or both")
    p.add_argument("--gemv", choices=("on", "off"), default="on",
                   help="one-row calls may take the CUDA-core product (GraphConfig.gemv); off: tensor cores only")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    gemv = a.gemv == "on"
    variants = [v for v in a.variants.split(",") if v]
    bad = ([v for v in variants if v not in VARIANTS] + [s for s in a.sets.split(",") if s not in SETS]
           + [k for k in a.kinds.split(",") if k not in KINDS])
    if bad:
        print(f"linear_chain_bench: unknown variant, set or kind {bad[0]!r} (variants {VARIANTS}, sets "
              f"{tuple(SETS)}, kinds {KINDS})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("linear_chain_bench: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    card, bw = torch.cuda.get_device_name(dev), copy_GBps()
    have_pdl = pdl.enabled(dev)
    log(f"card: {card}; copy bandwidth {bw:.0f} GB/s; PDL {'on' if have_pdl else 'unavailable'}")
    rows_out, configs = [], []
    if any(w not in ("bf16", "fp8") for w in a.weights.split(",")):
        print(f"linear_chain_bench: --weights takes bf16 and fp8, got {a.weights!r}", file=sys.stderr)
        return 2
    for s, wk in ((s, wk) for s in a.sets.split(",") for wk in a.weights.split(",")):
        layers = Layers(s, a.layers, fp8=wk == "fp8")
        s = s if wk == "bf16" else f"{s}-fp8"
        for M in (int(m) for m in a.rows.split(",")):
            for kind in a.kinds.split(","):
                floor_us = layers.bytes(kind) / bw / 1e3
                for v in variants:
                    fn = layers.chain(kind, M, use_pdl=have_pdl and v != "nopdl", norm=v != "nonorm", gemv=gemv)
                    us = captured_ms(fn, reps=20) * 1e3 / a.layers
                    row = {"set": s, "M": M, "kind": kind, "variant": v, "us": us, "floor_us": floor_us}
                    rows_out.append(row)
                    log(f"{s:7s} M={M:2d} {kind:8s} {v:7s} {us:8.1f} us  floor {floor_us:7.1f}  "
                        f"x{us / floor_us:.2f}  excess {us - floor_us:6.1f} us")
        if a.configs:
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            for M in (int(m) for m in a.rows.split(",")):
                for kind in ("qkv", "o", "gate_up", "down"):
                    w = {"qkv": layers.qkv, "o": layers.o, "gate_up": layers.gu, "down": layers.down}[kind][0]
                    N, K = w.shape[0] // (2 if kind == "gate_up" else 1), w.shape[1]
                    item, gate = w.element_size(), kind == "gate_up"
                    cands = fl.tuning_candidates(M, N, K, sms, gate, item, gemv) + [
                        fl.FusedConfig(bn, bk, nw, ns) for bn in (16, 32)
                        for bk in ((64, 128) if item == 2 else (256, 512, 1024)) for nw in (4, 8) for ns in (3, 4)
                        if K % bk == 0]
                    for c in dict.fromkeys(cands):
                        try:
                            us = captured_ms(layers.chain(kind, M, have_pdl, True, c, gemv), reps=20) * 1e3 / a.layers
                        except Exception as e:  # noqa: BLE001 - a configuration that does not fit is reported
                            log(f"{s} M={M} {kind} {c}: failed ({type(e).__name__})")
                            continue
                        configs.append({"set": s, "M": M, "kind": kind, "config": str(c), "us": us,
                                        "floor_us": layers.bytes(kind) / bw / 1e3})
                        log(f"config {s:7s} M={M:2d} {kind:8s} {c.block_n:3d}x{c.block_k:<3d} w{c.num_warps} "
                            f"s{c.num_stages}{f' gemv a{c.ahead}' if c.gemv else ' tc'}  {us:8.1f} us  "
                            f"x{us / configs[-1]['floor_us']:.2f}")
        del layers
        torch.cuda.empty_cache()
    log("tuned choices: " + json.dumps(fl.chosen()))
    sweeps = {}
    if not a.no_sweep:
        for M in (int(m) for m in a.rows.split(",")):
            for use in sorted({have_pdl, False}, reverse=True):
                r = sweeps[f"M{M}{'' if use else '-nopdl'}"] = sweep(M, use, gemv=gemv)
                log(f"sweep M={M} pdl={use}: fixed {r['fixed_us']:.1f} us per kernel, streaming "
                    f"{r['stream_GBps']:.0f} GB/s; points " + ", ".join(f"{b / 2**20:.0f}MB:{t:.1f}us"
                                                                       for b, t in r["points_bytes_us"]))
    log("\n| set | M | kind | " + " | ".join(f"{v} us (x floor)" for v in variants) + " | floor us |")
    log("|---|---|---|" + "---|" * (len(variants) + 1))
    keys = sorted({(r["set"], r["M"], r["kind"]) for r in rows_out},
                  key=lambda k: (list(SETS).index(k[0].removesuffix("-fp8")), k[0], k[1], KINDS.index(k[2])))
    for key in keys:
        rs = {r["variant"]: r for r in rows_out if (r["set"], r["M"], r["kind"]) == key}
        log(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(
            f"{rs[v]['us']:.1f} ({rs[v]['us'] / rs[v]['floor_us']:.2f})" for v in variants) +
            f" | {next(iter(rs.values()))['floor_us']:.1f} |")
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "linear_chain.json").write_text(json.dumps(
            {"card": card, "copy_GBps": bw, "pdl": have_pdl, "gemv": gemv, "layers": a.layers, "rows": rows_out,
             "sweeps": sweeps,
             "configs": configs, "chosen": fl.chosen(),
             "torch": torch.__version__}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
