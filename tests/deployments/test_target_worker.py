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
