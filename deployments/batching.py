"""Step-level batching inside a worker actor: concurrent calls from many requests become one model pass.

Calls arrive as asyncio coroutines on the worker's event loop; a single loop task collects the queued
rows and runs them through `run_batch` in one dedicated thread (the model is not thread-safe, and the
event loop must keep receiving calls while a pass runs). While a pass runs, the next calls queue up and
form the next batch: continuous batching without any waiting. Before a pass starts, it waits at most
`wait_ms` for requests known to be active on this worker that have not sent their call yet; a lone
request never waits.

Every decode row joins the next pass. Rows that feed many tokens (a row's `cost` attribute above
SMALL_ROW: prompt prefills) join while their summed cost stays within `token_budget`, at least one per
pass. Long prompt prefills thereby go one or a few per
pass while the decode steps of running requests ride along, instead of every running request waiting until
all new prompts are prefilled (the idea of chunked prefill, at request granularity).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from deployments import metrics

_ACTIVE_WINDOW_S = 1.0  # a request that called within this window is expected to call again
SMALL_ROW = 128  # rows feeding at most this many tokens (decode steps: K + 1) always join a pass
AGAIN = "again"  # a row's result meaning "not done: put me in the next pass too" (chunked prefill)


class StepBatcher:
    def __init__(
        self,
        run_batch: Callable[[Sequence[Any]], list[Any]],  # rows -> one result per row (in a worker thread)
        max_batch: int,
        wait_ms: float = 0.0,
        name: str = "batcher",
        token_budget: int | None = None,  # None: no limit
    ) -> None:
        self._run_batch, self.max_batch, self.wait_s = run_batch, max_batch, wait_ms / 1000.0
        self.token_budget = token_budget
        self.name = name
        self._queue: list[tuple[str, Any, asyncio.Future]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._last_seen: dict[str, float] = {}
        self.batches = 0  # statistics: passes run and rows in them
        self.rows = 0

    def _ensure_started(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def submit(self, key: str, row: Any) -> Any:
        """Queue one row (key: the request id; one row per key per pass) and wait for its result."""
        self._ensure_started()
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((key, row, fut))
        self._last_seen[key] = time.monotonic()
        self._wake.set()
        return await fut

    def active(self, window_s: float = 10.0) -> int:
        """Requests that submitted a row within the last `window_s` seconds (the autoscaling load: it cannot
        leak, unlike per-request state left behind by a call that lands after its request was released). The
        window spans several steps: on a loaded machine (a replica starting beside the running ones) a step takes
        seconds, and a shorter window reads that as load gone and stops the scale-up it caused."""
        now = time.monotonic()
        for key in [k for k, t in self._last_seen.items() if now - t > max(window_s, _ACTIVE_WINDOW_S)]:
            del self._last_seen[key]  # (also bounds the table when wait_ms is 0 and _expected never runs)
        return len(self._last_seen)

    async def run_in_worker(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the thread that runs the passes, so never while a pass runs: for changes to state the passes
        read (a released request's slot, its cached context). Done on the event loop instead, a release that lands
        during a pass for that request tore its entries out from under it (a KeyError in the drafter, seen in
        CI under autoscaling load)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def forget(self, key: str) -> None:
        """The request finished here: stop expecting calls from it."""
        self._last_seen.pop(key, None)

    def _expected(self) -> int:
        now = time.monotonic()
        stale = [k for k, t in self._last_seen.items() if now - t > _ACTIVE_WINDOW_S]
        for k in stale:
            del self._last_seen[k]
        return min(len(self._last_seen), self.max_batch)

    def _take(self) -> list[tuple[str, Any, asyncio.Future]]:
        batch, rest, keys = [], [], set()
        budget, took_large = self.token_budget, False
        for item in self._queue:
            key, row, fut = item
            if fut.done():  # cancelled by its caller while queued
                continue
            if key in keys or len(batch) >= self.max_batch:
                rest.append(item)
                continue
            cost = getattr(row, "cost", 1)
            if budget is not None and cost > SMALL_ROW:  # a prefill: bounded per pass, at least one
                if took_large and cost > budget:
                    rest.append(item)
                    continue
                budget -= cost
                took_large = True
            keys.add(key)
            batch.append(item)
        self._queue = rest
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            if self.wait_s > 0:
                deadline = time.monotonic() + self.wait_s
                while len({k for k, _, _ in self._queue}) < self._expected():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), left)
                    except asyncio.TimeoutError:
                        break
            batch = self._take()
            if not batch:
                continue
            metrics.set_queue_depth(len(self._queue), stage=self.name)  # calls left for the next pass
            rows = [row for _, row, _ in batch]
            try:
                results = await loop.run_in_executor(self._pool, self._run_batch, rows)
            except Exception as err:  # noqa: BLE001 - handed to every caller of the failed pass
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(err)
                continue
            self.batches += 1
            self.rows += len(rows)
            again = []
            for item, result in zip(batch, results):
                if result == AGAIN:
                    again.append(item)
                elif not item[2].done():
                    item[2].set_result(result)
            self._queue[:0] = again  # first in line for the next pass
