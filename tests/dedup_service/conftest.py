"""Fixtures of the dedup store tests: every behavioural test runs against both backends."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from dedup_clock import Clock  # this folder is on sys.path (rootdir-based discovery)

from dedup_service import Store, make_store


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture(params=["memory", "redis"])
def store_url(request: pytest.FixtureRequest) -> str:
    """ "memory", or the url of a fresh redis-server (the root conftest's `redis_server`)."""
    if request.param == "redis":
        return str(request.getfixturevalue("redis_server").url)
    return "memory"


@pytest.fixture
async def store(store_url: str, clock: Clock) -> AsyncIterator[Store]:
    s = make_store(store_url, clock)
    yield s
    await s.close()


@pytest.fixture
async def peer(store_url: str, store: Store, clock: Clock) -> AsyncIterator[Store]:
    """Another replica's view of the same store: a second RedisStore on the same server (the memory store is
    one process, so its peer is itself)."""
    if store_url == "memory":
        yield store
        return
    other = make_store(store_url, clock)
    yield other
    await other.close()
