"""The `Store` protocol: what the control plane calls.

Two backends implement it with the same behaviour, checked by the same tests: `MemoryStore` (embedded
default, one process) and `RedisStore` (shared by control-plane replicas).

Fencing: every write to an owned record or token log names (owner, epoch). The epoch grows by one at each
takeover and at each fresh claim of a released key, and the owner should be unique per control-plane process
(e.g. host/pid/random), so a writer that lost its lease is refused (False) and changes nothing.

Request ids are scoped per tenant: the request index and token logs are keyed by (tenant, request id), so two
tenants may use the same id at once, each seeing only its own request and log.

Stored payloads (`claim`, `claim_item`, `start_request`) are bounded by the `max_payload_bytes` the store
was made with (`make_store`, 1 MiB by default): a larger one raises ValueError before anything is written.
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
    """Idempotency records, content-dedup leases, the request index, token logs and replica liveness.

    Every method may raise `StoreUnavailable` (the store cannot do this now: unreachable, timing out, full).
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
        (CLAIMED); every later outcome returns the record's original payload, so a TAKEOVER can re-run it.
        REQUEST_ID_IN_USE when the tenant already uses `request_id` for another key or a keyless request."""
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

    # --- request index: (tenant, request id) -> key, owner, epoch, state ---

    async def start_request(self, tenant: str, request_id: str, owner: str, *, payload: bytes = b"") -> bool:
        """Index a request that has no idempotency key (epoch 1, PROCESSING) and open its token log.
        False when the tenant's request id is taken. (`claim` does this itself for keyed requests.)

        `payload` (the serialized request) is kept with the entry (`RequestInfo.payload`), so another replica
        can continue the request after `take_request`."""
        ...

    async def lookup_request(self, tenant: str, request_id: str) -> RequestInfo | None:
        """The tenant's index entry, or None when absent or expired."""
        ...

    async def take_request(self, tenant: str, request_id: str, owner: str, epoch: int) -> int | None:
        """Move a RUNNING keyless request from (its owner, `epoch`) to (`owner`, epoch + 1), keeping its log
        to continue from, and return the new epoch: the old owner's appends and finish are refused from then
        on. None when the entry moved on already (another replica took it), or is keyed (claim takes those
        over), finished or gone. Whether the owner is dead is the caller's decision (`alive`)."""
        ...

    async def purge_request(self, tenant: str, request_id: str) -> bool:
        """Delete the tenant's request (and its idempotency record, if keyed) and its token log."""
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

    # --- token logs, per (tenant, request id) ---

    async def append_many(self, appends: list[LogAppend]) -> list[bool]:
        """Append tokens of many requests in one round trip. Each append is refused (False) unless
        (owner, epoch) own the request, the log is open and `offset` equals its current length. When it
        raises StoreUnavailable because the store is full, nothing was written."""
        ...

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
        """Close the log (waking tailers); it stays readable keep_s. For a request without a key this also
        sets its index state (SUCCESS, or FAILED when `failed`)."""
        ...

    async def read(self, tenant: str, request_id: str, offset: int, limit: int = 1024) -> LogSlice | None:
        """Up to `limit` entries from token index `offset`; None when the log is unknown or expired."""
        ...

    async def tail(
        self, tenant: str, request_id: str, offset: int, timeout_s: float, limit: int = 1024
    ) -> LogSlice | None:
        """Like `read`, but waits up to timeout_s (real time) for entries or the finish, on any replica."""
        ...

    # --- replica liveness, by the injected clock ---

    async def heartbeat(self, owner: str, lease_s: float) -> None:
        """The control-plane replica `owner` is alive until now + lease_s (a later beat replaces it)."""
        ...

    async def alive(self, owner: str) -> bool:
        """Whether `owner`'s last heartbeat still holds (False when it never beat)."""
        ...

    async def close(self) -> None: ...
