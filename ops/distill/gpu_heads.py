"""The GPU run that trains feature heads for the demo target: an EAGLE-3 head, then Medusa heads on the same data if
the wall clock allows, with `specserve distill --method eagle3|medusa`; packs both for the trip back (the device
tool returns at most 8 files of 16 MiB from $OUT).

    python -m ops.distill.gpu_heads --pack-to $OUT --wall-seconds 520 [--reuse-data DIR] [specserve distill flags...]

The data (the target's own answers, written by the runner's fast generator from prompts without Spec-Bench text:
`ops/distill/build_prompts.py --check-eval` refuses any 8-gram shared with it) and the evaluation references are
made once, by the EAGLE-3 run, and reused by the Medusa run (its shards and references are linked, not
regenerated). `--reuse-data DIR` takes them from an earlier call instead: DIR holds that call's
`data.tar.xz.partNN` (the same prompts, seed, --heldout-prompts, --chunk-prompts and evaluation flags give the same
shards); no answer is generated then, and the whole budget goes to training. `ops/distill/gpu_clean_retrain.sh
main` runs this module with TRAINER=ops.distill.gpu_heads (the GGUF reassembly, the prompts, the carried data
parts); `--dry-run` settings for the CPU: see docs/benchmarks.md, "Feature heads".

Writes to --pack-to, as it goes (a late crash leaves what was done): heads.tar.partNN (folders eagle3/ and
medusa/: bf16 weights, each head's metrics.json and curves.png; `cat heads.tar.part* | tar -x`), metrics.json
({"eagle3": ..., "medusa": ...}: losses, learning curves, tokens per pass by position and category, and the
summary), curves.png (both heads), and, when this call generated the answers, data.tar.xz.partNN (the answers and
the evaluation references, token ids as uint16, xz; the input of a later call's --reuse-data).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import io
import json
import os
import signal
import tarfile
import threading
import time
import traceback
from pathlib import Path

from pipeline.distill.archive import pack_data, split_parts, unpack_data
from specserve.cmd_distill import add_arguments, config_from_args

PART_BYTES = 15 * 2**20  # under the device tool's 16 MiB per returned file


def _split(data: bytes, dest: Path, stem: str) -> list[str]:
    return split_parts(data, dest, stem, PART_BYTES)


_PACKING = threading.Lock()  # the periodic packer and the main thread write the same parts


def pack(folders: dict[str, Path], dest: Path) -> list[str]:
    """Tar each head folder's files (not its work/) and split the archive into parts."""
    with _PACKING:
        return _pack(folders, dest)


