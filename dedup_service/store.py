"""The `Store` protocol: what the control plane calls.

Two backends implement it with the same behaviour, checked by the same tests: `MemoryStore` (embedded
default, one process) and `RedisStore` (shared by control-plane replicas).

Fencing: every write to an owned record or token log names (owner, epoch). The epoch grows by one at each
takeover and at each fresh claim of a released key, and the owner should be unique per control-plane process
(e.g. host/pid/random), so a writer that lost its lease is refused (False) and changes nothing.
"""

from __future__ import annotations

from typing import Protocol

from dedup_service.model import (
    BatchItem,
    ClaimResult,
    ContentClaim,
    LogAppend,
    LogSlice,
    Record,
    RequestInfo,
)
from dedup_service.timing import Clock


class Store(Protocol):
    """Idempotency records, content-dedup leases, the request index and token logs.

    Every method may raise `StoreUnavailable`.
    """

    clock: Clock
    # True when replicas share the store (Redis): token logs and content leases must go through it. The
    # memory store lives in one process, whose in-memory generations are already the log.
    shared: bool

    # --- idempotency records, one per (tenant, key) ---

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
        """Claim the key or report what holds it (see `Outcome`). CLAIMED/TAKEOVER records are ours.

        `payload` (the serialized request, arbitrary bytes) is stored only when the claim creates the record
        (CLAIMED); every later outcome returns the record's original payload, so a TAKEOVER can re-run it."""
        ...

    async def renew(self, tenant: str, key: str, owner: str, epoch: int, lease_s: float) -> bool:
        """Extend our lease to now + lease_s while INIT/PROCESSING."""
        ...

    async def mark_processing(self, tenant: str, key: str, owner: str, epoch: int) -> bool:
        """INIT -> PROCESSING (admitted to a worker)."""
        ...

    async def succeed(self, tenant: str, key: str, owner: str, epoch: int, result: bytes, retention_s: float) -> bool:
        """Record SUCCESS with the result, replayed to retries for retention_s."""
        ...

    async def fail(
        self, tenant: str, key: str, owner: str, epoch: int, error: str, retention_s: float, retryable: bool
    ) -> bool:
        """retryable (server's fault): release the key so a retry runs anew. Else FAILED, replayed."""
        ...

    async def get(self, tenant: str, key: str) -> Record | None:
        """The live record (running, or finished within retention), else None."""
        ...

    async def purge(self, tenant: str, key: str) -> bool:
        """Delete the record, its request index entry and token log. True when a live record existed."""
        ...

    # --- batch items: records keyed batch_key(batch_id, seq_id), listed per batch ---

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
        """`claim` of batch_key(batch_id, seq_id), also adding seq_id to the batch's item set."""
        ...

    async def list_batch(self, tenant: str, batch_id: str) -> list[BatchItem]:
        """Every item ever claimed in the batch (while the batch is kept), in seq_id order."""
        ...

    # --- request index: request id -> tenant, owner, epoch, state ---

    async def start_request(self, tenant: str, request_id: str, owner: str) -> bool:
        """Index a request that has no idempotency key (epoch 1, PROCESSING) and open its token log.
        False when the request id is taken. (`claim` does this itself for keyed requests.)"""
        ...

    async def lookup_request(self, tenant: str, request_id: str) -> RequestInfo | None:
        """The index entry, or None when absent, expired or of another tenant (never reveal)."""
        ...

    async def purge_request(self, tenant: str, request_id: str) -> bool:
        """Delete a request (and its idempotency record, if keyed) and its token log."""
        ...

    # --- content dedup: one leader per (tenant, fingerprint) in flight ---

    async def claim_content(
        self, tenant: str, fingerprint: str, request_id: str, owner: str, lease_s: float
    ) -> ContentClaim:
        """Lead (no live leader: ours for lease_s) or follow the live leader's request id."""
        ...

    async def renew_content(self, tenant: str, fingerprint: str, request_id: str, lease_s: float) -> bool: ...

    async def release_content(self, tenant: str, fingerprint: str, request_id: str) -> bool:
        """The leader finished: later identical requests lead anew (or hit a result cache)."""
        ...

    # --- token logs, per request id ---

    async def append_many(self, appends: list[LogAppend]) -> list[bool]:
        """Append tokens of many requests in one round trip. Each append is refused (False) unless
        (owner, epoch) own the request, the log is open and `offset` equals its current length."""
        ...

    async def finish(
        self, request_id: str, owner: str, epoch: int, finish_info: bytes, keep_s: float, failed: bool = False
    ) -> bool:
        """Close the log (waking tailers); it stays readable keep_s. For a request without a key this also
        sets its index state (SUCCESS, or FAILED when `failed`)."""
        ...

    async def read(self, request_id: str, offset: int, limit: int = 1024) -> LogSlice | None:
        """Up to `limit` entries from token index `offset`; None when the log is unknown or expired."""
        ...

    async def tail(self, request_id: str, offset: int, timeout_s: float, limit: int = 1024) -> LogSlice | None:
        """Like `read`, but waits up to timeout_s (real time) for entries or the finish, on any replica."""
        ...

    async def close(self) -> None: ...
