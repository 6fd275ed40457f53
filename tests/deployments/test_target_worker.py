"""Batched verification on the target replica's worker (no Ray: the worker is a plain class): concurrent
verify calls of several requests, at ragged positions with mixed K, joining and leaving between steps, are
gathered into shared target passes and answer exactly what one-at-a-time calls answer (greedy)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deployments.messages import VerifyCall
from deployments.target_replica import TargetWorker
from pipeline.config import SamplingParams
from pipeline.models.graphs import GraphCausalLM, GraphConfig
from pipeline.step import Draft

GREEDY = SamplingParams(temperature=0.0, seed=0)
STATIC = GraphConfig(graphs=False, compile=False, batch_buckets=(1, 2, 4, 8), token_buckets=(1, 2, 4, 8), kv_block=16)


def _worker(path, graphs: bool) -> TargetWorker:
    w = TargetWorker(str(path), max_batch_size=4, max_seq_len=64, batch_wait_ms=20.0)
    if graphs:
        w.model = GraphCausalLM(w.model, STATIC)
    return w


def _script():
    """Rounds of (request id, start, tokens, prefix or None); `None` rows mean: release that request."""
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(0, 128, (n,), generator=g).tolist()  # noqa: E731
    prefix = {"a": ids(7), "b": ids(19), "c": ids(3), "d": ids(12)}
    return [
        [("a", 7, ids(5), prefix["a"]), ("b", 19, ids(1), prefix["b"]), ("c", 3, ids(3), prefix["c"])],
        [("a", 9, ids(3), None), ("b", 20, ids(5), None), ("c", 5, ids(1), None)],  # mixed K, rollback of a
        [("b", None, None, None)],  # b leaves
        [("a", 10, ids(4), None), ("d", 12, ids(2), prefix["d"]), ("c", 6, ids(5), None)],  # d joins
        [("d", 13, ids(1), None), ("a", 11, ids(2), None)],
    ]


async def _play(worker: TargetWorker, batched: bool) -> list[dict]:
    answers = []
    for round_ in _script():
        rows, leaving = [], []
        for rid, start, tokens, prefix in round_:
            if start is None:
                leaving.append(rid)
            else:
                rows.append(VerifyCall(rid, start, tokens[0], Draft(tokens[1:]), GREEDY, step=start, prefix=prefix))
        if leaving:
            await worker.release(leaving)
        if batched:
            answers += await asyncio.gather(*(worker.verify(r) for r in rows))
        else:
            for r in rows:
                answers.append(await worker.verify(r))
    return answers


@pytest.mark.parametrize("graphs", [False, True])
def test_concurrent_verify_calls_share_passes_and_equal_single_calls(tiny_models, graphs):
    single = asyncio.run(_play(_worker(tiny_models["llama"], graphs=False), batched=False))
    worker = _worker(tiny_models["llama"], graphs)
    batched = asyncio.run(_play(worker, batched=True))
    assert batched == single
    assert worker.batcher.rows == len(single)
    assert worker.batcher.batches < len(single)  # calls really were gathered into shared passes
    if graphs:
        assert worker.model.stats.graph_calls > 0


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=5)


async def _one_call_per_step(worker: TargetWorker, rid: str, prefix: list[int], n: int, params) -> list:
    """n passes of a target-only request, one verify call each (the prompt's last token is the first pending)."""
    out, start, pending = [], len(prefix) - 1, prefix[-1]
    for step in range(n):
        v = await worker.verify(VerifyCall(rid, start, pending, Draft([]), params, step,
                                           prefix=prefix[:-1] if step == 0 else None))
        out.append(v)
        start, pending = start + len(v.tokens), v.tokens[-1]
    return out


async def _multi_step(worker: TargetWorker, rid: str, prefix: list[int], params, steps: int, remaining: int,
                      stop_ids=(), release_after: int | None = None) -> list:
    call = VerifyCall(rid, len(prefix) - 1, prefix[-1], Draft([]), params, 0, prefix=prefix[:-1], steps=steps,
                      remaining=remaining, stop_ids=tuple(stop_ids))
    out = []
    async for v in worker.verify_steps(call):
        out.append(v)
        if release_after is not None and len(out) == release_after:
            await worker.release([rid])
    return out


def test_a_multi_step_call_equals_one_call_per_step_beside_other_requests(tiny_models):
    """The worker feeds a request's passes itself, batched with another request's one-step calls: both get exactly
    what they get alone (seeded sampling: the step counter keys the randomness)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 128, (9,), generator=g).tolist(), torch.randint(0, 128, (5,), generator=g).tolist()
    alone_a = asyncio.run(_one_call_per_step(_worker(tiny_models["llama"], False), "a", a, 12, SEEDED))
    alone_b = asyncio.run(_one_call_per_step(_worker(tiny_models["llama"], False), "b", b, 12, GREEDY))
    worker = _worker(tiny_models["llama"], False)

    async def both():
        return await asyncio.gather(_multi_step(worker, "a", a, SEEDED, steps=12, remaining=100),
                                    _one_call_per_step(worker, "b", b, 12, GREEDY))

    got_a, got_b = asyncio.run(both())
    assert got_a == alone_a and got_b == alone_b
    assert worker.batcher.batches < worker.batcher.rows  # the two requests' passes were shared


def test_a_multi_step_call_stops_at_the_budget_a_stop_id_or_a_release(tiny_models):
    prompt = [3, 14, 15, 92, 65]
    full = asyncio.run(_one_call_per_step(_worker(tiny_models["llama"], False), "r", prompt, 10, GREEDY))
    tokens = [v.tokens[0] for v in full]
    assert asyncio.run(_multi_step(_worker(tiny_models["llama"], False), "r", prompt, GREEDY, 8, 5)) == full[:5]
    stop = next(i for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    got = asyncio.run(_multi_step(_worker(tiny_models["llama"], False), "r", prompt, GREEDY, 8, 100,
                                  stop_ids=[tokens[stop]]))
    assert got == full[:stop + 1]
    worker = _worker(tiny_models["llama"], False)
    got = asyncio.run(_multi_step(worker, "r", prompt, GREEDY, 8, 100, release_after=3))
    assert got == full[:3]  # no pass after the release, and the slot stays free
    assert worker.slots.slot_of("r") is None
