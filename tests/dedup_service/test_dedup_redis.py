"""Redis-only behaviour: outages, recovery, replicas sharing one server, key layout and GC TTLs, URLs."""

from __future__ import annotations

import asyncio

import pytest
import redis
from dedup_clock import Clock

from dedup_service import LogAppend, LogEntry, Outcome, StoreUnavailable, make_store
from dedup_service.redis_store import RedisStore


async def test_store_unavailable_and_recovery(redis_server, clock: Clock) -> None:
    store = make_store(redis_server.url, clock)
    try:
        assert (await store.claim("t", "k", "cp-a", "fp", "r1", 10)).outcome == Outcome.CLAIMED
        redis_server.stop()
        for op in (
            store.claim("t", "k2", "cp-a", "fp", "r2", 10),
            store.get("t", "k"),
            store.append_many([LogAppend("t", "r1", "cp-a", 1, 0, [LogEntry(1)])]),
            store.read("t", "r1", 0),
            store.tail("t", "r1", 0, timeout_s=0.1),
            store.list_batch("t", "b"),
        ):
            with pytest.raises(StoreUnavailable, match="unavailable") as err:
                await op
            # Callers see the message: it never names the store's address; operators' logs get `where`.
            assert str(redis_server.port) not in str(err.value) and "127.0.0.1" not in str(err.value)
            assert err.value.where == f"127.0.0.1:{redis_server.port}"
        redis_server.start()  # same port, empty (nothing is persisted)
        assert await store.get("t", "k") is None
        assert (await store.claim("t", "k", "cp-a", "fp", "r1", 10)).outcome == Outcome.CLAIMED
        assert await store.append_many([LogAppend("t", "r1", "cp-a", 1, 0, [LogEntry(1)])]) == [True]
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
                got = await b.tail("t", rid, offset, timeout_s=5)
                assert got is not None
                received.extend(e.token_id for e in got.entries)
                offset = got.next_offset
                if got.finished:
                    return

        follower = asyncio.create_task(follow())
        for i in range(5):
            assert await a.append_many([LogAppend("t", rid, "cp-a", 1, i, [LogEntry(100 + i)])]) == [True]
            await asyncio.sleep(0.01)
        assert await a.finish("t", rid, "cp-a", 1, b"done", 30)
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
        await store.append_many([LogAppend("a:b", "r1", "cp", 1, 0, [LogEntry(1)])])
        # Request ids are scoped by the quoted tenant: ("x:y", "z") and ("x", "y:z") are two requests.
        assert await store.start_request("x:y", "z", "cp")
        assert await store.start_request("x", "y:z", "cp")
        await store.heartbeat("cp", 10)
    finally:
        await store.close()
    sync = redis.Redis.from_url(redis_server.url, decode_responses=True)
    keys = sorted(str(k) for k in sync.keys("*"))
    assert keys == [
        "coalesce:alive:cp",
        "coalesce:batch:a:job",
        "coalesce:content:a:fp4",
        "coalesce:idem:a%3Ab:c",
        "coalesce:idem:a:b:c",
        "coalesce:idem:a:batch/job/1",
        "coalesce:log:a%3Ab:r1",
        "coalesce:logm:a%3Ab:r1",
        "coalesce:logm:a:r2",
        "coalesce:logm:a:r3",
        "coalesce:logm:x%3Ay:z",
        "coalesce:logm:x:y:z",
        "coalesce:req:a%3Ab:r1",
        "coalesce:req:a:r2",
        "coalesce:req:a:r3",
        "coalesce:req:x%3Ay:z",
        "coalesce:req:x:y:z",
    ]
    # Everything expires eventually, and never before its logical expiry (10 s lease here).
    for key in keys:
        assert sync.pttl(key) > 10_000, key


def test_rediss_url_options_reach_the_tls_connection() -> None:
    """redis-py reads the TLS options from a rediss:// URL's query (nothing connects here)."""
    url = "rediss://:secret@redis.example:6380/2?ssl_ca_certs=/etc/ca.pem&ssl_certfile=/etc/c.pem"
    url += "&ssl_keyfile=/etc/c.key&ssl_cert_reqs=required"
    store = RedisStore.from_url(url)
    pool = store._r.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"]) == ("redis.example", 6380, 2)
    assert (kw["ssl_ca_certs"], kw["ssl_certfile"], kw["ssl_keyfile"]) == ("/etc/ca.pem", "/etc/c.pem", "/etc/c.key")
    assert kw["ssl_cert_reqs"] == "required"
    plain = RedisStore.from_url("redis://127.0.0.1:6379/0")
    assert plain._r.connection_pool.connection_class.__name__ == "Connection"


def test_bad_store_url_option_is_refused_when_the_store_is_made() -> None:
    # A misspelt option fails at startup, in one line that does not quote the URL (it may hold a password).
    with pytest.raises(ValueError, match="bad store url option") as err:
        make_store("rediss://:secret@127.0.0.1:6380/0?ssl_ca_cert=/etc/ca.pem")
    assert "secret" not in str(err.value)
    with pytest.raises(ValueError, match="bad store url option"):
        make_store("rediss://127.0.0.1:6380/0?ssl_cert_reqs=sometimes")
