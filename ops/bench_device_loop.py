"""In-process speculation with the device loop against the step-by-step path: step time, host time on the
critical path, tokens/s and efficiency against the ideal step, one table.

    python -m ops.bench_device_loop --target llama-8b --draft llama-1b --alpha 0.8 --dtype bfloat16 --batches 1,32
    python -m ops.bench_device_loop --target demo --draft demo --dtype float32 --batches 1   # real weights
    python -m ops.bench_device_loop --target demo --draft eagle3:DIR --dtype float32 --batches 1,8  # a feature head
    python -m ops.bench_device_loop --device cpu --target tiny --draft tiny --max-tokens 16  # a dry run

For each batch size, the same prompts run four ways, each after an untimed warm-up run of the same shape (graph
captures, compilation): target-only and speculative (fixed K), on the step-by-step path (`SpeculativeEngine.step`)
and on the device loop (`EngineConfig.device_loop`, `pipeline.device_loop`). Greedy, `--max-tokens` each, EOS
ignored. A run's step time is the wall time between its first and its last streamed step over the steps between.

- `--target` a shape of `pipeline.models.shapes` (random weights) or `demo` (the demo target, real weights; its
  GGUF joined from `--gguf-parts` on a machine without it). `--draft` a shape (random weights: with `--alpha`, a
  synthetic-acceptance drafter, `pipeline.synthetic`, whose proposals are the target's recorded greedy output kept
  with probability alpha: figures labelled synthetic acceptance), `demo` (the shipped distilled drafter), or a
  feature head as the CLI names it, `eagle3:DIR` / `medusa:DIR` (on the target's states; `--draft eagle3:random` /
  `medusa:random`: random weights of the target's shape, for a dry run).
- Forward costs, GPU time (20 calls captured as one graph): target decode (B x 1) and verify (B x K+1), one draft
  step (B x 1) or a head's whole draft of a step (EAGLE-3's catch-up and K-1 steps, Medusa's one pass; the ideal
  counts it as K draft steps of a K-th of it); and the device loop's whole step (its captured graph, from a saved
  state, restored after).
- tok/s = tokens per pass x rows / step time (steady decoding; `e2e_tok_s` in the JSON adds prefill and
  captures); host on the critical path = measured loop step - its graph replayed alone; ideal = `pipeline.ideal`
  from the forward costs and the measured tokens per pass; efficiency = measured speedup over target-only (the
  faster of its two paths) / ideal speedup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams, is_head
from pipeline.ideal import efficiency, ideal_speedup

TINY = "tiny"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _models(args) -> tuple[Any, Any, Any]:
    """(target, draft model or None, tokenizer or None) on the device."""
    from pipeline.models.loader import load_model
    from pipeline.models.shapes import SHAPES, random_llama

    dtype = getattr(torch, args.dtype)
    tok = None
    if args.target == "demo":
        from pipeline.models.store import resolve

        target, tok = load_model(str(resolve(None)), device=args.device, dtype=args.dtype)
    elif args.target == TINY:
        target = _tiny(args, 0)
    else:
        target = random_llama(SHAPES[args.target], torch.device(args.device), dtype)
    if is_head(args.draft):
        draft = None  # built on the target (`_head`)
    elif args.draft == "demo":
        from pipeline.models.store import DEMO_DRAFT, resolve

        draft = load_model(str(resolve(DEMO_DRAFT)), device=args.device, dtype=args.dtype)[0]
    elif args.draft == TINY:
        draft = _tiny(args, 1)
    else:
        draft = random_llama(SHAPES[args.draft], torch.device(args.device), dtype)
    return target, draft, tok


def _head(args, target, tok):
    """The feature head `--draft` names, on the target; `eagle3:random` / `medusa:random` write a random-weight
    checkpoint of the target's shape first (a dry run's)."""
    from pipeline.drafters import build_drafter

    kind, folder = args.draft.split(":", 1)
    if folder == "random":
        folder = str(Path(tempfile.mkdtemp()) / kind)
        random_head(kind, folder, target)
    return build_drafter(f"{kind}:{folder}", target.info, tok, target=target)


def random_head(kind: str, folder: str, target) -> None:
    """Random weights of the target's shape (K = 4 Medusa heads on its output layer; an EAGLE-3 layer of its width)."""
    from pipeline.heads.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
    from pipeline.heads.medusa import MedusaConfig, MedusaHeads, save_medusa

    a = target.args
    torch.manual_seed(0)
    if kind == "medusa":
        heads = MedusaHeads(MedusaConfig(4, 1, shared_lm_head=True), a.dim, a.vocab_size,
                            target.model.output.weight.detach().cpu().float())
        save_medusa(heads, folder, torch.float32)
        return
    cfg = Eagle3Config(hidden_size=a.dim, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                       intermediate_size=a.intermediate_size, vocab_size=a.vocab_size,
                       draft_vocab_size=min(a.vocab_size, 32768), head_dim=a.head_dim,
                       aux_layers=None if a.n_layers >= 4 else (0, a.n_layers // 2, a.n_layers))
    head = Eagle3Head(cfg, target.model.tok_embeddings.weight.detach().cpu().float())
    for w in head.parameters():
        if w.dim() > 1:
            torch.nn.init.normal_(w, std=w.shape[-1] ** -0.5)
    save_eagle3(head, folder, torch.float32)


def _tiny(args, seed: int):
    from pipeline.models.loader import load_model
    from tests.support.models import make_tiny_llama

    folder = Path(tempfile.mkdtemp()) / f"tiny{seed}"
    make_tiny_llama(folder, vocab_size=512, hidden=64, layers=2, seed=seed, max_position_embeddings=4096)
    return load_model(str(folder), device=args.device, dtype=args.dtype)[0]


def _prompts(args, tok, vocab: int, n: int) -> list[list[int]]:
    if tok is not None:
        from specserve.prompts import SPEC_BENCH_DEV, load_prompts

        texts = [s.prompt for s in load_prompts(SPEC_BENCH_DEV, 1)[:n]]
        out = []
        for t in texts:
            ids = tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
        return out
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        chunk = torch.randint(100, vocab, (48,), generator=gen).tolist()
        out.append((chunk * (args.prompt_len // 48 + 1))[: args.prompt_len])
    return out


def _run(engine, prompts, k: int, args) -> dict:
    """One timed batch: step time from the first to the last streamed step."""
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    states = engine._make_states(prompts, params, False)
    steps0 = engine.timings.steps
    sync()
    t0 = time.perf_counter()
    first = last = None
    for _ in engine._run(states, SpecParams(num_draft_tokens=max(k, 1))):
        now = time.perf_counter()
        if first is None:
            first = now
        last = now
    sync()
    t_end = time.perf_counter()
    steps = engine.timings.steps - steps0
    tokens = sum(len(s.output_ids) for s in states)
    passes = sum(s.stats.target_passes for s in states)
    step_s = (last - first) / max(steps - 1, 1)
    return {"tok_s": tokens / max(passes, 1) * len(states) / step_s, "steps": steps, "tokens": tokens,
            "wall_s": t_end - t0,
            "step_ms": 1e3 * (last - first) / max(steps - 1, 1), "e2e_tok_s": tokens / (t_end - t0),
            "tokens_per_pass": tokens / max(passes, 1),
            "outputs": [list(s.output_ids) for s in states]}


def _replay_ms(fn, iters: int, sync) -> float:
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return 1e3 * (time.perf_counter() - t0) / iters


def _graph_ms(fn, n: int) -> float:
    """GPU ms of one call of `fn`: n calls captured as one CUDA graph, replayed, timed with CUDA events (so a small
    model's host launch cost, which the device loop hides, is not counted)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * n)


@torch.inference_mode()
def _forward_costs(engine, B: int, k: int, args, sync) -> dict:
    """Target decode / verify and one draft step on slots 0..B-1 at a position past every row's tokens: GPU time
    (`_graph_ms`) where the model runs `forward_static`, else back-to-back calls."""
    from pipeline.device_loop import device_resident
    from pipeline.drafters import ModelDrafter

    dev = torch.device(args.device)
    pos = torch.full((B,), args.prompt_len + args.max_tokens + 8, dtype=torch.int64)
    slots = torch.arange(B, dtype=torch.int64)
    pos_d, slots_d = pos.to(dev), slots.to(dev)

    def cost(model, T: int) -> float:
        toks = torch.zeros(B, T, dtype=torch.int64, device=dev)
        if device_resident(model):
            return _graph_ms(lambda: model.forward_static(toks, pos_d, slots_d), 20)
        return _replay_ms(lambda: model.forward(toks, pos, slots), args.iters, sync)

    out = {"decode_ms": cost(engine.target, 1), "verify_ms": cost(engine.target, k + 1)}
    drafter = engine.drafter
    if isinstance(drafter, ModelDrafter):
        out["draft_ms"] = cost(drafter.model, 1)
    loop = getattr(engine, "_last_loop", None)
    if loop is not None and loop.head is not None:  # the head's whole draft of a step, from the loop's last state
        draft = loop._draft_head
        out["head_draft_ms"] = (_graph_ms(draft, 20) if loop.capture else _replay_ms(draft, args.iters, sync))
        out["draft_ms"] = out["head_draft_ms"] / k
    return out


@torch.inference_mode()
def _loop_graph_ms(engine, args, sync) -> float | None:
    """The last device loop's whole step, replayed alone from a saved state (restored after)."""
    loop = getattr(engine, "_last_loop", None)
    if loop is None or loop._graph is None:
        return None
    saved = [t.clone() for t in loop._state()]
    ms = _replay_ms(loop._graph.replay, min(args.iters, 10), sync)
    for t, s in zip(loop._state(), saved):
        t.copy_(s)
    return ms


def bench(args) -> dict:
    from pipeline.drafters import ModelDrafter
    from pipeline.engine import SpeculativeEngine
    from pipeline.synthetic import Recording, SyntheticDrafter

    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    target, draft_model, tok = _models(args)
    head = _head(args, target, tok) if draft_model is None else None
    if head is not None and args.alpha is not None:
        raise SystemExit("--alpha applies to a draft model's shape (synthetic acceptance), not to a feature head")
    max_b = max(args.batches)
    cfg = EngineConfig(max_batch_size=max_b, max_seq_len=args.prompt_len + args.max_tokens + 600,
                       device=args.device, dtype=args.dtype)
    if tok is not None:
        cfg = dataclasses.replace(cfg, max_seq_len=4096)
    # wraps the target (and a draft model) on the graph path
    engine = SpeculativeEngine(target, tok, head or ModelDrafter(draft_model), cfg)
    target = engine.target
    draft_model = None if head is not None else engine.drafter.model
    # Keep the last synthetic loop (not cached by the engine) for the replay measurement.
    make = engine._device_loop

    def keep(*a, **kw):
        loop = make(*a, **kw)
        engine._last_loop = loop
        return loop

    engine._device_loop = keep
    rows = []
    for B in args.batches:
        prompts = _prompts(args, tok, target.info.vocab_size, B)
        if tok is not None:
            args.prompt_len = max(len(p) for p in prompts)
        res: dict[str, Any] = {"batch": B, "k": args.k}
        ref = None
        for label, k, loop in (("target_step", 0, False), ("target_loop", 0, True), ("spec_step", args.k, False),
                               ("spec_loop", args.k, True)):
            engine.config = dataclasses.replace(cfg, device_loop=loop)
            if k == 0:
                engine.drafter = None
            elif engine.drafter is None:
                if head is not None:
                    engine.drafter = head
                elif args.alpha is not None:  # synthetic acceptance on the recorded target-only output
                    rec = Path(tempfile.mkdtemp()) / "recording.json"
                    Recording(prompts, ref, target.info.vocab_size).save(rec)
                    engine.drafter = SyntheticDrafter(draft_model, rec, args.alpha)
                else:
                    engine.drafter = ModelDrafter(draft_model)
            _run(engine, prompts, k, args)  # warm-up: captures, compilation, the linears' tuning
            r = _run(engine, prompts, k, args)
            if ref is None:
                ref = r["outputs"]
            r["exact"] = r.pop("outputs") == ref
            if loop:
                g = _loop_graph_ms(engine, args, sync)
                r["graph_ms"] = g
                r["host_ms"] = None if g is None else r["step_ms"] - g
            res[label] = r
            _log(f"B={B} {label}: {r['step_ms']:.3f} ms/step, {r['tok_s']:.1f} tok/s, "
                 f"{r['tokens_per_pass']:.2f} tokens/pass, exact {r['exact']}, host {r.get('host_ms')}")
        res.update(_forward_costs(engine, B, args.k, args, sync))
        tpp = res["spec_loop"]["tokens_per_pass"]
        ideal = ideal_speedup(res["decode_ms"], res["verify_ms"], res.get("draft_ms", 0.0), args.k,
                              min(tpp, args.k + 1))
        base = max(res["target_step"]["tok_s"], res["target_loop"]["tok_s"])
        for path in ("spec_step", "spec_loop"):
            s = res[path]["tok_s"] / base
            res[path]["speedup"] = s
            res[path]["efficiency"] = efficiency(s, ideal)
        res["ideal_speedup"] = ideal.speedup
        rows.append(res)
    card = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    return {"card": card, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "target": args.target, "draft": args.draft, "alpha": args.alpha, "dtype": args.dtype, "k": args.k,
            "max_tokens": args.max_tokens, "argv": sys.argv, "rows": rows}


def table(r: dict) -> str:
    label = f" (synthetic acceptance, alpha {r['alpha']})" if r["alpha"] is not None else ""
    lines = [f"{r['card']}, {r['date']}, target {r['target']}, draft {r['draft']}{label}, {r['dtype']}, K={r['k']}, "
             f"{r['max_tokens']} tokens",
             "| B | path | step ms | graph alone ms | host on critical path ms | tokens/pass | tok/s | speedup | "
             "ideal | efficiency | exact |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        for path in ("target_step", "target_loop", "spec_step", "spec_loop"):
            x = row[path]
            f = lambda v, p=3: "" if v is None else f"{v:.{p}f}"  # noqa: E731
            lines.append(f"| {row['batch']} | {path} | {f(x['step_ms'])} | {f(x.get('graph_ms'))} | "
                         f"{f(x.get('host_ms'))} | {f(x['tokens_per_pass'], 2)} | {f(x['tok_s'], 1)} | "
                         f"{f(x.get('speedup'), 2)} | "
                         f"{f(row['ideal_speedup'], 2) if path.startswith('spec') else ''} | "
                         f"{f(x.get('efficiency'), 2)} | {x['exact']} |")
        draft = (f"head draft of a step {row['head_draft_ms']:.3f}" if "head_draft_ms" in row
                 else f"draft step {row.get('draft_ms', 0):.3f}")
        lines.append(f"| {row['batch']} | forward costs | decode {row['decode_ms']:.3f}, "
                     f"verify {row['verify_ms']:.3f}, {draft} ms | | | | | | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="llama-8b")
    p.add_argument("--draft", default="llama-1b")
    p.add_argument("--alpha", type=float, default=None, help="synthetic acceptance (a shape drafter); none: real")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="1")
    p.add_argument("-k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--gguf-parts", default=None, help="glob of the demo GGUF's parts, joined first")
    p.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.gguf_parts:
        from ops.gpu_demo_serve import DEMO_GGUF_SHA256, join_parts
        from pipeline.models.store import DEMO_GGUF_MEMBER, cache_root

        join_parts(args.gguf_parts, cache_root() / "gguf" / Path(DEMO_GGUF_MEMBER).name, DEMO_GGUF_SHA256)
    result = bench(args)
    text = table(result)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"device_loop_{args.target}_{args.draft.replace('/', '_').replace(':', '-')}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
