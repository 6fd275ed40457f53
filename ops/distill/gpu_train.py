"""The GPU run behind the shipped drafter: `specserve distill` with the same flags, plus packing for the trip
back (the device tool returns at most 8 files of 16 MiB from $OUT). `ops/distill/gpu_clean_retrain.sh main`
runs it for the clean retrain (GGUF reassembly, prompts, the flags); `--wall-seconds` counts from this
process's start.

    python -m ops.distill.gpu_train --pack-to $OUT [specserve distill flags...]

Writes to --pack-to: metrics.json, summary.txt, and drafter.tar.partNN (the exported drafter folder of
the selected variant, plus further variants while the total stays under --pack-mb). Reassemble with
`cat drafter.tar.part* | tar -x`.
"""

from __future__ import annotations

import argparse
import io
import json
import tarfile
import time
import traceback
from pathlib import Path

from specserve.cmd_distill import add_arguments, config_from_args


def pack(out: Path, dest: Path, pack_mb: float, part_mb: float = 15.0) -> list[str]:
    """Tar the drafter folder (and variants while they fit) and split it into parts."""
    dest.mkdir(parents=True, exist_ok=True)
    metrics = json.loads((out / "metrics.json").read_text())
    chosen = metrics["selected"]
    folders = [("drafter", out)]
    variants = sorted((out / "work" / "variants").iterdir()) if (out / "work" / "variants").exists() else []
    budget = pack_mb * 2**20 - sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    for v in variants:
        if v.name == chosen:
            continue
        size = sum(f.stat().st_size for f in v.iterdir())
        if size <= budget:
            folders.append((f"variants/{v.name}", v))
            budget -= size
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for arc, folder in folders:
            for f in sorted(folder.iterdir()):
                if f.is_file() and f.name != "metrics.json" and not f.name.endswith(".tmp"):
                    tar.add(f, arcname=f"{arc}/{f.name}")
    data = buf.getvalue()
    step = int(part_mb * 2**20)
    names = []
    for i in range(0, len(data), step):
        name = f"drafter.tar.part{i // step:02d}"
        (dest / name).write_bytes(data[i : i + step])
        names.append(name)
    (dest / "metrics.json").write_text((out / "metrics.json").read_text())
    return [a for a, _ in folders] + names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--pack-to", required=True)
    ap.add_argument("--pack-mb", type=float, default=50.0)
    args = ap.parse_args()
    t_process = time.perf_counter()
    # Imported after t_process: their time counts against --wall-seconds.
    import torch

    from pipeline.distill.run import distill, summary_table

    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
    t0 = time.time()
    cfg = config_from_args(args)
    if cfg.wall_seconds:  # the limit counts from this process's start: imports are spent already
        cfg.wall_seconds -= time.perf_counter() - t_process
    dest = Path(args.pack_to)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        metrics = distill(cfg)
    except BaseException:
        (dest / "error.txt").write_text(traceback.format_exc())
        raise
    table = summary_table(metrics)
    packed = pack(Path(cfg.out), dest, args.pack_mb)
    curve = "\n".join(
        f"step {h['step']:5d} tokens {h['tokens_seen']:>10d} answer_tokens {h['answer_tokens_seen']:>10d}  "
        + "  ".join(
            f"{n}:" + ",".join(f"{s}={r['tokens_per_pass']:.3f}" for s, r in ev.items()) for n, ev in h["eval"].items())
        for h in metrics["history"])
    text = (f"{table}\n\ncurve:\n{curve}\n\ncoverage {metrics['coverage']}\ncost {metrics['cost_ratio']}\n"
            f"data {metrics['data']}\ntimings {metrics['timings']}\nselected {metrics['selected']}\npacked {packed}\n"
            f"steps {metrics['steps']}\n"
            f"wall {time.time() - t0:.0f} s\n")
    (dest / "summary.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
