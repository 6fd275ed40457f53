"""GPU check of feature heads on the device loop (skipped without CUDA): with an EAGLE-3 head and with Medusa heads
(random weights in the published layouts) on a float32 target, the loop with each step captured as one CUDA graph
gives the step-by-step path's tokens, greedy and seeded sampled, with rows that end at different steps, and reads no
position back from the device."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import pytest
import torch

from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.engine import SpeculativeEngine
from pipeline.heads.drafter import HeadDrafter
from pipeline.models.shapes import SHAPES, random_llama
from tests.support.heads import make_eagle3_checkpoint, make_medusa_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TINY = replace(SHAPES["llama-1b"], n_layers=4, dim=256, n_heads=8, n_kv_heads=2, head_dim=32, intermediate_size=512,
               vocab_size=512)
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-heads")
    cfg = {"hidden_size": TINY.dim, "vocab_size": TINY.vocab_size, "num_attention_heads": TINY.n_heads,
           "num_key_value_heads": TINY.n_kv_heads}
    return {"medusa": make_medusa_checkpoint(root / "medusa", TINY.dim, TINY.vocab_size, heads=4, layers=1, seed=1),
            "eagle3": make_eagle3_checkpoint(root / "eagle3", cfg, draft_vocab=384, seed=3)}


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("name", ["eagle3", "medusa"])
def test_heads_on_the_captured_loop_equal_the_step_path_fp32(checkpoints, name):
    prompts = [[5, 17, 33, 17, 33, 9], list(range(40, 70)), [100, 7]]
    runs = {}
    # the step path with EAGLE-3's draft eager and captured (`HeadDrafter.static`), and the device loop
    for loop, static in ((False, False), (False, True), (True, True)):
        if static and name != "eagle3" and not loop:
            continue
        target = random_llama(TINY, torch.device("cuda"), torch.float32, seed=3)
        drafter = HeadDrafter.from_spec(f"{name}:{checkpoints[name]}", target)
        drafter.static = static and drafter.eagle
        engine = SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=3, max_seq_len=128,
                                                                       device_loop=loop))
        greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 9, 33)]
        sampled = [SamplingParams(max_tokens=30, temperature=t, top_p=0.95, seed=s, ignore_eos=True)
                   for t, s in ((0.8, 1), (1.0, 2), (0.0, 3))]
        out = []
        for p in (greedy, sampled, sampled):
            results = engine.generate_batch(prompts, p, SpecParams(4))
            out.append(([r.token_ids for r in results], [(r.stats["target_passes"], r.stats["accepted"])
                                                          for r in results]))
        runs[loop, static] = out
        if loop:
            assert engine._loops and all(lp._graph is not None and lp.head is drafter for lp in engine._loops.values())
            assert engine.target.stats.host_syncs == 0
        elif drafter.static:
            assert drafter._chains and all(c.graph is not None for c in drafter._chains.values())
    assert runs[True, True] == runs[False, False]
    if name == "eagle3":
        assert runs[False, True] == runs[False, False]
    assert runs[True, True][1] == runs[True, True][2]  # seeded requests replay
    assert sum(a for _, a in runs[True, True][1][1]) > 0  # drafts were accepted: the heads' distributions took part
