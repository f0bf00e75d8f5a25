"""In-memory `Store`: the embedded default (one process, one asyncio loop).

Idempotency records, content-dedup leases and batch item sets, on top of `MemoryLogs` (request index and
token logs). Like the Redis scripts, no method awaits between reading and writing, so each is atomic.
"""

from __future__ import annotations

import dataclasses
import time

from dedup_service.memory_log import MemoryLogs, drop_where
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
from dedup_service.timing import BATCH_GC_S, GC_SLACK_S, RUNNING_GC_S, Clock


class MemoryStore(MemoryLogs):
    shared = False  # one process: its in-memory generations are the token log

    def __init__(self, clock: Clock = time.time, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> None:
        super().__init__(clock, max_payload_bytes)
        self._records: dict[tuple[str, str], Record] = {}
        self._tombstones: dict[tuple[str, str], tuple[int, float]] = {}  # released key -> (last epoch, gc_at)
        self._content: dict[tuple[str, str], tuple[str, float]] = {}  # -> (leader request id, lease_until)
        self._batches: dict[tuple[str, str], tuple[set[str], float]] = {}  # -> (seq ids, gc_at)
        self._alive: dict[str, float] = {}  # control-plane replica (owner) -> alive until

    # --- idempotency records ---

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
        return self._claim(tenant, key, owner, fingerprint, request_id, lease_s, payload)

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
        result = self._claim(tenant, key, owner, fingerprint, request_id, lease_s, payload)
        if result.outcome != Outcome.REQUEST_ID_IN_USE:
            seqs, _ = self._batches.get((tenant, batch_id), (set(), 0.0))
            seqs.add(seq_id)
            self._batches[(tenant, batch_id)] = (seqs, self.clock() + BATCH_GC_S)
        return result

    def _claim(
        self, tenant: str, key: str, owner: str, fp: str, request_id: str, lease_s: float, payload: bytes
    ) -> ClaimResult:
        check_payload(payload, self.max_payload_bytes)
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

        req = self._req((tenant, request_id), now)
        if req is not None and req.key != key:
            return ClaimResult(Outcome.REQUEST_ID_IN_USE, None)
        # Epochs keep growing across releases, so a stale writer of an earlier run never matches.
        old = self._records.pop((tenant, key), None)
        last_epoch = old.epoch if old else self._tombstones.pop((tenant, key), (0, 0.0))[0]
        rec = Record(
            tenant, key, State.INIT, owner, last_epoch + 1, fp, request_id, now + lease_s, payload=bytes(payload)
        )
        self._records[(tenant, key)] = rec
        self._index(rec, now, reset_log=True)
        return ClaimResult(Outcome.CLAIMED, _copy(rec))

    async def renew(self, tenant: str, key: str, owner: str, epoch: int, lease_s: float) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        now = self.clock()
        rec.lease_until = now + lease_s
        self._touch_req(_rid(rec), None, now + RUNNING_GC_S)
        return True

    async def mark_processing(self, tenant: str, key: str, owner: str, epoch: int) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        rec.state = State.PROCESSING
        self._touch_req(_rid(rec), State.PROCESSING, self.clock() + RUNNING_GC_S)
        return True

    async def succeed(self, tenant: str, key: str, owner: str, epoch: int, result: bytes, retention_s: float) -> bool:
        rec = self._owned(tenant, key, owner, epoch)
        if rec is None:
            return False
        now = self.clock()
        rec.state, rec.result, rec.expires_at = State.SUCCESS, result, now + retention_s
        self._touch_req(_rid(rec), State.SUCCESS, rec.expires_at + GC_SLACK_S)
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
            self._touch_req(_rid(rec), State.FAILED, now + RUNNING_GC_S)
        else:
            rec.state, rec.error, rec.expires_at = State.FAILED, error, now + retention_s
            self._touch_req(_rid(rec), State.FAILED, rec.expires_at + GC_SLACK_S)
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
        self._drop_request(_rid(rec))
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

    async def purge_request(self, tenant: str, request_id: str) -> bool:
        now, rid = self.clock(), (tenant, request_id)
        req = self._req(rid, now)
        if req is None:
            return False
        rec = self._records.get((tenant, req.key)) if req.key else None
        if rec is not None and rec.request_id == request_id:
            self._release(rec, now)
        self._drop_request(rid)
        return True

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

    # --- replica liveness ---

    async def heartbeat(self, owner: str, lease_s: float) -> None:
        self._wrote()
        self._alive[owner] = self.clock() + lease_s

    async def alive(self, owner: str) -> bool:
        return self._alive.get(owner, 0.0) > self.clock()

    def sweep(self) -> None:
        super().sweep()
        now = self.clock()
        for k, rec in list(self._records.items()):
            gc_at = rec.lease_until + RUNNING_GC_S if rec.state in RUNNING else rec.expires_at + GC_SLACK_S
            if gc_at <= now:
                del self._records[k]
        drop_where(self._tombstones, lambda v: v[1] <= now)
        drop_where(self._content, lambda v: v[1] + GC_SLACK_S <= now)
        drop_where(self._batches, lambda v: v[1] <= now)
        drop_where(self._alive, lambda until: until + GC_SLACK_S <= now)


def _rid(rec: Record) -> tuple[str, str]:
    return (rec.tenant, rec.request_id)


def _copy(rec: Record) -> Record:
    """Callers get copies, so nothing they do changes the store."""
    return dataclasses.replace(rec)
