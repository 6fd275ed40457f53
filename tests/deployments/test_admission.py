"""Admission to KV-cache slots at the seam (no Ray): slot sizing from a memory budget, the FIFO grant order, the
queue bound, release on finish and on cancel, preemption and idle reclaim; and a target worker (a plain class)
serving more requests than it has slots, without one cache miss."""

from __future__ import annotations

import asyncio

import pytest

from deployments.admission import QueueFull, SlotQueue, kv_bytes_per_slot, kv_cache_slots
from deployments.config import TargetConfig

GIB = 2**30


async def _settle() -> None:
    """Let every ready task run (a grant reaches its waiter through a few hops of the event loop)."""
    for _ in range(10):
        await asyncio.sleep(0)


def test_slots_from_the_memory_budget():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, float32: 2 * 30 * 3 * 64 * 4 = 46,080 bytes a position
    per_slot = kv_bytes_per_slot(30, 3, 64, 2048 + 16, 4)
    assert per_slot == 46_080 * 2064
    assert kv_cache_slots(30, 3, 64, 2064, 4, budget_bytes=None, max_slots=16) == 16  # no budget: the cap
    assert kv_cache_slots(30, 3, 64, 2064, 4, budget_bytes=per_slot * 5 + 1, max_slots=16) == 5
    assert kv_cache_slots(30, 3, 64, 2064, 4, budget_bytes=100 * GIB, max_slots=16) == 16  # the cap holds
    # Llama-3-70B in bfloat16 over 8 ranks: 80 layers, 8 KV heads of 128 -> one head a rank
    assert kv_bytes_per_slot(80, 8, 128, 8192, 2, tensor_parallel_size=8) == 2 * 80 * 1 * 8192 * 128 * 2
    assert kv_cache_slots(80, 8, 128, 8192, 2, budget_bytes=40 * GIB, max_slots=256,
                          tensor_parallel_size=8) == 40 * GIB // (2 * 80 * 8192 * 128 * 2)
    with pytest.raises(ValueError, match="holds no slot"):
        kv_cache_slots(30, 3, 64, 2064, 4, budget_bytes=per_slot - 1, max_slots=16)


def test_kv_cache_config_is_typed():
    assert TargetConfig().kv_cache_gb is None and TargetConfig().max_waiting == 64
    assert TargetConfig(kv_cache_gb=1.5).kv_cache_gb == 1.5
    with pytest.raises(ValueError):
        TargetConfig(kv_cache_gb=0)
    with pytest.raises(ValueError):
        TargetConfig(max_waiting=-1)


def test_slots_are_granted_first_come_first_served():
    async def main():
        q = SlotQueue(2, max_waiting=8)
        assert (await q.acquire("a"))[0] == 0 and (await q.acquire("b"))[0] == 1
        assert await q.acquire("a") == (0, 0.0)  # a holder gets its own slot back
        order = []

        async def wait(rid):
            slot, _ = await q.acquire(rid)
            order.append((rid, slot))

        waiters = [asyncio.ensure_future(wait(r)) for r in ("c", "d", "e")]
        await _settle()
        assert q.waiting == 3 and not order
        q.release("b")
        await _settle()
        assert order == [("c", 1)]  # the longest waiting request, in the freed slot
        q.release("a")
        q.release("c")
        await asyncio.gather(*waiters)
        assert order == [("c", 1), ("d", 0), ("e", 1)] and q.waiting == 0

    asyncio.run(main())


def test_a_full_queue_refuses_at_once_but_a_running_request_still_queues():
    async def main():
        q = SlotQueue(1, max_waiting=1)
        await q.acquire("a")
        queued = asyncio.ensure_future(q.acquire("b"))
        await _settle()
        with pytest.raises(QueueFull):
            await q.acquire("c")
        assert q.rejected == 1
        moved = asyncio.ensure_future(q.acquire("d", bounded=False))  # failed over here: waits its turn
        await _settle()
        assert q.waiting == 2
        q.release("a")
        assert (await queued)[0] == 0 and not moved.done()
        q.release("b")
        assert (await moved)[0] == 0

    asyncio.run(main())


