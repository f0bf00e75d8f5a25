"""Redis-only behaviour: outages, recovery, replicas sharing one server, key layout and GC TTLs."""

from __future__ import annotations

import asyncio

import pytest
import redis
from dedup_clock import Clock

from dedup_service import LogAppend, LogEntry, Outcome, StoreUnavailable, make_store


async def test_store_unavailable_and_recovery(redis_server, clock: Clock) -> None:
    store = make_store(redis_server.url, clock)
    try:
        assert (await store.claim("t", "k", "cp-a", "fp", "r1", 10)).outcome == Outcome.CLAIMED
        redis_server.stop()
        for op in (
            store.claim("t", "k2", "cp-a", "fp", "r2", 10),
            store.get("t", "k"),
            store.append_many([LogAppend("r1", "cp-a", 1, 0, [LogEntry(1)])]),
            store.read("r1", 0),
            store.tail("r1", 0, timeout_s=0.1),
            store.list_batch("t", "b"),
        ):
            with pytest.raises(StoreUnavailable, match="unavailable"):
                await op
        redis_server.start()  # same port, empty (nothing is persisted)
        assert await store.get("t", "k") is None
        assert (await store.claim("t", "k", "cp-a", "fp", "r1", 10)).outcome == Outcome.CLAIMED
        assert await store.append_many([LogAppend("r1", "cp-a", 1, 0, [LogEntry(1)])]) == [True]
    finally:
        await store.close()


async def test_replicas_tail_each_other(redis_server, clock: Clock) -> None:
    a, b = make_store(redis_server.url, clock), make_store(redis_server.url, clock)
    try:
        claimed = await a.claim("t", "k", "cp-a", "fp", "r1", 10)
        assert claimed.outcome == Outcome.CLAIMED
        attached = await b.claim("t", "k", "cp-b", "fp", "r9", 10)
        assert attached.outcome == Outcome.ATTACH and attached.record is not None
        rid = attached.record.request_id
        # Replica b streams replica a's tokens as they are appended.
        received: list[int] = []
        offset = 0

        async def follow() -> None:
            nonlocal offset
            while True:
                got = await b.tail(rid, offset, timeout_s=5)
                assert got is not None
                received.extend(e.token_id for e in got.entries)
                offset = got.next_offset
                if got.finished:
                    return

        follower = asyncio.create_task(follow())
        for i in range(5):
            assert await a.append_many([LogAppend(rid, "cp-a", 1, i, [LogEntry(100 + i)])]) == [True]
            await asyncio.sleep(0.01)
        assert await a.finish(rid, "cp-a", 1, b"done", 30)
        await asyncio.wait_for(follower, 5)
        assert received == [100, 101, 102, 103, 104]
    finally:
        await a.close()
        await b.close()


async def test_key_layout_and_gc_ttls(redis_server, clock: Clock) -> None:
    store = make_store(redis_server.url, clock)
    try:
        # A ':' in a tenant cannot reach another tenant's key.
        assert (await store.claim("a:b", "c", "cp", "fp1", "r1", 10)).outcome == Outcome.CLAIMED
        assert (await store.claim("a", "b:c", "cp", "fp2", "r2", 10)).outcome == Outcome.CLAIMED
        await store.claim_item("a", "job", "1", "cp", "fp3", "r3", 10)
        await store.claim_content("a", "fp4", "r4", "cp", 10)
        await store.append_many([LogAppend("r1", "cp", 1, 0, [LogEntry(1)])])
    finally:
        await store.close()
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = sorted(str(k) for k in sync.keys("*"))
    assert keys == [
        "coalesce:batch:a:job",
        "coalesce:content:a:fp4",
        "coalesce:idem:a%3Ab:c",
        "coalesce:idem:a:b:c",
        "coalesce:idem:a:batch/job/1",
        "coalesce:log:r1",
        "coalesce:logm:r1",
        "coalesce:logm:r2",
        "coalesce:logm:r3",
        "coalesce:req:r1",
        "coalesce:req:r2",
        "coalesce:req:r3",
    ]
    # Everything expires eventually, and never before its logical expiry (10 s lease here).
    for key in keys:
        assert sync.pttl(key) > 10_000, key
