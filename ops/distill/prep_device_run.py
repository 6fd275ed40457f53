"""Prepare the clean-retrain GPU run: what each device call carries, checked against the size limit.

    python -m ops.distill.prep_device_run --prompts .carry/clean/prompts.npz --out .carry/clean

The device copies the working tree (tracked + untracked-not-ignored files) plus the paths a call names in
`carry`, at most 64 MiB per call, and nothing else reaches it. The demo target's GGUF (98 MB) does not fit
next to the tree, so it travels in parts: each *stash* call carries one part and copies it to /tmp there
(files written there stay while the machine stays warm between calls), and the *main* call carries the last
part, the prompts, the tokenized evaluation prompts, the `gguf` wheel and (with --data) the answers of an earlier
feature-heads call, reassembles and checks the GGUF
(sha256) and runs `ops/distill/gpu_clean_retrain.sh main`.

Writes, under --out:
    call1/ ... callN/      what call i carries (`carry: [".carry/clean/callI"]`); callN is the main call
    manifest.json          sha256 of the GGUF, of every part and of the prompts; what the prompts are
    COMMANDS.txt           the exact `run` calls, in order

Prompts are built beforehand (never from the evaluation set; `--check-eval` refuses any shared 8-gram):
    python -m ops.distill.build_prompts --out .carry/clean/prompts.jsonl.gz --num 150000 --seed 0 \\
        --man-pages 800 --tokenizer $T --tokenized .carry/clean/prompts.npz \\
        --check-eval specserve/data/spec_bench_dev.jsonl
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from pipeline.models import store
from specserve.prompts import SPEC_BENCH_DEV

ROOT = Path(__file__).resolve().parents[2]

LIMIT = 64 * 2**20  # the device's working-tree limit per call (tree + carried paths)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tree_bytes(root: Path) -> int:
    """Bytes of what every call sends anyway: tracked files and untracked files git does not ignore."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout
    total = 0
    for name in {n for n in out.decode().split("\0") if n}:
        p = root / name
        if p.is_file():
            total += p.stat().st_size
    shared = root / "shared"
    if shared.is_dir():
        total += sum(f.stat().st_size for f in shared.rglob("*") if f.is_file())
    return total


