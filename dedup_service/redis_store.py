"""Redis `Store` (redis-py asyncio + hiredis): shared by all control-plane replicas.

Key layout (prefix `coalesce:`; <t> is the tenant percent-quoted, so a ':' in a tenant cannot fake a key):

  coalesce:idem:<t>:<key>      hash    idempotency record: st, own, ep, fp, rid, lease (ms), exp (ms), res, err.
                                       A released or purged key keeps only `ep` (a tombstone): epochs keep growing.
  coalesce:batch:<t>:<batch>   zset    seq ids of a batch job (score 0); each item is the idempotency record
                                       of key batch_key(batch, seq)
  coalesce:content:<t>:<fp>    hash    content-dedup leader of a fingerprint: rid, own, lease (ms)
  coalesce:req:<rid>           hash    request index: tenant, key ('' when none), rk (record's Redis key or ''),
                                       own, ep, st
  coalesce:logm:<rid>          hash    token log meta: n (tokens logged), fin (0/1), info (finish bytes), exp (ms)
  coalesce:log:<rid>           stream  token i is entry id 0-(i+1), field e = LogEntry.pack(); after the last
                                       token, an entry with field `end` marks the finish (and wakes XREAD)

Request-id keys carry no tenant in their name because Resume names only the request id; the tenant is stored
in `req:` and checked on every lookup (another tenant's id reads as absent).

Every multi-step change is one Lua script (redis_scripts.py) given the injected clock's now in ms; key TTLs
only garbage-collect (store.py GC_* constants). Commands are not retried: a retried script may have run
already (a claim would come back ATTACH to its own claimer), so a failure surfaces as StoreUnavailable and the
caller retries the request, which idempotency makes safe.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar
from urllib.parse import quote

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from dedup_service import redis_scripts as lua
from dedup_service.model import (
    RUNNING,
    BatchItem,
    ClaimResult,
    ContentClaim,
    LogAppend,
    LogEntry,
    LogSlice,
    Outcome,
    Record,
    RequestInfo,
    State,
    StoreUnavailable,
    batch_key,
    seq_sort_key,
)
from dedup_service.store import BATCH_GC_S, GC_SLACK_S, RUNNING_GC_S, Clock, ms

P = ParamSpec("P")
T = TypeVar("T")

MAX_BLOCK_S = 2.0  # one XREAD BLOCK waits at most this (under the socket timeout); tail loops to its deadline


def _unavailable(
    fn: Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, T]],
) -> Callable[Concatenate[RedisStore, P], Coroutine[Any, Any, T]]:
    """Turn redis-py's connection and timeout errors into the one StoreUnavailable."""

    @functools.wraps(fn)
    async def run(self: RedisStore, *args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return await fn(self, *args, **kwargs)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise StoreUnavailable(f"redis store at {self.where} is unavailable: {e}") from e

    return run


class RedisStore:
    def __init__(self, client: aioredis.Redis, clock: Clock = time.time, prefix: str = "coalesce:") -> None:
        self.clock = clock
        self._r = client
        self._p = prefix
        kw = client.connection_pool.connection_kwargs
        self.where = f"{kw.get('host', kw.get('path', '?'))}:{kw.get('port', '')}"
        self._claim_lua = client.register_script(lua.CLAIM)
        self._write_lua = client.register_script(lua.WRITE)
        self._purge_lua = client.register_script(lua.PURGE)
        self._start_lua = client.register_script(lua.START_REQUEST)
        self._append_lua = client.register_script(lua.APPEND)
        self._finish_lua = client.register_script(lua.FINISH)
        self._content_claim_lua = client.register_script(lua.CONTENT_CLAIM)
        self._content_renew_lua = client.register_script(lua.CONTENT_RENEW)

    @classmethod
    def from_url(cls, url: str, clock: Clock = time.time, prefix: str = "coalesce:") -> RedisStore:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5, retry=Retry(NoBackoff(), 0))
        return cls(client, clock, prefix)

    # --- keys ---

    def _rk(self, tenant: str, key: str) -> str:
        return f"{self._p}idem:{quote(tenant, safe='')}:{key}"

    def _bk(self, tenant: str, batch_id: str) -> str:
        return f"{self._p}batch:{quote(tenant, safe='')}:{batch_id}"

    def _ck(self, tenant: str, fingerprint: str) -> str:
        return f"{self._p}content:{quote(tenant, safe='')}:{fingerprint}"

    def _log_keys(self, request_id: str) -> list[str]:
        return [f"{self._p}req:{request_id}", f"{self._p}logm:{request_id}", f"{self._p}log:{request_id}"]

    def _now(self) -> int:
        return ms(self.clock())

    # --- idempotency records ---

    @_unavailable
    async def claim(
        self, tenant: str, key: str, owner: str, fingerprint: str, request_id: str, lease_s: float
    ) -> ClaimResult:
        return await self._claim(tenant, key, owner, fingerprint, request_id, lease_s, "", "")

    @_unavailable
    async def claim_item(
        self, tenant: str, batch_id: str, seq_id: str, owner: str, fingerprint: str, request_id: str, lease_s: float
    ) -> ClaimResult:
        key = batch_key(batch_id, seq_id)
        return await self._claim(
            tenant, key, owner, fingerprint, request_id, lease_s, self._bk(tenant, batch_id), seq_id
        )

    async def _claim(
        self, tenant: str, key: str, owner: str, fp: str, rid: str, lease_s: float, batch: str, seq: str
    ) -> ClaimResult:
        args: list[Any] = [self._p, tenant, key, owner, fp, rid, ms(lease_s), self._now(), ms(RUNNING_GC_S), batch, seq]
        outcome, flat = await self._claim_lua([self._rk(tenant, key)], [*args, ms(BATCH_GC_S)])
        return ClaimResult(Outcome(outcome.decode()), _record(tenant, key, _pairs(flat)))

    async def _write(self, tenant: str, key: str, owner: str, epoch: int, op: str, span_s: float, value: Any) -> bool:
        args: list[Any] = [
            self._p,
            owner,
            str(epoch),
            self._now(),
            op,
            ms(span_s),
            value,
            ms(RUNNING_GC_S),
            ms(GC_SLACK_S),
        ]
        return bool(await self._write_lua([self._rk(tenant, key)], args))

    @_unavailable
    async def renew(self, tenant: str, key: str, owner: str, epoch: int, lease_s: float) -> bool:
        return await self._write(tenant, key, owner, epoch, "renew", lease_s, "")

    @_unavailable
    async def mark_processing(self, tenant: str, key: str, owner: str, epoch: int) -> bool:
        return await self._write(tenant, key, owner, epoch, "processing", 0, "")

    @_unavailable
    async def succeed(self, tenant: str, key: str, owner: str, epoch: int, result: bytes, retention_s: float) -> bool:
        return await self._write(tenant, key, owner, epoch, "success", retention_s, result)

    @_unavailable
    async def fail(
        self, tenant: str, key: str, owner: str, epoch: int, error: str, retention_s: float, retryable: bool
    ) -> bool:
        op = "release" if retryable else "failed"
        return await self._write(tenant, key, owner, epoch, op, retention_s, error)

    @_unavailable
    async def get(self, tenant: str, key: str) -> Record | None:
        h: dict[bytes, bytes] = await self._r.hgetall(self._rk(tenant, key))  # type: ignore[assignment]
        return self._live(_record(tenant, key, h))

    @_unavailable
    async def purge(self, tenant: str, key: str) -> bool:
        args: list[Any] = [self._p, "key", tenant, self._now(), ms(RUNNING_GC_S), ""]
        return bool(await self._purge_lua([self._rk(tenant, key)], args))

    def _live(self, rec: Record | None) -> Record | None:
        if rec is None or (rec.state not in RUNNING and rec.expires_at <= self.clock()):
            return None
        return rec

    # --- batch items ---

    @_unavailable
    async def list_batch(self, tenant: str, batch_id: str) -> list[BatchItem]:
        members: list[bytes] = await self._r.zrange(self._bk(tenant, batch_id), 0, -1)  # type: ignore[assignment]
        seqs = sorted((m.decode() for m in members), key=seq_sort_key)
        async with self._r.pipeline(transaction=False) as pipe:
            for seq in seqs:
                pipe.hgetall(self._rk(tenant, batch_key(batch_id, seq)))
            rows = await pipe.execute()
        return [
            BatchItem(seq, self._live(_record(tenant, batch_key(batch_id, seq), row)))
            for seq, row in zip(seqs, rows, strict=True)
        ]

    # --- request index ---

    @_unavailable
    async def start_request(self, tenant: str, request_id: str, owner: str) -> bool:
        args: list[Any] = [self._p, tenant, owner, request_id, ms(RUNNING_GC_S)]
        return bool(await self._start_lua([self._log_keys(request_id)[0]], args))

    @_unavailable
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

    @_unavailable
    async def purge_request(self, tenant: str, request_id: str) -> bool:
        args: list[Any] = [self._p, "rid", tenant, self._now(), ms(RUNNING_GC_S), request_id]
        return bool(await self._purge_lua([self._log_keys(request_id)[0]], args))

    # --- content dedup ---

    @_unavailable
    async def claim_content(
        self, tenant: str, fingerprint: str, request_id: str, owner: str, lease_s: float
    ) -> ContentClaim:
        args: list[Any] = [request_id, owner, ms(lease_s), self._now(), ms(GC_SLACK_S)]
        lead, rid = await self._content_claim_lua([self._ck(tenant, fingerprint)], args)
        return ContentClaim(bool(lead), rid.decode())

    @_unavailable
    async def renew_content(self, tenant: str, fingerprint: str, request_id: str, lease_s: float) -> bool:
        args: list[Any] = [request_id, ms(lease_s), self._now(), ms(GC_SLACK_S)]
        return bool(await self._content_renew_lua([self._ck(tenant, fingerprint)], args))

    @_unavailable
    async def release_content(self, tenant: str, fingerprint: str, request_id: str) -> bool:
        args: list[Any] = [request_id, "", self._now(), ms(GC_SLACK_S)]
        return bool(await self._content_renew_lua([self._ck(tenant, fingerprint)], args))

    # --- token logs ---

    @_unavailable
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

    @_unavailable
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

    @_unavailable
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

    @_unavailable
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


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


def _record(tenant: str, key: str, h: dict[bytes, bytes]) -> Record | None:
    """A record from its hash; None for an absent key or a tombstone (only `ep`)."""
    if b"st" not in h:
        return None
    return Record(
        tenant=tenant,
        key=key,
        state=State(h[b"st"].decode()),
        owner=h[b"own"].decode(),
        epoch=int(h[b"ep"]),
        fingerprint=h[b"fp"].decode(),
        request_id=h[b"rid"].decode(),
        lease_until=int(h[b"lease"]) / 1000,
        expires_at=int(h.get(b"exp", b"0")) / 1000,
        result=h.get(b"res", b""),
        error=h.get(b"err", b"").decode(),
    )
