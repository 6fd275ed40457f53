"""Drafter replicas: a Serve host plus a worker actor holding a drafter (`pipeline.drafters.ModelDrafter`).

Context protocol, per request: the worker mirrors the request's context. A call names `base`, a length of
context the worker already holds, and sends only `new = context[base:]` (a few ids per step instead of
the whole context). A worker that holds less than `base` (restarted, request moved) answers CACHE_MISS and
the coordinator resends with base 0. The drafter's own KV cache keeps the longest prefix that still
matches, so a block drafted optimistically and then rejected costs nothing to roll back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from deployments import metrics, tracing
from deployments.batching import StepBatcher
from deployments.config import DRAFTER, AppConfig
from deployments.target_replica import CACHE_SLACK
from deployments.workers import CACHE_MISS, ModelHost, spawn_workers, warm_up

logger = logging.getLogger(__name__)


@dataclass
class ProposeRow:
    request_id: str
    base: int  # context length the worker already mirrors for this request
    new: list[int]  # context[base:]
    num_draft: int  # tokens wanted (may exceed K by one: the guess of the bonus token, for overlap)
    params: Any  # pipeline.config.SamplingParams (seed fixed)
    step: int  # the target pass these drafts are for (randomness key)
    draft_top_k: int


class DrafterWorker:
    """Holds one drafter model and serves batched propose calls."""

    def __init__(
        self, model: Optional[str], max_batch_size: int, max_seq_len: int, device: str = "cpu",
        dtype: str = "float32", torch_threads: int = 1, batch_wait_ms: float = 0.0,
        rank: int = 0, world_size: int = 1,
    ) -> None:
        import torch

        torch.set_num_threads(torch_threads)
        from pipeline.drafters import ModelDrafter
        from pipeline.models.loader import load_model
        from pipeline.models.store import DEMO_DRAFT

        from pipeline.models.graphs import graphs_on_cuda

        runner, _ = load_model(model or DEMO_DRAFT, device=device, dtype=dtype)  # None: the shipped demo drafter
        runner = graphs_on_cuda(runner)  # CUDA: captured decode steps; CPU unchanged
        runner.allocate(max_batch_size, max_seq_len + CACHE_SLACK)
        warm_up(runner, max_batch_size, "drafter")
        self.drafter = ModelDrafter(runner)
        self._ctx: dict[str, list[int]] = {}
        self.batcher = StepBatcher(self._run_batch, max_batch_size, batch_wait_ms, name="drafter")
        self.compute_s = 0.0

    async def info(self) -> dict[str, Any]:
        i = self.drafter.model.info
        return {"name": i.name, "path": i.path, "vocab_size": i.vocab_size}

    async def ping(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batcher.batches, "rows": self.batcher.rows, "compute_s": self.compute_s,
                "requests": len(self._ctx), "active_requests": self.batcher.active()}

    async def propose(self, row: ProposeRow, trace: Optional[dict] = None) -> Any:
        """-> {"token_ids": [n] list, "top_ids": [n, k] int64 array, "top_probs": [n, k] float32 array} or
        CACHE_MISS."""
        with tracing.span("drafter.propose", parent=trace, request_id=row.request_id, base=row.base,
                          num_draft=row.num_draft):
            return await self.batcher.submit(row.request_id, row)

    async def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.batcher.forget(rid)
        await self.batcher.run_in_worker(lambda: self._release(request_ids))  # between passes, never during one

    def _release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._ctx.pop(rid, None)
            self.drafter.release(rid)

    def _run_batch(self, rows: Sequence[ProposeRow]) -> list[Any]:
        import torch

        from pipeline.drafters import DraftRequest
        from pipeline.sampling import SamplingTensors

        t0 = time.perf_counter()
        results: list[Any] = [None] * len(rows)
        live, reqs = [], []
        for b, r in enumerate(rows):
            held = self._ctx.get(r.request_id)
            if held is None and r.base > 0 or held is not None and len(held) < r.base:
                results[b] = CACHE_MISS
                continue
            ctx = (held[: r.base] if held is not None else []) + list(r.new)
            self._ctx[r.request_id] = ctx
            live.append(b)
            reqs.append(DraftRequest(r.request_id, ctx, r.num_draft))
        if live:
            k = max(r.num_draft for r in reqs)
            lrows = [rows[b] for b in live]
            sampling = SamplingTensors.from_params([r.params for r in lrows])
            steps = torch.tensor([r.step for r in lrows], dtype=torch.int64)
            top_k = max(r.draft_top_k for r in lrows)
            with torch.inference_mode():
                block = self.drafter.propose(reqs, k, sampling, steps, top_k).to("cpu")
            for j, b in enumerate(live):
                n = reqs[j].num_draft
                results[b] = {
                    "token_ids": block.token_ids[j, :n].tolist(),
                    # the whole support the draft sampled from (the batch's top-k), or verification is inexact
                    "top_ids": block.top_ids[j, :n].numpy().copy(),  # numpy: 15x cheaper to pickle than torch
                    "top_probs": block.top_probs[j, :n].numpy().copy(),
                }
        self.compute_s += time.perf_counter() - t0
        metrics.record_draft_latency(time.perf_counter() - t0, scope="compute")
        return results


class DrafterServer(ModelHost):
    """The Serve replica of the drafter deployment."""

    async def __init__(self, config: dict[str, Any]) -> None:
        cfg = AppConfig.model_validate(config)
        d = cfg.drafter
        self.workers = spawn_workers(
            DrafterWorker, DRAFTER, d.resources, 1,
            model=d.model, max_batch_size=d.max_batch_size, max_seq_len=cfg.target.max_seq_len,
            device=d.device, dtype=d.dtype, torch_threads=d.resources.torch_threads, batch_wait_ms=d.batch_wait_ms,
        )
        self._info = await self.workers[0].info.remote()