def _pack(folders: dict[str, Path], dest: Path) -> list[str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, folder in folders.items():
            for f in sorted(folder.iterdir()):
                if f.is_file() and not f.name.endswith(".tmp"):
                    tar.add(f, arcname=f"{name}/{f.name}")
    for old in dest.glob("heads.tar.part*"):
        old.unlink()
    return _split(buf.getvalue(), dest, "heads.tar")


def _link_data(src_work: Path, dst_work: Path) -> None:
    """The second run reads the first run's data shards and evaluation references."""
    dst_work.mkdir(parents=True, exist_ok=True)
    if not (dst_work / "data").exists():
        os.symlink((src_work / "data").resolve(), dst_work / "data")
    for f in src_work.glob("eval_*.npz"):
        if not (dst_work / f.name).exists():
            os.symlink(f.resolve(), dst_work / f.name)


def plot_both(results: dict[str, dict], path: Path) -> None:
    """The heads' training loss and held-out tokens per pass, one row per head, in one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(len(results), 2, figsize=(11, 3.6 * len(results)), squeeze=False)
    for (name, m), (ax1, ax2) in zip(results.items(), axes):
        log = m.get("train_log") or []
        ax1.plot([r["elapsed"] for r in log], [r["loss"] for r in log])
        ax1.set_xlabel("training seconds")
        ax1.set_ylabel(f"{name}: loss (mean over depths)")
        for s in sorted({s for h in m.get("history", []) for s in h.get("eval", {})}):
            pts = [(h["elapsed"], h["eval"][s]["tokens_per_pass"]) for h in m["history"] if s in h.get("eval", {})]
            ax2.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=s)
        ax2.set_xlabel("training seconds")
        ax2.set_ylabel(f"{name}: tokens per pass (K={m.get('eval_k', 4)})")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _finished_metrics(out: Path) -> dict | None:  # what a head folder holds after a crash (exported as it went)
    f = out / "metrics.json"
    return json.loads(f.read_text()) if f.exists() else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--pack-to", required=True)
    ap.add_argument("--reuse-data", default=None,
                    help="a folder with an earlier call's data.tar.xz.partNN: train on those answers (no generation)")
    ap.add_argument("--medusa-seconds", type=float, default=60.0,
                    help="Medusa's training budget (0: no Medusa); it runs if this plus --medusa-margin is left")
    ap.add_argument("--medusa-margin", type=float, default=45.0,
                    help="seconds Medusa's setup and evaluation need")
    ap.add_argument("--medusa-batch-tokens", type=int, default=8192,
                    help="Medusa's batch (its heads' logits span the whole vocabulary)")
    args = ap.parse_args()
    t_process = time.perf_counter()
    import torch  # imported after t_process: the time counts against --wall-seconds

    from pipeline.distill.heads import head_summary
    from pipeline.distill.run import distill

    print(f"torch {torch.__version__}, cuda {torch.cuda.is_available()}, "
          f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}", flush=True)
    cfg = config_from_args(args)
    cfg = dataclasses.replace(cfg, method="eagle3")
    dest = Path(args.pack_to)
    dest.mkdir(parents=True, exist_ok=True)
    out = Path(cfg.out)
    reused = 0
    if args.reuse_data:
        t0 = time.perf_counter()
        reused = unpack_data(Path(args.reuse_data), out / "work")
        print(f"reused data: {reused} files from {args.reuse_data} ({time.perf_counter() - t0:.1f} s)", flush=True)
        if reused:  # no generation: no static step to build either
            cfg = dataclasses.replace(cfg, gen_seconds=0.0, gen_graphs=False, gen_compile=False)
    medusa_need = args.medusa_seconds + args.medusa_margin if args.medusa_seconds > 0 else 0.0
    if cfg.wall_seconds:  # the EAGLE-3 run leaves Medusa its budget
        cfg.wall_seconds -= time.perf_counter() - t_process + medusa_need
    results, folders, errors = {}, {}, []
    packer: dict = {}

    def left() -> float:
        return (args.wall_seconds - (time.perf_counter() - t_process)) if args.wall_seconds else float("inf")

    def write_metrics() -> None:
        text = "\n".join(head_summary(m) for m in results.values())
        text += "\n" + "\n".join(
            f"{name}: steps {m.get('steps')}, epochs {m.get('epochs')}, head params {m.get('head_params')}, cost "
            f"ratio {m.get('cost_ratio')}, data {m.get('data', {}).get('answer_tokens')} answer tokens, timings "
            f"{m.get('timings')}, cache {m.get('cache')}" for name, m in results.items())
        text += f"\nwall {time.perf_counter() - t_process:.0f} s; errors: {len(errors)}"
        (dest / "metrics.json").write_text(json.dumps({**results, "summary": text.splitlines(), "errors": errors,
                                                       "reused_data_files": reused}, indent=2, default=str) + "\n")
        if results:
            try:
                plot_both(results, dest / "curves.png")
            except Exception as e:  # noqa: BLE001 - a figure never stops the run
                print(f"curves.png not written: {e!r}", flush=True)
        print(text, flush=True)

    def pack_in_background() -> None:
        def job() -> None:
            try:
                t0 = time.perf_counter()
                packer["parts"] = pack_data(out / "work", dest, PART_BYTES)
                packer["s"] = time.perf_counter() - t0
            except BaseException:  # noqa: BLE001 - reported in metrics.json
                packer["error"] = traceback.format_exc()
        packer["thread"] = threading.Thread(target=job, daemon=True)
        packer["thread"].start()

    m_out = out.parent / (out.name + "_medusa")
    stop = threading.Event()

    def keep_packing() -> None:  # the heads exported so far reach $OUT even if this process is killed
        while not stop.wait(60.0):
            try:
                pack({n: f for n, f in (("eagle3", out), ("medusa", m_out)) if (f / "config.json").exists()}, dest)
            except Exception as e:  # noqa: BLE001 - the next round or the final pack
                print(f"periodic pack failed: {e!r}", flush=True)

    threading.Thread(target=keep_packing, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit("SIGTERM")))
    try:
        results["eagle3"] = distill(cfg)
    except BaseException:
        errors.append(traceback.format_exc())
        print(errors[-1], flush=True)
        m = _finished_metrics(out)
        if m is not None:  # the head exported at its last evaluation
            results["eagle3"] = {**m, "crashed": True}
    if (out / "config.json").exists():
        folders["eagle3"] = out
    if not reused and (out / "work" / "data").is_dir():
        pack_in_background()  # the answers, for a later call's --reuse-data; xz runs beside Medusa's training
    pack(folders, dest)
    write_metrics()
    gc.collect()  # the EAGLE-3 run's feature cache, before Medusa's
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    terminated = any("SIGTERM" in e for e in errors)
    if medusa_need and not terminated and left() >= args.medusa_margin + 10 and (out / "work" / "data").is_dir():
        try:
            _link_data(out / "work", m_out / "work")
            # Medusa's heads write the whole vocabulary: smaller batches keep their logits within memory.
            m_cfg = dataclasses.replace(cfg, method="medusa", out=str(m_out), gen_seconds=0.0, gen_graphs=False,
                                        gen_compile=False,
                                        train_seconds=min(args.medusa_seconds, left() - args.medusa_margin),
                                        batch_tokens=max(cfg.max_seq_len, min(cfg.batch_tokens,
                                                                              args.medusa_batch_tokens)),
                                        wall_seconds=left() if args.wall_seconds else None,
                                        wall_reserve=min(cfg.wall_reserve, 30.0))
            results["medusa"] = distill(m_cfg)
        except BaseException:
            errors.append(traceback.format_exc())
            print(errors[-1], flush=True)
            m = _finished_metrics(m_out)
            if m is not None:
                results["medusa"] = {**m, "crashed": True}
        if (m_out / "config.json").exists():
            folders["medusa"] = m_out
    else:
        print(f"medusa skipped: {left():.0f} s left", flush=True)
    stop.set()
    packed = pack(folders, dest)
    if "thread" in packer:
        packer["thread"].join(timeout=max(5.0, left()) if args.wall_seconds else None)
        if "error" in packer:
            errors.append(packer["error"])
        elif "parts" in packer:
            size = sum((dest / p).stat().st_size for p in packer["parts"])
            print(f"data packed: {packer['parts']} ({size / 2**20:.1f} MiB, {packer['s']:.0f} s)", flush=True)
    write_metrics()
    print(f"packed {packed}; wall {time.perf_counter() - t_process:.0f} s", flush=True)
    for f in sorted(dest.iterdir()):
        print(f"  {f.name} {f.stat().st_size}", flush=True)
    if errors and not folders:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
