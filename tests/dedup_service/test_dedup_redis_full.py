"""A full Redis (maxmemory with noeviction): writes are StoreUnavailable, refused whole before they change
anything; reads keep working; writes work again once memory is freed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import pytest
import redis
from dedup_clock import Clock

from dedup_service import LogAppend, LogEntry, Outcome, Store, StoreUnavailable, make_store
from tests.conftest import RedisServer

T, LEASE, KEEP = "tenant-a", 10.0, 30.0
FILLER = b"f" * 10_000


@pytest.fixture
def full_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path, ["--maxmemory", "2mb", "--maxmemory-policy", "noeviction"])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def store(full_server: RedisServer, clock: Clock) -> AsyncIterator[Store]:
    s = make_store(full_server.url, clock)
    yield s
    await s.close()


def fill(client: redis.Redis) -> int:
    """Write filler keys until Redis refuses: it is then at maxmemory. Returns how many were written."""
    n = 0
    while True:
        try:
            client.set(f"filler:{n}", FILLER)
        except redis.exceptions.OutOfMemoryError:
            return n
        n += 1


def snapshot(client: redis.Redis) -> dict[object, object]:
    """Every store key and its serialized value."""
    keys: list[bytes] = client.keys("coalesce:*")  # type: ignore[assignment]
    return {k: client.dump(k) for k in sorted(keys)}


async def refused(op: Awaitable[object], port: int) -> None:
    with pytest.raises(StoreUnavailable, match="redis store is unavailable: OutOfMemoryError") as err:
        await op
    assert str(port) not in str(err.value) and "127.0.0.1" not in str(err.value)


async def test_writes_are_refused_whole_and_reads_go_on(store: Store, full_server: RedisServer) -> None:
    # Something of every kind before Redis fills up.
    assert (await store.claim(T, "k", "cp-a", "fp", "keyed", LEASE)).outcome == Outcome.CLAIMED
    assert (await store.claim_item(T, "job", "1", "cp-a", "fp1", "item", LEASE)).outcome == Outcome.CLAIMED
    assert await store.start_request(T, "plain", "cp-a")
    assert await store.append_many([LogAppend(T, "plain", "cp-a", 1, 0, [LogEntry(1, "a")])]) == [True]
    assert (await store.claim_content(T, "fp", "keyed", "cp-a", LEASE)).leader
    await store.heartbeat("cp-a", LEASE)

    client = full_server.client()
    fill(client)
    before = snapshot(client)
    port = full_server.port
    for op in (
        store.claim(T, "k2", "cp-a", "fp", "new", LEASE),  # a fresh claim: DEL first, then writes
        store.claim(T, "k", "cp-b", "other-fp", "x", LEASE),  # KEY_REUSED would write nothing, still refused
        store.claim_item(T, "job", "2", "cp-a", "fp2", "item2", LEASE),
        store.renew(T, "k", "cp-a", 1, LEASE),
        store.mark_processing(T, "k", "cp-a", 1),
        store.succeed(T, "k", "cp-a", 1, b"result", 3600),
        store.fail(T, "k", "cp-a", 1, "worker lost", 3600, retryable=True),  # DEL first, then the tombstone
        store.purge(T, "k"),
        store.purge_request(T, "plain"),
        store.start_request(T, "plain2", "cp-a"),
        store.take_request(T, "plain", "cp-b", 1),
        store.append_many([LogAppend(T, "plain", "cp-a", 1, 1, [LogEntry(2, "b")])]),
        store.finish(T, "plain", "cp-a", 1, b"done", KEEP),
        store.claim_content(T, "fp2", "new", "cp-a", LEASE),
        store.renew_content(T, "fp", "keyed", LEASE),
        store.release_content(T, "fp", "keyed"),
        store.heartbeat("cp-b", LEASE),
    ):
        await refused(op, port)
    assert snapshot(client) == before  # nothing was half written

    # Reads still answer: resumes, lookups and replays work while Redis is full.
    log = await store.read(T, "plain", 0)
    assert log is not None and [e.token_id for e in log.entries] == [1]
    tailed = await store.tail(T, "plain", 1, timeout_s=0.01)
    assert tailed is not None and tailed.entries == [] and not tailed.finished
    info = await store.lookup_request(T, "plain")
    assert info is not None and info.owner == "cp-a"
    rec = await store.get(T, "k")
    assert rec is not None and rec.owner == "cp-a"
    assert [i.seq_id for i in await store.list_batch(T, "job")] == ["1"]
    assert await store.alive("cp-a")

    # Memory freed: the same writes go through.
    client.delete(*client.keys("filler:*"))
    assert (await store.claim(T, "k2", "cp-a", "fp", "new", LEASE)).outcome == Outcome.CLAIMED
    assert await store.append_many([LogAppend(T, "plain", "cp-a", 1, 1, [LogEntry(2, "b")])]) == [True]
    assert await store.finish(T, "plain", "cp-a", 1, b"done", KEEP)
    await store.heartbeat("cp-b", LEASE)


async def test_a_batch_of_appends_is_all_or_nothing(store: Store, full_server: RedisServer) -> None:
    """The journal writes every request's tokens in one append_many and retries it whole when it fails: a
    batch written in part would make the retry look fenced (the offsets moved) for the written part."""
    rids = [f"r{i}" for i in range(8)]
    for rid in rids:
        assert await store.start_request(T, rid, "cp-a")
    client = full_server.client()
    fillers = fill(client)
    entry = LogEntry(1, "x" * 4000)
    offset = 0
    # Free memory a little at a time, so that some batch starts just under maxmemory and ends past it.
    for n in range(fillers):
        client.delete(f"filler:{n}")
        batch = [LogAppend(T, rid, "cp-a", 1, offset, [entry] * 4) for rid in rids]
        before = snapshot(client)
        try:
            written = await store.append_many(batch)
        except StoreUnavailable:
            assert snapshot(client) == before
            continue
        assert written == [True] * len(rids)
        offset += 4
        if offset >= 12:
            break
    assert offset >= 12
    for rid in rids:
        log = await store.read(T, rid, 0)
        assert log is not None and len(log.entries) == offset
