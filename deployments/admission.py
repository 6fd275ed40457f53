"""Admission to a worker's KV-cache slots: granted first come first served, with a bounded queue in front.

A worker (target or drafter) owns `num_slots` cache slots. A request *acquires* one before its first step and
*releases* it when it finishes, fails, is cancelled or abandoned. While every slot is held, an acquire waits in a
FIFO queue; when the queue already holds `max_waiting` requests, a bounded acquire fails at once with `QueueFull`
(the coordinator then tries another replica, and answers 429 when every one is full). A request waiting for a
slot never takes one away from a request that holds it: nothing is evicted and replayed.

Preemption is the one exception, and only under memory pressure: when a pass runs out of memory, the worker takes
the youngest holder's slot back and retires that slot (`preempt`; one slot always stays in service), so the passes
that follow are smaller. A preempted request queues again and replays its prompt. A holder silent for `idle_s`
(its coordinator died and nobody resumed it) loses its slot to a waiting request (`reclaim_idle`).

`kv_cache_slots` sizes the slots from a memory budget: a pure function of the model's shape, `max_len` and dtype.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable, Optional

QUEUE_FULL = "queue_full"  # a worker's answer to a bounded acquire when its queue is full
PREEMPTED = "preempted"  # a worker's answer to a call whose request lost its slot under memory pressure
IDLE_RECLAIM_S = 30.0  # a slot holder that has not called for this long loses its slot to a waiting request


class QueueFull(Exception):
    """Every slot is held and `max_waiting` requests already wait."""


def kv_bytes_per_slot(num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype_bytes: int,
                      tensor_parallel_size: int = 1) -> int:
    """Bytes one slot's keys and values take on one rank: K and V, per layer, [kv heads / TP, max_len, head_dim]."""
    assert min(num_layers, num_kv_heads, head_dim, max_len, dtype_bytes, tensor_parallel_size) >= 1
    heads = -(-num_kv_heads // tensor_parallel_size)  # a rank holds its share of the KV heads (rounded up)
    return 2 * num_layers * heads * max_len * head_dim * dtype_bytes


def kv_cache_slots(num_layers: int, num_kv_heads: int, head_dim: int, max_len: int, dtype_bytes: int,
                   budget_bytes: Optional[int], max_slots: int, tensor_parallel_size: int = 1) -> int:
    """KV-cache slots a worker allocates: as many as `budget_bytes` holds, at most `max_slots` (the batch cap).
    budget None: `max_slots`. A budget too small for one slot is an error, with the size one slot needs."""
    assert max_slots >= 1, f"max_slots must be >= 1, got {max_slots}"
    if budget_bytes is None:
        return max_slots
    per_slot = kv_bytes_per_slot(num_layers, num_kv_heads, head_dim, max_len, dtype_bytes, tensor_parallel_size)
    fits = budget_bytes // per_slot
    if fits < 1:
        raise ValueError(f"a KV-cache budget of {budget_bytes / 2**30:.3f} GiB holds no slot: one slot of "
                         f"{max_len} positions needs {per_slot / 2**30:.3f} GiB (lower max_seq_len or raise "
                         "kv_cache_gb)")
    return int(min(max_slots, fits))


class SlotQueue:
    """A worker's slot grants, on its event loop. Slots are handed out FIFO; `release` gives a slot to the
    longest waiting request. Not thread-safe: call it from the worker's event loop only."""

    def __init__(self, num_slots: int, max_waiting: int, idle_s: float = IDLE_RECLAIM_S,
                 on_free: Optional[Callable[[str], None]] = None, on_queue: Optional[Callable[[int], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert num_slots >= 1 and max_waiting >= 0, f"num_slots={num_slots}, max_waiting={max_waiting}"
        self.idle_s = idle_s  # a holder silent this long loses its slot to a waiting request
        self._seen: dict[str, float] = {}  # holder -> its last grant or touch()
        self._on_free = on_free  # called with a request id whenever it loses its slot (the worker drops its cache)
        self._on_queue = on_queue  # called with the queue's length whenever it changes (a gauge)
        self.seq: dict[str, int] = {}  # holder -> grant number (larger: younger)
        self.capacity = num_slots  # slots in service (shrink() retires some under memory pressure)
        self.max_waiting = max_waiting
        self._clock = clock
        self._free = list(range(num_slots - 1, -1, -1))  # slot 0 first
        self.holders: OrderedDict[str, int] = OrderedDict()  # request id -> slot, in grant order (oldest first)
        self._waiting: OrderedDict[str, asyncio.Future] = OrderedDict()  # request id -> its grant, FIFO
        self._retire = 0  # slots to take out of service as they come free
        self.granted = self.rejected = self.preempted = 0  # statistics
        self._queue_changed()  # the gauge starts at 0 rather than appearing with the first wait

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def slot_of(self, request_id: str) -> Optional[int]:
        return self.holders.get(request_id)

    async def acquire(self, request_id: str, bounded: bool = True) -> tuple[int, float]:
        """-> (the request's slot, seconds it waited). A holder gets its own slot back at once. bounded: raise
        QueueFull instead of waiting when `max_waiting` requests already wait (a request that already runs, e.g.
        one moved here after a failure, passes bounded=False and always waits its turn)."""
        if request_id in self.holders:
            return self.holders[request_id], 0.0
        if request_id in self._waiting:  # a second acquire of a queued request shares its place
            fut = self._waiting[request_id]
        else:
            if self._free and not self._waiting:
                return self._grant(request_id), 0.0
            if bounded and len(self._waiting) >= self.max_waiting:
                self.rejected += 1
                raise QueueFull(f"{len(self.holders)} slots held, {len(self._waiting)} requests waiting")
            fut = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = fut
            self._queue_changed()
        t0 = self._clock()
        try:
            while True:
                try:
                    slot = await asyncio.wait_for(asyncio.shield(fut), self.idle_s / 4)
                    break
                except asyncio.TimeoutError:
                    self.reclaim_idle()
        except asyncio.CancelledError:
            self._cancel_wait(request_id, fut)
            raise
        return slot, self._clock() - t0

    def touch(self, request_id: str) -> None:
        """The holder called (a step): it is alive."""
        if request_id in self.holders:
            self._seen[request_id] = self._clock()

    def reclaim_idle(self) -> list[str]:
        """Free the slots of holders silent for `idle_s` (their coordinator died and nobody resumed them), while
        requests wait. A reclaimed request that comes back queues again and replays its prompt."""
        if not self._waiting:
            return []
        now = self._clock()
        idle = [r for r in self.holders if now - self._seen.get(r, now) >= self.idle_s]
        for r in idle:
            self.release(r)
        return idle

    def release(self, request_id: str) -> bool:
        """The request is done here (finished, failed, cancelled, abandoned): free its slot, or drop its place in
        the queue. -> whether it held or awaited one."""
        fut = self._waiting.pop(request_id, None)
        if fut is not None:
            if not fut.done():
                fut.cancel()
            self._queue_changed()
            return True
        slot = self.holders.pop(request_id, None)
        if slot is None:
            return False
        self._seen.pop(request_id, None)
        self.seq.pop(request_id, None)
        if self._on_free is not None:
            self._on_free(request_id)
        self._put_back(slot)
        return True

    def can_preempt(self) -> bool:
        """Whether a slot can still be retired (one always stays in service)."""
        return self.capacity - self._retire > 1 and bool(self.holders)

    def preempt(self, victim: Optional[str] = None) -> Optional[str]:
        """Under memory pressure: retire one slot (never the last) and take a holder's slot back: `victim`, or the
        youngest holder. -> the preempted request id, or None when nothing can be preempted."""
        if not self.can_preempt():
            return None
        if victim is None or victim not in self.holders:
            victim = next(reversed(self.holders))
        self._retire += 1
        self.preempted += 1
        self.release(victim)  # its slot is the one retired: the passes that follow have one row less
        return victim

    # -- internals -------------------------------------------------------------------------------------
    def _grant(self, request_id: str) -> int:
        slot = self._free.pop()
        self.holders[request_id] = slot
        self._seen[request_id] = self._clock()
        self.granted += 1
        self.seq[request_id] = self.granted
        return slot

    def _put_back(self, slot: int) -> None:
        if self._retire > 0:
            self._retire -= 1
            self.capacity -= 1
            return
        self._free.append(slot)
        if not self._waiting:
            return
        while self._free and self._waiting:
            request_id, fut = self._waiting.popitem(last=False)
            if fut.done():  # cancelled while queued
                continue
            fut.set_result(self._grant(request_id))
        self._queue_changed()

    def _queue_changed(self) -> None:
        if self._on_queue is not None:
            self._on_queue(len(self._waiting))

    def _cancel_wait(self, request_id: str, fut: asyncio.Future) -> None:
        """The waiter went away: leave the queue, or hand back the slot granted as it was cancelled."""
        if self._waiting.get(request_id) is fut:
            del self._waiting[request_id]
            self._queue_changed()
        elif fut.done() and not fut.cancelled() and self.holders.get(request_id) == fut.result():
            self.release(request_id)
