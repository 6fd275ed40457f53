"""Suffix decoding: the index against a brute-force reference, the draft's adaptive length, the store's bound, and
the engine's output with the suffix drafter equal to the target's."""

from __future__ import annotations

import random

import pytest

from pipeline.config import SUFFIX, EngineConfig, SamplingParams, SpecParams
from pipeline.drafters import ProposeRow, build_drafter, lookup_part
from pipeline.engine import SpeculativeEngine
from pipeline.models.loader import load_model
from pipeline.suffix import SEPARATOR, OutputStore, SuffixConfig, SuffixDrafter, SuffixIndex, best_path


def _ends(tokens: list[int], pattern: list[int]) -> list[int]:
    """Brute force: ends e (most recent first) with tokens[e-n:e] == pattern and a token at e."""
    n = len(pattern)
    return [e for e in range(len(tokens) - 1, n - 1, -1) if tokens[e - n:e] == pattern]


def _longest(tokens: list[int], context: list[int], max_pattern: int) -> int:
    return max((n for n in range(1, min(max_pattern, len(context)) + 1) if _ends(tokens, context[-n:])), default=0)


def test_index_equals_brute_force_on_random_sequences():
    """Longest match and every occurrence of every pattern, for token lists grown 1-5 tokens at a time."""
    rng = random.Random(0)
    for trial in range(20):
        index, tokens = SuffixIndex(max_pattern=5), []
        vocab = rng.choice([2, 3, 6])
        for _ in range(25):
            new = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            tokens += new
            index.extend(new)
            assert index.tokens == tokens
            query = [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))]
            for ctx in (tokens, query):
                assert index.longest_match(ctx) == _longest(tokens, ctx, 5), (trial, ctx)
            for n in range(1, 6):
                pattern = tokens[-n:] if rng.random() < 0.5 else query[-n:]
                assert index.ends(pattern, 1000) == _ends(tokens, pattern)
                assert index.ends(pattern, 2) == _ends(tokens, pattern)[:2]


def test_best_path_follows_the_most_frequent_continuations():
    rng = random.Random(1)
    for _ in range(200):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(2, 40))]
        pattern = tokens[-1:]
        ends = _ends(tokens, pattern)
        path, followed = best_path([(tokens, ends)], 6, 0.0)
        # reference: at each depth the token most of the remaining occurrences continue with (ties: most recent)
        cands, want = list(ends), []
        while len(want) < 6:
            nxt = [tokens[e + len(want)] for e in cands if e + len(want) < len(tokens)]
            if not nxt:
                break
            best = max(dict.fromkeys(nxt), key=nxt.count)
            cands = [e for e in cands if e + len(want) < len(tokens) and tokens[e + len(want)] == best]
            want.append(best)
        assert path == want
        assert [e for _, e in followed] == cands


def test_draft_length_adapts_to_the_match():
    """At most alpha * match-length tokens; a continuation that few occurrences share is cut (min_prob)."""
    d = SuffixDrafter(SuffixConfig(alpha=1.0, min_prob=0.0))
    long_run = list(range(10, 30))
    assert len(d.draft("a", long_run + [99] + long_run[:6], 20, False)) == 6  # a 6-token match: 6 tokens
    assert len(d.draft("b", long_run + [99] + long_run[:2], 20, False)) == 2  # a 2-token match: 2 tokens
    assert d.draft("c", long_run + [99, 98], 20, False) == []  # no match: nothing
    assert d.draft("a", long_run + [99] + long_run[:6], 3, False) == long_run[6:9]  # the row's budget caps it
    # Four continuations after token 7, each once: a path's share is 1/4, under min_prob 0.3.
    ctx = [7, 1, 7, 2, 7, 3, 7, 4, 7]
    assert SuffixDrafter(SuffixConfig(min_prob=0.3)).draft("d", ctx, 4, False) == []
    assert SuffixDrafter(SuffixConfig(min_prob=0.2)).draft("d", ctx, 4, False) == [4, 7]


