"""In-memory `Store`: the embedded default (one process, one asyncio loop).

No method awaits between reading and writing its state, so each is atomic on the loop, as each Redis
script is on the server. Expired entries are dropped by a sweep every few hundred writes, following the same
GC deadlines as the Redis key TTLs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

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
    batch_key,
    seq_sort_key,
)
from dedup_service.store import BATCH_GC_S, GC_SLACK_S, RUNNING_GC_S, Clock

SWEEP_EVERY = 256  # writes between sweeps

K = TypeVar("K")
V = TypeVar("V")


@dataclass(slots=True)
class _Req:
    tenant: str
    key: str
    owner: str
    epoch: int
    state: State
    gc_at: float


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


class MemoryStore:
    def __init__(self, clock: Clock = time.time) -> None:
        self.clock = clock
        self._records: dict[tuple[str, str], Record] = {}
        self._tombstones: dict[tuple[str, str], tuple[int, float]] = {}  # released key -> (last epoch, gc_at)
        self._reqs: dict[str, _Req] = {}
        self._logs: dict[str, _Log] = {}
        self._content: dict[tuple[str, str], tuple[str, float]] = {}  # -> (leader request id, lease_until)
        self._batches: dict[tuple[str, str], tuple[set[str], float]] = {}  # -> (seq ids, gc_at)
        self._writes = 0

    # --- idempotency records ---

    async def claim(
        self, tenant: str, key: str, owner: str, fingerprint: str, request_id: str, lease_s: float
    ) -> ClaimResult:
        return self._claim(tenant, key, owner, fingerprint, request_id, lease_s)

    async def claim_item(
        self, tenant: str, batch_id: str, seq_id: str, owner: str, fingerprint: str, request_id: str, lease_s: float
    ) -> ClaimResult:
        result = self._claim(tenant, batch_key(batch_id, seq_id), owner, fingerprint, request_id, lease_s)
        if result.outcome != Outcome.REQUEST_ID_IN_USE:
            seqs, _ = self._batches.get((tenant, batch_id), (set(), 0.0))
            seqs.add(seq_id)
            self._batches[(tenant, batch_id)] = (seqs, self.clock() + BATCH_GC_S)
        return result

    def _claim(self, tenant: str, key: str, owner: str, fp: str, request_id: str, lease_s: float) -> ClaimResult:
        self._wrote()
        now = self.clock()
        rec = self._live(tenant, key, now)
        if rec is not None:
            if rec.fingerprint != fp:
                return ClaimResult(Outcome.KEY_REUSED, _copy(rec))
            if rec.state == State.SUCCESS:
                return ClaimResult(Outcome.REPLAY, _copy(rec))
            if rec.state == State.FAILED:
                return ClaimResult(Outcome.REPLAY_ERROR, _copy(rec))
            if rec.lease_until > now:
                return ClaimResult(Outcome.ATTACH, _copy(rec))
            # The owner stopped renewing: a new epoch fences it out; the log is kept to continue from.
            rec.epoch += 1
            rec.owner, rec.state, rec.lease_until = owner, State.INIT, now + lease_s
            self._index(rec, now, reset_log=False)
            return ClaimResult(Outcome.TAKEOVER, _copy(rec))

        req = self._req(request_id, now)
        if req is not None and (req.tenant != tenant or req.key != key):
            return ClaimResult(Outcome.REQUEST_ID_IN_USE, None)
        # Epochs keep growing across releases, so a stale writer of an earlier run never matches.
        old = self._records.pop((tenant, key), None)
        last_epoch = old.epoch if old else self._tombstones.pop((tenant, key), (0, 0.0))[0]
        rec = Record(tenant, key, State.INIT, owner, last_epoch + 1, fp, request_id, now + lease_s)
        self._records[(tenant, key)] = rec
        self._index(rec, now, reset_log=True)
        return ClaimResult(Outcome.CLAIMED, _copy(rec))

    def _index(self, rec: Record, now: float, reset_log: bool) -> None:
        """Point the request index at the record's owner and epoch; open (or keep) its log."""
        gc_at = now + RUNNING_GC_S
        self._reqs[rec.request_id] = _Req(rec.tenant, rec.key, rec.owner, rec.epoch, rec.state, gc_at)
        log = self._logs.get(rec.request_id)
        if reset_log or log is None:
            if log is not None:
                log.notify()
            self._logs[rec.request_id] = _Log(gc_at)
        else:
            log.gc_at = gc_at

    async def renew(self, tenant: str, key: str, owner: str, epoch: int, lease_s: float) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        now = self.clock()
        rec.lease_until = now + lease_s
        self._touch_req(rec.request_id, None, now + RUNNING_GC_S)
        return True

    async def mark_processing(self, tenant: str, key: str, owner: str, epoch: int) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        rec.state = State.PROCESSING
        self._touch_req(rec.request_id, State.PROCESSING, self.clock() + RUNNING_GC_S)
        return True

    async def succeed(self, tenant: str, key: str, owner: str, epoch: int, result: bytes, retention_s: float) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        now = self.clock()
        rec.state, rec.result, rec.expires_at = State.SUCCESS, result, now + retention_s
        self._touch_req(rec.request_id, State.SUCCESS, rec.expires_at + GC_SLACK_S)
        return True

    async def fail(
        self, tenant: str, key: str, owner: str, epoch: int, error: str, retention_s: float, retryable: bool
    ) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        self._wrote()
        now = self.clock()
        if retryable:
            self._release(rec, now)
            self._touch_req(rec.request_id, State.FAILED, now + RUNNING_GC_S)
        else:
            rec.state, rec.error, rec.expires_at = State.FAILED, error, now + retention_s
            self._touch_req(rec.request_id, State.FAILED, rec.expires_at + GC_SLACK_S)
        return True

    async def get(self, tenant: str, key: str) -> Record | None:
        rec = self._live(tenant, key, self.clock())
        return _copy(rec) if rec else None

    async def purge(self, tenant: str, key: str) -> bool:
        now = self.clock()
        live = self._live(tenant, key, now)
        rec = self._records.get((tenant, key))
        if rec is None:
            return False
        self._release(rec, now)
        self._drop_request(rec.request_id)
        return live is not None

    def _release(self, rec: Record, now: float) -> None:
        """Delete the record but remember its epoch (the Redis backend keeps a tombstone hash)."""
        del self._records[(rec.tenant, rec.key)]
        self._tombstones[(rec.tenant, rec.key)] = (rec.epoch, now + RUNNING_GC_S)

    def _live(self, tenant: str, key: str, now: float) -> Record | None:
        rec = self._records.get((tenant, key))
        if rec is None or (rec.state not in RUNNING and rec.expires_at <= now):
            return None
        return rec

    def _owned(self, tenant: str, key: str, owner: str, epoch: int) -> Record | None:
        rec = self._records.get((tenant, key))
        if rec is None or rec.state not in RUNNING or rec.owner != owner or rec.epoch != epoch:
            return None
        return rec

    # --- batch items ---

    async def list_batch(self, tenant: str, batch_id: str) -> list[BatchItem]:
        now = self.clock()
        seqs, gc_at = self._batches.get((tenant, batch_id), (set(), 0.0))
        if gc_at <= now:
            return []
        items = []
        for seq in sorted(seqs, key=seq_sort_key):
            rec = self._live(tenant, batch_key(batch_id, seq), now)
            items.append(BatchItem(seq, _copy(rec) if rec else None))
        return items

    # --- request index ---

    async def start_request(self, tenant: str, request_id: str, owner: str) -> bool:
        now = self.clock()
        if self._req(request_id, now) is not None:
            return False
        self._wrote()
        self._reqs[request_id] = _Req(tenant, "", owner, 1, State.PROCESSING, now + RUNNING_GC_S)
        self._logs[request_id] = _Log(now + RUNNING_GC_S)
        return True

    async def lookup_request(self, tenant: str, request_id: str) -> RequestInfo | None:
        now = self.clock()
        req = self._req(request_id, now)
        if req is None or req.tenant != tenant:
            return None
        log = self._log(request_id, now)
        if not req.key and log is None:
            return None  # a keyless request lives as long as its log
        n, finished = (len(log.entries), log.finished) if log else (0, False)
        return RequestInfo(request_id, req.tenant, req.key, req.owner, req.epoch, req.state, n, finished)

    async def purge_request(self, tenant: str, request_id: str) -> bool:
        now = self.clock()
        req = self._req(request_id, now)
        if req is None or req.tenant != tenant:
            return False
        rec = self._records.get((tenant, req.key)) if req.key else None
        if rec is not None and rec.request_id == request_id:
            self._release(rec, now)
        self._drop_request(request_id)
        return True

    def _req(self, request_id: str, now: float) -> _Req | None:
        req = self._reqs.get(request_id)
        return req if req is not None and req.gc_at > now else None

    def _touch_req(self, request_id: str, state: State | None, gc_at: float) -> None:
        req = self._reqs.get(request_id)
        if req is not None:
            req.state = state or req.state
            req.gc_at = gc_at

    def _drop_request(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)
        log = self._logs.pop(request_id, None)
        if log is not None:
            log.notify()

    # --- content dedup ---

    async def claim_content(
        self, tenant: str, fingerprint: str, request_id: str, owner: str, lease_s: float
    ) -> ContentClaim:
        now = self.clock()
        leader = self._content.get((tenant, fingerprint))
        if leader is not None and leader[1] > now:
            return ContentClaim(False, leader[0])
        self._wrote()
        self._content[(tenant, fingerprint)] = (request_id, now + lease_s)
        return ContentClaim(True, request_id)

    async def renew_content(self, tenant: str, fingerprint: str, request_id: str, lease_s: float) -> bool:
        leader = self._content.get((tenant, fingerprint))
        if leader is None or leader[0] != request_id:
            return False
        self._content[(tenant, fingerprint)] = (request_id, self.clock() + lease_s)
        return True

    async def release_content(self, tenant: str, fingerprint: str, request_id: str) -> bool:
        leader = self._content.get((tenant, fingerprint))
        if leader is None or leader[0] != request_id:
            return False
        del self._content[(tenant, fingerprint)]
        return True

    # --- token logs ---

    async def append_many(self, appends: list[LogAppend]) -> list[bool]:
        now = self.clock()
        return [self._append(a, now) for a in appends]

    def _append(self, a: LogAppend, now: float) -> bool:
        req, log = self._req(a.request_id, now), self._logs.get(a.request_id)
        if req is None or log is None or (req.owner, req.epoch) != (a.owner, a.epoch):
            return False
        if log.finished or len(log.entries) != a.offset:
            return False
        log.entries.extend(a.entries)
        log.gc_at = req.gc_at = max(req.gc_at, now + RUNNING_GC_S)
        log.notify()
        return True

    async def finish(
        self, request_id: str, owner: str, epoch: int, finish_info: bytes, keep_s: float, failed: bool = False
    ) -> bool:
        now = self.clock()
        req, log = self._req(request_id, now), self._logs.get(request_id)
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

    async def read(self, request_id: str, offset: int, limit: int = 1024) -> LogSlice | None:
        log = self._log(request_id, self.clock())
        if log is None:
            return None
        entries = log.entries[offset : offset + limit]
        end = offset + len(entries)
        return LogSlice(entries, end, log.finished and end >= len(log.entries), log.info if log.finished else b"")

    async def tail(self, request_id: str, offset: int, timeout_s: float, limit: int = 1024) -> LogSlice | None:
        log = self._log(request_id, self.clock())
        if log is not None and len(log.entries) <= offset and not log.finished and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(log.changed.wait(), timeout_s)
        return await self.read(request_id, offset, limit)

    def _log(self, request_id: str, now: float) -> _Log | None:
        log = self._logs.get(request_id)
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
        for k, rec in list(self._records.items()):
            gc_at = rec.lease_until + RUNNING_GC_S if rec.state in RUNNING else rec.expires_at + GC_SLACK_S
            if gc_at <= now:
                del self._records[k]
        _drop_where(self._tombstones, lambda v: v[1] <= now)
        _drop_where(self._reqs, lambda r: r.gc_at <= now)
        _drop_where(self._logs, lambda log: log.gc_at <= now)
        _drop_where(self._content, lambda v: v[1] + GC_SLACK_S <= now)
        _drop_where(self._batches, lambda v: v[1] <= now)


def _drop_where(table: dict[K, V], expired: Callable[[V], bool]) -> None:
    for k in [k for k, v in table.items() if expired(v)]:
        del table[k]


def _copy(rec: Record) -> Record:
    """Callers get copies, so nothing they do changes the store."""
    return dataclasses.replace(rec)