def test_release_and_cancel_give_the_place_and_the_slot_back():
    freed = []

    async def main():
        q = SlotQueue(1, max_waiting=4, on_free=freed.append)
        await q.acquire("a")
        gone = asyncio.ensure_future(q.acquire("b"))  # its client disconnects while it waits
        released = asyncio.ensure_future(q.acquire("c"))  # its coordinator releases it while it waits
        last = asyncio.ensure_future(q.acquire("d"))
        await _settle()
        gone.cancel()
        assert q.release("c") is True
        await _settle()
        assert gone.cancelled() and released.cancelled() and q.waiting == 1
        assert q.release("a") is True  # finished: its slot goes to the next one still waiting
        assert (await last)[0] == 0 and list(q.holders) == ["d"] and freed == ["a"]
        assert q.release("a") is False  # twice is harmless

    asyncio.run(main())


def test_preemption_retires_a_slot_and_is_bounded():
    async def main():
        q = SlotQueue(3, max_waiting=4)
        for rid in "abc":
            await q.acquire(rid)
        assert q.preempt() == "c"  # the youngest holder
        assert q.capacity == 2 and q.preempted == 1
        waiting = asyncio.ensure_future(q.acquire("c", bounded=False))
        await _settle()
        assert q.preempt("a") == "a" and q.capacity == 1
        assert not waiting.done()  # both slots were retired, not granted
        assert q.preempt() is None and q.preempted == 2  # the last slot stays in service
        q.release("b")
        assert (await waiting)[0] in (0, 1, 2) and q.capacity == 1

    asyncio.run(main())


def test_a_silent_holder_loses_its_slot_to_a_waiting_request():
    now = [0.0]

    async def main():
        q = SlotQueue(1, max_waiting=4, idle_s=0.05, clock=lambda: now[0])
        await q.acquire("dead")  # its coordinator died and nobody resumed it
        now[0] = 10.0
        slot, waited = await q.acquire("next")
        assert slot == 0 and waited == 0.0 and list(q.holders) == ["next"]

    asyncio.run(main())


def test_target_worker_serves_more_requests_than_slots_without_a_cache_miss(tiny_models):
    """Four concurrent requests, two slots: two wait, nobody is evicted; every verdict equals the one of a worker
    with a slot for every request."""
    from deployments.messages import VerifyCall
    from deployments.target_replica import TargetWorker
    from deployments.workers import CACHE_MISS
    from pipeline.config import SamplingParams
    from pipeline.step import Draft, Verdict

    params = SamplingParams(temperature=0.0, seed=0)
    prompts = {rid: [(5 * i + n) % 128 for i in range(9 + n)] for n, rid in enumerate("abcd")}

    async def run_request(worker, rid):
        prompt = prompts[rid]
        await worker.admit(rid)
        out = []
        context = list(prompt)
        for step in range(4):
            start = len(context) - 1
            call = VerifyCall(rid, start, context[-1], Draft([1, 2]), params, step,
                              prefix=context[:-1] if step == 0 else None)
            verdict = await worker.verify(call)
            assert verdict != CACHE_MISS and isinstance(verdict, Verdict)
            out.append(verdict.tokens)
            context += verdict.tokens
        await worker.release([rid])
        return out

    async def serve(num_slots):
        worker = TargetWorker(str(tiny_models["llama"]), max_batch_size=num_slots, max_seq_len=64, max_waiting=8)
        outs = await asyncio.gather(*(run_request(worker, rid) for rid in "abcd"))
        assert worker.slots.granted == 4 and not worker.slots.holders and worker.slots.preempted == 0
        return outs

    assert asyncio.run(serve(2)) == asyncio.run(serve(4))
