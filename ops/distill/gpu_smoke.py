"""Rehearsal on the GPU machine before the real run: a random-weight target of the demo's exact shape.

    python -m ops.distill.gpu_smoke TARGET_CONFIG.json PROMPTS.npz EVAL.npz OUT_DIR

1. generate() throughput at several batch shapes (ms per decoding step, tokens/s) -> sizes the real run;
2. the whole `distill` pipeline on real prompt token ids (long RAG/summaries, follow-ups, Spec-Bench
   evaluation prompts), tiny budgets, three variants: every code path on CUDA/bf16 before the real run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import transformers

from pipeline.distill.config import DistillConfig
from pipeline.distill.generate import generate_answers
from pipeline.distill.run import distill, summary_table


def main() -> None:
    config_path, prompts, eval_prompts, out = sys.argv[1:5]
    print(f"torch {torch.__version__} transformers {transformers.__version__} {torch.cuda.get_device_name()}",
          flush=True)
    cfg_dict = json.loads(Path(config_path).read_text())
    cfg_dict.pop("transformers_version", None)
    config = transformers.LlamaConfig(**cfg_dict)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    folder = Path("/tmp/rand_target")
    model.save_pretrained(folder)
    model = model.to("cuda", torch.bfloat16).eval()

    probes = []
    for batch, plen, new in ((1024, 64, 32), (2048, 64, 32), (4096, 64, 32), (768, 1000, 32)):
        ids = torch.randint(100, 40000, (batch, plen)).tolist()
        kw = dict(max_new_tokens=new, temperature=0.0, eos_ids=[49151], pad_id=2, batch_tokens=1 << 30,
                  max_batch=batch, seed=0)
        generate_answers(model, ids[:8], **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        generate_answers(model, ids, **kw)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        probes.append({"batch": batch, "prompt": plen, "new": new, "s": round(dt, 2),
                       "ms_per_step": round(1000 * dt / new, 1), "tok_per_s": round(batch * new / dt)})
        print("generate probe", probes[-1], f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    del model
    torch.cuda.empty_cache()
    best = max((p for p in probes if p["prompt"] == 64), key=lambda p: p["tok_per_s"])
    Path(out, "gen_batch").write_text(f"{best['batch']}\n")  # read by the real run's command line

    cfg = DistillConfig(
        target=str(folder), out=f"{out}/smoke", prompts=prompts, eval_prompts=eval_prompts, heldout_prompts=64,
        layers=(1, 2, 3), draft_vocab=8192, gen_tokens=40_000, chunk_prompts=512, max_new_tokens=48,
        gen_batch_tokens=1 << 21, gen_max_batch=4096, train_seconds=25, batch_tokens=65536, eval_every=40,
        ckpt_every=40, eval_max_new_tokens=32, warmup_steps=20, device="cuda", dtype="bfloat16",
    )
    m = distill(cfg)
    print(summary_table(m))
    print("timings", m["timings"], "steps", m["steps"], "data", m["data"], flush=True)
    summary = {"probes": probes, "timings": m["timings"], "steps": m["steps"], "data": m["data"],
               "cost": m["cost_ratio"]}
    Path(out, "smoke_summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
