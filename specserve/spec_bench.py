"""Spec-Bench style benchmark on this machine: this engine (target-only and speculative) against Hugging
Face `generate` and Hugging Face assisted generation with the same drafter, greedy, batch 1.

Every method runs on the same prompts in the same process, one after another per prompt, so machine
noise hits all of them alike. The speculative outputs are checked token for token against target-only
decoding (greedy speculation must not change a single token).
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM

from pipeline.adaptive import AdaptiveK
from pipeline.config import EngineConfig, SamplingParams, SpecParams, TreeConfig, is_head
from pipeline.distill.drafter import load_hf_assistant
from pipeline.drafters import build_drafter, draft_model_spec
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model
from pipeline.models.store import resolve
from specserve.prompts import Sample


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (torch {torch.__version__})"
    return f"{cpu}, {torch.get_num_threads()} torch threads (torch {torch.__version__})"


def run_bench(
    target: str | None,
    draft: str,
    prompts: list[Sample],
    methods: list[str],
    k: int,
    max_tokens: int,
    device: str = "cpu",
    progress: bool = True,
    dtype: str = "float32",
    adaptive_k: bool = False,
    draft_weights: str = "model",  # "fp8": the draft model's graph path streams float8 weights (CUDA only)
    tree: TreeConfig | None = None,  # engine-spec drafts token trees of this shape (`EngineConfig.tree`)
) -> dict[str, Any]:
    target_path = str(resolve(target))
    torch_dtype = getattr(torch, dtype)
    model, tok = load_model(target_path, device=device, dtype=dtype)
    config = EngineConfig(max_batch_size=1, max_seq_len=4096, device=device, dtype=dtype, draft_weights=draft_weights,
                          tree=tree)
    drafter = build_drafter(draft, model.info, tok, device, dtype, target=model)
    policy = AdaptiveK(max_k=k) if adaptive_k else None
    engine = SpeculativeEngine(model, tok, drafter, config, k_policy=policy)  # refuses bad options before HF loads
    drafter = engine.drafter  # as the engine drafts with it (a tree drafter around a draft model)
    draft_model_path = draft_model_spec(draft)
    if is_head(draft) and "hf-assisted" in methods:  # transformers has no assisted generation with a feature head
        methods = [m for m in methods if m != "hf-assisted"]
        print(f"[{draft}: a feature head; Hugging Face assisted generation cannot run it, hf-assisted skipped]")
    if draft_model_path is None:
        hf_assist: dict[str, Any] = {"prompt_lookup_num_tokens": k}
    else:  # HF assisted generation with the same draft model (for a hybrid: its model part)
        hf_assist = {"assistant_model": _hf_assistant(str(resolve(draft_model_path)), k, device, torch_dtype)}
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch_dtype).to(device).eval() if any(
        m.startswith("hf") for m in methods
    ) else None
    params = SamplingParams(max_tokens=max_tokens, seed=0)
    eos = list(model.info.eos_token_ids)

    def run_engine(ids: list[int], use_draft: bool) -> tuple[list[int], dict]:
        engine.drafter = drafter if use_draft else None
        r = engine.generate(ids, params, SpecParams(num_draft_tokens=k))
        return r.token_ids, r.stats

    def run_hf(ids: list[int], assisted: bool) -> tuple[list[int], dict]:
        extra = hf_assist if assisted else {}
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids], device=device), max_new_tokens=max_tokens, do_sample=False,
                              eos_token_id=eos, pad_token_id=eos[0], **extra)
        return out[0, len(ids):].tolist(), {}

    runners: dict[str, Callable[[list[int]], tuple[list[int], dict]]] = {
        "engine-target": lambda ids: run_engine(ids, False),
        "engine-spec": lambda ids: run_engine(ids, True),
        "hf-generate": lambda ids: run_hf(ids, False),
        "hf-assisted": lambda ids: run_hf(ids, True),
    }
    unknown = set(methods) - set(runners)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {sorted(runners)}")

    encoded = [engine.encode(s.prompt, chat=True) for s in prompts]
    engine.warmup(k)  # CUDA: every step shape captured now, as a server does before traffic (CPU: nothing)
    runners[methods[0]](encoded[0][:16])  # warm-up (allocations, first-call overheads)
    records = []
    bar = _progress(len(prompts) * len(methods), progress)
    for sample, ids in zip(prompts, encoded):
        outputs = {}
        for method in methods:
            t0 = time.perf_counter()
            out, stats = runners[method](ids)
            dt = time.perf_counter() - t0
            outputs[method] = out
            records.append({
                "question_id": sample.question_id, "category": sample.category, "method": method,
                "prompt_tokens": len(ids), "tokens": len(out), "seconds": dt,
                "target_passes": stats.get("target_passes"), "accepted": stats.get("accepted"),
                "drafted": stats.get("drafted"), "accepted_at": stats.get("acceptance_by_position"),
            })
            bar.update(1)
        if "engine-target" in outputs and "engine-spec" in outputs:
            for r in records[-len(methods):]:
                r["spec_equals_target"] = outputs["engine-spec"] == outputs["engine-target"]
    bar.close()
    return {
        "machine": machine(), "date": time.strftime("%Y-%m-%d"), "target": target_path, "draft": draft,
        "k": k, "tree": None if tree is None else {"branching": list(tree.branching), "max_nodes": tree.max_nodes,
                                                   "dynamic": tree.dynamic,
                                                   "paths": tree.paths and [list(p) for p in tree.paths]},
        "adaptive_k": engine.k_policy is not None, "dtype": dtype, "draft_weights": draft_weights,
        "max_tokens": max_tokens,
        "methods": methods, "records": records,
        "summary": summarize(records, methods),
    }


def _hf_assistant(path: str, k: int, device: str, dtype: torch.dtype = torch.float32):
    # A distilled drafter may have a reduced draft vocabulary; this wrapper maps it to target ids
    # (plain AutoModelForCausalLM for any other folder).
    m = load_hf_assistant(path, device=device, dtype=dtype)
    m.generation_config.num_assistant_tokens = k
    m.generation_config.num_assistant_tokens_schedule = "constant"
    m.generation_config.assistant_confidence_threshold = 0.0
    return m


def summarize(records: list[dict], methods: list[str]) -> dict[str, Any]:
    """Per method and category: tokens/s, and for the engine the mean tokens per target pass."""
    out: dict[str, Any] = {}
    cats = sorted({r["category"] for r in records}) + ["overall"]
    for m in methods:
        out[m] = {}
        for c in cats:
            rows = [r for r in records if r["method"] == m and (c == "overall" or r["category"] == c)]
            tokens, secs = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
            passes = sum(r["target_passes"] or 0 for r in rows)
            accepted = sum(r["accepted"] or 0 for r in rows)
            out[m][c] = {
                "tokens_per_s": tokens / secs if secs else 0.0,
                "mean_accepted_tokens": (accepted + passes) / passes if passes else None,
                "tokens": tokens,
            }
    equal = [r["spec_equals_target"] for r in records if "spec_equals_target" in r and r["method"] == methods[0]]
    out["spec_equals_target"] = f"{sum(equal)}/{len(equal)}" if equal else None
    return out


def markdown_table(result: dict[str, Any]) -> str:
    summary, methods = result["summary"], result["methods"]
    cats = [c for c in summary[methods[0]]]
    head = "| method | " + " | ".join(cats) + " |\n|---|" + "---|" * len(cats) + "\n"
    rows = []
    for m in methods:
        cells = []
        for c in cats:
            s = summary[m][c]
            cell = f"{s['tokens_per_s']:.1f}"
            if s["mean_accepted_tokens"] is not None and m == "engine-spec":
                cell += f" ({s['mean_accepted_tokens']:.2f})"
            cells.append(cell)
        rows.append(f"| {m} | " + " | ".join(cells) + " |")
    base = summary.get("engine-target", {}).get("overall", {}).get("tokens_per_s")
    notes = []
    if base:
        for m in methods:
            notes.append(f"{m}: {summary[m]['overall']['tokens_per_s'] / base:.2f}x of engine-target")
    return (
        f"Machine: {result['machine']}; date {result['date']}; drafter `{result['draft']}`, K={result['k']}"
        f"{' (adaptive, 0..K per step)' if result.get('adaptive_k') else ''}{_tree_words(result.get('tree'))}, "
        f"{result.get('dtype', 'float32')}, "
        f"greedy, max_tokens={result['max_tokens']}, batch 1.\n"
        "Cells: tokens/s (engine-spec: mean tokens per target pass, bonus included, in brackets).\n\n"
        + head + "\n".join(rows) + "\n\n" + "; ".join(notes)
        + f"\n\nSpeculative output identical to target-only: {summary.get('spec_equals_target')} prompts.\n"
    )


def _tree_words(tree: dict | None) -> str:
    if tree is None:
        return ""
    if tree.get("paths"):
        return f", token tree of {len(tree['paths'])} nodes from a tree file (K caps its depth)"
    budget = f", budget {tree['max_nodes']}" if tree["max_nodes"] else ""
    return f", token tree {','.join(map(str, tree['branching']))}{budget} (K caps its depth)"


def plot(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib  # optional (the serve extra): the caller skips the plot without it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, methods = result["summary"], result["methods"]
    cats = list(summary[methods[0]])
    fig, ax = plt.subplots(figsize=(1.6 * len(cats) + 2, 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax.bar([x + i * width for x in range(len(cats))], [summary[m][c]["tokens_per_s"] for c in cats], width, label=m)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(cats))], cats, rotation=20)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"Spec-Bench dev, greedy, K={result['k']}, drafter {result['draft']}\n{result['machine']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _progress(total: int, enabled: bool) -> tqdm:
    return tqdm(total=total, disable=not enabled, desc="bench", unit="run")
