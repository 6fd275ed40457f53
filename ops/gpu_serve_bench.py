"""The Serve pipeline on GPUs against the in-process engine, with synthetic acceptance, one command, one table.

    ops/gpu_serve_bench.sh --out $OUT          # on the GPU machine: unpacks Ray & co, redis-server, runs this
    python -m ops.gpu_serve_bench --target-shape llama-8b --draft-shape llama-1b --alpha 0.8 -k 4 \\
        --streams 1,8,32 --max-tokens 128 --placements separate,colocated --out $OUT

A target of `--target-shape` with random weights (stored in bf16; `--dtype` sets what the models run in) is written
once as a model folder (so the Serve target replica loads it like any model), prompts are random token ids,
requests are greedy with `ignore_eos`:

1. In process, one GPU (cuda:0): the engine target-only at each stream count (its greedy outputs are the
   recording), then the engine with the synthetic drafter (`pipeline.synthetic`, "synthetic acceptance": the
   recorded continuation, each position kept with probability ALPHA, at the cost of a real `--draft-shape`
   model's forwards) co-located on the same GPU, fixed K. The step costs the ideal needs (`pipeline.ideal`) are
   timed on the same models: target decode (T=1), verify (T=K+1), one draft step, at each batch size.
2. Through HTTP (`specserve serve`'s app, Ray Serve, embedded Redis), with the `openai` client: per placement
   (`separate`: target replica on one GPU and drafter replica on another, `resources.num_gpus: 1` each;
   `colocated`: both on one GPU, 0.5 each; `tp2`, on 4 GPUs: the target at tensor parallel 2 on two, one drafter
   replica on each of the other two) the same prompts speculative (K) and target-only (K=0 per request,
   the same HTTP path), at each stream count. Greedy outputs must equal the recording token for token; two
   seeded sampled requests must replay identically. The per-step timeline comes from the workers' own compute
   time per pass (target: verify+accept; drafter: propose) against the step the client sees. At 1 stream each
   request starts once the workers have freed the previous one's slots (at most 1 s; a slot still held then is
   logged with its state and freed by the bench, since the next request would queue for 30 s behind it).

`--prespec-branches B` sets `coordinator.prespec_branches` (pre-speculation: the drafter drafts the next step for the
step's B likeliest outcomes while the target verifies); the timeline reports its hits by accepted length. The
synthetic drafter ships point masses (no distribution to rank outcomes by), so it pre-speculates one branch whatever
B is: every draft accepted, then its guess of the bonus token.

`--in-process-last` runs part 2 first and part 1 afterwards on the same GPU, while `--budget-s` allows: the
recording is then the HTTP target-only output, and the in-process target-only output is checked against it.
`--order` names the parts in any order (`separate,in-process,colocated`); the first part that serves target-only
writes the recording. A part starts only before `--budget-s`, an HTTP run only before `--deadline-s`.

Each HTTP part asks every worker actor where it runs (CUDA_VISIBLE_DEVICES, its CUDA device's UUID, the memory
its tensors hold) and lists `nvidia-smi`'s GPU processes, and times one step's Redis write against the app's own
Redis. Prints one table per part, a per-step timeline of the HTTP runs (the coordinator's clocks: waiting for the
draft, for the verdict, the commit; the workers' compute per pass; the hops between), and writes
serve_gpu_bench.json, .md and a plot to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.ideal import ideal_speedup

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def first_mismatch(got: list[list[int]], recorded: list[list[int]]) -> list[int | None]:
    """Per request: the index of the first token that differs from the recording (None: equal)."""
    out = []
    for a, b in zip(got, recorded):
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        out.append(i if i is not None or len(a) == len(b) else min(len(a), len(b)))
    return out


def recorded_outputs(runs: dict[int, list[list[int]]]) -> list[list[int]]:
    """The greedy target-only outputs the recording holds, prompt i's at index i: those of the run at the most
    streams (the first c prompts), then those of the 1-stream run beyond them (its --single-requests prompts)."""
    out = list(runs[max(runs)])
    if 1 in runs:
        out += runs[1][len(out):]
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


# ------------------------------------------------------------------------------------------------------
# the random target as a model folder


def shape_args(shape: str):
    """A named shape (`pipeline.models.shapes.SHAPES`), or `tiny` (a dry run of this script on a CPU)."""
    from dataclasses import replace

    from pipeline.models.shapes import SHAPES

    if shape == "tiny":
        return replace(SHAPES["llama-1b"], vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                       intermediate_size=128, tie_embeddings=False)
    return SHAPES[shape]


def write_random_target(shape: str, folder: Path, device: str, seed: int = 0, margin: float = 16.0) -> Path:
    """A Llama model folder (config.json + model.safetensors, bf16) of `shape` with random weights, the embedding
    scaled by `margin` and copied into the output layer (`pipeline.models.shapes.embedding_margin`: a greedy output
    that bf16 rounding does not move)."""
    from safetensors.torch import save_file

    from pipeline.models.llama import HF_TO_LOCAL
    from pipeline.models.shapes import embedding_margin, random_llama

    if (folder / "model.safetensors").exists():
        return folder
    a = shape_args(shape)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": a.vocab_size,
              "hidden_size": a.dim, "intermediate_size": a.intermediate_size, "num_hidden_layers": a.n_layers,
              "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_kv_heads, "head_dim": a.head_dim,
              "rms_norm_eps": a.norm_eps, "rope_theta": a.rope_theta, "hidden_act": "silu",
              "max_position_embeddings": a.max_position_embeddings, "tie_word_embeddings": a.tie_embeddings,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    runner = embedding_margin(random_llama(a, device, torch.bfloat16, seed=seed), margin)
    to_hf = {}
    for hf, local in HF_TO_LOCAL.items():
        for i in range(a.n_layers) if "{i}" in hf else [None]:
            to_hf[local.format(i=i)] = hf.format(i=i)
    state = {}
    for name, t in runner.model.state_dict().items():
        if a.tie_embeddings and name == "output.weight":
            continue
        state[to_hf[name]] = t.contiguous().cpu()
    save_file(state, str(folder / "model.safetensors.tmp"))
    os.replace(folder / "model.safetensors.tmp", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    del runner, state
    gc.collect()
    if device.startswith("cuda"):  # the bench process keeps no GPU memory beside the replicas it measures
        torch.cuda.empty_cache()
    return folder


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]


# ------------------------------------------------------------------------------------------------------
# in process


@torch.inference_mode()
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@torch.inference_mode()
def forward_ms(model, B: int, T: int, position: int, iters: int = 30) -> float:
    """ms per forward of B rows x T tokens at `position`, replayed back to back, one sync at the end."""
    dev = model.device
    tokens = torch.randint(0, min(model.info.vocab_size, 1000), (B, T), device=dev)
    positions = torch.full((B,), position, dtype=torch.int64)
    slots = torch.arange(B, dtype=torch.int64)
    for _ in range(3):
        model.forward(tokens, positions, slots)
    sync(str(dev))
    t0 = time.perf_counter()
    for _ in range(iters):
        model.forward(tokens, positions, slots)
    sync(str(dev))
    return 1e3 * (time.perf_counter() - t0) / iters


def warm_requests(engine, prompts: list[list[int]], c: int, spec: SpecParams) -> None:
    """Short requests first, one alone and c at once: the prefill's eager path compiles and times its kernels for
    these prompt lengths on first use, which the graph warm-up does not cover."""
    t0 = time.perf_counter()
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=0)
    engine.generate(prompts[0], params, spec)
    engine.generate_batch(prompts[:c], params, spec)
    log(f"warm-up requests: {time.perf_counter() - t0:.1f} s")


def engine_run(engine, prompts: list[list[int]], c: int, params: SamplingParams, spec: SpecParams) -> dict:
    """c = 1: the prompts one after another, streamed (TTFT, inter-token gaps); c > 1: the first c at once."""
    if c == 1:
        ids, ttft, gaps, t_all = [], [], [], 0.0
        passes = 0
        for p in prompts:
            t0 = time.perf_counter()
            times, out, res = [], [], None
            for ev in engine.stream(p, params, spec):
                if ev.token_ids:
                    now = time.perf_counter()
                    gap = now - (times[-1] if times else t0)
                    if times:
                        gaps += [gap / len(ev.token_ids)] * len(ev.token_ids)
                    times.append(now)
                    out += ev.token_ids
                if ev.result is not None:
                    res = ev.result
            t_all += time.perf_counter() - t0
            ttft.append(times[0] - t0)
            ids.append(out)
            passes += res.stats["target_passes"]
        tokens = sum(len(o) for o in ids)
        return {"ids": ids, "tokens": tokens, "seconds": t_all, "tokens_per_s": tokens / t_all,
                "ttft_ms_p50": 1e3 * pct(ttft, 50), "ttft_ms_max": 1e3 * max(ttft), "itl_ms_p50": 1e3 * pct(gaps, 50),
                "itl_ms_p99": 1e3 * pct(gaps, 99), "itl_ms_max": 1e3 * max(gaps), "tokens_per_pass": tokens / passes}
    batch = prompts[:c]
    t0 = time.perf_counter()
    res = engine.generate_batch(batch, params, spec)
    wall = time.perf_counter() - t0
    tokens = sum(len(r.token_ids) for r in res)
    passes = sum(r.stats["target_passes"] for r in res)
    return {"ids": [r.token_ids for r in res], "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "tokens_per_pass": tokens / passes}


def in_process(args, folder: Path, prompts: list[list[int]], streams: list[int], rec_path: Path,
               out: dict | None = None, save=None) -> dict:
    from pipeline.engine import SpeculativeEngine
    from pipeline.models.loader import load_model
    from pipeline.synthetic import Recording, SyntheticDrafter, timing_model

    cfg = EngineConfig(max_batch_size=max(streams), max_seq_len=args.prompt_len + args.max_tokens + 8,
                       device=args.device, dtype=args.dtype)
    target, _ = load_model(str(folder), device=args.device, dtype=args.dtype)
    engine = SpeculativeEngine(target, None, None, cfg)
    log(f"in-process target loaded; warm-up: {engine.warmup(args.k)}")
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    warm_requests(engine, prompts, max(streams), SpecParams(0))
    out = {} if out is None else out
    out.update({"target_only": {}, "spec": {}, "costs": {}})
    n1 = prompts[: args.single_requests]
    for c in streams:
        r = engine_run(engine, n1 if c == 1 else prompts, c, params, SpecParams(0))
        out["target_only"][c] = r
        log(f"in-process target-only c={c}: {r['tokens_per_s']:.1f} tok/s")
    # The recording: the target's greedy continuations of every prompt served (`recorded_outputs`).
    outputs = recorded_outputs({c: r["ids"] for c, r in out["target_only"].items()})
    if rec_path.exists():  # written by the HTTP part: the same prompts' greedy outputs through the Serve target
        served = Recording.load(rec_path).outputs
        out["equals_http_target_only"] = outputs == served[: len(outputs)]
        log(f"in-process target-only greedy == HTTP target-only greedy: {out['equals_http_target_only']}")
    rec = Recording(prompts[: len(outputs)], outputs, target.info.vocab_size)  # the prompts of that run
    rec.save(rec_path)
    consistent = all(out["target_only"][c]["ids"] == outputs[: len(out["target_only"][c]["ids"])] for c in streams)
    drafter = SyntheticDrafter(timing_model(args.draft_shape, args.device, args.dtype), rec, args.alpha)
    spec_engine = SpeculativeEngine(engine.target, None, drafter, cfg)
    log(f"in-process drafter ready; warm-up: {spec_engine.warmup(args.k)}")
    warm_requests(spec_engine, prompts, max(streams), SpecParams(args.k))
    for c in streams:
        if time.perf_counter() - T0 > args.deadline_s:
            log(f"in-process spec c={c}: not run (--deadline-s)")
            continue
        r = engine_run(spec_engine, n1 if c == 1 else prompts, c, params, SpecParams(args.k))
        r["exact"] = r["ids"] == outputs[: len(r["ids"])]
        r["first_mismatch"] = first_mismatch(r["ids"], outputs)
        out["spec"][c] = r
        log(f"in-process spec c={c}: {r['tokens_per_s']:.1f} tok/s, {r['tokens_per_pass']:.2f} tokens/pass, "
            f"exact {r['exact']} (first differing token per request: {r['first_mismatch']})")
        if save is not None:
            save()
    pos = args.prompt_len + args.max_tokens // 2
    for c in [c for c in streams if c in out["spec"]]:
        out["costs"][c] = {"decode_ms": forward_ms(spec_engine.target, c, 1, pos),
                           "verify_ms": forward_ms(spec_engine.target, c, args.k + 1, pos),
                           "draft_step_ms": forward_ms(drafter.model, c, 1, pos)}
        log(f"costs B={c}: {out['costs'][c]}")
    out["target_only_consistent"] = consistent
    del engine, spec_engine, drafter, target
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    for d in ("target_only", "spec"):
        for r in out[d].values():
            r.pop("ids", None)
    return out


# ------------------------------------------------------------------------------------------------------
# through HTTP


async def http_one(client, model: str, prompt: list[int], max_tokens: int, k: int, temperature: float = 0.0,
                   seed: int = 0, ignore_eos: bool = True) -> dict:
    t0 = time.perf_counter()
    times, ids, gaps, spec = [], [], [], {}
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature, seed=seed, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": ignore_eos, "speculation": {"num_draft_tokens": k}})
    rid = None
    async for chunk in stream:
        rid = rid or chunk.id
        extra = chunk.model_extra or {}
        if chunk.choices:
            got = (chunk.choices[0].model_extra or {}).get("token_ids") or []
            if got:
                now = time.perf_counter()
                if times:
                    gaps += [(now - times[-1]) / len(got)] * len(got)
                times.append(now)
                ids += got
        if extra.get("speculation"):
            spec = extra["speculation"]
    return {"ids": ids, "ttft": times[0] - t0 if times else float("nan"), "gaps": gaps,
            "seconds": time.perf_counter() - t0, "spec": spec, "id": rid}


def worker_actors() -> list[tuple[str, Any]]:
    """(role, handle) of every target and drafter worker actor."""
    import ray

    from deployments.workers import WORKER_NAMESPACE

    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] != WORKER_NAMESPACE:
            continue
        role = "target" if ":Target:" in a["name"] else "drafter" if ":Drafter:" in a["name"] else None
        if role:
            try:
                out.append((role, ray.get_actor(a["name"], namespace=WORKER_NAMESPACE)))
            except Exception:  # noqa: BLE001 - a worker of a deleted app, going away
                continue
    return out


def worker_placement() -> list[dict]:
    """Where each worker actor runs, asked inside it: its CUDA_VISIBLE_DEVICES, current CUDA device, that device's
    UUID and the memory its tensors hold there (the target's weights against the drafter's)."""
    import ray

    def where(_self) -> dict:
        import os as _os

        import torch as _torch

        d: dict[str, Any] = {"pid": _os.getpid(), "CUDA_VISIBLE_DEVICES": _os.environ.get("CUDA_VISIBLE_DEVICES")}
        if _torch.cuda.is_available():  # the device holding the worker's tensors (a tensor-parallel rank sees every
            # GPU and picks its own; current_device() is per thread, and Ray calls this on another thread)
            i = max(range(_torch.cuda.device_count()), key=_torch.cuda.memory_allocated)
            props = _torch.cuda.get_device_properties(i)
            d.update(current_device=i, name=props.name, uuid=str(getattr(props, "uuid", "")),
                     allocated_gib=round(_torch.cuda.memory_allocated(i) / 2**30, 2))
        return d

    out = []
    for role, handle in worker_actors():
        try:
            out.append({"role": role, **ray.get(handle.__ray_call__.remote(where), timeout=30)})
        except Exception as err:  # noqa: BLE001
            out.append({"role": role, "error": repr(err)[:200]})
    return out


async def slots_freed(actors: list[tuple[str, Any]], limit_s: float = 1.0) -> float | None:
    """Wait until no worker holds a slot (the request that just ended has freed its own), at most limit_s.
    -> ms waited, None if a slot was still held. The next request one after another goes only then: a slot
    still held makes it queue until the holder counts as idle (30 s)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if not any(s["slots_used"] for s in worker_stats(actors).values()):
            return round(1e3 * (time.perf_counter() - t0), 1)
        await asyncio.sleep(0.01)
    import ray

    def state(w) -> dict:  # the slot holders, and whether the worker still keeps each one's cache or context
        return {rid: {"slot": slot, "seen_s_ago": round(time.monotonic() - w.slots._seen.get(rid, 0.0), 2),
                      "cache": rid in getattr(w, "_fed", getattr(w, "_ctx", {})),
                      "batcher_expects": rid in w.batcher._last_seen} for rid, slot in w.slots.holders.items()}

    for role, handle in actors:  # a slot the request that ended did not free: log it, then free it
        try:
            held = ray.get(handle.__ray_call__.remote(state), timeout=10)
            if held:
                log(f"slot still held {limit_s:.0f} s after the request ended: {role} {held}; the bench frees it")
                ray.get(handle.release.remote(list(held)), timeout=10)
        except Exception as err:  # noqa: BLE001
            log(f"slot state of {role}: {err!r}")
    return None


