"""Redis `Store` (redis-py asyncio + hiredis): shared by all control-plane replicas.

Key layout (prefix `coalesce:`; <t> is the tenant percent-quoted, so a ':' in a tenant cannot fake a key, and
the first ':' after <t> ends it, whatever the key or request id holds):

  coalesce:idem:<t>:<key>      hash    idempotency record: st, own, ep, fp, rid, lease (ms), exp (ms), res, err,
                                       pl (request payload bytes, set when claimed, never changed after).
                                       A released or purged key keeps only `ep` (a tombstone): epochs keep growing.
  coalesce:batch:<t>:<batch>   zset    seq ids of a batch job (score 0); each item is the idempotency record
                                       of key batch_key(batch, seq)
  coalesce:content:<t>:<fp>    hash    content-dedup leader of a fingerprint: rid, own, lease (ms)
  coalesce:req:<t>:<rid>       hash    request index: key ('' when none), rk (record's Redis key or ''), own, ep,
                                       st, pl (a keyless request's payload, from start_request)
  coalesce:logm:<t>:<rid>      hash    token log meta: n (tokens logged), fin (0/1), info (finish bytes), exp (ms)
  coalesce:log:<t>:<rid>       stream  token i is entry id 0-(i+1), field e = LogEntry.pack(); after the last
                                       token, an entry with field `end` marks the finish (and wakes XREAD)
  coalesce:alive:<owner>       string  a control-plane replica's heartbeat: alive until (ms)

Request ids are scoped per tenant (Resume names the id, and the caller's tenant completes it): two tenants may
use one id at once, and nothing tells one whether the other does. A script that derives a record's index and
log keys from its stored request id is given the quoted tenant of the record's key.

Every multi-step change is one Lua script (redis_scripts.py) given the injected clock's now in ms; key TTLs
only garbage-collect (store.py GC_* constants). Timeouts are not retried: a retried script may have run
already (a claim would come back ATTACH to its own claimer), so they surface as StoreUnavailable and the
caller retries the request, which idempotency makes safe. A connection error is retried once: after a Redis
restart every pooled connection is stale, and a command sent on one never reached the new server. Every other
redis-py error becomes StoreUnavailable too (redis_errors.py), e.g. a full Redis (maxmemory, noeviction).

TLS: a `rediss://` URL connects with TLS; redis-py reads `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`,
`ssl_cert_reqs` (and its other `ssl_*` options) from the URL's query.
"""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from dedup_service import redis_scripts as lua
from dedup_service.model import (
    MAX_PAYLOAD_BYTES,
    RUNNING,
    BatchItem,
    ClaimResult,
    ContentClaim,
    Outcome,
    Record,
    State,
    batch_key,
    check_payload,
    seq_sort_key,
)
from dedup_service.redis_errors import unavailable
from dedup_service.redis_log import RedisLogs, scope
from dedup_service.timing import BATCH_GC_S, GC_SLACK_S, RUNNING_GC_S, Clock, ms