def compress_prompts(src: Path, dest: Path) -> dict:
    """The prompts .npz, re-saved uncompressed and xz-compressed (token ids repeat: xz finds it, zip does not)."""
    z = np.load(src)
    buf = io.BytesIO()
    np.savez(buf, **{k: z[k] for k in z.files})
    raw = buf.getvalue()
    dest.write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    n = len(z["offsets"]) - 1
    return {"file": dest.name, "npz_sha256": hashlib.sha256(raw).hexdigest(), "npz_bytes": len(raw),
            "xz_bytes": dest.stat().st_size, "prompts": int(n), "prompt_tokens": int(len(z["ids"])),
            "with_followup": int((np.diff(z["followup_offsets"]) > 0).sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default=".carry/clean/prompts.npz", help="tokenized training prompts (.npz)")
    ap.add_argument("--prompts-meta", default=None, help="the builder's .meta.json (default: beside --prompts)")
    ap.add_argument("--build-log", default=None, help="the builder's log (its --check-eval line is recorded)")
    ap.add_argument("--eval", default=str(SPEC_BENCH_DEV),
                    help="evaluation prompts (tokenized here; evaluated on, never trained on)")
    ap.add_argument("--gguf", default=None, help="the demo target's GGUF (default: the model store's copy)")
    ap.add_argument("--wheel", default=None,
                    help="the gguf wheel (not on the GPU image; default: .carry/gpu5w/gguf-*.whl)")
    ap.add_argument("--target", default=None, help="tokenizer folder for the evaluation prompts (default: the demo)")
    ap.add_argument("--data", default=None,
                    help="a folder with an earlier heads call's data.tar.xz.partNN (its $OUT): the main call carries "
                         "them and trains on those answers instead of generating")
    ap.add_argument("--out", default=".carry/clean")
    ap.add_argument("--stash-env", default="", help="environment of the stash calls, e.g. REHEARSE=0")
    ap.add_argument("--main-env", default="",
                    help="environment of the main call, e.g. 'TRAINER=ops.distill.gpu_heads WALL_TOTAL=560'")
    ap.add_argument("--main-args", default="", help="arguments appended to the main call (the trainer's flags)")
    ap.add_argument("--margin-mib", type=float, default=2.0, help="room left in every call for files added later")
    args = ap.parse_args()

    out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
    for old in out.glob("call*"):
        shutil.rmtree(old)
    gguf = Path(args.gguf) if args.gguf else store._demo_gguf()
    target = store.resolve(args.target)
    wheel = Path(args.wheel) if args.wheel else next(iter(sorted((ROOT / ".carry" / "gpu5w").glob("gguf-*.whl"))), None)
    if wheel is None or not wheel.exists():
        raise SystemExit("no gguf wheel: pip download --no-deps gguf==0.19.0 -d .carry/gpu5w")

    # The main call's extras (besides the last GGUF part).
    extras = out / "extras.tmp"
    shutil.rmtree(extras, ignore_errors=True)
    extras.mkdir(parents=True)
    prompts = Path(args.prompts)
    pinfo = compress_prompts(prompts, extras / "prompts.npz.xz")
    meta_path = (Path(args.prompts_meta) if args.prompts_meta
                 else prompts.with_name(prompts.name.split(".")[0] + ".meta.json"))
    if meta_path.exists():
        pinfo["builder"] = json.loads(meta_path.read_text())
    log_path = Path(args.build_log) if args.build_log else prompts.with_name("build.log")
    if log_path.exists():
        pinfo["builder_log"] = log_path.read_text().strip().splitlines()
    subprocess.run([sys.executable, "-m", "ops.distill.tokenize_eval", args.eval, str(target),
                    str(extras / "spec_bench_dev.npz")], cwd=ROOT, check=True)
    shutil.copy(wheel, extras / wheel.name)
    data_parts = sorted(Path(args.data).glob("data.tar.xz.part*")) if args.data else []
    if args.data and not data_parts:
        raise SystemExit(f"--data {args.data}: no data.tar.xz.part* there")
    for f in data_parts:
        shutil.copy(f, extras / f.name)
    extra_bytes = sum(f.stat().st_size for f in extras.iterdir()) + 16384  # + manifest

    tree = tree_bytes(ROOT)
    cap = LIMIT - tree - int(args.margin_mib * 2**20)
    size = gguf.stat().st_size
    if cap <= extra_bytes:
        raise SystemExit(f"the working tree ({tree / 2**20:.1f} MiB) leaves no room for the main call's files")
    # Calls 1..n-1 carry a full part each; the main call carries the rest of the GGUF and the extras.
    n = 1
    while size - (n - 1) * cap > cap - extra_bytes:
        n += 1
    # The stash calls carry equal parts, just enough that the rest fits beside the main call's extras.
    stash_part = -(-(size - (cap - extra_bytes)) // (n - 1)) if n > 1 else 0
    parts, offset = [], 0
    with open(gguf, "rb") as f:
        for i in range(1, n + 1):
            length = min(cap, stash_part) if i < n else size - offset
            folder = out / f"call{i}"
            folder.mkdir(parents=True, exist_ok=True)
            data = f.read(length)
            (folder / f"gguf.part{i}").write_bytes(data)
            parts.append({"name": f"gguf.part{i}", "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
            offset += len(data)
    assert offset == size
    for f in extras.iterdir():
        f.replace(out / f"call{n}" / f.name)
    extras.rmdir()
    manifest = {
        "gguf": {"name": gguf.name, "bytes": size, "sha256": sha256(gguf), "parts": parts},
        "prompts": pinfo,
        "eval": {"file": "spec_bench_dev.npz", "source": Path(args.eval).name,
                 "sha256": sha256(out / f"call{n}" / "spec_bench_dev.npz"), "use": "evaluation only, never training"},
        "wheel": wheel.name,
        "data": [{"name": f.name, "bytes": f.stat().st_size, "sha256": sha256(f)} for f in data_parts],
        "calls": n,
        "tree_bytes": tree,
    }
    for i in range(1, n + 1):
        (out / f"call{i}" / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    shutil.copy(target / "config.json", out / "call1" / "target_config.json")  # for the rehearsal (stash 1)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    rel = os.path.relpath(out, ROOT)
    clean_env = "" if rel == ".carry/clean" else f"CLEAN_DIR={rel} "
    lines = [f"# {n} device calls on one machine, each issued right after the last returns (the machine stays warm",
             "# ~30 s between calls; /tmp survives only while it does). "
             "Rerun this script right before: it checks sizes.", ""]
    for i in range(1, n + 1):
        carried = sum(f.stat().st_size for f in (out / f"call{i}").iterdir())
        total = tree + carried
        assert total <= LIMIT, (i, total)
        if i < n:
            cmd = f"{clean_env}{args.stash_env} bash ops/distill/gpu_clean_retrain.sh stash {i}".replace("  ", " ")
            timeout = 150 if i == 1 else 60  # call 1 also rehearses (<= 100 s)
        else:
            cmd = f"{clean_env}{args.main_env} bash ops/distill/gpu_clean_retrain.sh main {args.main_args}".strip()
            cmd = cmd.replace("  ", " ")
            timeout = 600
        lines.append(f"# call {i}/{n}: tree {tree / 2**20:.1f} MiB + carried {carried / 2**20:.1f} MiB = "
                     f"{total / 2**20:.1f} MiB (limit 64)")
        # No `kind`: every call keeps the machine the first got (naming another kind would give it back).
        carry = [f"{os.path.relpath(out, ROOT)}/call{i}"]
        lines.append(json.dumps({"command": cmd, "carry": carry, "timeout_s": timeout}))
        lines.append("")
    (out / "COMMANDS.txt").write_text("\n".join(lines))
    print("\n".join(lines))
    print(json.dumps({k: v for k, v in pinfo.items() if k not in ("builder", "builder_log")}))


if __name__ == "__main__":
    main()