def worker_stats(actors: list[tuple[str, Any]] | None = None) -> dict[str, dict]:
    import ray

    out = {}
    for role, handle in worker_actors() if actors is None else actors:
        try:
            s = ray.get(handle.stats.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - a worker of a deleted app, going away
            continue
        prev = out.get(role, {"batches": 0, "rows": 0, "compute_s": 0.0, "slots_used": 0, "waiting": 0})
        out[role] = {k: prev[k] + s.get(k, 0) for k in ("batches", "rows", "compute_s", "slots_used", "waiting")}
    return out


def redis_commit_ms(app: str, n: int = 200) -> dict:
    """The coordinator's per-step Redis write (`RequestStore.commit`: one step's tokens, stats and event, one
    script call), timed from this process against the app's own Redis: p50/p99 ms of `n` commits to a probe
    request. The coordinator chains these writes behind its steps (off the critical path) on its event loop."""
    from ray import serve

    from deployments.config import EMBEDDED_REDIS
    from deployments.redis_state import RequestStore

    url = serve.get_deployment_handle(EMBEDDED_REDIS, app).url.remote().result(timeout_s=30)

    async def go() -> list[float]:
        async def get_url() -> str:
            return url

        store = await RequestStore.connect(get_url, namespace="bench-probe", ttl_s=120)
        try:
            rid, owner = f"probe-{os.getpid()}-{time.time_ns()}", "bench"
            state = {"prompt_ids": list(range(128)), "params": {"max_tokens": 128}, "eos_token_ids": [2],
                     "stats": {}, "step": 0}
            await store.create(rid, owner, state)
            times = []
            for i in range(n):
                toks = [1000 + i, 2000 + i, 3000 + i]
                event = {"i": i, "token_ids": toks, "text": "", "finish_reason": None}
                t0 = time.perf_counter()
                await store.commit(rid, owner, i, i + 1, toks, 0, None, {"target_passes": i + 1, "accepted": 2 * i},
                                   event)
                times.append(time.perf_counter() - t0)
            return times
        finally:
            await store.close()

    times = asyncio.run(go())
    return {"n": n, "p50_ms": 1e3 * pct(times, 50), "p99_ms": 1e3 * pct(times, 99)}


def http_run(url: str, model: str, prompts: list[list[int]], c: int, args, k: int) -> dict:
    from openai import AsyncOpenAI

    async def go():
        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        try:
            if c == 1:  # one after another, each once the workers have freed the slots of the one before
                res = []
                t0 = time.perf_counter()
                actors = worker_actors()
                for p in prompts:
                    res.append(await http_one(client, model, p, args.max_tokens, k))
                    held.append(await slots_freed(actors))
                    if held[-1] is None:
                        log(f"request {res[-1]['id']} ended {len(res[-1]['ids'])} tokens")
                return res, time.perf_counter() - t0
            t0 = time.perf_counter()
            res = await asyncio.gather(*[http_one(client, model, p, args.max_tokens, k) for p in prompts[:c]])
            return res, time.perf_counter() - t0
        finally:
            await client.close()

    held: list[float | None] = []
    before = worker_stats()
    res, wall = asyncio.run(go())
    after = worker_stats()
    tokens = sum(len(r["ids"]) for r in res)
    secs = sum(r["seconds"] for r in res) if c == 1 else wall
    passes = sum(r["spec"].get("target_passes", 0) for r in res) or None
    row = {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
           "ttft_ms_p50": 1e3 * pct([r["ttft"] for r in res], 50),
           "ttft_ms_p99": 1e3 * pct([r["ttft"] for r in res], 99),
           "itl_ms_p50": 1e3 * pct([g for r in res for g in r["gaps"]], 50),
           "itl_ms_p99": 1e3 * pct([g for r in res for g in r["gaps"]], 99),
           "itl_ms_max": 1e3 * max((g for r in res for g in r["gaps"]), default=float("nan")),
           "ttft_ms_max": 1e3 * max(r["ttft"] for r in res),
           # all tokens over all target passes (as in process); the mean of the requests' own ratios beside it
           "tokens_per_pass": tokens / passes if k and passes else 1.0,
           "tokens_per_pass_mean_of_requests": statistics.mean(r["spec"].get("mean_accepted_tokens", 1.0)
                                                               for r in res) if k else 1.0,
           "passes_reported": passes, "ids": [r["ids"] for r in res],
           "passes_each": [r["spec"].get("target_passes") for r in res],
           "seconds_each": [round(r["seconds"], 4) for r in res],
           "ttft_ms_each": [round(1e3 * r["ttft"], 1) for r in res], "slots_freed_ms_after_each": held}
    # The coordinator's own clocks, summed over the requests (each request's stats arrive with its last event):
    # waiting for the draft (the drafter call, or a pre-draft), for the verdict (the target call), the whole step.
    for key in ("coordinator_draft_s", "coordinator_verify_s", "coordinator_step_s", "overlap_tries",
                "overlap_hits", "queue_wait_s"):
        row[key] = sum(float(r["spec"].get(key, 0.0) or 0.0) for r in res)
    # pre-speculation: accepted length -> [steps verified while the next was pre-speculated, of those hits]
    by: dict[str, list[int]] = {}
    for r in res:
        for n, (steps, hits) in (r["spec"].get("prespec_by_accepted") or {}).items():
            by.setdefault(n, [0, 0])
            by[n][0] += steps
            by[n][1] += hits
    row["prespec_by_accepted"] = {n: by[n] for n in sorted(by, key=int)}
    row["coordinator_steps"] = passes
    for role in ("target", "drafter"):
        if role in after:
            b = after[role]["batches"] - before.get(role, {}).get("batches", 0)
            cs = after[role]["compute_s"] - before.get(role, {}).get("compute_s", 0.0)
            row[f"{role}_passes"] = b
            row[f"{role}_rows"] = after[role]["rows"] - before.get(role, {}).get("rows", 0)
            row[f"{role}_compute_ms_per_pass"] = 1e3 * cs / b if b else float("nan")
    return row


def serve_part(args, folder: Path, rec_path: Path, prompts: list[list[int]], streams: list[int],
               placement: str, outputs: list[list[int]] | None, save=None, part: dict | None = None) -> dict:
    from deployments.ray_env import apply_ray_defaults

    apply_ray_defaults()
    import ray
    from ray import serve

    gpus = torch.cuda.device_count()
    share = (0.5 if placement == "colocated" else 1.0) if gpus else 0.0
    need = {"separate": 2, "tp2": 4}.get(placement, 1)
    if gpus < need and args.device != "cpu":
        return {"skipped": f"{gpus} GPU(s), {placement} needs {need}"}
    port = 8000
    # colocated: Ray is given one GPU, so both replicas (0.5 each) share it; separate: every GPU.
    ray.init(address="local", num_gpus=min(gpus, 1) if placement == "colocated" else gpus,
             num_cpus=max(os.cpu_count() or 2, 4), include_dashboard=False, logging_level="WARNING")
    quiet = {"log_level": "WARNING", "enable_access_log": False}
    serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=quiet)
    try:
        return _serve_part(args, folder, rec_path, prompts, streams, placement, outputs, share, port, quiet, save,
                           part)
    finally:
        serve.shutdown()
        ray.shutdown()


