"""Target replicas: a Serve host plus a worker actor that holds the target model and its KV-cache slots.

The worker runs the target side of the step (`pipeline.step.verify_and_accept`: one pass over the rows' drafts,
verification and acceptance) and returns each request's `Verdict`: the tokens it emits. Concurrent requests'
calls are batched into one target pass (`StepBatcher`).

Cache protocol, per request: a call feeds `[pending] + draft` at absolute position `start`; the worker's
cache must hold the request's committed tokens at positions [0, start). It knows it does when it fed this
request up to at least `start` before (rejected tokens beyond are simply overwritten: rollback is free).
Otherwise the call must carry `prefix` (the committed tokens [0, start)), which the worker prefills first;
without it the answer is CACHE_MISS and the coordinator resends with the prefix (replica restarted,
request moved after a failure, or slot evicted).

Prefill is chunked: a prefix is fed PREFILL_CHUNK tokens per target pass (the row goes back into the queue
until done, then verifies in the same pass as its last chunk), so a long prompt does not stall the decode
steps of the requests already running on the replica.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any, Optional, Sequence

import torch

from deployments import metrics, tracing
from deployments.batching import AGAIN, StepBatcher
from deployments.config import TARGET, AppConfig
from deployments.messages import PREFILL_CHUNK, VerifyCall
from deployments.tp_group import leader_runner, spawn_tensor_parallel_workers
from deployments.workers import CACHE_MISS, ModelHost, spawn_workers, warm_up
from pipeline.models.graphs import graphs_on_cuda
from pipeline.models.loader import load_model
from pipeline.sampling import SamplingTensors
from pipeline.step import CACHE_SLACK, Verdict, pack, verify_and_accept

logger = logging.getLogger(__name__)

PREFILL_TOKEN_BUDGET = 512  # prompt tokens prefilled per target pass beyond the first prefill


class TargetWorker:
    """Holds one target model (one tensor-parallel rank) and serves batched verify calls."""

    def __init__(
        self, model: Optional[str], max_batch_size: int, max_seq_len: int, device: str = "cpu",
        dtype: str = "float32", torch_threads: int = 1, batch_wait_ms: float = 1.0,
        rank: int = 0, world_size: int = 1, tp_init_method: Optional[str] = None, tp_allreduce: str = "auto",
    ) -> None:
        assert rank == 0, "ranks > 0 of a tensor-parallel replica are tp_group.RankFollower actors"
        torch.set_num_threads(torch_threads)
        if world_size > 1:  # rank 0 of a tensor-parallel group: each pass is broadcast to the other ranks
            self.model = leader_runner(model, world_size, tp_init_method, device, dtype, allreduce=tp_allreduce)
        else:
            # CUDA: the static-shape graph runner (as the engine and tensor-parallel ranks use); CPU unchanged.
            self.model = graphs_on_cuda(load_model(model, device=device, dtype=dtype)[0])
        max_seq_len = min(max_seq_len, self.model.info.max_position_embeddings or max_seq_len)
        self.max_seq_len = max_seq_len
        self.model.allocate(max_batch_size, max_seq_len + CACHE_SLACK)
        warm_up(self.model, max_batch_size, "target")
        self.device = torch.device(device)
        self.num_slots = max_batch_size
        self._slots: OrderedDict[str, int] = OrderedDict()  # request id -> slot, least recently used first
        self._fed: dict[str, int] = {}  # request id -> positions [0, fed) written by its calls
        self._prefilling: dict[str, int] = {}  # request id -> prompt tokens prefilled so far (chunked)
        self._free = list(range(max_batch_size - 1, -1, -1))
        self.batcher = StepBatcher(self._run_batch, max_batch_size, batch_wait_ms, name="target",
                                   token_budget=PREFILL_TOKEN_BUDGET)
        self.compute_s = 0.0

    # -- calls -------------------------------------------------------------------------------------------
    async def info(self) -> dict[str, Any]:
        i = self.model.info
        return {"name": i.name, "path": i.path, "vocab_size": i.vocab_size, "eos_token_ids": list(i.eos_token_ids),
                "max_seq_len": self.max_seq_len, "num_slots": self.num_slots}

    async def ping(self) -> bool:
        return True

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batcher.batches, "rows": self.batcher.rows, "compute_s": self.compute_s,
                "slots_used": len(self._slots), "active_requests": self.batcher.active()}

    async def verify(self, row: VerifyCall, trace: Optional[dict] = None) -> Verdict | str:
        """-> the row's Verdict, or CACHE_MISS."""
        with tracing.span("target.verify", parent=trace, request_id=row.request_id, start=row.start,
                          num_draft=len(row.draft.tokens), prefill=row.prefix is not None):
            return await self.batcher.submit(row.request_id, row)

    async def release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self.batcher.forget(rid)
        await self.batcher.run_in_worker(lambda: self._release(request_ids))  # between passes, never during one

    def _release(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._prefilling.pop(rid, None)
            slot = self._slots.pop(rid, None)
            self._fed.pop(rid, None)
            if slot is not None:
                self._free.append(slot)

    # -- the pass (worker thread) ------------------------------------------------------------------------
    def _slot_for(self, rid: str, pinned: set[str]) -> int:
        if rid in self._slots:
            self._slots.move_to_end(rid)
            return self._slots[rid]
        if not self._free:  # evict the least recently used request not in this pass; it will replay
            victim = next(r for r in self._slots if r not in pinned)
            self._free.append(self._slots.pop(victim))
            self._fed.pop(victim, None)
            self._prefilling.pop(victim, None)  # a half-done prefill restarts from 0 in its new slot
            logger.info("evicted %s from its KV-cache slot", victim)
        self._slots[rid] = self._free.pop()
        return self._slots[rid]

    def _run_batch(self, rows: Sequence[VerifyCall]) -> list[Any]:
        t0 = time.perf_counter()
        results: list[Any] = [None] * len(rows)
        live: list[int] = []
        pinned = {r.request_id for r in rows}
        with torch.inference_mode():
            for b, r in enumerate(rows):
                if r.prefix is not None:
                    assert len(r.prefix) == r.start, f"prefix has {len(r.prefix)} tokens, start is {r.start}"
                    slot = self._slot_for(r.request_id, pinned)
                    done = self._prefilling.pop(r.request_id, 0)
                    if r.start > done:  # chunked prefill: at most PREFILL_CHUNK prompt tokens per pass
                        end = min(r.start, done + PREFILL_CHUNK)
                        tokens = torch.tensor([r.prefix[done:end]], dtype=torch.int64)  # runners move it
                        self.model.forward(tokens, torch.full((1,), done, dtype=torch.int64),
                                           torch.tensor([slot], dtype=torch.int64), end - done - 1)
                        if end < r.start:  # the rest in later passes; running requests step in between
                            self._prefilling[r.request_id] = end
                            results[b] = AGAIN
                            continue
                    self._fed[r.request_id] = r.start
                elif self._fed.get(r.request_id, -1) < r.start:
                    results[b] = CACHE_MISS
                    continue
                live.append(b)
            if live:
                outs = self._verify_rows([rows[b] for b in live], pinned)
                for b, out in zip(live, outs):
                    results[b] = out
        self.compute_s += time.perf_counter() - t0
        metrics.record_verify_latency(time.perf_counter() - t0, scope="compute")
        return results

    def _verify_rows(self, rows: Sequence[VerifyCall], pinned: set[str]) -> list[Verdict]:
        dev = self.device
        # Tokens, positions and slots stay on the host: runners read the positions without a device sync, the graph
        # path sends all three in one copy, and a tensor-parallel leader broadcasts them from the host anyway (a
        # device copy made it copy them back, a sync).
        pending = torch.tensor([r.pending for r in rows], dtype=torch.int64)
        slots = torch.tensor([self._slot_for(r.request_id, pinned) for r in rows], dtype=torch.int64)
        positions = torch.tensor([r.start for r in rows], dtype=torch.int64)
        sampling = SamplingTensors.from_params([r.params for r in rows], dev)
        steps = torch.tensor([r.step for r in rows], dtype=torch.int64, device=dev)
        verdicts = verify_and_accept(self.model, pending, pack([r.draft for r in rows]), positions, slots,
                                     sampling, steps)
        for r in rows:
            self._fed[r.request_id] = max(self._fed.get(r.request_id, 0), r.start + 1 + len(r.draft.tokens))
        return verdicts


class TargetServer(ModelHost):
    """The Serve replica of the target deployment: starts the workers, answers control calls, health."""

    async def __init__(self, config: dict[str, Any]) -> None:
        cfg = AppConfig.model_validate(config)
        t = cfg.target
        spawn = spawn_tensor_parallel_workers if t.tensor_parallel_size > 1 else spawn_workers
        self.workers = spawn(
            TargetWorker, TARGET, t.resources, t.tensor_parallel_size,
            model=t.model, max_batch_size=t.max_batch_size, max_seq_len=t.max_seq_len, device=t.device,
            dtype=t.dtype, torch_threads=t.resources.torch_threads, batch_wait_ms=t.batch_wait_ms,
            **({"tp_allreduce": t.tp_allreduce} if t.tensor_parallel_size > 1 else {}),
        )
        self._info = await self.workers[0].info.remote()  # waits for the model to load

