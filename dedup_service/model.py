"""Plain data of the dedup store: record states, claim outcomes, token log entries, errors.

Times are seconds from the store's injected clock (floats); both backends decide leases and retention
from that clock only, so tests move time instead of sleeping.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple
from urllib.parse import quote


class StoreUnavailable(Exception):
    """The store cannot do this now (Redis down, timing out, full, read-only). The control plane answers
    UNAVAILABLE.

    The message goes to callers, so it never names the store's address: `where` does (for operators' logs),
    and `__cause__` keeps the backend's own error.
    """

    def __init__(self, message: str, where: str = "") -> None:
        super().__init__(message)
        self.where = where


# The stored payload (a serialized request) of a claim or keyless start is bounded: records are kept for the
# retention (24 h by default), so nothing unbounded may be stored. `make_store(..., max_payload_bytes=...)`.
MAX_PAYLOAD_BYTES = 1 << 20


def check_payload(payload: bytes, limit: int) -> None:
    """ValueError when `payload` is over `limit` bytes (checked before anything is written)."""
    if len(payload) > limit:
        raise ValueError(f"payload of {len(payload)} bytes is over the store's limit of {limit} bytes")


class State(StrEnum):
    """State of an idempotency record (docs/architecture.md, "The dedup decision")."""

    INIT = "INIT"  # claimed, waiting in the batch buffer
    PROCESSING = "PROCESSING"  # running on a worker
    SUCCESS = "SUCCESS"  # finished; the result replays
    FAILED = "FAILED"  # failed because of the request; the error replays


RUNNING = (State.INIT, State.PROCESSING)


class Outcome(StrEnum):
    """What `claim` found, and so what the caller does next."""

    CLAIMED = "CLAIMED"  # the key is ours (epoch in the record): run the request
    ATTACH = "ATTACH"  # another live owner runs it: read its token log from offset 0
    TAKEOVER = "TAKEOVER"  # its owner's lease expired: we own a new epoch; continue from the logged tokens
    REPLAY = "REPLAY"  # SUCCESS: replay record.result
    REPLAY_ERROR = "REPLAY_ERROR"  # FAILED by the request's fault: replay record.error
    KEY_REUSED = "KEY_REUSED"  # the key holds another payload: FAILED_PRECONDITION IDEMPOTENCY_KEY_REUSED
    # The tenant already uses the request id for another request (another key, or none): the caller must
    # pick another id. Request ids are scoped per tenant (see RequestInfo).
    REQUEST_ID_IN_USE = "REQUEST_ID_IN_USE"


@dataclass(slots=True)
class Record:
    """An idempotency record of (tenant, key)."""

    tenant: str
    key: str
    state: State
    owner: str
    epoch: int
    fingerprint: str
    request_id: str
    lease_until: float  # end of the owner's lease (meaningful while INIT/PROCESSING)
    expires_at: float = 0.0  # end of retention (SUCCESS/FAILED); 0 while running
    result: bytes = b""  # SUCCESS: the caller's serialized result (a coalesce.v1.GenerateResponse)
    error: str = ""  # FAILED: what went wrong
    # The request as claimed (the caller's serialized request), set when the claim creates the record and
    # never changed after: a replica that takes over re-runs the request from it.
    payload: bytes = b""


class ClaimResult(NamedTuple):
    outcome: Outcome
    record: Record | None  # None only for REQUEST_ID_IN_USE


class ContentClaim(NamedTuple):
    """Result of `claim_content`: whether we lead, and the leader's request id (ours when we lead)."""

    leader: bool
    request_id: str


@dataclass(slots=True)
class RequestInfo:
    """The request index entry of one (tenant, request id): which replica owns it, at which epoch.

    Request ids are scoped per tenant: two tenants may use the same id at once, each seeing only its own
    request and log, and nothing tells a tenant whether another uses an id.
    """

    request_id: str
    tenant: str
    key: str  # its idempotency key, "" when it has none
    owner: str
    epoch: int
    state: State
    logged_tokens: int
    finished: bool
    # What `start_request` stored for a keyless request (its serialized request), so that another replica
    # can continue it (`take_request`). b"" for a keyed request: its payload is in its `Record`.
    payload: bytes = b""


@dataclass(slots=True, frozen=True)
class LogEntry:
    """One generated token: its id, the text it adds (may be empty), opaque logprob bytes (may be empty)."""

    token_id: int
    text: str = ""
    logprob: bytes = b""  # the caller's serialized coalesce.v1.TokenLogprob, when asked for

    _HEAD = struct.Struct("<iI")

    def pack(self) -> bytes:
        """Compact form: token id, text length, UTF-8 text, then the logprob bytes to the end."""
        text = self.text.encode()
        return self._HEAD.pack(self.token_id, len(text)) + text + self.logprob

    @classmethod
    def unpack(cls, data: bytes) -> LogEntry:
        token_id, size = cls._HEAD.unpack_from(data)
        start = cls._HEAD.size
        return cls(token_id, data[start : start + size].decode(), data[start + size :])


@dataclass(slots=True)
class LogAppend:
    """Tokens for one request (tenant, request id), starting at token index `offset` of its log; fenced by
    (owner, epoch)."""

    tenant: str
    request_id: str
    owner: str
    epoch: int
    offset: int
    entries: list[LogEntry] = field(default_factory=list)


@dataclass(slots=True)
class LogSlice:
    """Entries from a read; `finished` means nothing will ever follow `next_offset`."""

    entries: list[LogEntry]
    next_offset: int
    finished: bool
    finish_info: bytes = b""  # the caller's serialized finish (reason, usage), once finished


@dataclass(slots=True)
class BatchItem:
    """One item of a batch job; `record` is None when the item's record is gone (released or expired)."""

    seq_id: str
    record: Record | None


# Prefix of the keys batch items use; the control plane refuses client idempotency keys that start with it.
BATCH_KEY_PREFIX = "batch/"


def batch_key(batch_id: str, seq_id: str) -> str:
    """The idempotency key of a batch item. The batch id is quoted so "a/b"+"c" never equals "a"+"b/c"."""
    return f"{BATCH_KEY_PREFIX}{quote(batch_id, safe='')}/{seq_id}"


def seq_sort_key(seq_id: str) -> tuple[int, int, str]:
    """Numeric seq ids in numeric order ("2" before "10"), then the others in string order."""
    return (0, int(seq_id), "") if seq_id.isdigit() else (1, 0, seq_id)
