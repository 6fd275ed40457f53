"""Worker actors behind the Serve replicas, and how the coordinator finds and calls them.

Each drafter/target Serve replica (a *host*) starts its worker actors as named Ray actors:
    namespace "specserve-workers", name "{app}:{role}:{replica id}:{rank}"
Workers are owned by their host, so they die with it (Ray fate-sharing) and Serve's restart of a replica
brings up new ones. The coordinator lists the named actors to find the live workers of its app and calls
rank 0 directly: one plain actor call per step (0.8 ms here) instead of a Serve handle call (2.5 ms).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

import ray
import torch
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.admission import kv_cache_slots
from deployments.autoscaling import ONGOING_REQUESTS
from deployments.config import Resources, worker_actor_options
from pipeline.models.base import warmup

logger = logging.getLogger(__name__)

WORKER_NAMESPACE = "specserve-workers"
CACHE_MISS = "cache_miss"  # a worker's answer when it lacks a request's committed tokens
STALE = "stale"  # a worker's answer to a call of a coordinator that no longer owns the request


class EpochFence:
    """Per request, the newest ownership epoch a worker's passes have served (Redis counts one up at every take-over).

    A coordinator that dies leaves calls behind: queued in a worker, or still on the way. Run after the new owner's
    calls, a stale pre-draft would overwrite the drafter's mirror of the context with a guess the new owner never
    made, and its later drafts would differ from the undisturbed run's (a seeded request would no longer replay).
    Checked in the pass, in execution order: a call older than the newest epoch served is answered STALE."""

    def __init__(self) -> None:
        self._newest: dict[str, int] = {}

    def admits(self, request_id: str, epoch: int) -> bool:
        if epoch < self._newest.get(request_id, 0):
            return False
        self._newest[request_id] = epoch
        return True

    def current(self, request_id: str, epoch: int) -> bool:
        """Whether a caller of `epoch` still owns the request here (0: a caller that owns every request)."""
        return epoch == 0 or epoch >= self._newest.get(request_id, 0)

    def forget(self, request_id: str) -> None:
        self._newest.pop(request_id, None)


def warm_up(model: Any, max_batch_size: int, role: str, layers: tuple[int, ...] = ()) -> int:
    """Capture a worker model's step graphs before the replica takes traffic (the CUDA graph path, and every rank
    of a tensor-parallel group in lockstep; nothing elsewhere): every batch size up to max_batch_size and every
    token count the graph path buckets (verify blocks of any K it captures, a drafter's catch-up calls), so that
    no request sees a capture's stall; with `layers`, the passes that also return those layers' states (a feature
    head's). Returns the graphs captured."""
    t0 = time.perf_counter()
    captured = warmup(model, max_batch_size, layers=layers)
    if captured:
        logger.info("%s: %d CUDA graphs captured in %.1f s before serving", role, captured, time.perf_counter() - t0)
    return captured


def kv_slots(model: Any, device: str, kv_cache_gb: Optional[float], kv_cache_fraction: float, max_len: int,
             max_slots: int, role: str) -> int:
    """KV-cache slots for a loaded, not yet allocated model (`admission.kv_cache_slots`): from kv_cache_gb, else on
    CUDA from the free device memory, else max_slots. A runner whose shape is unknown (the generic fallback) gets
    max_slots."""
    shape = _kv_shape(model)
    budget: Optional[int] = None
    if kv_cache_gb is not None:
        budget = int(kv_cache_gb * 2**30)
    elif torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        budget = int(free * kv_cache_fraction)
    if shape is None or budget is None:
        return max_slots
    layers, kv_heads, head_dim, dtype_bytes = shape
    slots = kv_cache_slots(layers, kv_heads, head_dim, max_len, dtype_bytes, budget, max_slots)
    logger.info("%s: %d KV-cache slots of %d positions (budget %.2f GiB, cap %d)", role, slots, max_len,
                budget / 2**30, max_slots)
    return slots


def _kv_shape(model: Any) -> Optional[tuple[int, int, int, int]]:
    """(layers, KV heads, head dim, bytes per element) of the innermost runner (a tensor-parallel rank's runner holds
    its share of the heads), or None."""
    for _ in range(4):
        args = getattr(model, "args", None)
        if args is not None and hasattr(args, "n_kv_heads"):
            dtype = getattr(model, "dtype", torch.float32)
            return args.n_layers, args.n_kv_heads, args.head_dim, torch.empty((), dtype=dtype).element_size()
        model = getattr(model, "runner", None)
        if model is None:
            return None
    return None


def worker_name(app: str, role: str, replica_id: str, rank: int = 0) -> str:
    return f"{app}:{role}:{replica_id}:{rank}"


def spawn_workers(
    worker_cls: type, role: str, resources: Resources, world_size: int, **init_kwargs: Any
) -> list[Any]:
    """Start `world_size` worker actors for the calling Serve replica, in its placement group if any."""
    ctx = serve.get_replica_context()
    pg = get_current_placement_group()
    remote_cls = ray.remote(worker_cls)
    workers = []
    for rank in range(world_size):
        opts = worker_actor_options(resources, has_placement_group=pg is not None)
        if pg is not None:
            opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=rank,
                placement_group_capture_child_tasks=True,
            )
        name = worker_name(ctx.app_name, role, ctx.replica_id.unique_id, rank)
        workers.append(remote_cls.options(name=name, namespace=WORKER_NAMESPACE, max_restarts=0, **opts)
                       .remote(rank=rank, world_size=world_size, **init_kwargs))
    return workers


class WorkerPool:
    """The live rank-0 workers of one role, as seen by one coordinator, with its own load counts."""

    def __init__(self, app: str, role: str, refresh_s: float = 2.0) -> None:
        self.prefix = f"{app}:{role}:"
        self.refresh_s = refresh_s
        self.handles: dict[str, Any] = {}
        self.load: dict[str, int] = {}  # requests this coordinator has placed on each worker
        self._dead: dict[str, float] = {}  # name -> when it failed (ignored while Ray still lists it)
        self._listed_at = 0.0
        self._lock = asyncio.Lock()

    async def refresh(self, force: bool = False) -> None:
        async with self._lock:
            if not force and time.monotonic() - self._listed_at < self.refresh_s:
                return
            listed = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
            names = sorted(a["name"] for a in listed
                           if a["namespace"] == WORKER_NAMESPACE and a["name"].startswith(self.prefix)
                           and a["name"].endswith(":0"))
            now = time.monotonic()
            self._dead = {n: t for n, t in self._dead.items() if now - t < 30.0 and n in names}
            handles = {}
            for name in names:
                if name in self._dead:
                    continue
                handle = self.handles.get(name)
                if handle is None:
                    try:
                        handle = ray.get_actor(name, namespace=WORKER_NAMESPACE)
                    except ValueError:  # died between listing and lookup
                        continue
                handles[name] = handle
            self.handles = handles
            self._listed_at = now

    async def pick(self, prefer: Optional[str] = None, exclude: frozenset[str] = frozenset(),
                   ) -> Optional[tuple[str, Any]]:
        """The preferred worker if alive, else the least loaded one not in `exclude`; None if there is none."""
        await self.refresh()
        if prefer and prefer in self.handles and prefer not in exclude:
            return prefer, self.handles[prefer]
        names = [n for n in self.handles if n not in exclude]
        if not names:
            return None
        name = min(names, key=lambda n: (self.load.get(n, 0), n))
        return name, self.handles[name]

    async def wait_pick(self, timeout_s: float, prefer: Optional[str] = None, exclude: frozenset[str] = frozenset(),
                        ) -> Optional[tuple[str, Any]]:
        """pick(), retrying while Serve brings replicas (back) up."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = await self.pick(prefer, exclude)
            if got is not None or time.monotonic() >= deadline:
                return got
            await asyncio.sleep(0.25)
            await self.refresh(force=True)

    def mark_dead(self, name: str) -> None:
        logger.warning("worker %s is gone; using another", name)
        self._dead[name] = time.monotonic()
        self.handles.pop(name, None)
        self.load.pop(name, None)

    def acquire(self, name: str) -> None:
        self.load[name] = self.load.get(name, 0) + 1

    def release(self, name: str) -> None:
        if self.load.get(name, 0) > 0:
            self.load[name] -= 1


def is_actor_lost(err: BaseException) -> bool:
    """Errors that mean the worker process is gone or unreachable (as opposed to a bug in a call)."""
    return isinstance(err, (ActorDiedError, ActorUnavailableError, RayActorError, asyncio.TimeoutError))


class ModelHost:
    """What the drafter and target Serve replicas share: they are light hosts of worker actors
    (`self.workers`, rank 0 first) that hold the model; these methods answer Serve about them."""

    workers: list
    _info: dict[str, Any]

    async def info(self) -> dict[str, Any]:
        return self._info

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve autoscaling input: requests that called rank 0 lately (deployments/autoscaling.py)."""
        stats = await self.workers[0].stats.remote()
        return {ONGOING_REQUESTS: float(stats["active_requests"])}

    async def check_health(self) -> None:
        await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in self.workers]), 20.0)

    def __del__(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                ray.kill(w)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
