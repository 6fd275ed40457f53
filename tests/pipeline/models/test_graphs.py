"""The static-shape (graph) runner and batched decoding on CPU: ragged positions, padded buckets, mixed K,
requests joining and leaving between steps, all exactly equal to unbatched greedy decoding.

On CPU the static path runs without capture (`GraphConfig(graphs=False)`): same shapes, same padding, same
scratch slot and bucketed key length as the captured CUDA graphs; tests/gpu/test_gpu_graphs.py checks capture.
"""

from __future__ import annotations

import pytest
import torch

from pipeline.adaptive import AdaptiveK
from pipeline.config import EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ModelDrafter, PromptLookupDrafter
from pipeline.engine import SpeculativeEngine
from pipeline.models.graphs import GraphCausalLM, GraphConfig, bucket, maybe_graphs, plan_shape
from pipeline.models.loader import load_model
from tests.support.models import make_tiny_gpt2, make_tiny_llama

STATIC = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4, 8), token_buckets=(1, 2, 4, 8), kv_block=16)


def _graph(path, slots: int = 4, max_len: int = 96) -> GraphCausalLM:
    runner, _ = load_model(path)
    g = GraphCausalLM(runner, STATIC)
    g.allocate(slots, max_len)
    return g


def _eager(path, slots: int = 4, max_len: int = 96):
    runner, _ = load_model(path)
    runner.allocate(slots, max_len)
    return runner


@pytest.mark.parametrize(
    "B, T, max_pos, max_len, expected",
    [
        (1, 1, 0, 96, (1, 1, 16)),
        (3, 1, 15, 96, (4, 1, 16)),
        (3, 1, 16, 96, (4, 1, 32)),
        (2, 5, 40, 96, (2, 8, 48)),
        (8, 8, 80, 96, (8, 8, 96)),  # key length capped at max_len
        (9, 1, 0, 96, None),  # more rows than the largest bucket
        (1, 9, 0, 96, None),  # prefill-sized
        (1, 3, 93, 96, None),  # padded tokens would run past the cache
    ],
)
def test_plan_shape_table(B, T, max_pos, max_len, expected):
    assert plan_shape(B, T, max_pos, max_len, STATIC) == expected


@pytest.mark.parametrize("B, T, max_pos, expected", [(1, 1, 0, (1, 1, 96)), (3, 5, 40, (4, 8, 96)), (1, 3, 93, None)])
def test_plan_shape_whole_cache_ignores_the_context(B, T, max_pos, expected):
    """The Triton attention's shapes: keys are not bucketed (one graph per (Bb, Tb) for every context)."""
    assert plan_shape(B, T, max_pos, 96, STATIC, whole_cache=True) == expected


def test_shape_for_follows_the_attention(tiny_models):
    """A graph runner keys its graphs by context only where its attention reads the keys up to S (SDPA)."""
    g = _graph(tiny_models["llama"])
    assert g.attention == "sdpa" and g.shape_for(3, 1, 16) == (4, 1, 32)
    g.attention = "triton"  # (its kernel is not run here)
    assert g.shape_for(3, 1, 16) == g.shape_for(3, 1, 70) == (4, 1, g.max_len)


def test_warmup_without_cuda_graphs_captures_nothing(tiny_models):
    g = _graph(tiny_models["llama"])
    assert g.warmup(4, 5) == 0 and g.stats.captures == 0 and g.stats.graph_calls == 0


