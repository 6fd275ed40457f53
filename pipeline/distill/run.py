"""`distill(cfg)`: data -> draft vocabulary -> drafter(s) -> training -> evaluation -> HF folder.

Output folder (`cfg.out`):
    config.json, model.safetensors, draft_vocab.safetensors, tokenizer files, distill.json   the drafter
    metrics.json                       data statistics, coverage, learning curve, final evaluation
    work/data/shard_*.npz              the target's answers (resumable)
    work/eval_*.npz                    the target's reference answers for evaluation prompts
    work/checkpoint.pt                 training state (resumable)
    work/variants/<name>/              every trained variant, in the same format as the drafter
Re-running the same command resumes: finished data shards are reused, training continues from the
checkpoint, and the export is redone.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from pipeline.distill.config import DistillConfig
from pipeline.distill.drafter import build_drafter, save_drafter, target_matmul_params
from pipeline.distill.evaluate import evaluate
from pipeline.distill.generate import SampleSet, generate_chunk, generate_dataset
from pipeline.distill.prompts import Prompt, load_prompts, spec_bench_prompts, synthetic_prompts
from pipeline.distill.target import DTYPES, eos_token_ids, load_target
from pipeline.distill.train import Trainer
from pipeline.distill.vocab import coverage, draft_vocabulary, token_counts


def load_eval_prompts(path: str, tokenizer: Any | None) -> list[Prompt]:
    """Spec-Bench style rows ({"turns": [...]}) or anything `load_prompts` reads."""
    p = Path(path)
    if p.suffix == ".jsonl":
        first = next((json.loads(line) for line in open(p) if line.strip()), {})
        if "turns" in first:
            if tokenizer is None:
                raise ValueError(f"{path}: text prompts need the target's tokenizer")
            return spec_bench_prompts(p, tokenizer)
    return load_prompts(p, tokenizer)


def _references(model: Any, prompts: list[Prompt], path: Path, *, temperature: float, cfg: DistillConfig,
                eos: list[int], pad: int, seed: int) -> SampleSet:
    """The target's answers to evaluation prompts (cached in `path`)."""
    if path.exists():
        return SampleSet.load(path)
    s = generate_chunk(model, prompts, seed=seed, sample_fraction=1.0 if temperature > 0 else 0.0,
                       sample_temperature=temperature, max_new_tokens=cfg.eval_max_new_tokens, eos_ids=eos,
                       pad_id=pad, batch_tokens=cfg.gen_batch_tokens, max_batch=cfg.gen_max_batch)
    s.save(path)
    return s


def _runner_generator(cfg: DistillConfig, folder: Path, device: torch.device, max_len: int,
                      probe: list[list[int]], say: Callable[[str], None]) -> Any:
    """The runner backend for the training data, checked before use: the configured static step, then (on CUDA)
    the static step with SDPA attention and without torch.compile, then the eager runner. Each must agree
    with the eager runner on one decoding step over real prompts (`RunnerGenerator.self_check`)."""
    from pipeline.distill.fastgen import RunnerGenerator

    tries = [dict(graphs=cfg.gen_graphs, compile=cfg.gen_compile, attention=cfg.gen_attention)]
    if device.type == "cuda" and cfg.gen_graphs is not False:
        tries += [dict(graphs=True, compile=False, attention="sdpa"),
                  dict(graphs=False, compile=False, attention="sdpa")]
    last: Exception | None = None
    for kw in tries:
        gen = None
        try:
            t0 = time.perf_counter()
            gen = RunnerGenerator.load(folder, device, cfg.dtype, rows=cfg.gen_rows, max_len=max_len,
                                       refill_min=cfg.gen_refill or None, **kw)
            check = gen.self_check(probe)
            say(f"generation backend: runner {kw}, {cfg.gen_rows} rows x {gen.max_len} positions, static step "
                f"{'on' if gen.static else 'off'}; check against the eager runner {check} "
                f"({time.perf_counter() - t0:.1f} s)")
            if check["ok"]:
                return gen
            last = RuntimeError(f"static step disagrees with the eager runner: {check}")
        except Exception as e:  # noqa: BLE001 - fall back to a simpler path and say why
            last = e
            say(f"generation backend runner {kw} failed: {e!r}")
        if gen is not None:
            gen.release()
    raise RuntimeError(f"no usable runner backend: {last!r}")


