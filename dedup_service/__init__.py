"""Coalesce: dedup_service.

Idempotency records, fingerprints, in-flight content dedup, the request index, token logs for resume and
batch item records, behind one `Store` protocol with a memory and a Redis backend (see store.py).
"""

from dedup_service.factory import make_store
from dedup_service.fingerprint import fingerprint
from dedup_service.model import (
    BATCH_KEY_PREFIX,
    MAX_PAYLOAD_BYTES,
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
)
from dedup_service.store import Store
from dedup_service.timing import DEFAULT_KEEP_S, DEFAULT_LEASE_S, DEFAULT_RETENTION_S

__all__ = [
    "BATCH_KEY_PREFIX",
    "DEFAULT_KEEP_S",
    "DEFAULT_LEASE_S",
    "DEFAULT_RETENTION_S",
    "MAX_PAYLOAD_BYTES",
    "BatchItem",
    "ClaimResult",
    "ContentClaim",
    "LogAppend",
    "LogEntry",
    "LogSlice",
    "Outcome",
    "Record",
    "RequestInfo",
    "State",
    "Store",
    "StoreUnavailable",
    "batch_key",
    "fingerprint",
    "make_store",
]
