"""`specserve distill`: train a small drafter for a target by distillation on the target's own outputs.

    specserve distill --target PATH --out DIR --prompts PROMPTS.jsonl [--eval-prompts EVAL.jsonl]

Writes a loadable drafter folder to DIR (HF format + draft_vocab.safetensors); re-running the same
command resumes (data shards and the training checkpoint live in DIR/work). See pipeline/distill/.

torch and pipeline/ are imported inside the functions, not at the top: `specserve --help` does not need them.
"""

from __future__ import annotations

import argparse
import json

from specserve.prompts import SPEC_BENCH_DEV


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target model folder or .gguf (default: the demo target)")
    p.add_argument("--out", required=True, help="output folder (the drafter; work files under DIR/work)")
    p.add_argument("--prompts", default=None,
                   help="training prompts: .jsonl(.gz) chats or .npz token ids (python -m ops.distill.build_prompts); "
                        "required unless the target has no tokenizer (then random-token prompts are used)")
    p.add_argument("--eval-prompts", default=None,
                   help="evaluation prompts, evaluated on, never trained on (e.g. the Spec-Bench dev set shipped "
                        f"as {SPEC_BENCH_DEV})")
    p.add_argument("--method", default="model", choices=("model", "eagle3", "medusa"),
                   help="model: a separate draft model; eagle3: an EAGLE-3 head on three of the target's hidden "
                        "states; medusa: Medusa heads on its last hidden state")
    p.add_argument("--head-depth", type=int, default=4, help="eagle3: drafts per pass it trains for")
    p.add_argument("--aux-layers", type=_ints, default=None,
                   help="eagle3: the three target layers whose input states it reads (default 2,n/2,n-3)")
    p.add_argument("--medusa-heads", type=int, default=4, help="medusa: heads (tokens drafted per pass at most)")
    p.add_argument("--medusa-layers", type=int, default=1, help="medusa: residual blocks per head")
    p.add_argument("--eval-limit", type=int, default=0, help="evaluate on the first N evaluation prompts (0: all)")
    p.add_argument("--layers", type=_ints, default=(2,),
                   help="drafter depth; a list (e.g. 1,2,4) trains variants side by side and keeps the best")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="output vocabulary rows (0 = target's full vocabulary)")
    p.add_argument("--init-layers", default="first", choices=("first", "spread", "random"))
    p.add_argument("--init-from", default=None, help="start from this drafter folder (continue training)")
    p.add_argument("--select", default="speedup", choices=("speedup", "first"),
                   help="which variant to export: best held-out tokens-per-pass / (1 + K x cost), or the first listed")
    p.add_argument("--gen-tokens", type=int, default=2_000_000, help="answer tokens to generate with the target")
    p.add_argument("--gen-seconds", type=float, default=None, help="or stop generating after this long")
    p.add_argument("--max-new-tokens", type=int, default=256, help="answer length limit when generating data")
    p.add_argument("--sample-fraction", type=float, default=0.3, help="share of prompts answered by sampling")
    p.add_argument("--gen-batch-tokens", type=int, default=1 << 20,
                   help="rows x (prompt + new tokens) per generate call")
    p.add_argument("--gen-max-batch", type=int, default=1024, help="rows per generate call")
    p.add_argument("--chunk-prompts", type=int, default=4096, help="prompts per data shard")
    p.add_argument("--gen-backend", default="runner", choices=("runner", "hf"),
                   help="runner: this project's runner, continuous batching (default); hf: transformers generate")
    p.add_argument("--gen-rows", type=int, default=512, help="runner: requests decoding together")
    p.add_argument("--gen-refill", type=int, default=0, help="runner: refill once this many slots are free (0: rows/8)")
    p.add_argument("--gen-graphs", default="auto", choices=("auto", "on", "off"),
                   help="runner: captured static decoding steps (auto: on CUDA)")
    p.add_argument("--gen-compile", default="auto", choices=("auto", "on", "off"),
                   help="runner: torch.compile inside the static step (auto: on CUDA)")
    p.add_argument("--gen-attention", default="auto", choices=("auto", "triton", "sdpa"),
                   help="runner: attention of the static step")
    p.add_argument("--wall-seconds", type=float, default=None,
                   help="finish the whole run within this many seconds (data and training budgets shrink to fit)")
    p.add_argument("--wall-reserve", type=float, default=30.0, help="seconds kept for the final evaluation and export")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--train-seconds", type=float, default=None, help="fit the step count to this budget instead")
    p.add_argument("--batch-tokens", type=int, default=65536)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--prompt-weight", type=float, default=0.1)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--ckpt-every", type=int, default=250)
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (heads: matrices only)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine schedule ends at lr x this")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--teacher-topk", type=int, default=32,
                   help="eagle3/medusa: the target's top-k probabilities kept per position (renormalised)")
    p.add_argument("--cache-gb", type=float, default=None,
                   help="eagle3/medusa: GiB of cached target features on the training device (default: CUDA's "
                        "free memory less 24 GiB; 8 on a CPU)")
    p.add_argument("--host-cache-gb", type=float, default=48.0,
                   help="eagle3/medusa: GiB more in pinned host memory (CUDA); batches beyond both are recomputed")
    p.add_argument("--log-every", type=int, default=25, help="eagle3/medusa: steps between reads of the loss")
    p.add_argument("--eval-max-new-tokens", type=int, default=128)
    p.add_argument("--heldout-prompts", type=int, default=256)
    p.add_argument("-k", "--eval-k", type=int, default=4, help="K for the acceptance figures")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                   help="default: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the metrics as JSON at the end")


