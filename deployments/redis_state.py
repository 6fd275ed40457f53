"""Per-request state in Redis: enough to resume a request exactly, and to replay its stream.

Keys (namespace `ns`, request id `rid`; the `{rid}` hash tag keeps one request's keys on one cluster slot):
    {ns}:req:{rid}          hash: kind, model, created, prompt_ids, params, spec, eos, status, step,
                            emitted_chars, finish_reason, stats, owner, epoch, target_worker, error
    {ns}:req:{rid}:ids      list: generated token ids, in order
    {ns}:req:{rid}:events   list: one JSON event per step {"i", "ids", "text", "finish"}; the SSE replay
All three expire `ttl_s` after the last write.

Ownership is fenced: a coordinator takes a request over by writing its own `owner` token, and every
commit checks (in one Lua script) that it is still the owner and that the step counter is the one it
extends. A coordinator presumed dead that still runs can therefore never corrupt a resumed request.
Randomness comes from (seed, step), so a resumed request regenerates exactly the tokens of any steps that
were streamed but not yet persisted.

A server that stops answering (killed, restarted; an embedded one comes back on a new port) is reconnected to
through the store's URL getter, and the operation tried once more. A request the server no longer holds (it came
back empty) raises StateLost on commit: its coordinator finishes it unpersisted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from deployments.config import RedisTLS
from deployments.redis_conn import RedisAddress, client_options, describe, redact
from deployments.tracing import traced

log = logging.getLogger(__name__)

# KEYS: meta, ids, events. ARGV: owner, expected_step, new_step, ttl, emitted_chars, finish_reason,
# status, stats_json, event_json, ids...
_COMMIT = """
local meta = KEYS[1]
if redis.call('EXISTS', meta) == 0 then return -3 end
if redis.call('HGET', meta, 'owner') ~= ARGV[1] then return -1 end
if tonumber(redis.call('HGET', meta, 'step')) ~= tonumber(ARGV[2]) then return -2 end
local n = #ARGV
if n >= 10 then redis.call('RPUSH', KEYS[2], unpack(ARGV, 10, n)) end
if ARGV[9] ~= '' then redis.call('RPUSH', KEYS[3], ARGV[9]) end
redis.call('HSET', meta, 'step', ARGV[3], 'emitted_chars', ARGV[5], 'finish_reason', ARGV[6],
           'status', ARGV[7], 'stats', ARGV[8])
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return redis.call('LLEN', KEYS[2])
"""

# KEYS: meta, ids, events. ARGV: new owner, ttl. Returns the new epoch, or -1 if the request is unknown.
_TAKE_OVER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
redis.call('HSET', KEYS[1], 'owner', ARGV[1])
if redis.call('HGET', KEYS[1], 'status') == 'cancelled' then redis.call('HSET', KEYS[1], 'status', 'running') end
for i = 1, 3 do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
return redis.call('HINCRBY', KEYS[1], 'epoch', 1)
"""

