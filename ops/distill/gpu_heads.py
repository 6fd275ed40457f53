"""The GPU run that trains feature heads for the demo target: an EAGLE-3 head, then Medusa heads on the same data if
the wall clock allows, with `specserve distill --method eagle3|medusa`; packs both for the trip back (the device
tool returns at most 8 files of 16 MiB from $OUT).

    python -m ops.distill.gpu_heads --pack-to $OUT --wall-seconds 520 [specserve distill flags...]

The data (the target's own answers, written by the runner's fast generator from prompts without Spec-Bench text:
`ops/distill/build_prompts.py --check-eval` refuses any 8-gram shared with it) and the evaluation references are
made once, by the EAGLE-3 run, and reused by the Medusa run (its shards and references are linked, not
regenerated). `ops/distill/gpu_clean_retrain.sh main` runs this module with TRAINER=ops.distill.gpu_heads (the
GGUF reassembly, the prompts); `--dry-run` settings for the CPU: see docs/benchmarks.md, "Feature heads".

Writes to --pack-to: metrics.json ({"eagle3": ..., "medusa": ...}: losses, learning curves, tokens per pass by
position and category), summary.txt, and heads.tar.partNN (folders eagle3/ and medusa/, bf16 weights; reassemble
with `cat heads.tar.part* | tar -x`).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import tarfile
import time
import traceback
from pathlib import Path

from specserve.cmd_distill import add_arguments, config_from_args


def pack(folders: dict[str, Path], dest: Path, part_mb: float = 15.0) -> list[str]:
    """Tar each head folder's files (not its work/) and split the archive into parts."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, folder in folders.items():
            for f in sorted(folder.iterdir()):
                if f.is_file() and not f.name.endswith(".tmp"):
                    tar.add(f, arcname=f"{name}/{f.name}")
    data, step, names = buf.getvalue(), int(part_mb * 2**20), []
    for i in range(0, len(data), step):
        names.append(f"heads.tar.part{i // step:02d}")
        (dest / names[-1]).write_bytes(data[i : i + step])
    return names


def _link_data(src_work: Path, dst_work: Path) -> None:
    """The second run reads the first run's data shards and evaluation references."""
    dst_work.mkdir(parents=True, exist_ok=True)
    if not (dst_work / "data").exists():
        os.symlink((src_work / "data").resolve(), dst_work / "data")
    for f in src_work.glob("eval_*.npz"):
        if not (dst_work / f.name).exists():
            os.symlink(f.resolve(), dst_work / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--pack-to", required=True)
    ap.add_argument("--medusa-seconds", type=float, default=60.0,
                    help="Medusa's training budget (0: no Medusa); it runs if this plus --medusa-margin is left")
    ap.add_argument("--medusa-margin", type=float, default=45.0,
                    help="seconds Medusa's setup and evaluation need")
    args = ap.parse_args()
    t_process = time.perf_counter()
    import torch  # imported after t_process: the time counts against --wall-seconds

    from pipeline.distill.heads import head_summary
    from pipeline.distill.run import distill

    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
    cfg = config_from_args(args)
    cfg = dataclasses.replace(cfg, method="eagle3")
    medusa_need = args.medusa_seconds + args.medusa_margin if args.medusa_seconds > 0 else 0.0
    if cfg.wall_seconds:  # the EAGLE-3 run leaves Medusa its budget
        cfg.wall_seconds -= time.perf_counter() - t_process + medusa_need
    dest = Path(args.pack_to)
    dest.mkdir(parents=True, exist_ok=True)
    out = Path(cfg.out)
    results, folders = {}, {}

    def left() -> float:
        return (args.wall_seconds - (time.perf_counter() - t_process)) if args.wall_seconds else float("inf")

    try:
        results["eagle3"] = distill(cfg)
        folders["eagle3"] = out
        if medusa_need and left() >= args.medusa_margin + 10:  # a shorter training if the first run overran
            m_out = out.parent / (out.name + "_medusa")
            _link_data(out / "work", m_out / "work")
            # Medusa's heads write the whole vocabulary: smaller batches keep their logits within memory.
            m_cfg = dataclasses.replace(cfg, method="medusa", out=str(m_out), gen_seconds=0.0, gen_graphs=False,
                                        gen_compile=False,
                                        train_seconds=min(args.medusa_seconds, left() - args.medusa_margin),
                                        batch_tokens=max(cfg.max_seq_len, min(cfg.batch_tokens, 8192)),
                                        wall_seconds=left() if args.wall_seconds else None,
                                        wall_reserve=min(cfg.wall_reserve, 30.0))
            results["medusa"] = distill(m_cfg)
            folders["medusa"] = m_out
        else:
            print(f"medusa skipped: {left():.0f} s left", flush=True)
    except BaseException:
        (dest / "error.txt").write_text(traceback.format_exc())
        if not folders:
            raise
    packed = pack(folders, dest)
    (dest / "metrics.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    text = "\n".join(head_summary(m) for m in results.values())
    text += "\n\n" + "\n".join(
        f"{name}: steps {m['steps']}, head params {m['head_params']}, cost ratio {m['cost_ratio']}, "
        f"data {m['data']['answer_tokens']} answer tokens, timings {m['timings']}" for name, m in results.items())
    text += f"\npacked {packed}\nwall {time.perf_counter() - t_process:.0f} s\n"
    (dest / "summary.txt").write_text(text)
    print(text, flush=True)


if __name__ == "__main__":
    main()
