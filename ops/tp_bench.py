"""Tensor-parallel decode-step benchmark: one command on a multi-GPU machine, a table at the end.

    python -m ops.tp_bench --out $OUT                        # 4 GPUs: 8B at TP=1,2,4 and 70B at TP=4
    python -m ops.tp_bench --out $OUT --sizes 1,2            # 2 GPUs: 8B at TP=1,2 (70B needs 4 cards)
    torchrun --nproc_per_node 4 -m ops.tp_bench --out $OUT    # one size per launch (the table reads every
                                                              # result already in --out, so TP=1 can come first)
    python -m ops.tp_bench --device cpu --shapes tiny --sizes 1,2 --out /tmp/tpb   # smoke test (gloo)

Where one command may run at most 10 minutes, split it and keep the results in one folder that outlives the
command (the table reads every result in --out):
    python -m ops.tp_bench --out /tmp/tpb --shapes llama-8b && cp /tmp/tpb/* $OUT
    python -m ops.tp_bench --out /tmp/tpb --shapes llama-70b --sizes 4 && cp /tmp/tpb/* $OUT
`--no-compile` starts faster (graphs still captured); `--batches 1,8` adds batch 8.

Per shape (random bf16 weights; `llama-8b` = Llama-3-8B, `llama-70b` = Llama-3-70B) and per size N, N ranks
(one process and one GPU each, a NCCL group; the launcher spawns them itself, no Ray) build their shards of
the same model (`pipeline.models.tensor_parallel`: every rank generates each full tensor from a per-tensor
seed and keeps its slice, so TP=N is the same model as TP=1; past `--exact-init-gb` ranks draw only their own
slices, which is as good for timing), wrap them in the static-shape graph runner (CUDA graphs with the
collectives captured inside), prefill `--context` tokens per row, and time one step of B rows x T tokens
(T = 1 decode, T = K+1 verify), all ranks in lockstep (SPMD). TP=1 is the plain unsharded runner.
Also timed: the eager runner (B=1, T=1); "synced" steps (B=1), each waited for before the next as a serving
step is (every rank in lockstep), which shows the host work a back-to-back step hides; and "driven" steps, the
way a serving replica runs them: rank 0's
`TensorParallelRunner` sends each call's inputs over its control channel and the other ranks `follow()`.
`--control socket,gloo` times each channel (`pipeline.models.tp_control`) in the same processes; the table's
driven column shows the first.

floor = (this rank's weights read once + its KV heads read and written) / copy bandwidth of one card
(a large device-to-device copy: bytes read + written over time), so at TP=N it is the floor "across the N
cards". Logits: the decode and verify logits of TP=N against TP=1 at the same inputs (8B, exact init).
`--allreduce auto,nccl` times each all-reduce kind of the graph path (`pipeline.models.tp_allreduce`, and
"fused", `pipeline.models.tp_fused`) in the same processes; the checks read the first kind listed. The other
kinds' logits are recorded against the first's (`variant_logits_max_diff`): equal at TP=2, different in bf16
rounding past 2 ranks (another summation order).
`--linear` picks the graph runner's few-row linears (`GraphConfig.linear`, default auto: tuned per shape);
`--gemv off` keeps the fused layer's one-row calls on the tensor cores (`GraphConfig.gemv`); `--pdl-preload`
sets when its linears load their first weight tile before the PDL wait (`GraphConfig.pdl_preload`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.models.base import ModelInfo  # noqa: E402
from pipeline.models.kernel_timing import copy_GBps  # noqa: E402
from pipeline.models.llama import LlamaArgs, LlamaCausalLM, Transformer  # noqa: E402
from pipeline.models.tensor_parallel import (  # noqa: E402
    Slice,
    TensorParallelRunner,
    build_sharded_transformer,
    follow,
    init_tensor_parallel,
    make_plan,
    num_parameters,
    sharded_runner,
    tensor_parallel_graphs,
)
from pipeline.models.tp_control import parse_control  # noqa: E402

_COMMON = dict(norm_eps=1e-5, rope_theta=500000.0, rope_scaling=None, qkv_bias=False, o_bias=False, mlp_bias=False,
               sliding_window=None, max_position_embeddings=8192, tie_embeddings=False)
SHAPES: dict[str, LlamaArgs] = {
    "llama-8b": LlamaArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                          intermediate_size=14336, **_COMMON),  # 8.03B parameters
    "llama-70b": LlamaArgs(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                           intermediate_size=28672, **_COMMON),  # 70.6B parameters
    "tiny": LlamaArgs(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=128, **_COMMON),  # CPU smoke test
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------------
# Timing and bandwidth


def time_fn(fn: Callable[[], Any], cuda: bool, iters: int = 30, warmup: int = 3) -> dict:
    """Median/p90 milliseconds of fn(), back to back (CUDA events on CUDA). Every rank must call it with the
    same iters/warmup: the collectives inside fn keep the ranks in lockstep."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in ev:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        ms = sorted(s.elapsed_time(e) for s, e in ev)
    else:
        ms = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
        ms.sort()
    return {"median_ms": statistics.median(ms), "p90_ms": ms[(9 * len(ms)) // 10]}


def copy_bandwidth_GBps(device: torch.device, gib: float = 4.0) -> float:
    return copy_GBps(device, gib) if device.type == "cuda" else float("nan")


# ----------------------------------------------------------------------------------------------------
# Random models


def random_source(seed: int, device: torch.device, exact: bool, rank: int):
    """(name, full shape, slice) -> this rank's tensor. exact: the full tensor is drawn (per-tensor seed, the
    same on every rank and at every N) and sliced; else only the slice is drawn (per-rank seed)."""

    def draw(name: str, shape: tuple[int, ...], fan_in: int, gen_seed: int) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(gen_seed)
        t = torch.empty(shape, device=device, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            return t.normal_(1.0, 0.05, generator=gen)
        return t.normal_(0.0, fan_in ** -0.5 if len(shape) == 2 else 0.02, generator=gen)

    def read(name: str, full_shape: tuple[int, ...], sl: Slice) -> torch.Tensor:
        base = seed * 1_000_003 + zlib.crc32(name.encode())
        fan_in = full_shape[-1]
        if exact:
            return sl.take(draw(name, full_shape, fan_in, base)).contiguous().clone()
        if sl.zeros:
            return torch.zeros(full_shape, device=device, dtype=torch.bfloat16)
        return draw(name, sl.shape(full_shape), fan_in, base + 7919 * rank)

    return read


def plain_model(a: LlamaArgs, source, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Transformer:
    with torch.device("meta"):
        model = Transformer(a)
    state = {n: source(n, tuple(p.shape), Slice()).to(device, dtype) for n, p in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def info_of(shape: str, a: LlamaArgs) -> ModelInfo:
    return ModelInfo(name=shape, path="", vocab_size=a.vocab_size, eos_token_ids=(), max_position_embeddings=8192,
                     architecture="LlamaForCausalLM", num_parameters=num_parameters(a), fast_path=True)


# ----------------------------------------------------------------------------------------------------
# One rank


def bench_rank(rank: int, world: int, init_method: str, shape: str, args: argparse.Namespace, tp: Any = None) -> None:
    """One rank of one (shape, N) run. `tp`: an existing group (torchrun, several shapes); else one is made."""
    from pipeline.models.graphs import GraphCausalLM, GraphConfig

    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    a = SHAPES[shape]
    exact = num_parameters(a) * 2 <= args.exact_init_gb * 1e9
    rec: dict[str, Any] = {"shape": shape, "tp": world, "rank": rank, "exact_init": exact, "rows": [],
                           "card": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__}
    rec["copy_GBps"] = copy_bandwidth_GBps(device)
    source = random_source(args.seed, device, exact, rank)
    t0 = time.perf_counter()
    own_group = world > 1 and tp is None
    if world == 1:  # the baseline: the plain runner, no collectives at all
        runner = LlamaCausalLM(plain_model(a, source, device), info_of(shape, a))
    else:
        if own_group:
            tp = init_tensor_parallel(rank, world, init_method, device, collective_timeout_s=600, control_timeout_s=600)
        replicate = args.embedding == "replicated" or (args.embedding == "auto" and cuda)
        rec["embedding"] = "replicated" if replicate else "parallel"
        model = build_sharded_transformer(a, make_plan(a, rank, world, replicate), tp.group, source, device,
                                          torch.bfloat16)
        runner = sharded_runner(model, info_of(shape, a))
    if cuda:
        torch.cuda.synchronize()
    rec["build_s"] = time.perf_counter() - t0
    cfg = GraphConfig(graphs=cuda, compile=cuda and not args.no_compile, linear=args.linear, gemv=args.gemv == "on",
                      pdl_preload=args.pdl_preload)
    batches = [int(b) for b in args.batches.split(",")]
    Ts = [1, args.k + 1]
    la = runner.args  # this rank's shard
    elsize = 2  # bf16
    weights = sum(p.numel() for n, p in runner.model.named_parameters() if n != "tok_embeddings.weight") * elsize
    kv_per_token = la.n_layers * 2 * la.n_kv_heads * la.head_dim * elsize
    rec.update(weight_bytes=weights, kv_bytes_per_token=kv_per_token, linear=args.linear)
    log(f"{shape} TP={world} rank {rank}: built in {rec['build_s']:.1f} s ({weights / 1e9:.2f} GB of weights read per "
        f"step), copy {rec['copy_GBps']:.0f} GB/s")

    g = torch.Generator().manual_seed(args.seed)  # the same inputs on every rank and at every N
    V = a.vocab_size
    prompts = torch.randint(0, V, (max(batches), args.context), generator=g)
    step_tokens = torch.randint(0, V, (max(batches), max(Ts)), generator=g)
    variants = [v.strip() for v in args.allreduce.split(",")] if world > 1 else ["-"]
    logits = {}
    for vi, variant in enumerate(variants):
        fast = tensor_parallel_graphs(runner, cfg, variant) if world > 1 else GraphCausalLM(runner, cfg)
        resolved = getattr(fast, "allreduce", "-")
        fast.allocate(max(batches), args.context + 256)
        for b in range(max(batches)):  # prefill every slot (eager path): the cache is the same model's at any N
            fast.forward(prompts[b : b + 1], torch.tensor([0]), torch.tensor([b]), args.context - 1)
        # Logits at the same inputs (compared across N by the launcher; the first variant's are the TP=N ones):
        # row 0 alone, and every row of the largest batch.
        for name, T, B in logit_cases(batches, Ts):
            out = fast.forward(step_tokens[:B, :T], torch.full((B,), args.context), torch.arange(B))
            key = name if vi == 0 else f"{resolved}:{name}"
            logits[key] = out.float().cpu()
            if vi > 0:  # another all-reduce kind: same sums, maybe in another order (bf16 rounding)
                rec.setdefault("variant_logits_max_diff", {})[key] = float((logits[key] - logits[name]).abs().max())

        vrows: list[dict] = []  # this variant's rows
        for B in batches:
            for T in Ts:
                tokens = step_tokens[:B, :T]
                positions = torch.full((B,), args.context, dtype=torch.int64)  # host tensors, as the engine passes
                slots = torch.arange(B)
                t = time.perf_counter()
                fast.forward(tokens, positions, slots)
                if cuda:
                    torch.cuda.synchronize()
                first_s = time.perf_counter() - t
                step = time_fn(lambda: fast.forward(tokens, positions, slots), cuda, iters=args.iters)
                row = {"B": B, "T": T, "ms": step["median_ms"], "p90_ms": step["p90_ms"], "first_call_s": first_s,
                       "allreduce": resolved}
                entry = fast._graphs.get(fast.shape_for(B, T, args.context))
                if entry is not None and entry.graph is not None:
                    row["replay_ms"] = time_fn(entry.graph.replay, cuda, iters=args.iters)["median_ms"]
                if B == 1 and T == 1 and vi == 0:
                    eager = time_fn(lambda: runner.forward(tokens, positions, slots), cuda, iters=10)
                    row["eager_ms"] = eager["median_ms"]
                if B == 1:  # each step waited for, as a serving step is: the host work it exposes

                    def synced() -> None:
                        fast.forward(tokens, positions, slots)
                        if cuda:
                            torch.cuda.synchronize()

                    row["synced_ms"] = time_fn(synced, cuda=False, iters=args.iters)["median_ms"]
                kv = B * (args.context + T) * kv_per_token + B * T * kv_per_token
                row["floor_ms"] = (weights + kv) / (rec["copy_GBps"] * 1e9) * 1e3 if cuda else None
                rec["rows"].append(row)
                vrows.append(row)
                if cuda and args.timeline and vi == 0 and (B, T) == (1, 1) and entry is not None \
                        and entry.graph is not None:
                    timeline(rec, entry.graph.replay, args.timeline, a.n_layers, world, rank, shape, Path(args.out))
                if rank == 0:
                    log(f"{shape} TP={world} [{resolved}] B={B} T={T}: {row['ms']:.3f} ms (replay "
                        f"{row.get('replay_ms', float('nan')):.3f}, floor {row['floor_ms'] or float('nan'):.3f}, "
                        f"eager {row.get('eager_ms', float('nan')):.2f})")

        for ci, control in enumerate(args.control.split(",") if world > 1 and args.control != "none" else []):
            # driven steps: rank 0 sends each call over its control channel, the others follow
            if rank == 0:
                kind, spin_ms = parse_control(control)
                leader = TensorParallelRunner(fast, tp, heartbeat_s=None, control=kind, spin_ms=spin_ms)
                name = leader.control + (f":{spin_ms:g}" if spin_ms is not None and leader.control == "socket" else "")
                if ci == 0:
                    # What a serving replica does at start: every rank captures the remaining step graphs in
                    # lockstep (batch buckets up to 4 here; the timed shapes above are captured already).
                    t_warm = time.perf_counter()
                    captured = leader.warmup(4, max(Ts))
                    rec[f"driven_warmup_{resolved}"] = {"captures": captured, "seconds": time.perf_counter() - t_warm}
                    log(f"{shape} TP={world} [{resolved}] driven warm-up: {captured} graphs on every rank in "
                        f"{time.perf_counter() - t_warm:.1f} s")
                for T in Ts:
                    tokens, positions, slots = step_tokens[:1, :T], torch.tensor([args.context]), torch.tensor([0])

                    def call() -> None:
                        leader.forward(tokens, positions, slots)
                        if cuda:
                            torch.cuda.synchronize()

                    ms = time_fn(call, cuda=False, iters=args.iters)["median_ms"]
                    row = next(r for r in vrows if (r["B"], r["T"]) == (1, T))
                    row[f"driven_{name}_ms"] = ms
                    if ci == 0:
                        row["driven_ms"] = ms
                    log(f"{shape} TP={world} [{resolved}] driven ({name}) B=1 T={T}: {ms:.3f} ms")
                leader.close()
            else:
                follow(fast, tp)
        if vi < len(variants) - 1:
            del fast, entry
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    if cuda:
        from pipeline.models.fused_linear import chosen as fused_chosen
        from pipeline.models.skinny_linear import chosen
        rec["linear_choices"] = chosen()
        rec["fused_choices"] = fused_chosen()  # this rank's fused-layer configuration per shape (CUDA or tensor cores)

    if rank == 0:
        out = Path(args.out)
        torch.save(logits, out / f"logits_{shape}_tp{world}.pt")
        if world == 1 and exact and not args.no_fp32_ref:  # the yardstick of bf16 error: the same model in fp32
            entry = None  # noqa: F841 - a captured graph holds its memory pool
            del fast, runner
            if cuda:
                torch.cuda.empty_cache()
            ref = LlamaCausalLM(plain_model(a, source, device, torch.float32), info_of(shape, a))
            ref.allocate(max(batches), args.context + 256)
            for b in range(max(batches)):
                ref.forward(prompts[b : b + 1], torch.tensor([0]), torch.tensor([b]), args.context - 1)
            torch.save({name: ref.forward(step_tokens[:B, :T], torch.full((B,), args.context), torch.arange(B)).cpu()
                        for name, T, B in logit_cases(batches, Ts)}, out / f"logits_{shape}_fp32.pt")
            del ref
        (out / f"tp_bench_{shape}_tp{world}.json").write_text(json.dumps(rec, indent=1))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def logit_cases(batches: list[int], Ts: list[int]) -> list[tuple[str, int, int]]:
    """(name, T, B) of the logits compared across sizes: row 0 at each T ("T5"), and the largest batch ("B8T5")."""
    return [(f"T{T}", T, 1) for T in Ts] + [(f"B{max(batches)}T{T}", T, max(batches)) for T in Ts if max(batches) > 1]


def timeline(rec: dict, replay: Callable[[], object], reps: int, n_layers: int, world: int, rank: int, shape: str,
             out: Path) -> None:
    """`ops.step_timeline` of the B=1, T=1 graph: every rank replays it `reps` times in lockstep, rank 0 under the
    profiler (its table goes to the log and to timeline_<shape>_tp<N>.md)."""
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    if rank == 0:
        from ops.step_timeline import format_table, profile_replays

        rows = profile_replays(replay, reps, n_layers)
        rec["timeline"] = rows
        text = format_table(rows)
        (out / f"timeline_{shape}_tp{world}.md").write_text(f"{shape} TP={world} rank 0, B=1 T=1, {reps} replays\n\n"
                                                           f"{text}\n")
        log(f"{shape} TP={world} timeline (rank 0, B=1 T=1):\n{text}")
    else:
        for _ in range(reps + 1):  # profile_replays' warm-up replay, then the profiled ones
            replay()
        torch.cuda.synchronize()


def _spawned(rank: int, world: int, init_method: str, shape: str, args: argparse.Namespace) -> None:
    try:
        bench_rank(rank, world, init_method, shape, args)
    except BaseException:
        traceback.print_exc()
        raise
    # Leave without tearing the process group or the captured graphs down: NCCL's shutdown with live CUDA graphs
    # hung past the launcher's timeout on 4xH200 (2026-11-26). Every result is on disk by now (barrier above).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------------------------------
# Launcher and table


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(shape: str, world: int, args: argparse.Namespace) -> str | None:
    """Run one (shape, N) in N fresh processes; None if it went well, else why not."""
    import multiprocessing as mp

    if args.device == "cuda":
        cards = torch.cuda.device_count()
        if world > cards:
            return f"needs {world} GPUs, {cards} here"
        need = num_parameters(SHAPES[shape]) * 2 / world
        have = torch.cuda.get_device_properties(0).total_memory
        if need > 0.85 * have:
            return f"{need / 1e9:.0f} GB of weights per card > 85% of {have / 1e9:.0f} GB"
    ctx = mp.get_context("spawn")
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_spawned, args=(r, world, init, shape, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
    return None if codes == [0] * world else f"exit codes {codes}"


def _row(recs: dict, shape: str, tp: int, B: int, T: int) -> dict | None:
    """The (B, T) row of the first all-reduce kind timed (the checks' figure; the table lists every kind)."""
    rec = recs.get((shape, tp))
    return next((r for r in rec["rows"] if (r["B"], r["T"]) == (B, T)), None) if rec else None


def table(out: Path) -> str:
    recs = {}
    for f in sorted(out.glob("tp_bench_*_tp*.json")):
        r = json.loads(f.read_text())
        recs[(r["shape"], r["tp"])] = r
    if not recs:
        return "no results"
    f = lambda v, p=3: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    any_rec = next(iter(recs.values()))
    lines = [f"card: {any_rec['card']}; torch {any_rec['torch']}; copy bandwidth per card "
             f"{f(any_rec['copy_GBps'], 0)} GB/s",
             "| model | TP | all-reduce | B | T | step ms | x TP=1 | floor ms | x floor | replay ms | synced ms "
             "| driven ms | eager ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, tp), rec in sorted(recs.items(), key=lambda kv: (list(SHAPES).index(kv[0][0]), kv[0][1])):
        for r in rec["rows"]:
            base = _row(recs, shape, 1, r["B"], r["T"])
            rel = r["ms"] / base["ms"] if base else None
            xf = r["ms"] / r["floor_ms"] if r.get("floor_ms") else None
            lines.append(f"| {shape} | {tp} | {r.get('allreduce', '-')} | {r['B']} | {r['T']} | {f(r['ms'])} "
                         f"| {f(rel, 2)} | {f(r.get('floor_ms'))} | {f(xf, 2)} | {f(r.get('replay_ms'))} "
                         f"| {f(r.get('synced_ms'))} | {f(r.get('driven_ms'))} |"
                         f" {f(r.get('eager_ms'), 2)} |")
    lines.append("")
    lines += [f"- {c['check']}: {f(c['value'])} (target {c['target']}): {c['state']}" for c in checks(out, recs)]
    return "\n".join(lines)


def logits_diff(out: Path, shape: str, tp: int, ref_name: str = "tp1") -> dict | None:
    """Largest difference of TP=tp's logits from `ref_name`'s (tp1: bf16 TP=1; fp32: TP=1 in float32)."""
    a, b = out / f"logits_{shape}_{ref_name}.pt", out / f"logits_{shape}_tp{tp}.pt"
    if not (a.exists() and b.exists()):
        return None
    ref, got = torch.load(a), torch.load(b)
    worst = {"max_abs": 0.0, "rel_to_max_logit": 0.0, "argmax_agree": 1.0}
    for k in ref:
        d = (got[k] - ref[k]).abs().max().item()
        worst["max_abs"] = max(worst["max_abs"], d)
        worst["rel_to_max_logit"] = max(worst["rel_to_max_logit"], d / ref[k].abs().max().item())
        agree = (got[k].argmax(-1) == ref[k].argmax(-1)).float().mean().item()
        worst["argmax_agree"] = min(worst["argmax_agree"], agree)
    return worst


# "Within bf16 tolerance": TP=N's distance from the float32 model is at most twice TP=1's own bf16 distance
# from it (TP only reorders bf16 sums; it must not add error beyond what bf16 already has).
BF16_ERROR_RATIO = 2.0


def checks(out: Path, recs: dict) -> list[dict]:
    res = []

    def add(name: str, value: float | None, target: str, ok: Callable[[float], bool]) -> None:
        state = "not measured" if value is None else ("MET" if ok(value) else "MISSED")
        res.append({"check": name, "value": value, "target": target, "state": state})

    base = _row(recs, "llama-8b", 1, 1, 1)
    for n, lim in ((2, 0.6), (4, 0.4)):
        r = _row(recs, "llama-8b", n, 1, 1)
        add(f"8B B=1 decode step TP={n} / TP=1", r["ms"] / base["ms"] if r and base else None, f"<= {lim}",
            lambda v, lim=lim: v <= lim)
    r = _row(recs, "llama-70b", 4, 1, 1)
    add("70B B=1 decode step TP=4 / its floor", r["ms"] / r["floor_ms"] if r and r.get("floor_ms") else None,
        "<= 1.5", lambda v: v <= 1.5)
    base_err = logits_diff(out, "llama-8b", 1, "fp32")
    for n in (2, 4):
        d, err = logits_diff(out, "llama-8b", n), logits_diff(out, "llama-8b", n, "fp32")
        extra = "" if d is None else (f" (vs bf16 TP=1: max |diff| {d['max_abs']:.4f} = {d['rel_to_max_logit']:.4f} of "
                                      f"the largest logit, argmax agreement {d['argmax_agree']:.2f})")
        ratio = err["max_abs"] / base_err["max_abs"] if err and base_err and base_err["max_abs"] > 0 else None
        add(f"8B logits TP={n}: max |TP={n} - fp32| / max |TP=1 - fp32|{extra}", ratio, f"<= {BF16_ERROR_RATIO}",
            lambda v: v <= BF16_ERROR_RATIO)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "tp-bench-out"))
    p.add_argument("--shapes", default="llama-8b,llama-70b")
    p.add_argument("--sizes", default="1,2,4", help="tensor-parallel sizes to run (launcher mode)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--batches", default="1", help="rows per step, e.g. 1,8")
    p.add_argument("--context", type=int, default=512, help="KV positions already in the cache per row")
    p.add_argument("-k", type=int, default=4, help="draft tokens: verify steps feed K+1 tokens")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--exact-init-gb", type=float, default=40.0,
                   help="models up to this size draw full tensors on every rank (TP=N == TP=1 model)")
    p.add_argument("--no-compile", action="store_true", help="graphs without torch.compile (faster start)")
    p.add_argument("--allreduce", default="auto",
                   help="all-reduce kinds to time at TP > 1 (pipeline.models.tp_allreduce: auto, nccl, "
                        "symm; and fused, pipeline.models.tp_fused)")
    p.add_argument("--embedding", default="auto", choices=["auto", "replicated", "parallel"],
                   help="TP embedding table: replicated on every rank, or vocabulary-parallel with an all_reduce "
                        "(auto: replicated on CUDA, as load_tensor_parallel_model does)")
    p.add_argument("--linear", default="auto", help="GraphConfig.linear: auto (tuned Triton/cuBLAS), torch, triton")
    p.add_argument("--gemv", choices=("on", "off"), default="on",
                   help="GraphConfig.gemv: the fused layer's one-row calls may multiply on the CUDA cores (off: tensor "
                        "cores only)")
    p.add_argument("--pdl-preload", choices=("auto", "on", "off"), default="auto",
                   help="GraphConfig.pdl_preload: first weight tile before the PDL wait (auto: float8 weights only)")
    p.add_argument("--control", default="auto",
                   help="driven steps' control channel(s), comma-separated: auto, socket, gloo (tp_control), each "
                        "with an optional :MS, the followers' poll window (socket:0 blocks at once); none: no driven "
                        "steps")
    p.add_argument("--no-fp32-ref", action="store_true", help="skip the float32 TP=1 logits (needs 4 bytes/param)")
    p.add_argument("--timeline", type=int, default=0, metavar="REPS",
                   help="profile REPS replays of the B=1 T=1 step kernel by kernel (ops.step_timeline; CUDA)")
    p.add_argument("--timeout-s", type=float, default=900.0, help="per (shape, N) launch")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    if "WORLD_SIZE" in os.environ:  # torchrun: one size, this process is one rank
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        tp = None
        if world > 1:
            device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", rank))) if args.device == "cuda" \
                else torch.device("cpu")
            tp = init_tensor_parallel(rank, world, "env://", device, collective_timeout_s=600, control_timeout_s=600)
        for shape in shapes:
            bench_rank(rank, world, "env://", shape, args, tp)
        if rank == 0:
            print(table(out))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("tp_bench: no CUDA device (use --device cpu for the smoke test)", file=sys.stderr)
        return 2
    notes = []
    for shape in shapes:
        for n in (int(s) for s in args.sizes.split(",")):
            log(f"--- {shape} TP={n}")
            why = launch(shape, n, args)
            if why:
                notes.append(f"{shape} TP={n}: not run ({why})")
                log(notes[-1])
    print()
    print(table(out))
    for n in notes:
        print("-", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
