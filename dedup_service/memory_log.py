"""Request index and token logs of the in-memory store (the base of `MemoryStore`).

No method awaits between reading and writing its state, so each is atomic on the loop, as each Redis
script is on the server. Expired entries are dropped by a sweep every few hundred writes, following the same
GC deadlines as the Redis key TTLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from dedup_service.model import (
    MAX_PAYLOAD_BYTES,
    LogAppend,
    LogEntry,
    LogSlice,
    Record,
    RequestInfo,
    State,
    check_payload,
)
from dedup_service.timing import GC_SLACK_S, RUNNING_GC_S, Clock

SWEEP_EVERY = 256  # writes between sweeps

K = TypeVar("K")
V = TypeVar("V")

Rid = tuple[str, str]  # (tenant, request id): request ids are scoped per tenant


@dataclass(slots=True)
class _Req:
    key: str
    owner: str
    epoch: int
    state: State
    gc_at: float
    payload: bytes = b""  # a keyless request's, for `take_request`


@dataclass(slots=True)
class _Log:
    gc_at: float
    entries: list[LogEntry] = field(default_factory=list)
    finished: bool = False
    info: bytes = b""
    expires_at: float = 0.0  # end of the resume window once finished
    # Set and replaced at each change: a tailer waits on the event it saw (no lost wake-ups).
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class MemoryLogs:
    """(tenant, request id) -> (key, owner, epoch, state), and each request's token log."""

    def __init__(self, clock: Clock = time.time, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        self.clock = clock
        self.max_payload_bytes = max_payload_bytes
        self._reqs: dict[Rid, _Req] = {}
        self._logs: dict[Rid, _Log] = {}
        self._writes = 0

    # --- request index ---

    async def start_request(self, tenant: str, request_id: str, owner: str, *, payload: bytes = b"") -> bool:
        check_payload(payload, self.max_payload_bytes)
        now, rid = self.clock(), (tenant, request_id)
        if self._req(rid, now) is not None:
            return False
        self._wrote()
        self._reqs[rid] = _Req("", owner, 1, State.PROCESSING, now + RUNNING_GC_S, bytes(payload))
        self._logs[rid] = _Log(now + RUNNING_GC_S)
        return True

    async def lookup_request(self, tenant: str, request_id: str) -> RequestInfo | None:
        now, rid = self.clock(), (tenant, request_id)
        req = self._req(rid, now)
        if req is None:
            return None
        log = self._log(rid, now)
        if not req.key and log is None:
            return None  # a keyless request lives as long as its log
        n, finished = (len(log.entries), log.finished) if log else (0, False)
        return RequestInfo(request_id, tenant, req.key, req.owner, req.epoch, req.state, n, finished, req.payload)

    async def take_request(self, tenant: str, request_id: str, owner: str, epoch: int) -> int | None:
        now, rid = self.clock(), (tenant, request_id)
        req, log = self._req(rid, now), self._log(rid, now)
        if req is None or log is None or req.key or req.state != State.PROCESSING or log.finished:
            return None
        if req.epoch != epoch:
            return None  # another replica took it already
        self._wrote()
        req.owner, req.epoch = owner, epoch + 1
        req.gc_at = log.gc_at = max(req.gc_at, now + RUNNING_GC_S)
        return req.epoch

    def _index(self, rec: Record, now: float, reset_log: bool) -> None:
        """Point the request index at the record's owner and epoch; open (or keep) its log."""
        gc_at, rid = now + RUNNING_GC_S, (rec.tenant, rec.request_id)
        self._reqs[rid] = _Req(rec.key, rec.owner, rec.epoch, rec.state, gc_at)
        log = self._logs.get(rid)
        if reset_log or log is None:
            if log is not None:
                log.notify()
            self._logs[rid] = _Log(gc_at)
        else:
            log.gc_at = gc_at

    def _req(self, rid: Rid, now: float) -> _Req | None:
        req = self._reqs.get(rid)
        return req if req is not None and req.gc_at > now else None

    def _touch_req(self, rid: Rid, state: State | None, gc_at: float) -> None:
        req = self._reqs.get(rid)
        if req is not None:
            req.state = state or req.state
            req.gc_at = gc_at

    def _drop_request(self, rid: Rid) -> None:
        self._reqs.pop(rid, None)
        log = self._logs.pop(rid, None)
        if log is not None:
            log.notify()

    # --- token logs ---

    async def append_many(self, appends: list[LogAppend]) -> list[bool]:
        now = self.clock()
        return [self._append(a, now) for a in appends]

    def _append(self, a: LogAppend, now: float) -> bool:
        rid = (a.tenant, a.request_id)
        req, log = self._req(rid, now), self._logs.get(rid)
        if req is None or log is None or (req.owner, req.epoch) != (a.owner, a.epoch):
            return False
        if log.finished or len(log.entries) != a.offset:
            return False
        log.entries.extend(a.entries)
        log.gc_at = req.gc_at = max(req.gc_at, now + RUNNING_GC_S)
        log.notify()
        return True

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
        now, rid = self.clock(), (tenant, request_id)
        req, log = self._req(rid, now), self._logs.get(rid)
        if req is None or log is None or (req.owner, req.epoch) != (owner, epoch) or log.finished:
            return False
        self._wrote()
        log.finished, log.info, log.expires_at = True, finish_info, now + keep_s
        log.gc_at = log.expires_at + GC_SLACK_S
        if not req.key:
            req.state = State.FAILED if failed else State.SUCCESS
            req.gc_at = log.gc_at
        log.notify()
        return True

    async def read(self, tenant: str, request_id: str, offset: int, limit: int = 1024) -> LogSlice | None:
        log = self._log((tenant, request_id), self.clock())
        if log is None:
            return None
        entries = log.entries[offset : offset + limit]
        end = offset + len(entries)
        return LogSlice(entries, end, log.finished and end >= len(log.entries), log.info if log.finished else b"")

    async def tail(
        self, tenant: str, request_id: str, offset: int, timeout_s: float, limit: int = 1024
    ) -> LogSlice | None:
        log = self._log((tenant, request_id), self.clock())
        if log is not None and len(log.entries) <= offset and not log.finished and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(log.changed.wait(), timeout_s)
        return await self.read(tenant, request_id, offset, limit)

    def _log(self, rid: Rid, now: float) -> _Log | None:
        log = self._logs.get(rid)
        if log is None or log.gc_at <= now or (log.finished and log.expires_at <= now):
            return None
        return log

    async def close(self) -> None:
        return None

    # --- garbage collection ---

    def _wrote(self) -> None:
        self._writes += 1
        if self._writes % SWEEP_EVERY == 0:
            self.sweep()

    def sweep(self) -> None:
        """Drop everything past its GC deadline (the same deadlines as the Redis key TTLs)."""
        now = self.clock()
        drop_where(self._reqs, lambda r: r.gc_at <= now)
        drop_where(self._logs, lambda log: log.gc_at <= now)


def drop_where(table: dict[K, V], expired: Callable[[V], bool]) -> None:
    for k in [k for k, v in table.items() if expired(v)]:
        del table[k]
