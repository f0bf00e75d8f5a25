"""Request index and token logs of the Redis store (the base of `RedisStore`; key layout in redis_store.py)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup_service import redis_scripts as lua
from dedup_service.model import LogAppend, LogEntry, LogSlice, RequestInfo, State, StoreUnavailable
from dedup_service.timing import GC_SLACK_S, RUNNING_GC_S, Clock, ms

P = ParamSpec("P")
T = TypeVar("T")
S = TypeVar("S", bound="RedisLogs")

MAX_BLOCK_S = 2.0  # one XREAD BLOCK waits at most this (under the socket timeout); tail loops to its deadline


def unavailable(
    fn: Callable[Concatenate[S, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[S, P], Coroutine[Any, Any, T]]:
    """Turn redis-py's connection and timeout errors into the one StoreUnavailable."""

    @functools.wraps(fn)
    async def run(self: S, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"redis store at {self.where} is unavailable: {e}") from e

    return run


class RedisLogs:
    """Request id -> (tenant, key, owner, epoch, state), and each request's token log (a stream)."""

    def __init__(self, client: aioredis.Redis, clock: Clock = time.time, prefix: str = "coalesce:") -> None:
        self.clock = clock
        self._r = client
        self._p = prefix
        kw = client.connection_pool.connection_kwargs
        self.where = f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"
        self._start_lua = client.register_script(lua.START_REQUEST)
        self._append_lua = client.register_script(lua.APPEND)
        self._finish_lua = client.register_script(lua.FINISH)

    def _log_keys(self, request_id: str) -> list[str]:
        return [f"{self._p}req:{request_id}", f"{self._p}logm:{request_id}", f"{self._p}log:{request_id}"]

    def _now(self) -> int:
        return ms(self.clock())

    # --- request index ---

    @unavailable
    async def start_request(self, tenant: str, request_id: str, owner: str) -> bool:
        args: list[Any] = [self._p, tenant, owner, request_id, ms(RUNNING_GC_S)]
        return bool(await self._start_lua([self._log_keys(request_id)[0]], args))

    @unavailable
    async def lookup_request(self, tenant: str, request_id: str) -> RequestInfo | None:
        ik, mk, _ = self._log_keys(request_id)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hgetall(ik)
            pipe.hmget(mk, "n", "fin", "exp")
            h, (n, fin, exp) = await pipe.execute()
        if not h or h[b"tenant"].decode() != tenant:
            return None
        log_live = n is not None and not (fin == b"1" and int(exp) <= self._now())
        key = h[b"key"].decode()
        if not key and not log_live:
            return None  # a keyless request lives as long as its log
        return RequestInfo(
            request_id,
            tenant,
            key,
            h[b"own"].decode(),
            int(h[b"ep"]),
            State(h[b"st"].decode()),
            int(n) if log_live else 0,
            log_live and fin == b"1",
        )

    # --- token logs ---

    @unavailable
    async def append_many(self, appends: list[LogAppend]) -> list[bool]:
        """One pipeline, one APPEND script call per request: one round trip per step for all requests."""
        if not appends:
            return []
        async with self._r.pipeline(transaction=False) as pipe:
            for a in appends:
                args: list[Any] = [
                    a.owner,
                    str(a.epoch),
                    str(a.offset),
                    ms(RUNNING_GC_S),
                    *(e.pack() for e in a.entries),
                ]
                await self._append_lua(self._log_keys(a.request_id), args, client=pipe)
            return [bool(r) for r in await pipe.execute()]

    @unavailable
    async def finish(
        self, request_id: str, owner: str, epoch: int, finish_info: bytes, keep_s: float, failed: bool = False
    ) -> bool:
        args: list[Any] = [
            owner,
            str(epoch),
            finish_info,
            ms(keep_s),
            self._now(),
            ms(GC_SLACK_S),
            "1" if failed else "0",
        ]
        return bool(await self._finish_lua(self._log_keys(request_id), args))

    @unavailable
    async def read(self, request_id: str, offset: int, limit: int = 1024) -> LogSlice | None:
        _, mk, lk = self._log_keys(request_id)
        async with self._r.pipeline(transaction=True) as pipe:
            pipe.hmget(mk, "n", "fin", "info", "exp")
            pipe.xrange(lk, min=f"0-{offset + 1}", max="+", count=max(limit, 1))
            (n, fin, info, exp), rows = await pipe.execute()
        if n is None or (fin == b"1" and int(exp) <= self._now()):
            return None
        entries = [LogEntry.unpack(fields[b"e"]) for _, fields in rows if b"e" in fields][: max(limit, 0)]
        end = offset + len(entries)
        finished = fin == b"1" and end >= int(n)
        return LogSlice(entries, end, finished, (info or b"") if fin == b"1" else b"")

    @unavailable
    async def tail(self, request_id: str, offset: int, timeout_s: float, limit: int = 1024) -> LogSlice | None:
        deadline = time.monotonic() + timeout_s
        lk = self._log_keys(request_id)[2]
        while True:
            got = await self.read(request_id, offset, limit)
            left = deadline - time.monotonic()
            if got is None or got.entries or got.finished or left <= 0:
                return got
            # Wakes on any entry past `offset`: a token, or the finish's `end` entry, from any replica.
            await self._r.xread({lk: f"0-{offset}"}, count=1, block=max(1, int(min(left, MAX_BLOCK_S) * 1000)))

    async def close(self) -> None:
        await self._r.aclose()