class RedisStore(RedisLogs):
    shared = True  # every replica reads and writes the same keys

    def __init__(
        self,
        client: aioredis.Redis,
        clock: Clock = time.time,
        prefix: str = "coalesce:",
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> None:
        super().__init__(client, clock, prefix, max_payload_bytes)
        self._claim_lua = client.register_script(lua.CLAIM)
        self._write_lua = client.register_script(lua.WRITE)
        self._purge_lua = client.register_script(lua.PURGE)
        self._content_claim_lua = client.register_script(lua.CONTENT_CLAIM)
        self._content_renew_lua = client.register_script(lua.CONTENT_RENEW)

    @classmethod
    def from_url(
        cls,
        url: str,
        clock: Clock = time.time,
        prefix: str = "coalesce:",
        max_payload_bytes: int = MAX_PAYLOAD_BYTES,
    ) -> RedisStore:
        """A store on `url` (redis://, rediss:// with TLS, unix://). ValueError names a bad URL option now,
        rather than at the first request (the message does not quote the URL, which may hold a password)."""
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        client = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5, retry=retry)
        try:
            client.connection_pool.make_connection()  # builds a connection (and TLS context) without connecting
        except (TypeError, ValueError, RedisError) as e:
            raise ValueError(f"bad store url option: {e}") from None
        return cls(client, clock, prefix, max_payload_bytes)

    # --- keys ---

    def _rk(self, tenant: str, key: str) -> str:
        return f"{self._p}idem:{scope(tenant)}:{key}"

    def _bk(self, tenant: str, batch_id: str) -> str:
        return f"{self._p}batch:{scope(tenant)}:{batch_id}"

    def _ck(self, tenant: str, fingerprint: str) -> str:
        return f"{self._p}content:{scope(tenant)}:{fingerprint}"

    # --- idempotency records ---

    @unavailable
    async def claim(
        self,
        tenant: str,
        key: str,
        owner: str,
        fingerprint: str,
        request_id: str,
        lease_s: float,
        *,
        payload: bytes = b"",
    ) -> ClaimResult:
        return await self._claim(tenant, key, owner, fingerprint, request_id, lease_s, "", "", payload)

    @unavailable
    async def claim_item(
        self,
        tenant: str,
        batch_id: str,
        seq_id: str,
        owner: str,
        fingerprint: str,
        request_id: str,
        lease_s: float,
        *,
        payload: bytes = b"",
    ) -> ClaimResult:
        key = batch_key(batch_id, seq_id)
        batch = self._bk(tenant, batch_id)
        return await self._claim(tenant, key, owner, fingerprint, request_id, lease_s, batch, seq_id, payload)

    async def _claim(
        self,
        tenant: str,
        key: str,
        owner: str,
        fp: str,
        rid: str,
        lease_s: float,
        batch: str,
        seq: str,
        payload: bytes,
    ) -> ClaimResult:
        check_payload(payload, self.max_payload_bytes)
        args: list[Any] = [self._p, scope(tenant), key, owner, fp, rid, ms(lease_s), self._now(), ms(RUNNING_GC_S)]
        args += [batch, seq]
        # bytes go to Redis as they are (binary-safe); str would be UTF-8 encoded.
        outcome, flat = await self._claim_lua([self._rk(tenant, key)], [*args, ms(BATCH_GC_S), bytes(payload)])
        return ClaimResult(Outcome(outcome.decode()), _record(tenant, key, _pairs(flat)))

    async def _write(self, tenant: str, key: str, owner: str, epoch: int, op: str, span_s: float, value: Any) -> bool:
        args: list[Any] = [
            self._p,
            scope(tenant),
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

    @unavailable
    async def renew(self, tenant: str, key: str, owner: str, epoch: int, lease_s: float) -> bool:
        return await self._write(tenant, key, owner, epoch, "renew", lease_s, "")

    @unavailable
    async def mark_processing(self, tenant: str, key: str, owner: str, epoch: int) -> bool:
        return await self._write(tenant, key, owner, epoch, "processing", 0, "")

    @unavailable
    async def succeed(self, tenant: str, key: str, owner: str, epoch: int, result: bytes, retention_s: float) -> bool:
        return await self._write(tenant, key, owner, epoch, "success", retention_s, result)

    @unavailable
    async def fail(
        self, tenant: str, key: str, owner: str, epoch: int, error: str, retention_s: float, retryable: bool
    ) -> bool:
        op = "release" if retryable else "failed"
        return await self._write(tenant, key, owner, epoch, op, retention_s, error)

    @unavailable
    async def get(self, tenant: str, key: str) -> Record | None:
        h: dict[bytes, bytes] = await self._r.hgetall(self._rk(tenant, key))  # type: ignore[assignment]
        return self._live(_record(tenant, key, h))

    @unavailable
    async def purge(self, tenant: str, key: str) -> bool:
        args: list[Any] = [self._p, scope(tenant), "key", self._now(), ms(RUNNING_GC_S), ""]
        return bool(await self._purge_lua([self._rk(tenant, key)], args))

    def _live(self, rec: Record | None) -> Record | None:
        if rec is None or (rec.state not in RUNNING and rec.expires_at <= self.clock()):
            return None
        return rec

    # --- batch items ---

    @unavailable
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

    @unavailable
    async def purge_request(self, tenant: str, request_id: str) -> bool:
        args: list[Any] = [self._p, scope(tenant), "rid", self._now(), ms(RUNNING_GC_S), request_id]
        return bool(await self._purge_lua([self._log_keys(tenant, request_id)[0]], args))

    # --- content dedup ---

    @unavailable
    async def claim_content(
        self, tenant: str, fingerprint: str, request_id: str, owner: str, lease_s: float
    ) -> ContentClaim:
        args: list[Any] = [request_id, owner, ms(lease_s), self._now(), ms(GC_SLACK_S)]
        lead, rid = await self._content_claim_lua([self._ck(tenant, fingerprint)], args)
        return ContentClaim(bool(lead), rid.decode())

    @unavailable
    async def renew_content(self, tenant: str, fingerprint: str, request_id: str, lease_s: float) -> bool:
        args: list[Any] = [request_id, ms(lease_s), self._now(), ms(GC_SLACK_S)]
        return bool(await self._content_renew_lua([self._ck(tenant, fingerprint)], args))

    @unavailable
    async def release_content(self, tenant: str, fingerprint: str, request_id: str) -> bool:
        args: list[Any] = [request_id, "", self._now(), ms(GC_SLACK_S)]
        return bool(await self._content_renew_lua([self._ck(tenant, fingerprint)], args))

    # --- replica liveness ---

    def _alive_key(self, owner: str) -> str:
        return f"{self._p}alive:{owner}"

    @unavailable
    async def heartbeat(self, owner: str, lease_s: float) -> None:
        # The injected clock decides (the value); the TTL only garbage-collects.
        until = self._now() + ms(lease_s)
        await self._r.set(self._alive_key(owner), until, px=max(1, ms(lease_s + GC_SLACK_S)))

    @unavailable
    async def alive(self, owner: str) -> bool:
        until = await self._r.get(self._alive_key(owner))
        return until is not None and int(until) > self._now()


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
        payload=h.get(b"pl", b""),
    )
