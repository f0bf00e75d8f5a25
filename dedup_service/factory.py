"""`make_store`: a store from its URL."""

from __future__ import annotations

import time

from dedup_service.memory import MemoryStore
from dedup_service.model import MAX_PAYLOAD_BYTES
from dedup_service.redis_store import RedisStore
from dedup_service.store import Store
from dedup_service.timing import Clock


def make_store(url: str, clock: Clock = time.time, *, max_payload_bytes: int = MAX_PAYLOAD_BYTES) -> Store:
    """ "memory" (embedded, one process) or "redis://host:port/db" / "rediss://..." (shared by replicas).

    `max_payload_bytes` bounds each stored payload (a serialized request): a larger one is a ValueError."""
    if url == "memory":
        return MemoryStore(clock, max_payload_bytes)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore.from_url(url, clock, max_payload_bytes=max_payload_bytes)
    scheme = url.split("://", 1)[0] if "://" in url else url[:16]  # never the rest: it may hold a password
    raise ValueError(f"unknown store url scheme {scheme!r}: expected 'memory', 'redis://...' or 'rediss://...'")