def _tristate(v: str) -> bool | None:
    return {"auto": None, "on": True, "off": False}[v]


def config_from_args(args: argparse.Namespace):  # -> DistillConfig
    import torch

    from pipeline.distill.config import DistillConfig

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    return DistillConfig(
        target=args.target, out=args.out, prompts=args.prompts, eval_prompts=args.eval_prompts,
        heldout_prompts=args.heldout_prompts, layers=args.layers, init_layers=args.init_layers,
        init_from=args.init_from,
        draft_vocab=args.draft_vocab, select=args.select, gen_tokens=args.gen_tokens, gen_seconds=args.gen_seconds,
        max_new_tokens=args.max_new_tokens, sample_fraction=args.sample_fraction,
        gen_batch_tokens=args.gen_batch_tokens, gen_max_batch=args.gen_max_batch, chunk_prompts=args.chunk_prompts,
        steps=args.steps, train_seconds=args.train_seconds, batch_tokens=args.batch_tokens,
        max_seq_len=args.max_seq_len, lr=args.lr, warmup_steps=args.warmup_steps, prompt_weight=args.prompt_weight,
        eval_every=args.eval_every, ckpt_every=args.ckpt_every, eval_k=args.eval_k,
        eval_max_new_tokens=args.eval_max_new_tokens, device=device, dtype=dtype, eval_dtype="float32", seed=args.seed,
        gen_backend=args.gen_backend, gen_rows=args.gen_rows, gen_refill=args.gen_refill,
        gen_graphs=_tristate(args.gen_graphs), gen_compile=_tristate(args.gen_compile),
        gen_attention=args.gen_attention,
        wall_seconds=args.wall_seconds, wall_reserve=args.wall_reserve,
        method=args.method, head_depth=args.head_depth, aux_layers=args.aux_layers or None,
        medusa_heads=args.medusa_heads, medusa_layers=args.medusa_layers, eval_limit=args.eval_limit,
        weight_decay=args.weight_decay, min_lr_ratio=args.min_lr_ratio, grad_clip=args.grad_clip,
        teacher_topk=args.teacher_topk, cache_gb=args.cache_gb, host_cache_gb=args.host_cache_gb,
        log_every=args.log_every,
    )


def run(args: argparse.Namespace) -> int:
    from pipeline.distill.heads import head_summary
    from pipeline.distill.run import distill, summary_table

    metrics = distill(config_from_args(args))
    print(summary_table(metrics) if args.method == "model" else head_summary(metrics))
    if args.json:
        print(json.dumps(metrics, default=str))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("distill", help="train a drafter for a target by distillation",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=run)