def _serve_part(args, folder, rec_path, prompts, streams, placement, outputs, share, port, quiet, save=None,
                part=None) -> dict:
    from ray import serve

    from deployments.app import build_app

    max_seq = args.prompt_len + args.max_tokens + 8
    tp = 2 if placement == "tp2" else 1  # tp2: the target on two GPUs, a drafter replica on each of two more
    cfg = {
        "target": {"model": str(folder), "device": args.device, "dtype": args.dtype, "max_batch_size": max(streams),
                   "max_seq_len": max_seq, "tensor_parallel_size": tp,
                   "resources": {"num_gpus": share, "num_cpus": 1}},
        "drafter": {"draft": f"synthetic:{args.alpha}:{args.draft_shape}:{rec_path}", "device": args.device,
                    "dtype": args.dtype, "max_batch_size": max(streams),
                    "resources": {"num_gpus": share, "num_cpus": 1, "num_replicas": tp}},
        "speculation": {"num_draft_tokens": args.k},
        "coordinator": {"adaptive_k": False, "overlap": not args.no_overlap},
    }
    if args.prespec_branches is not None:
        cfg["coordinator"]["prespec_branches"] = args.prespec_branches
    if args.steps_per_call is not None:
        cfg["coordinator"]["steps_per_call"] = args.steps_per_call
    t0 = time.perf_counter()
    serve.run(build_app(cfg), name="bench", route_prefix="/", logging_config=quiet)
    start_s = time.perf_counter() - t0
    log(f"serve [{placement}] up in {start_s:.1f} s")
    if args.device.startswith("cuda"):
        import subprocess

        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv"],
                             capture_output=True, text=True).stdout
        log("GPU processes:\n" + smi)
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used", "--format=csv"],
                              capture_output=True, text=True).stdout
        log("GPUs:\n" + gpus)
    else:
        smi = gpus = ""
    where = worker_placement()
    for w in where:
        log(f"worker [{placement}]: {w}")
    uuids = {role: {w.get("uuid") for w in where if w["role"] == role} - {None} for role in ("target", "drafter")}
    apart = bool(uuids["target"] and uuids["drafter"]) and not uuids["target"] & uuids["drafter"]
    log(f"serve [{placement}]: target and drafter workers on different GPUs: {apart}")
    url = f"http://127.0.0.1:{port}/v1"
    import httpx

    model = httpx.get(f"{url}/models").json()["data"][0]["id"]
    short = argparse.Namespace(**{**vars(args), "max_tokens": 16})
    out: dict[str, Any] = part if part is not None else {}
    out.update({"start_s": start_s, "spec": {}, "target_only": {}, "placement": placement, "workers": where,
                "workers_on_different_gpus": apart, "nvidia_smi_apps": smi, "nvidia_smi_gpus": gpus})
    n1 = prompts[: args.single_requests]
    runs = [("target_only", 0), ("spec", args.k)]
    if outputs is None:  # no in-process run: target-only through HTTP first; its greedy outputs are the recording
        http_run(url, model, prompts[:1], 1, short, 0)  # warm-up
        order = [(name, k, c) for name, k in runs for c in streams]
    else:
        http_run(url, model, prompts[:1], 1, short, args.k)  # warm-up
        http_run(url, model, prompts[:1], 1, short, 0)
        order = [(name, k, c) for i, c in enumerate(streams) for name, k in (runs if i % 2 else runs[::-1])]
    for name, k, c in order:
        if time.perf_counter() - T0 > args.deadline_s:
            out.setdefault("not_run", []).append(f"{name} c={c}")
            log(f"http [{placement}] {name} c={c}: not run (--deadline-s)")
            continue
        if name == "spec" and outputs is None:
            from pipeline.synthetic import Recording

            done = recorded_outputs({c: r["_ids"] for c, r in out["target_only"].items()})
            Recording(prompts[: len(done)], done, shape_args(args.target_shape).vocab_size).save(rec_path)
            outputs = Recording.load(rec_path).outputs
            for r in out["target_only"].values():  # each target-only run against the recording
                ids_c = r.pop("_ids")
                r["exact"] = ids_c == outputs[: len(ids_c)]
                r["first_mismatch"] = first_mismatch(ids_c, outputs)
            http_run(url, model, prompts[:1], 1, short, args.k)  # warm-up, with the recording now there
        r = http_run(url, model, n1 if c == 1 else prompts, c, args, k)
        ids = r.pop("ids")
        if outputs is not None:
            r["exact"] = ids == outputs[: len(ids)]
            r["first_mismatch"] = first_mismatch(ids, outputs)
        else:
            r["_ids"], r["exact"] = ids, None
        out[name][c] = r
        if save is not None:
            save()
        log(f"http [{placement}] {name} c={c}: {r['tokens_per_s']:.1f} tok/s, TTFT p50 {r['ttft_ms_p50']:.1f} ms, "
            f"ITL p50/p99/max {r['itl_ms_p50']:.2f}/{r['itl_ms_p99']:.2f}/{r['itl_ms_max']:.1f} ms, tokens/pass "
            f"{r['tokens_per_pass']:.2f}, target {r.get('target_compute_ms_per_pass', 0):.2f} ms/pass "
            f"({r.get('target_passes', 0)} passes), drafter {r.get('drafter_compute_ms_per_pass', float('nan')):.2f} "
            f"ms/pass ({r.get('drafter_passes', 0)} passes), exact {r['exact']} (first differing token per "
            f"request: {r.get('first_mismatch')}; target passes per request {r['passes_each']})")
        if c == 1:
            log(f"http [{placement}] {name} c=1: TTFT ms per request {r['ttft_ms_each']}, the slots of each "
                f"request freed after (ms; None: still held after 1 s) {r['slots_freed_ms_after_each']}")
    try:
        out["redis_commit"] = redis_commit_ms("bench")
        log(f"redis commit round trip from the bench process: {out['redis_commit']}")
    except Exception as err:  # noqa: BLE001
        log(f"redis commit probe: {err!r}")
    if time.perf_counter() - T0 > args.deadline_s:
        log(f"http [{placement}] seeded sampled replay: not run (--deadline-s)")
        return out
    # Seeded sampled requests replay identically (two prompts, twice each, speculative).
    n = min(48, args.max_tokens)
    async def sampled():
        from openai import AsyncOpenAI

        client = AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
        try:
            runs, actors = [], worker_actors()
            for _ in range(2):
                ids = []
                for j, p in enumerate(prompts[:2]):
                    ids.append((await http_one(client, model, p, n, args.k, temperature=0.8, seed=7 + j))["ids"])
                    await slots_freed(actors)
                runs.append(ids)
            return runs
        finally:
            await client.close()

    a, b = asyncio.run(sampled())
    out["sampled_replay_identical"] = a == b and all(len(x) == n for x in a)
    log(f"http [{placement}] seeded sampled replay identical: {out['sampled_replay_identical']}")
    return out


