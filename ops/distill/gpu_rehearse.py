"""Rehearse the runner generation backend on the GPU before the main call.

    python -m ops.distill.gpu_rehearse --config TARGET_CONFIG.json --rows 512 --seconds 30 --out $OUT

A random-weight target of the demo's exact shape (bf16): the static decoding step (GraphCausalLM: CUDA graphs,
torch.compile, the configured attention) is checked against the eager runner, then a throughput probe runs
the continuous batcher for `--seconds` on prompts of realistic lengths (a lognormal around 200 tokens, up to
1536; 30% sampled at T=0.7, 256 new tokens: random weights rarely say EOS, so answers run long). It writes
rehearsal.json to --out. It also fills torch.compile's on-disk cache (/tmp) for the same shapes, which the
main call on the same machine then reuses.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from pipeline.distill.fastgen import Job, RunnerGenerator


def probe(gen, seconds: float, rows: int, max_new: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    vocab = 49152
    t0 = time.perf_counter()
    made = [0]

    def source():
        if time.perf_counter() - t0 >= seconds:
            return None
        lens = np.clip(rng.lognormal(np.log(150), 0.8, size=rows), 8, 1536).astype(int)
        jobs = []
        for n in lens:
            made[0] += 1
            temp = 0.7 if rng.random() < 0.3 else 0.0
            jobs.append(Job(rng.integers(100, vocab - 100, size=int(n)).tolist(), temp, made[0]))
        return jobs

    b = gen.batcher([2])
    b.run(source, max_new, lambda job, ans: None)
    dt = time.perf_counter() - t0
    st = b.stats.summary()
    st.update(wall_s=round(dt, 1), tok_per_s=round(b.stats.decode_tokens / dt), jobs_made=made[0])
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the target's config.json")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--folder", default="/tmp/ss/rehearse_target")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__, "transformers": transformers.__version__,
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}

    def save() -> None:
        result["total_s"] = round(time.perf_counter() - t_start, 1)
        (out / "rehearsal.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result), flush=True)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = json.loads(Path(args.config).read_text())
    for k in ("transformers_version", "quantization_config", "dtype", "torch_dtype"):
        cfg.pop(k, None)
    folder = Path(args.folder)
    if not (folder / "config.json").exists():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.bfloat16)
        model.save_pretrained(folder)
        del model
    t0 = time.perf_counter()
    gen = RunnerGenerator.load(folder, device, "bfloat16", rows=args.rows, max_len=2304, attention=args.attention)
    result["static"] = gen.static
    result["attention"] = getattr(gen.model, "attention", None)  # GraphCausalLM's resolved attention kind
    g = torch.Generator().manual_seed(1)
    check = gen.self_check(torch.randint(100, 40000, (args.rows, 40), generator=g).tolist())
    result["self_check"] = check
    result["setup_s"] = round(time.perf_counter() - t0, 1)  # load + compile + first capture + the check
    save()
    try:
        result["probe"] = probe(gen, args.seconds, args.rows, args.max_new_tokens)
    except Exception as e:  # noqa: BLE001 - report it; the main call falls back on its own
        result["probe_error"] = repr(e)
    save()


if __name__ == "__main__":
    main()
