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

    # 1. Target and prompts.
    pretokenized = all(p is None or str(p).endswith(".npz") for p in (cfg.prompts, cfg.eval_prompts))
    target, tokenizer, src = load_target(cfg.target, device, cfg.dtype, need_tokenizer=not pretokenized)
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
    ref_model = target if cfg.eval_dtype == cfg.dtype else copy.deepcopy(target).to(DTYPES[cfg.eval_dtype])
    eval_sets: dict[str, tuple[SampleSet, float]] = {}
    kw = dict(cfg=cfg, eos=eos, pad=pad)
    if heldout:
        eval_sets["heldout_greedy"] = (_references(ref_model, heldout, work / "eval_heldout_greedy.npz",
                                                   temperature=0.0, seed=cfg.seed + 101, **kw), 0.0)
    if cfg.eval_prompts:
        bench = [p for p in load_eval_prompts(cfg.eval_prompts, tokenizer) if len(p.ids) <= cfg.max_prompt_tokens * 4]
        eval_sets["bench_greedy"] = (_references(ref_model, bench, work / "eval_bench_greedy.npz", temperature=0.0,
                                                 seed=cfg.seed + 202, **kw), 0.0)
        t = cfg.eval_temperature
        eval_sets[f"bench_t{t:g}"] = (_references(ref_model, bench, work / f"eval_bench_t{t:g}.npz", temperature=t,
                                                  seed=cfg.seed + 303, **kw), t)
    if ref_model is not target:
        del ref_model
    timings["eval_refs_s"] = time.perf_counter() - t0

    # 3. Distillation data: the target's answers.
    t0 = time.perf_counter()
    data = generate_dataset(
        target, train_prompts, work / "data", chunk_prompts=cfg.chunk_prompts, token_budget=cfg.gen_tokens,
        seconds_budget=cfg.gen_seconds, seed=cfg.seed, progress=say, sample_fraction=cfg.sample_fraction,
        sample_temperature=cfg.sample_temperature, max_new_tokens=cfg.max_new_tokens, eos_ids=eos, pad_id=pad,
        batch_tokens=cfg.gen_batch_tokens, max_batch=cfg.gen_max_batch)
    timings["data_s"] = time.perf_counter() - t0
    by_cat: dict[str, int] = {}
    for i in range(len(data)):
        c = data.names[int(data.category[i])]
        by_cat[c] = by_cat.get(c, 0) + int(data.lengths[i] - data.prompt_lens[i])
    data_stats = {"samples": len(data), "answer_tokens": data.response_tokens, "total_tokens": int(len(data.ids)),
                  "sampled_fraction": round(float(data.sampled.mean()), 4), "answer_tokens_by_category": by_cat}
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
    cov_sizes = sorted({s for s in (1024, 2048, 4096, 8192, 16384, 32768) if s < vocab_size} | {cfg.draft_vocab or vocab_size})
    cov = {"train_answers": coverage(counts, cov_sizes)}
    if token_ids is not None:
        keep = torch.zeros(vocab_size, dtype=torch.bool)
        keep[token_ids] = True
        for name, (s, _) in eval_sets.items():
            ans = [s.seq(i)[s.prompt_lens[i]:] for i in range(len(s))]
            n = sum(len(a) for a in ans)
            cov[f"{name}_in_draft_vocab"] = round(sum(int(keep[torch.from_numpy(a.astype('int64'))].sum()) for a in ans) / max(n, 1), 4)
    say(f"draft vocabulary: {cfg.draft_vocab if use_reduced else vocab_size} tokens; coverage {cov}")

    # 5. Drafter variants, trained side by side.
    variants = {f"L{n}": build_drafter(target, token_ids, n, cfg.init_layers, cfg.hidden, cfg.seed).to(device)
                for n in cfg.layers}
    if init is not None:
        for v in variants.values():
            v.lm.load_state_dict(init.lm.state_dict())
    t_cost = target_matmul_params(target)
    cost = {n: round(v.matmul_params() / t_cost, 4) for n, v in variants.items()}
    say("variants: " + ", ".join(f"{n} ({sum(p.numel() for p in v.parameters()) / 1e6:.1f}M params, cost ratio {cost[n]})"
                                 for n, v in variants.items()))
    trainer = Trainer(cfg, target, variants, data, token_ids, work, device)
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
