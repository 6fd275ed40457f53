"""pipeline/distill/archive.py: the generated answers travel between machines as uint16 xz parts, unchanged."""

from __future__ import annotations

import numpy as np

from pipeline.distill.archive import pack_data, unpack_data
from pipeline.distill.generate import SampleSet


def test_answers_pack_and_unpack_unchanged(tmp_path):
    rng = np.random.default_rng(0)
    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    sets = {}
    for name in ("data/shard_00000.npz", "data/shard_00001.npz", "eval_heldout_greedy.npz"):
        seqs = [rng.integers(0, 49152, size=int(rng.integers(5, 400))).tolist() for _ in range(30)]
        s = SampleSet.build(seqs, [3] * 30, ["qa", "math"] * 15, [True, False] * 15)
        s.save(work / name)
        sets[name] = s
    parts = pack_data(work, tmp_path, part_bytes=8192)  # several parts
    assert len(parts) > 1 and all((tmp_path / p).stat().st_size <= 8192 for p in parts)
    again = tmp_path / "again"
    assert unpack_data(tmp_path, again) == 3
    for name, s in sets.items():
        got = SampleSet.load(again / name)
        assert got.ids.dtype == np.int32 and np.array_equal(got.ids, s.ids)
        assert np.array_equal(got.offsets, s.offsets) and got.names == s.names
        assert np.array_equal(got.prompt_lens, s.prompt_lens) and np.array_equal(got.sampled, s.sampled)
    assert unpack_data(tmp_path / "none", again) == 0