# KEYS: meta. ARGV: owner, then field/value pairs. Returns 1, -1 if not the owner, -3 if the request is unknown.
_SET_IF_OWNER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -3 end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return -1 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2, #ARGV))
return 1
"""

# KEYS: meta, ids, events. ARGV: ttl, field/value pairs. Returns 1, or 0 if the request exists already.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2, #ARGV))
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""


RECONNECT_WAIT_S = 30.0  # how long an operation waits for a Redis that stopped answering to come back


class NotOwner(RuntimeError):
    """Another coordinator took this request over (or the step counter moved): stop working on it."""


class StateLost(RuntimeError):
    """Redis no longer holds the request (it restarted empty): the request goes on unpersisted."""


@dataclass
class StoredRequest:
    """A request as read back from Redis."""

    request_id: str
    fields: dict[str, str]
    output_ids: list[int]

    @property
    def kind(self) -> str:
        return self.fields["kind"]

    @property
    def status(self) -> str:
        return self.fields.get("status", "")

    @property
    def step(self) -> int:
        return int(self.fields.get("step", 0))

    @property
    def finished(self) -> bool:
        return self.status in ("finished", "failed")

    def json(self, name: str, default: Any = None) -> Any:
        raw = self.fields.get(name)
        return default if raw in (None, "") else json.loads(raw)

    def state_dict(self) -> dict[str, Any]:
        """The dict `pipeline.sequence.RequestState.from_dict` takes."""
        return {
            "request_id": self.request_id,
            "prompt_ids": self.json("prompt_ids"),
            "params": self.json("params"),
            "eos_token_ids": self.json("eos", []),
            "output_ids": self.output_ids,
            "step": self.step,
            "finish_reason": self.fields.get("finish_reason") or None,
            "stats": self.json("stats"),
            "emitted_chars": int(self.fields.get("emitted_chars", 0)),
        }


class RequestStore:
    """Async access to request state. One instance (one connection pool) per process."""

    def __init__(self, client: aioredis.Redis, namespace: str = "specserve", ttl_s: int = 3600) -> None:
        self.ns, self.ttl_s = namespace, ttl_s
        self._bind(client)
        # Set by connect(): reconnect() asks it again.
        self._get_url: Optional[Callable[[], Awaitable[Union[str, RedisAddress]]]] = None
        self._reconnecting: Optional[asyncio.Task] = None

    def _bind(self, client: aioredis.Redis) -> None:
        self.client = client
        self._commit = client.register_script(_COMMIT)
        self._take_over = client.register_script(_TAKE_OVER)
        self._set_if_owner = client.register_script(_SET_IF_OWNER)
        self._create = client.register_script(_CREATE)

    @classmethod
    def from_url(cls, url: str, namespace: str = "specserve", ttl_s: int = 3600,
                 tls: Optional[RedisTLS] = None) -> "RequestStore":
        client = aioredis.Redis.from_url(url, decode_responses=True, socket_connect_timeout=5,
                                          health_check_interval=30, **client_options(url, tls))
        return cls(client, namespace, ttl_s)

    @classmethod
    async def connect(
        cls,
        get_url: Callable[[], Awaitable[Union[str, RedisAddress]]],
        namespace: str = "specserve",
        ttl_s: int = 3600,
        wait_s: float = 60.0,
        retry_s: float = 1.0,
    ) -> "RequestStore":
        """A store whose server answered PING, waiting up to `wait_s` for one that is (re)starting. The address is
        asked again on every try: an embedded redis-server whose Serve replica is being replaced comes back on a new
        port, with a new password. (Without the wait, coordinator replicas that start while the embedded server is
        being replaced each fail their first ping, and the deployment fails before Serve has replaced the server.)"""
        deadline = time.monotonic() + wait_s
        while True:
            where, store = None, None
            try:
                got = await get_url()  # inside the try: the embedded server's replica may be being replaced
                where = got if isinstance(got, RedisAddress) else RedisAddress(got)
                store = cls.from_url(where.url, namespace, ttl_s, where.tls)
                await store.client.ping()
                store._get_url = get_url
                return store
            except Exception as err:  # noqa: BLE001 - any failure to answer is "not yet"
                if store is not None:
                    await store.close()
                url = where.url if where is not None else "(its URL)"
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"Redis at {redact(url)} is unreachable: {describe(err, url)}") from None
                log.warning("Redis at %s does not answer yet (%s); retrying", redact(url), describe(err, url))
                await asyncio.sleep(retry_s)

    async def close(self) -> None:
        await self.client.aclose()

    async def ping(self) -> bool:
        return bool(await self._retrying(lambda: self.client.ping()))

    async def reconnect(self, wait_s: float = RECONNECT_WAIT_S) -> None:
        """Connect again, asking for the URL again (a replaced embedded server has a new port); one attempt at a
        time, shared by every caller that saw the connection fail."""
        if self._get_url is None:
            raise ConnectionError("this store cannot reconnect (made without connect())")
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self._reconnect(wait_s))
        await asyncio.shield(self._reconnecting)

    async def _reconnect(self, wait_s: float) -> None:
        assert self._get_url is not None
        fresh = await RequestStore.connect(self._get_url, self.ns, self.ttl_s, wait_s=wait_s)
        old, self._reconnecting = self.client, None
        self._bind(fresh.client)
        log.warning("reconnected to Redis")
        try:
            await old.aclose()
        except Exception:  # noqa: BLE001 - the old connection is gone anyway
            pass

    async def _retrying(self, op: Callable[[], Awaitable[Any]]) -> Any:
        """`op()`; if Redis does not answer, reconnect (waiting for it to come back) and try once more."""
        try:
            return await op()
        except (RedisConnectionError, RedisTimeoutError, OSError):
            if self._get_url is None:
                raise
        await self.reconnect()
        return await op()

    def keys(self, rid: str) -> list[str]:
        meta = f"{self.ns}:req:{{{rid}}}"
        return [meta, f"{meta}:ids", f"{meta}:events"]

    # -- lifecycle -------------------------------------------------------------------------------------
    @traced("redis create", **{"db.system": "redis"})
    async def create(self, rid: str, owner: str, state: dict[str, Any], **extra: Any) -> None:
        """Store a new request (state: `RequestState.to_dict()` before any step)."""
        fields: dict[str, Any] = {
            "prompt_ids": json.dumps(state["prompt_ids"]),
            "params": json.dumps(state["params"]),
            "eos": json.dumps(state["eos_token_ids"]),
            "stats": json.dumps(state["stats"]),
            "step": state["step"], "emitted_chars": state.get("emitted_chars", 0),
            "finish_reason": "", "status": "running", "owner": owner, "epoch": 1,
        }
        for k, v in extra.items():
            fields[k] = v if isinstance(v, (str, int, float)) else json.dumps(v)
        flat: list[Any] = []
        for k, v in fields.items():
            flat += [k, v]
        keys = self.keys(rid)
        if not await self._retrying(lambda: self._create(keys=keys[:1], args=[self.ttl_s, *flat])):
            raise ValueError(f"request {rid} exists already")

    @traced("redis take_over", **{"db.system": "redis"})
    async def take_over(self, rid: str, owner: str) -> Optional[StoredRequest]:
        """Become the request's owner (fencing out any previous one) and read it; None if unknown."""
        epoch = await self._retrying(lambda: self._take_over(keys=self.keys(rid), args=[owner, self.ttl_s]))
        if int(epoch) < 0:
            return None
        return await self.load(rid)

    @traced("redis commit", **{"db.system": "redis"})
    async def commit(
        self,
        rid: str,
        owner: str,
        expected_step: int,
        new_step: int,
        token_ids: list[int],
        emitted_chars: int,
        finish_reason: Optional[str],
        stats: dict[str, Any],
        event: Optional[dict[str, Any]],
    ) -> int:
        """Append one step atomically; returns the number of generated ids stored. Raises NotOwner."""
        status = "finished" if finish_reason else "running"
        args = [owner, expected_step, new_step, self.ttl_s, emitted_chars, finish_reason or "", status,
                json.dumps(stats), "" if event is None else json.dumps(event, ensure_ascii=False), *token_ids]
        tries = []

        async def once() -> Any:
            tries.append(1)
            return await self._commit(keys=self.keys(rid), args=args)

        n = int(await self._retrying(once))
        if n == -3:
            raise StateLost(f"request {rid} is not in Redis (restarted empty?) at step {expected_step}")
        if n == -2 and len(tries) > 1 and int(await self.client.hget(self.keys(rid)[0], "step") or -1) == new_step:
            return int(await self.client.llen(self.keys(rid)[1]))  # applied, its reply lost with the connection
        if n < 0:
            raise NotOwner(f"request {rid}: {'owner changed' if n == -1 else 'step moved'} at step {expected_step}")
        return n

    @traced("redis set_fields", **{"db.system": "redis"})
    async def set_fields(self, rid: str, owner: str, **fields: Any) -> None:
        flat: list[Any] = []
        for k, v in fields.items():
            flat += [k, v if isinstance(v, (str, int, float)) else json.dumps(v)]
        n = int(await self._retrying(lambda: self._set_if_owner(keys=self.keys(rid)[:1], args=[owner, *flat])))
        if n == -3:
            raise StateLost(f"request {rid} is not in Redis (restarted empty?)")
        if n < 0:
            raise NotOwner(f"request {rid}: owner changed")

    # -- reads -----------------------------------------------------------------------------------------
    @traced("redis load", **{"db.system": "redis"})
    async def load(self, rid: str) -> Optional[StoredRequest]:
        meta, ids, _ = self.keys(rid)

        async def read() -> list[Any]:
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hgetall(meta)
                pipe.lrange(ids, 0, -1)
                return await pipe.execute()

        fields, out = await self._retrying(read)
        if not fields:
            return None
        return StoredRequest(rid, fields, [int(t) for t in out])

    @traced("redis events", **{"db.system": "redis"})
    async def events(self, rid: str, start: int = 0) -> list[dict[str, Any]]:
        raw = await self._retrying(lambda: self.client.lrange(self.keys(rid)[2], start, -1))
        return [json.loads(e) for e in raw]

    async def ttl(self, rid: str) -> int:
        return int(await self.client.ttl(self.keys(rid)[0]))


def redis_url_getter(cfg: Any, redis: Any) -> Callable[[], Awaitable[RedisAddress]]:
    """`RequestStore.connect`'s address source for a replica: the configured `redis_url` (with `redis_tls`), else
    the embedded server's deployment handle (asked again on every try), told which node asks: a server on loopback
    refuses to hand its URL to a replica on another node (the URL would not reach it)."""

    async def get() -> RedisAddress:
        if cfg.redis_url:
            return RedisAddress(cfg.redis_url, cfg.redis_tls)
        import ray

        return RedisAddress(await redis.url.remote(ray.get_runtime_context().get_node_id()))

    return get