# ------------------------------------------------------------------------------------------------------
# report


def header(r: dict) -> str:
    return (f"{r['card']} x{r['gpus']}, {r['date']}; target {r['target_shape']} (random weights, "
            f"{r.get('dtype', 'bfloat16')}, embedding margin {r.get('margin', 16):g}), drafter "
            f"synthetic:{r['alpha']}:{r['draft_shape']} (**synthetic "
            f"acceptance**), K={r['k']} fixed, greedy, {r['prompt_len']}-token random prompts, {r['max_tokens']} "
            f"tokens each; 1 stream = {r['single_requests']} requests one after another.")


def placement_lines(placement: str, part: dict) -> list[str]:
    """Where the workers ran, as they said themselves."""
    if "workers" not in part:
        return []
    ws = "; ".join(f"{w['role']}: CUDA_VISIBLE_DEVICES={w.get('CUDA_VISIBLE_DEVICES')}, cuda:{w.get('current_device')}"
                   f" {str(w.get('uuid', ''))[:13]}, {w.get('allocated_gib', '-')} GiB" for w in part["workers"])
    return [f"{placement}: workers {ws}; on different GPUs: {part.get('workers_on_different_gpus')}"]


def serve_table(r: dict) -> str:
    """The HTTP rows alone (a run without the in-process part)."""
    lines = [header(r), "",
             "| placement | path | streams | tokens/s | x target-only | tokens/pass | TTFT p50 / max ms | ITL p50 / "
             "p99 / max ms | target ms/pass (passes) | drafter ms/pass (passes) | greedy exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for placement, part in r["serve"].items():
        for c in r["streams"]:
            for name in ("target_only", "spec"):
                x = part.get(name, {}).get(c)
                if x is None:
                    continue
                base = part.get("target_only", {}).get(c)
                lines.append(
                    f"| {placement} | {name} | {c} | {x['tokens_per_s']:.1f} | "
                    f"{x['tokens_per_s'] / base['tokens_per_s'] if base else float('nan'):.2f} | "
                    f"{x['tokens_per_pass']:.2f} | {x['ttft_ms_p50']:.1f} / {x['ttft_ms_max']:.1f} | "
                    f"{x['itl_ms_p50']:.2f} / {x['itl_ms_p99']:.2f} / {x['itl_ms_max']:.1f} | "
                    f"{x.get('target_compute_ms_per_pass', float('nan')):.2f} ({x.get('target_passes', 0)}) | "
                    f"{x.get('drafter_compute_ms_per_pass', float('nan')):.2f} ({x.get('drafter_passes', 0)}) | "
                    f"{x.get('exact')} |")
        if "sampled_replay_identical" in part:
            lines.append(f"\n{placement}: seeded sampled requests replay identically: "
                         f"{part['sampled_replay_identical']}; app up in {part['start_s']:.1f} s")
        lines += placement_lines(placement, part)
        if "skipped" in part:
            lines.append(f"\n{placement}: stopped: {part['skipped']}")
    return "\n".join(lines) + "\n"


def timeline_table(r: dict) -> str:
    """Per HTTP run, where a step's time goes (ms a step of one request, from the coordinator's clocks summed over
    the requests, and the workers' compute per pass)."""
    ip = r.get("in_process")
    lines = ["", "Per-step timeline through HTTP (ms; a step = one target pass of one request):", "",
             "| placement | path | streams | client step | coordinator step | waiting for the draft | waiting for "
             "the verdict | commit & rest | outside the coordinator | target worker per pass (rows) | bare forward "
             "(B = streams) | verdict hop | drafter worker per pass (passes a step) | pre-speculation hits / steps "
             "(by accepted length) | "
             "Redis commit p50 / p99 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for placement, part in r["serve"].items():
        rc = part.get("redis_commit") or {}
        redis = f"{rc.get('p50_ms', nan):.2f} / {rc.get('p99_ms', nan):.2f}"
        for c in r["streams"]:
            for name in ("target_only", "spec"):
                x = part.get(name, {}).get(c)
                if x is None or not x.get("coordinator_steps"):
                    continue
                n = x["coordinator_steps"]
                client = 1e3 * sum(x["seconds_each"]) / n
                step, draft = 1e3 * x["coordinator_step_s"] / n, 1e3 * x["coordinator_draft_s"] / n
                verify = 1e3 * x["coordinator_verify_s"] / n
                tp, tb = x.get("target_passes", 0), x.get("target_compute_ms_per_pass", nan)
                rows = x.get("target_rows", 0) / tp if tp else nan
                bare = nan
                if ip is not None and c in ip.get("costs", {}):
                    bare = ip["costs"][c]["verify_ms" if name == "spec" else "decode_ms"]
                dp = x.get("drafter_passes", 0)
                drafter = (f"{x.get('drafter_compute_ms_per_pass', nan):.2f} ({dp * c / n if n else nan:.2f})"
                           if dp else "-")
                pre = "-"
                if name == "spec":
                    by = x.get("prespec_by_accepted") or {}
                    seen = sum(c for c, _ in by.values())
                    pre = (f"{x.get('overlap_hits', 0):.0f} / {seen} ("
                           + ", ".join(f"{n}: {h}/{c}" for n, (c, h) in by.items()) + ")")
                lines.append(
                    f"| {placement} | {name} | {c} | {client:.2f} | {step:.2f} | {draft:.2f} | {verify:.2f} | "
                    f"{step - draft - verify:.2f} | {client - step:.2f} | {tb:.2f} ({rows:.1f}) | {bare:.2f} | "
                    f"{verify - tb:.2f} | {drafter} | {pre} | {redis} |")
    lines += ["", "client step: a request's time over its target passes (TTFT included); coordinator step: its "
              "step loop's clock (draft + verdict + commit, the Redis write chained off the critical path); outside "
              "the coordinator: ingress, SSE, the client, admission; verdict hop: waiting for the verdict minus "
              "the target worker's compute a pass (the actor call both ways, batching waits); bare forward: the "
              "in-process target forward of the same run (decode for target-only, verify of K+1 for speculative) "
              "at B = streams; its difference to the worker's compute a pass is the worker's host work (packing, "
              "accept, read-back) plus the rows' count; drafter passes a step: drafter passes x streams / steps. "
              "Redis commit: one step's write, timed from the bench process against the app's Redis."]
    return "\n".join(lines) + "\n"


def tables(r: dict) -> str:
    return _tables(r) + timeline_table(r)


def _tables(r: dict) -> str:
    if not (r["in_process"] or {}).get("costs"):
        return serve_table(r)
    ip, k = r["in_process"], r["k"]
    lines = [header(r), "",
             "| path | streams | tokens/s | x target-only (same path) | ideal x | efficiency | tokens/pass | "
             "TTFT p50 ms | ITL p50 / p99 ms | target ms/pass | drafter ms/pass | greedy exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(path, c, spec, base, ideal, overlapped):
        speed = spec["tokens_per_s"] / base["tokens_per_s"] if base else float("nan")
        eff = speed / ideal.speedup if ideal else float("nan")
        itl = (f"{spec.get('itl_ms_p50', float('nan')):.2f} / {spec.get('itl_ms_p99', float('nan')):.2f}"
               if "itl_ms_p50" in spec else "-")
        ttft = f"{spec['ttft_ms_p50']:.1f}" if "ttft_ms_p50" in spec else "-"
        return (f"| {path} | {c} | {spec['tokens_per_s']:.1f} | {speed:.2f} | "
                f"{ideal.speedup:.2f}{' (hidden draft)' if overlapped else ''} | {eff:.2f} | "
                f"{spec['tokens_per_pass']:.2f} | {ttft} | {itl} | "
                f"{spec.get('target_compute_ms_per_pass', float('nan')):.2f} | "
                f"{spec.get('drafter_compute_ms_per_pass', float('nan')):.2f} | {spec.get('exact', '-')} |")

    done = [c for c in r["streams"] if c in ip.get("costs", {}) and c in ip.get("spec", {})]
    for c in done:
        cost = ip["costs"][c]
        sp = ip["spec"][c]
        ideal = ideal_speedup(cost["decode_ms"], cost["verify_ms"], cost["draft_step_ms"], k,
                              min(max(sp["tokens_per_pass"], 1.0), k + 1))
        lines.append(row("in process, target only", c, ip["target_only"][c], ip["target_only"][c],
                         ideal_speedup(cost["decode_ms"], cost["decode_ms"], 0, 0, 1.0), False))
        lines.append(row("in process, drafter co-located", c, sp, ip["target_only"][c], ideal, False))
        for placement, part in r["serve"].items():
            if "skipped" in part or c not in part.get("spec", {}) or c not in part.get("target_only", {}):
                continue
            hs, ht = part["spec"][c], part["target_only"][c]
            tpp = min(max(hs["tokens_per_pass"], 1.0), k + 1)
            over = placement == "separate"
            ideal_h = ideal_speedup(cost["decode_ms"], cost["verify_ms"], cost["draft_step_ms"], k, tpp,
                                    overlapped=over)
            lines.append(row("HTTP, target only", c, ht, ht, ideal_speedup(cost["decode_ms"], cost["decode_ms"],
                                                                            0, 0, 1.0), False))
            lines.append(row(f"HTTP, drafter {placement}", c, hs, ht, ideal_h, over))
    lines += ["", "| streams | decode ms (T=1) | verify ms (T=K+1) | draft step ms | HTTP spec / in-process spec, per "
              "placement | HTTP target-only / in-process target-only |", "|---|---|---|---|---|---|"]
    for c in done:
        cost = ip["costs"][c]
        ratios = ", ".join(f"{p} {part['spec'][c]['tokens_per_s'] / ip['spec'][c]['tokens_per_s']:.2f}"
                           for p, part in r["serve"].items() if c in part.get("spec", {}))
        ratios_t = ", ".join(f"{p} {part['target_only'][c]['tokens_per_s'] / ip['target_only'][c]['tokens_per_s']:.2f}"
                             for p, part in r["serve"].items() if c in part.get("target_only", {}))
        lines.append(f"| {c} | {cost['decode_ms']:.3f} | {cost['verify_ms']:.3f} | {cost['draft_step_ms']:.3f} | "
                     f"{ratios} | {ratios_t} |")
    if "equals_http_target_only" in ip:
        lines.append(f"\nIn-process target-only greedy output equal to HTTP target-only: "
                     f"{ip['equals_http_target_only']}")
    for placement, part in r["serve"].items():
        if "sampled_replay_identical" in part:
            lines.append(f"\n{placement}: seeded sampled requests replay identically: "
                         f"{part['sampled_replay_identical']}; app up in {part['start_s']:.1f} s")
        lines += placement_lines(placement, part)
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    s = r["streams"]
    ip = r["in_process"]
    if ip is not None and ip.get("spec"):
        si = [c for c in s if c in ip["spec"]]
        ax.plot(si, [ip["target_only"][c]["tokens_per_s"] for c in si], "k--o", label="in process, target only")
        ax.plot(si, [ip["spec"][c]["tokens_per_s"] for c in si], "k-o", label="in process, drafter co-located")
    for placement, part in r["serve"].items():
        if "skipped" in part:
            continue
        cs = [c for c in s if c in part.get("spec", {}) and c in part.get("target_only", {})]
        ax.plot(cs, [part["target_only"][c]["tokens_per_s"] for c in cs], "--s", label="HTTP, target only"
                if placement == "separate" else f"HTTP, target only ({placement} app)")
        ax.plot(cs, [part["spec"][c]["tokens_per_s"] for c in cs], "-s", label=f"HTTP, drafter {placement}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("tokens/s (all streams)")
    ax.set_title(f"{r['target_shape']} + {r['draft_shape']} (synthetic acceptance, alpha {r['alpha']}, K={r['k']}), "
                 f"{r['card']}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target-shape", default="llama-8b")
    p.add_argument("--draft-shape", default="llama-1b")
    p.add_argument("--alpha", type=float, default=0.8)
    p.add_argument("--dtype", default="bfloat16", help="the target's and the draft model's dtype (the folder is "
                   "written in bf16). In bf16 the target's greedy token can differ between a decode (T=1) and a "
                   "verify (T=K+1) pass on a near-tie, so the recording (target-only) and the speculative output "
                   "can part; float32 makes the exactness check strict, at float32 step costs")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--single-requests", type=int, default=4, help="requests, one after another, at 1 stream")
    p.add_argument("--placements", default="separate,colocated")
    p.add_argument("--no-overlap", action="store_true", help="coordinator.overlap off (no pre-speculation)")
    p.add_argument("--prespec-branches", type=int, default=None, help="coordinator.prespec_branches: outcomes of a "
                   "step whose next draft the drafter prepares during verification (default: the config's)")
    p.add_argument("--steps-per-call", type=int, default=None, help="coordinator.steps_per_call: passes one call to "
                   "the target worker may run where nothing is needed between them (here: the target-only runs)")
    p.add_argument("--workdir", default=None, help="where the random target folder goes (default: /dev/shm if it has "
                   "room for it, else /tmp)")
    p.add_argument("--serve-only", action="store_true",
                   help="skip the in-process part; the HTTP target-only run writes the recording")
    p.add_argument("--in-process-last", action="store_true",
                   help="the HTTP part first (its target-only run writes the recording), then the in-process part "
                   "on the same GPU if --budget-s has not run out (its target-only greedy output is checked "
                   "against the HTTP one)")
    p.add_argument("--order", default=None, help="the parts in order, e.g. separate,in-process,colocated (default: "
                   "in-process first, then --placements; see --serve-only, --in-process-last)")
    p.add_argument("--budget-s", type=float, default=540, help="skip a part that would start after this")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip an HTTP run (and the sampled replay) that "
                   "would start after this, so that the command ends cleanly inside its limit")
    p.add_argument("--margin", type=float, default=16.0, help="the random target's embedding scale "
                   "(`write_random_target`): 512 makes the 8B shape's greedy token robust to bf16 rounding")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (--target-shape tiny, --draft-shape "
                   "tiny: a random folder is written for it)")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)
    streams = [int(x) for x in args.streams.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.workdir is None:
        import shutil

        shm = Path("/dev/shm")
        roomy = shm.is_dir() and shutil.disk_usage(shm).free > 3 * 2**30 * 16
        args.workdir = "/dev/shm/specserve-bench" if roomy else "/tmp/specserve-bench"
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    log(f"{torch.cuda.device_count()} x {card}, torch {torch.__version__}")
    folder = write_random_target(args.target_shape, work / f"{args.target_shape}-random-m{args.margin:g}",
                                 args.device, margin=args.margin)
    log(f"random target folder: {folder}")
    if args.draft_shape == "tiny":  # a dry run: the draft model's forwards run on a folder of the tiny shape
        args.draft_shape = str(write_random_target("tiny", work / "tiny-draft-random", args.device, seed=1))
    # enough prompts for the largest stream count and for the one-after-another requests of 1 stream
    prompts = random_prompts(max(max(streams), args.single_requests), args.prompt_len,
                             shape_args(args.target_shape).vocab_size)
    rec_path = work / "recording.json"
    result: dict[str, Any] = {"card": card, "gpus": torch.cuda.device_count(), "date": time.strftime("%Y-%m-%d %H:%M"),
                              "target_shape": args.target_shape, "draft_shape": args.draft_shape,
                              "alpha": args.alpha, "k": args.k, "streams": streams, "prompt_len": args.prompt_len,
                              "max_tokens": args.max_tokens, "single_requests": args.single_requests,
                              "overlap": not args.no_overlap, "prespec_branches": args.prespec_branches,
                              "dtype": args.dtype, "margin": args.margin,
                              "serve": {}, "argv": sys.argv}
    def save() -> None:
        (out / "serve_gpu_bench.json").write_text(json.dumps(result, indent=1, default=str))

    outputs = None
    result["in_process"] = None
    if rec_path.exists():  # a recording of an earlier run in the same folder
        rec_path.unlink()
    placements = [x for x in args.placements.split(",") if x]
    if args.order:
        parts = [x for x in args.order.split(",") if x]
    elif args.serve_only:
        parts = placements
    elif args.in_process_last:
        parts = placements + ["in-process"]
    else:
        parts = ["in-process"] + placements
    result["order"] = parts
    from pipeline.synthetic import Recording

    for name in parts:
        if time.perf_counter() - T0 > args.budget_s:
            log(f"skipping {name}: time budget (--budget-s {args.budget_s:g})")
            if name != "in-process":
                result["serve"][name] = {"skipped": "time budget"}
            continue
        if name == "in-process":
            result["in_process"] = {}
            in_process(args, folder, prompts, streams, rec_path, result["in_process"], save)
            save()
            outputs = Recording.load(rec_path).outputs
            continue
        try:
            result["serve"][name] = {}
            serve_part(args, folder, rec_path, prompts, streams, name, outputs, save, result["serve"][name])
        except Exception as err:  # noqa: BLE001 - report what ran, and why the rest did not
            import traceback

            traceback.print_exc()
            result["serve"][name]["skipped"] = f"error: {err!r}"[:300]
        if outputs is None and rec_path.exists():  # the HTTP target-only run wrote the recording
            outputs = Recording.load(rec_path).outputs
        save()
        (out / "serve_gpu_bench.md").write_text(tables(result))
        print(tables(result), flush=True)
    md = tables(result)
    (out / "serve_gpu_bench.md").write_text(md)
    try:
        plot(result, out / "serve_gpu_bench.png")
    except Exception as err:  # noqa: BLE001
        log(f"plot failed: {err!r}")
    print(md, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
