"""Request index and token logs of the Redis store (the base of `RedisStore`; key layout in redis_store.py)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import quote

import redis.asyncio as aioredis

from dedup_service import redis_scripts as lua
from dedup_service.model import (
    MAX_PAYLOAD_BYTES,
    LogAppend,
    LogEntry,
    LogSlice,
    RequestInfo,
    State,
    check_payload,
)
from dedup_service.redis_errors import unavailable
from dedup_service.timing import GC_SLACK_S, RUNNING_GC_S, Clock, ms

MAX_BLOCK_S = 2.0  # one XREAD BLOCK waits at most this (under the socket timeout); tail loops to its deadline


def scope(tenant: str) -> str:
    """The tenant in key names, percent-quoted: it has no ':', so a tenant cannot fake another's key."""
    return quote(tenant, safe="")


class RedisLogs:
    """(tenant, request id) -> (key, owner, epoch, state), and each request's token log (a stream)."""

    def __init__(
        self,
        client: aioredis.Redis,
        clock: Clock = time.time,
        prefix: str = "coalesce:",
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        self.clock = clock
        self.max_payload_bytes = max_payload_bytes
        self._r = client
        self._p = prefix
        kw = client.connection_pool.connection_kwargs
        # For operators' logs only (StoreUnavailable.where): callers never see it.
        self.where = f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"
        self._start_lua = client.register_script(lua.START_REQUEST)
        self._take_lua = client.register_script(lua.TAKE_REQUEST)
        self._lookup_lua = client.register_script(lua.LOOKUP)
        self._read_lua = client.register_script(lua.READ)
        self._append_lua = client.register_script(lua.APPEND_MANY)
        self._finish_lua = client.register_script(lua.FINISH)

    def _log_keys(self, tenant: str, request_id: str) -> list[str]:
        """Request index, log meta, log stream (the scripts' `request_keys` builds the same names)."""
        scoped = f"{scope(tenant)}:{request_id}"
        return [f"{self._p}req:{scoped}", f"{self._p}logm:{scoped}", f"{self._p}log:{scoped}"]

    def _now(self) -> int:
        return ms(self.clock())

    # --- request index ---

    @unavailable
    async def start_request(self, tenant: str, request_id: str, owner: str, *, payload: bytes = b"") -> bool:
        check_payload(payload, self.max_payload_bytes)
        args: list[Any] = [owner, ms(RUNNING_GC_S), bytes(payload)]
        return bool(await self._start_lua(self._log_keys(tenant, request_id), args))

    @unavailable
    async def lookup_request(self, tenant: str, request_id: str) -> RequestInfo | None:
        flat, (n, fin, exp) = await self._lookup_lua(self._log_keys(tenant, request_id)[:2])
        h = dict(zip(flat[::2], flat[1::2], strict=True))
        if not h:
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
            h.get(b"pl", b""),
        )

    @unavailable
    async def take_request(self, tenant: str, request_id: str, owner: str, epoch: int) -> int | None:
        taken = await self._take_lua(self._log_keys(tenant, request_id), [owner, str(epoch), ms(RUNNING_GC_S)])
        return None if taken is None else int(taken)

    # --- token logs ---

    @unavailable
    async def append_many(self, appends: list[LogAppend]) -> list[bool]:
        """One script for every request's tokens: one round trip per step, and all or nothing under OOM."""
        if not appends:
            return []
        keys: list[str] = []
        args: list[Any] = [ms(RUNNING_GC_S)]
        for a in appends:
            keys += self._log_keys(a.tenant, a.request_id)
            args += [a.owner, str(a.epoch), str(a.offset), len(a.entries), *(e.pack() for e in a.entries)]
        return [bool(r) for r in await self._append_lua(keys, args)]

    @unavailable
    async def finish(
        self,
        tenant: str,
        request_id: str,
        owner: str,
        epoch: int,
        finish_info: bytes,
        keep_s: float,
        failed: bool = False,
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
        return bool(await self._finish_lua(self._log_keys(tenant, request_id), args))

    @unavailable
    async def read(self, tenant: str, request_id: str, offset: int, limit: int = 1024) -> LogSlice | None:
        _, mk, lk = self._log_keys(tenant, request_id)
        n, fin, info, exp, packed = await self._read_lua([mk, lk], [offset, max(limit, 1)])
        if n is None or (fin == b"1" and int(exp) <= self._now()):
            return None
        entries = [LogEntry.unpack(e) for e in packed][: max(limit, 0)]
        end = offset + len(entries)
        finished = fin == b"1" and end >= int(n)
        return LogSlice(entries, end, finished, (info or b"") if fin == b"1" else b"")

    @unavailable
    async def tail(
        self, tenant: str, request_id: str, offset: int, timeout_s: float, limit: int = 1024
    ) -> LogSlice | None:
        deadline = time.monotonic() + timeout_s
        lk = self._log_keys(tenant, request_id)[2]
        while True:
            got = await self.read(tenant, request_id, offset, limit)
            left = deadline - time.monotonic()
            if got is None or got.entries or got.finished or left <= 0:
                return got
            # Wakes on any entry past `offset`: a token, or the finish's `end` entry, from any replica.
            await self._r.xread({lk: f"0-{offset}"}, count=1, block=max(1, int(min(left, MAX_BLOCK_S) * 1000)))

    async def close(self) -> None:
        await self._r.aclose()
