"""Pre-speculation's pure pieces (`pipeline.prespec`): ranking a step's likely outcomes by the drafter's own
probabilities, matching a verdict to a branch, and giving each row of a request the cache slot that saves most."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.prespec import Branch, assign_keys, group_keys, match_branch, rank_branches, request_of

# A drafter's answer for K = 2 plus its guess at position 2. Row i: the sparse distribution token i was drawn from.
TOKENS = [10, 11, 12]
TOP_IDS = np.array([[10, 20, 21], [11, 30, 31], [12, 40, 41]])
TOP_PROBS = np.array([[0.5, 0.3, 0.2], [0.9, 0.08, 0.02], [0.6, 0.3, 0.1]], dtype=np.float32)


def test_outcomes_are_ranked_by_the_drafters_probabilities():
    # P(n=0) = 0.5, P(n=1) = 0.5 * 0.1 = 0.05, P(n=2) = 0.45. At n=0 the recovered token is 20 (0.3/0.5) or 21
    # (0.2/0.5); at n=1 30 (0.8) or 31 (0.2); at n=2 the bonus is 12 (0.6) or 40 (0.3).
    got = rank_branches(TOKENS, TOP_IDS, TOP_PROBS, num_verified=2, budget=6, top_m=2)
    assert [(b.num_accepted, b.token) for b in got] == [(0, 20), (2, 12), (0, 21), (2, 40), (1, 30), (1, 31)]
    assert [round(b.score, 4) for b in got] == [0.3, 0.27, 0.2, 0.135, 0.04, 0.01]
    assert got[1].tail(TOKENS[:2]) == [10, 11, 12] and got[0].tail(TOKENS[:2]) == [20]
    assert rank_branches(TOKENS, TOP_IDS, TOP_PROBS, 2, budget=2, top_m=2) == got[:2]
    assert [(b.num_accepted, b.token) for b in rank_branches(TOKENS, TOP_IDS, TOP_PROBS, 2, 6, top_m=1)] == [
        (0, 20), (2, 12), (1, 30)]


def test_without_a_guess_or_probabilities():
    # No token past K: the bonus cannot be guessed, only rejections are ranked.
    got = rank_branches(TOKENS[:2], TOP_IDS[:2], TOP_PROBS[:2], 2, budget=8, top_m=2)
    assert {b.num_accepted for b in got} == {0, 1}
    # Point masses (prompt lookup, the synthetic drafter): the one guess "all accepted, then the extra token".
    assert rank_branches(TOKENS, None, None, 2, budget=4) == [Branch(2, 12, 1.0)]
    assert rank_branches(TOKENS[:2], None, None, 2, budget=4) == []
    assert rank_branches(TOKENS, TOP_IDS, TOP_PROBS, 2, budget=0) == []


def test_a_sure_drafter_bets_on_its_draft():
    ids = np.array([[5, 6], [7, 8], [9, 1]])
    probs = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0]], dtype=np.float32)
    assert rank_branches([5, 7, 9], ids, probs, 2, budget=4) == [Branch(2, 9, 1.0)]  # nothing else has mass


def test_match_branch():
    tails = [[20], [10, 11, 12], [10, 30]]
    assert match_branch(tails, [1, 2, 10, 11, 12], base=2) == 1
    assert match_branch(tails, [1, 2, 20], base=2) == 0
    assert match_branch(tails, [1, 2, 10, 31], base=2) == -1
    assert match_branch(tails, [1, 2], base=2) == -1


def test_rows_take_the_slot_that_holds_most_of_their_context():
    keys = group_keys("r", 3)
    assert keys[0] == "r" and len(keys) == 4 and {request_of(k) for k in keys} == {"r"}
    cached = {"r": [1, 2, 3, 9], keys[1]: [1, 2, 3, 4, 5, 6], keys[2]: [1, 2]}
    # the hit branch's slot (1..6) goes to the row continuing from it; the next best to the next row
    assert assign_keys(keys, cached, [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 9, 8]]) == [keys[1], "r"]
    assert assign_keys(keys, {}, [[1], [2], [3]]) == keys[:3]  # nothing cached: in order
    with pytest.raises(AssertionError):
        assign_keys(keys[:1], {}, [[1], [2]])