def distill(cfg: DistillConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    out = Path(cfg.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)

    def left() -> float:  # seconds left of the wall-clock limit
        return cfg.wall_seconds - (time.perf_counter() - t_start) if cfg.wall_seconds else float("inf")

    # 1. Target and prompts.
    pretokenized = all(p is None or str(p).endswith(".npz") for p in (cfg.prompts, cfg.eval_prompts))
    runner_backend = cfg.gen_backend == "runner"
    target_path = cfg.target
    if runner_backend:  # the runner reads safetensors folders: a .gguf is converted once (pipeline.models.store)
        from pipeline.models.store import resolve

        target_path = str(resolve(cfg.target))
    target, tokenizer, src = load_target(target_path, device, cfg.dtype, need_tokenizer=not pretokenized)
    eos = eos_token_ids(target, tokenizer, src)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else eos[0]
    vocab_size = target.config.vocab_size
    if cfg.prompts:
        prompts = load_prompts(cfg.prompts, tokenizer)
    elif tokenizer is None:
        prompts = synthetic_prompts(4 * cfg.chunk_prompts, vocab_size, cfg.seed, special=eos)
    else:
        raise ValueError("pass --prompts (a .jsonl of chats, or ops/distill/build_prompts.py's output)")
    n_all = len(prompts)
    prompts = [p for p in prompts if len(p.ids) <= cfg.max_prompt_tokens]
    random.Random(cfg.seed).shuffle(prompts)
    heldout, train_prompts = prompts[: cfg.heldout_prompts], prompts[cfg.heldout_prompts :]
    say(f"target {src} ({sum(p.numel() for p in target.parameters()) / 1e6:.1f}M params, vocab {vocab_size}, "
        f"eos {eos}) on {device}/{cfg.dtype}; {n_all} prompts, {len(prompts)} within {cfg.max_prompt_tokens} tokens, "
        f"{len(heldout)} held out")
    timings["load_s"] = time.perf_counter() - t_start

    # 2. Reference answers for evaluation (never trained on).
    t0 = time.perf_counter()
    bench = []
    if cfg.eval_prompts:
        bench = [p for p in load_eval_prompts(cfg.eval_prompts, tokenizer) if len(p.ids) <= cfg.max_prompt_tokens * 4]
        bench = bench[: cfg.eval_limit] if cfg.eval_limit > 0 else bench
    sampled_refs = cfg.method == "model"  # a head's acceptance is evaluated greedily (exact without a decoding loop)
    ref_files = [work / "eval_heldout_greedy.npz"] * bool(heldout) + [work / "eval_bench_greedy.npz"] * bool(bench) + [
        work / f"eval_bench_t{cfg.eval_temperature:g}.npz"] * (bool(bench) and sampled_refs)
    if runner_backend and not all(f.exists() for f in ref_files):
        # The references on the runner's eager path (the reference implementation) in eval_dtype.
        from pipeline.distill.fastgen import RunnerGenerator, max_job_len

        ref_len = max_job_len(list(heldout) + bench, cfg.eval_max_new_tokens)
        ref_model = RunnerGenerator.load(src, device, cfg.eval_dtype, rows=min(cfg.gen_rows, 128), max_len=ref_len,
                                         graphs=False)
    elif runner_backend:
        ref_model = None  # every reference is cached
    else:
        ref_model = target if cfg.eval_dtype == cfg.dtype else copy.deepcopy(target).to(DTYPES[cfg.eval_dtype])
    eval_sets: dict[str, tuple[SampleSet, float]] = {}
    kw = dict(cfg=cfg, eos=eos, pad=pad)
    if heldout:
        eval_sets["heldout_greedy"] = (_references(ref_model, heldout, work / "eval_heldout_greedy.npz",
                                                   temperature=0.0, seed=cfg.seed + 101, **kw), 0.0)
    if bench:
        eval_sets["bench_greedy"] = (_references(ref_model, bench, work / "eval_bench_greedy.npz", temperature=0.0,
                                                 seed=cfg.seed + 202, **kw), 0.0)
        t = cfg.eval_temperature
        if sampled_refs:
            eval_sets[f"bench_t{t:g}"] = (_references(ref_model, bench, work / f"eval_bench_t{t:g}.npz", temperature=t,
                                                      seed=cfg.seed + 303, **kw), t)
    if hasattr(ref_model, "release"):
        ref_model.release()
    if ref_model is not target:
        del ref_model
    timings["eval_refs_s"] = time.perf_counter() - t0

    # 3. Distillation data: the target's answers.
    t0 = time.perf_counter()
    gen_seconds = cfg.gen_seconds
    if cfg.wall_seconds:  # leave the training budget and the reserve (plus ~15 s for the last chunk to drain)
        fit = max(0.0, left() - (cfg.train_seconds or 0.0) - cfg.wall_reserve - 15.0)
        gen_seconds = fit if gen_seconds is None else min(gen_seconds, fit)
        say(f"wall clock: {left():.0f} s left; data budget {gen_seconds:.0f} s, training {cfg.train_seconds} s")
    gen_model: Any = target
    gen_stats: list = []
    if runner_backend:
        from pipeline.distill.fastgen import max_job_len

        probe = [p.ids for p in train_prompts[: cfg.gen_rows]]
        gen_model = _runner_generator(cfg, src, device, max_job_len(train_prompts, cfg.max_new_tokens), probe, say)
        timings["gen_setup_s"] = time.perf_counter() - t0
        if gen_seconds is not None:  # the setup (load, compile, check) counts against the data budget
            gen_seconds = max(0.0, gen_seconds - timings["gen_setup_s"])
    data = generate_dataset(
        gen_model, train_prompts, work / "data", chunk_prompts=cfg.chunk_prompts, token_budget=cfg.gen_tokens,
        seconds_budget=gen_seconds, seed=cfg.seed, progress=say, sample_fraction=cfg.sample_fraction,
        sample_temperature=cfg.sample_temperature, max_new_tokens=cfg.max_new_tokens, eos_ids=eos, pad_id=pad,
        batch_tokens=cfg.gen_batch_tokens, max_batch=cfg.gen_max_batch)
    if gen_model is not target:
        gen_stats = gen_model.stats
        gen_model.release()
    del gen_model
    timings["data_s"] = time.perf_counter() - t0
    by_cat: dict[str, int] = {}
    for i in range(len(data)):
        c = data.names[int(data.category[i])]
        by_cat[c] = by_cat.get(c, 0) + int(data.lengths[i] - data.prompt_lens[i])
    data_stats = {"samples": len(data), "answer_tokens": data.response_tokens, "total_tokens": int(len(data.ids)),
                  "sampled_fraction": round(float(data.sampled.mean()), 4), "answer_tokens_by_category": by_cat,
                  "backend": cfg.gen_backend, "generation": gen_stats}
    say(f"data: {len(data)} samples, {data.response_tokens} answer tokens, {len(data.ids)} tokens in all")

    # 4. Draft vocabulary (frequency-ranked over the target's answers).
    counts = token_counts(data, vocab_size)
    use_reduced = 0 < cfg.draft_vocab < vocab_size
    token_ids = draft_vocabulary(counts, cfg.draft_vocab, always=eos) if use_reduced else None
    init = None
    if cfg.init_from:  # continue from a trained drafter: its vocabulary and weights
        from pipeline.distill.drafter import load_draft_model

        init = load_draft_model(cfg.init_from, "cpu", torch.float32)
        token_ids = init.token_ids
        use_reduced = token_ids is not None
        if use_reduced and len(token_ids) != cfg.draft_vocab:
            raise ValueError(f"--init-from {cfg.init_from} has {len(token_ids)} draft tokens, not {cfg.draft_vocab}")
    cov_sizes = sorted({s for s in (1024, 2048, 4096, 8192, 16384, 32768) if s < vocab_size}
                       | {cfg.draft_vocab or vocab_size})
    cov = {"train_answers": coverage(counts, cov_sizes)}
    if token_ids is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[token_ids] = True
        for name, (s, _) in eval_sets.items():
            ans = [s.seq(i)[s.prompt_lens[i]:] for i in range(len(s))]
            n = sum(len(a) for a in ans)
            kept = sum(int(keep[torch.from_numpy(a.astype('int64'))].sum()) for a in ans)
            cov[f"{name}_in_draft_vocab"] = round(kept / max(n, 1), 4)
    say(f"draft vocabulary: {cfg.draft_vocab if use_reduced else vocab_size} tokens; coverage {cov}")
    if cfg.method != "model":  # a feature head (pipeline/distill/heads.py) instead of a draft model
        from pipeline.distill.heads import run_heads

        if cfg.wall_seconds and cfg.train_seconds is not None:
            cfg = dataclasses.replace(cfg, train_seconds=max(10.0, left() - cfg.wall_reserve))
            timings["train_budget_s"] = cfg.train_seconds
            say(f"wall clock: {left():.0f} s left; training budget {cfg.train_seconds:.0f} s")
        meta = {"target": str(src), "config": cfg.to_dict(), "data": data_stats, "coverage": cov,
                "draft_vocab_size": cfg.draft_vocab if use_reduced else vocab_size}
        return run_heads(cfg, target, data, token_ids if cfg.method == "eagle3" else None, eval_sets, out, meta,
                         timings, say)

    # 5. Drafter variants, trained side by side.
    variants = {f"L{n}": build_drafter(target, token_ids, n, cfg.init_layers, cfg.hidden, cfg.seed).to(device)
                for n in cfg.layers}
    if init is not None:
        for v in variants.values():
            v.lm.load_state_dict(init.lm.state_dict())
    t_cost = target_matmul_params(target)
    cost = {n: round(v.matmul_params() / t_cost, 4) for n, v in variants.items()}
    say("variants: " + ", ".join(
        f"{n} ({sum(p.numel() for p in v.parameters()) / 1e6:.1f}M params, cost ratio {cost[n]})"
        for n, v in variants.items()))
    train_cfg = cfg
    if cfg.wall_seconds and cfg.train_seconds is not None:
        # Training gets what is left: about train_seconds when the data used its budget, more when the data ran
        # out early (all prompts answered), less when generation overran.
        budget = max(10.0, left() - cfg.wall_reserve)
        train_cfg = dataclasses.replace(cfg, train_seconds=budget)
        timings["train_budget_s"] = budget
        say(f"wall clock: {left():.0f} s left; training budget {budget:.0f} s")
    trainer = Trainer(train_cfg, target, variants, data, token_ids, work, device)
    resumed = trainer.maybe_resume()
    ac = DTYPES[cfg.dtype] if cfg.dtype != "float32" else None
    during = {k: v for k, v in eval_sets.items() if v[1] == 0.0}

    def eval_all(sets: dict = during) -> dict:
        return {n: evaluate(v, sets, target=target, k=cfg.eval_k, top_k=cfg.draft_top_k, autocast_dtype=ac,
                            seed=cfg.seed) for n, v in variants.items()}

    if not resumed and during:
        trainer.history.append({"step": 0, "tokens_seen": 0, "answer_tokens_seen": 0, "eval": eval_all()})
    t0 = time.perf_counter()
    history = trainer.run(eval_all, progress=say)
    timings["train_s"] = time.perf_counter() - t0

    # 6. Final evaluation (greedy and sampled), selection, export.
    final = eval_all(eval_sets) if eval_sets else {}
    select_on = "heldout_greedy" if "heldout_greedy" in eval_sets else next(iter(eval_sets), None)
    chosen = next(iter(variants))
    if cfg.select == "speedup" and select_on is not None:
        def est(n: str) -> float:
            return final[n][select_on]["tokens_per_pass"] / (1 + cfg.eval_k * cost[n])
        chosen = max(variants, key=est)
    meta = {
        "target": str(src), "config": cfg.to_dict(), "data": data_stats, "coverage": cov,
        "cost_ratio": cost, "final": final, "selected": chosen, "selected_on": select_on,
        "draft_vocab_size": cfg.draft_vocab if use_reduced else vocab_size,
    }
    tok_src = src if src.is_dir() else None
    for n, v in variants.items():
        save_drafter(v, work / "variants" / n, tokenizer_src=tok_src, eos_token_ids=eos, meta={**meta, "variant": n})
    save_drafter(variants[chosen], out, tokenizer_src=tok_src, eos_token_ids=eos, meta={**meta, "variant": chosen},
                 max_shard_size=cfg.extra.get("max_shard_size"))
    timings["total_s"] = time.perf_counter() - t_start
    metrics = {**meta, "history": history, "timings": {k: round(v, 1) for k, v in timings.items()},
               "resumed": resumed, "steps": trainer.step}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2, default=str) + "\n")
    say(f"selected {chosen} (on {select_on}); wrote the drafter to {out}")
    return metrics


def summary_table(metrics: dict[str, Any]) -> str:
    """A plain-text table of the final evaluation (one row per variant and evaluation set)."""
    lines = []
    final = metrics.get("final", {})
    for n, sets in final.items():
        for s, r in sets.items():
            pos = " ".join(f"{x:.2f}" if x is not None else "-" for x in r["accept_by_position"])
            cats = " ".join(f"{c}={v:.2f}" for c, v in r["by_category"].items())
            lines.append(f"{n:4s} {s:16s} tok/pass {r['tokens_per_pass']:.3f}  per-token {r['per_token_accept']:.3f}  "
                         f"by-pos [{pos}]  cost {metrics['cost_ratio'][n]:.3f}  {cats}")
    return "\n".join(lines)