def test_bucket():
    assert [bucket(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


@pytest.mark.parametrize("name", ["llama", "llama_mha_tied", "qwen2", "mistral_window"])
def test_static_path_equals_unbatched_eager_with_ragged_positions(tiny_models, tmp_path, name):
    """Rows at different positions, T padded to a bucket, B padded to a bucket, rows in any slot order:
    every row's logits equal an unbatched eager forward of that row alone."""
    torch.manual_seed(0)
    if name == "mistral_window":  # sliding window shorter than the contexts
        path = make_tiny_llama(tmp_path / name, arch="mistral", sliding_window=6, max_position_embeddings=512)
    else:
        path = tiny_models[name]
    graph, ref = _graph(path), _eager(path)
    lengths = {0: 5, 1: 23, 3: 11}  # slot -> prefilled tokens (slot 2 stays empty)
    for slot, n in lengths.items():
        prompt = torch.randint(0, 128, (1, n))
        for m in (graph, ref):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    assert graph.stats.eager_calls == 2  # prefills past the largest token bucket go to the eager runner
    for T in (1, 3, 5):
        slots = [3, 0, 1]  # not in slot order, 3 rows -> bucket 4
        tokens = torch.randint(0, 128, (3, T))
        positions = torch.tensor([lengths[s] for s in slots])
        got = graph.forward(tokens, positions, torch.tensor(slots))
        for b, s in enumerate(slots):
            want = ref.forward(tokens[b : b + 1], positions[b : b + 1], torch.tensor([s]))
            torch.testing.assert_close(got[b : b + 1], want, rtol=1e-4, atol=1e-4)
            assert torch.equal(got[b].argmax(-1), want[0].argmax(-1))
        # Roll back: the next call feeds from one past the last position (all rejected but the first).
        lengths = {s: lengths[s] + 1 for s in lengths}
    assert graph.stats.graph_calls == 1 + 3 and graph.stats.eager_calls == 2


def test_features_on_the_static_path_equal_the_eager_runners(tiny_models):
    """`forward_features` of host rows runs a graph per shape and layers (here static, uncaptured): rows at ragged
    positions, padded, called twice per shape (the second reuses the entry); logits and the states entering the
    layers (and the final normed state) equal the eager runner's, row by row."""
    from pipeline.models.llama import FINAL_NORMED

    torch.manual_seed(1)
    graph, ref = _graph(tiny_models["llama"]), _eager(tiny_models["llama"])
    lengths = {0: 5, 2: 9}
    for slot, n in lengths.items():
        prompt = torch.randint(0, 128, (1, n))
        for m in (graph, ref):
            m.forward(prompt, torch.tensor([0]), torch.tensor([slot]), n - 1)
    layers = (0, 1, FINAL_NORMED)
    for T in (1, 3, 3):
        slots = [2, 0]
        tokens = torch.randint(0, 128, (2, T))
        positions = torch.tensor([lengths[s] for s in slots])
        logits, feats = graph.forward_features(tokens, positions, torch.tensor(slots), layers)
        assert feats.shape[:2] == (2, T)
        for b, s in enumerate(slots):
            want_logits, want_feats = ref.forward_features(tokens[b:b + 1], positions[b:b + 1], torch.tensor([s]),
                                                           layers)
            torch.testing.assert_close(logits[b:b + 1], want_logits, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(feats[b:b + 1], want_feats, rtol=1e-4, atol=1e-4)
        lengths = {s: lengths[s] + 1 for s in lengths}  # all rejected but the first: the next call rolls back
    assert graph.stats.eager_calls == 1 and graph.stats.graph_calls == 1 + 3  # the 9-token prefill ran eagerly
    assert sorted(k[:2] for k in graph._graphs if len(k) == 4) == [(2, 1), (2, 4)]  # the second T = 3 call reused one


def test_padding_rows_and_columns_never_touch_other_slots(tiny_models):
    graph = _graph(tiny_models["llama"], slots=6)
    runner = graph.runner
    for cache in runner.k_caches + runner.v_caches:
        cache.normal_()
    untouched = [1, 2, 4]
    before = [c[untouched].clone() for c in runner.k_caches + runner.v_caches]
    graph.forward(torch.tensor([[3, 4, 5]]), torch.tensor([7]), torch.tensor([0]))  # bucket (1, 4): a pad column
    graph.forward(torch.tensor([[3], [4], [5]]), torch.tensor([9, 2, 4]), torch.tensor([3, 0, 5]))  # a pad row
    for b, c in zip(before, runner.k_caches + runner.v_caches):
        assert torch.equal(c[untouched], b)
    assert graph.num_slots == 6 and runner.num_slots == 7  # the seventh is the scratch slot


def test_logits_from_and_out_of_bucket_calls(tiny_models):
    graph, ref = _graph(tiny_models["llama"]), _eager(tiny_models["llama"])
    prompt = torch.randint(0, 128, (1, 6))
    got = graph.forward(prompt, torch.tensor([0]), torch.tensor([1]), logits_from=4)  # static path, T=6 -> 8
    want = ref.forward(prompt, torch.tensor([0]), torch.tensor([1]), logits_from=4)
    assert got.shape == (1, 2, 128)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    near_end = graph.forward(torch.tensor([[1, 2, 3]]), torch.tensor([93]), torch.tensor([2]))  # 93 + 4 > 96
    assert near_end.shape == (1, 3, 128) and graph.stats.eager_calls == 1


def test_non_llama_models_fall_back_once(tmp_path, caplog):
    model, _ = load_model(make_tiny_gpt2(tmp_path / "gpt2"))
    with caplog.at_level("WARNING"):
        assert maybe_graphs(model) is model
        assert maybe_graphs(model) is model
    assert sum("generic runner" in r.message for r in caplog.records) <= 1


def _run(engine: SpeculativeEngine, prompts, max_tokens, k: int) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True, seed=0) for m in max_tokens]
    return [r.token_ids for r in engine.generate_batch(prompts, params, SpecParams(num_draft_tokens=k))]


PROMPTS = [[5, 17, 33, 17, 33, 9], [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [100, 7], [9] * 14, [4, 4, 8, 15, 16, 23, 42]]
MAX_TOKENS = [19, 7, 26, 3, 12]  # requests leave at different steps; 5 requests on 3 slots join as they do


@pytest.fixture(scope="module")
def unbatched_reference(tiny_models):
    """Target-only greedy decoding, one request at a time, on the plain eager runner."""
    target, _ = load_model(tiny_models["llama"])
    engine = SpeculativeEngine(target, None, None, EngineConfig(max_batch_size=1, max_seq_len=64))
    return [_run(engine, [p], [m], 0)[0] for p, m in zip(PROMPTS, MAX_TOKENS)]


class CyclingK:
    """A K policy that runs a different K every step (same interface as AdaptiveK)."""

    def __init__(self, ks=(5, 0, 2, 1, 4, 3)) -> None:
        self.ks, self.i, self.used = ks, 0, set()

    def choose(self, batch: int, cap: int) -> int:
        self.i += 1
        return min(self.ks[self.i % len(self.ks)], cap)

    def observe(self, batch, k, seconds, num_draft, num_accepted, timed=True) -> None:
        self.used.add(k)


@pytest.mark.parametrize("drafter", ["model", "lookup"])
@pytest.mark.parametrize("policy", ["fixed", "cycling", "adaptive"])
def test_batched_graph_engine_equals_unbatched_greedy(tiny_models, unbatched_reference, drafter, policy):
    """Ragged positions, mixed K (per-row caps near max_tokens, lookup misses, a different K every step),
    requests joining and leaving: the same tokens as unbatched decoding."""
    target = GraphCausalLM(load_model(tiny_models["llama"])[0], STATIC)
    if drafter == "model":
        d = ModelDrafter(GraphCausalLM(load_model(tiny_models["draft"])[0], STATIC))
    else:
        d = PromptLookupDrafter()
    k_policy = {"fixed": None, "cycling": CyclingK(), "adaptive": AdaptiveK(max_k=5)}[policy]
    engine = SpeculativeEngine(target, None, d, EngineConfig(max_batch_size=3, max_seq_len=64), k_policy=k_policy)
    got = _run(engine, PROMPTS, MAX_TOKENS, 5)
    assert got == unbatched_reference
    assert target.stats.graph_calls > 0
    if policy == "cycling":
        assert len(k_policy.used) >= 4  # it really ran with several K


def test_k_policy_leaves_sampled_requests_reproducible(tiny_models):
    """A K policy picks K for greedy rows only: a seeded sampled request gives the same tokens with a policy
    that changes K every step as with the request's own fixed K, alone and next to greedy requests."""
    from pipeline.config import SamplingParams, SpecParams

    def engine(policy):
        target, _ = load_model(tiny_models["llama"])
        drafter = ModelDrafter(load_model(tiny_models["draft"])[0])
        return SpeculativeEngine(target, None, drafter, EngineConfig(max_batch_size=3, max_seq_len=64),
                                 k_policy=policy)

    sampled = SamplingParams(temperature=1.0, max_tokens=20, seed=7)
    greedy = SamplingParams(max_tokens=20)
    want = engine(None).generate(PROMPTS[0], sampled, SpecParams(num_draft_tokens=3)).token_ids
    cycling = CyclingK()
    got = engine(cycling).generate_batch([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [sampled, greedy, greedy],
                                         SpecParams(num_draft_tokens=3))
    assert got[0].token_ids == want
    assert len(cycling.used) >= 3  # the greedy rows really ran with several K