def test_the_store_is_bounded_and_drops_the_least_recently_used():
    store = OutputStore(max_tokens=10, max_pattern=3)
    store.add([1, 2, 3, 4])
    store.add([5, 6, 7, 8])
    store.touch(store.index.ends([1, 2], 10))  # the first output was used: the second is the older now
    store.add([9, 10, 11])
    assert store.num_tokens <= 10 and list(store.outputs.values()) == [[1, 2, 3, 4], [9, 10, 11]]
    assert store.index.tokens == [1, 2, 3, 4, SEPARATOR, 9, 10, 11, SEPARATOR]
    store.add(list(range(100, 125)))  # longer than the whole store: its last 10 tokens
    assert store.num_tokens == 10 and list(store.outputs.values()) == [list(range(115, 125))]
    assert OutputStore(max_tokens=0, max_pattern=3).num_tokens == 0


def test_only_greedy_rows_draw_on_earlier_requests():
    """A sampled row's drafts depend on its own context only, so a seeded request replays whatever ran before."""
    d = SuffixDrafter()
    d.finish("old", [40, 41, 42, 43, 44])
    rows = [ProposeRow("g", [1, 40, 41], 4, greedy=True), ProposeRow("s", [1, 40, 41], 4, greedy=False)]
    assert d.find(rows) == [[42, 43, 44], []]
    assert not d._index.get("old")


def test_the_word_builds_it_everywhere():
    assert isinstance(build_drafter(SUFFIX, None, None), SuffixDrafter)
    assert isinstance(lookup_part(SUFFIX), SuffixDrafter)  # the Serve coordinator's in-process drafter


@pytest.fixture(scope="module")
def target(tiny_models):
    return load_model(tiny_models["llama"])[0]


def test_greedy_output_equals_the_targets_and_sampled_replays(target):
    cfg = EngineConfig(max_batch_size=4, max_seq_len=160)
    engine = SpeculativeEngine(target, None, SuffixDrafter(), cfg)
    plain = SpeculativeEngine(target, None, None, cfg)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [11, 23, 42, 7, 99, 3, 64], [1, 2, 3, 1, 2, 3, 1]]
    greedy = SamplingParams(max_tokens=32)
    want = [r.token_ids for r in plain.generate_batch(prompts, greedy)]
    for k in (2, 5):  # the second round drafts from the store as well
        got = engine.generate_batch(prompts, greedy, SpecParams(num_draft_tokens=k))
        assert [r.token_ids for r in got] == want
    assert sum(r.stats["accepted"] for r in got) > 0
    sampled = SamplingParams(max_tokens=24, temperature=0.9, seed=7)
    first = engine.generate(prompts[1], sampled, SpecParams(3)).token_ids
    engine.generate(prompts[0], greedy, SpecParams(3))  # the store changes in between
    assert engine.generate(prompts[1], sampled, SpecParams(3)).token_ids == first
    assert SpeculativeEngine(target, None, SuffixDrafter(), cfg).generate(prompts[1], sampled,
                                                                           SpecParams(3)).token_ids == first


def test_a_repeated_request_gets_longer_accepted_runs(target):
    """The store at work: the second request with the same prompt drafts the first one's output and accepts more
    tokens per target pass."""
    engine = SpeculativeEngine(target, None, SuffixDrafter(), EngineConfig(max_batch_size=1, max_seq_len=160))
    prompt = [11, 23, 42, 7, 99, 3, 64, 17]
    spec, greedy = SpecParams(num_draft_tokens=8), SamplingParams(max_tokens=40)
    first = engine.generate(prompt, greedy, spec)
    second = engine.generate(prompt, greedy, spec)
    assert second.token_ids == first.token_ids
    assert second.stats["mean_accepted_tokens"] > first.stats["mean_accepted_tokens"] + 1
    assert second.stats["target_passes"] < first.stats["target_passes"]
