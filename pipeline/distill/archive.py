"""The distillation answers (data/shard_*.npz) and evaluation references (eval_*.npz) of a run's work folder as one
compact archive in parts, and back: how the answers generated on one machine are reused on another
(`ops/distill/gpu_heads.py --reuse-data`). Token ids travel as uint16 where they fit (else as they are),
the tar is xz-compressed, and the parts are named `data.tar.xz.partNN`.
"""

from __future__ import annotations

import io
import lzma
import tarfile
from pathlib import Path

import numpy as np


def split_parts(data: bytes, dest: Path, stem: str, part_bytes: int) -> list[str]:
    """Write `data` as dest/STEM.part00, part01, ... of at most `part_bytes` each -> their names."""
    names = []
    for i in range(0, len(data), part_bytes):
        names.append(f"{stem}.part{i // part_bytes:02d}")
        (dest / names[-1]).write_bytes(data[i : i + part_bytes])
    return names


def pack_data(work: Path, dest: Path, part_bytes: int = 15 * 2**20) -> list[str]:
    """The answers (data/shard_*.npz) and evaluation references (eval_*.npz) of `work` as one xz tar split into
    parts of at most `part_bytes` -> their names."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted((work / "data").glob("shard_*.npz")) + sorted(work.glob("eval_*.npz")):
            z = dict(np.load(f))
            if int(z["ids"].max(initial=0)) < 2**16:
                z["ids"] = z["ids"].astype(np.uint16)
            one = io.BytesIO()
            np.savez(one, **z)
            info = tarfile.TarInfo(str(f.relative_to(work)))
            info.size = one.tell()
            one.seek(0)
            tar.addfile(info, one)
    return split_parts(lzma.compress(buf.getvalue(), preset=6), dest, "data.tar.xz", part_bytes)


def unpack_data(folder: Path, work: Path) -> int:
    """The inverse of `pack_data`: folder/data.tar.xz.part* -> work/data/shard_*.npz and work/eval_*.npz (int32
    ids). Returns the number of files written (0: no parts)."""
    parts = sorted(folder.glob("data.tar.xz.part*"))
    if not parts:
        return 0
    raw = lzma.decompress(b"".join(p.read_bytes() for p in parts))
    n = 0
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r") as tar:
        for m in tar.getmembers():
            name = Path(m.name)
            if name.is_absolute() or ".." in name.parts or not m.isfile():
                raise ValueError(f"unexpected member {m.name!r} in the data archive")
            z = dict(np.load(io.BytesIO(tar.extractfile(m).read())))
            z["ids"] = z["ids"].astype(np.int32)
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            tmp = work / (m.name + ".tmp.npz")
            np.savez(tmp, **z)
            tmp.replace(work / name)
            n += 1
    return n
