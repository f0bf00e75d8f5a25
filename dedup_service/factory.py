"""`make_store`: a store from its URL."""

from __future__ import annotations

import time

from dedup_service.memory import MemoryStore
from dedup_service.redis_store import RedisStore
from dedup_service.store import Store
from dedup_service.timing import Clock


def make_store(url: str, clock: Clock = time.time) -> Store:
    """ "memory" (embedded, one process) or "redis://host:port/db" / "rediss://..." (shared by replicas)."""
    if url == "memory":
        return MemoryStore(clock)
    if url.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore.from_url(url, clock)
    raise ValueError(f"unknown store url {url!r}: expected 'memory' or 'redis://host:port/db'")
