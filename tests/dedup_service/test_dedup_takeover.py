"""Continuing a keyless request elsewhere: replica liveness, the stored payload, `take_request` and its
fencing, and the bound on stored payloads. Both backends."""

from __future__ import annotations

import asyncio

import pytest
from dedup_clock import Clock

from dedup_service import MAX_PAYLOAD_BYTES, LogAppend, LogEntry, Outcome, State, Store, make_store

T, LEASE, KEEP = "tenant-a", 10.0, 30.0
# A serialized protobuf: arbitrary bytes, including NUL and sequences that are not UTF-8.
PAYLOAD = b"\x0a\x05hello\x00\x12\x03\xff\xfe\xc3\x28\x80" + bytes(range(256))


def tokens(*ids: int) -> list[LogEntry]:
    return [LogEntry(i, f"<{i}>") for i in ids]


async def test_heartbeat_and_alive_follow_the_injected_clock(store: Store, peer: Store, clock: Clock) -> None:
    assert not await peer.alive("cp-a")  # never beat
    await store.heartbeat("cp-a", LEASE)
    assert await peer.alive("cp-a") and not await peer.alive("cp-b")
    clock.advance(LEASE - 0.001)
    assert await peer.alive("cp-a")
    clock.advance(0.002)  # the lease ran out: the replica is dead to the others
    assert not await peer.alive("cp-a")
    await store.heartbeat("cp-a", LEASE)  # back (e.g. after a network partition)
    assert await peer.alive("cp-a")
    await store.heartbeat("cp-a", 0)  # a replica that stops on purpose says so at once
    assert not await peer.alive("cp-a")


async def test_start_request_keeps_its_payload(store: Store, peer: Store) -> None:
    assert await store.start_request(T, "plain", "cp-a", payload=PAYLOAD)
    info = await peer.lookup_request(T, "plain")
    assert info is not None and info.payload == PAYLOAD
    assert await store.start_request(T, "bare", "cp-a")
    bare = await peer.lookup_request(T, "bare")
    assert bare is not None and bare.payload == b""
    # A keyed request's payload is in its record, not in the index.
    await store.claim(T, "k", "cp-a", "fp", "keyed", LEASE, payload=PAYLOAD)
    keyed = await peer.lookup_request(T, "keyed")
    assert keyed is not None and keyed.payload == b""


async def test_take_request_moves_a_keyless_request_and_fences_its_old_owner(store: Store, peer: Store) -> None:
    assert await store.start_request(T, "r1", "cp-a", payload=PAYLOAD)
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, tokens(1, 2))]) == [True]

    info = await peer.lookup_request(T, "r1")
    assert info is not None and (info.owner, info.epoch, info.logged_tokens) == ("cp-a", 1, 2)
    assert await peer.take_request(T, "r1", "cp-b", info.epoch) == 2
    # Someone who saw the same entry is too late; another tenant has no such request.
    assert await store.take_request(T, "r1", "cp-c", info.epoch) is None
    assert await store.take_request("tenant-b", "r1", "cp-c", 1) is None

    # The old owner can no longer write; the new one continues from the logged tokens.
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 1, 2, tokens(3))]) == [False]
    assert not await store.finish(T, "r1", "cp-a", 1, b"stale", KEEP)
    assert await peer.append_many([LogAppend(T, "r1", "cp-b", 2, 2, tokens(3))]) == [True]
    moved = await store.lookup_request(T, "r1")
    assert moved is not None
    assert (moved.owner, moved.epoch, moved.state, moved.logged_tokens) == ("cp-b", 2, State.PROCESSING, 3)
    assert moved.payload == PAYLOAD

    # It can move again (the new owner died too), from the epoch now there.
    assert await store.take_request(T, "r1", "cp-c", 2) == 3
    assert not await peer.finish(T, "r1", "cp-b", 2, b"stale", KEEP)
    assert await store.finish(T, "r1", "cp-c", 3, b"done", KEEP)
    log = await peer.read(T, "r1", 0)
    assert log is not None and log.entries == tokens(1, 2, 3) and log.finished and log.finish_info == b"done"
    # A finished request is not running: nothing to take.
    assert await peer.take_request(T, "r1", "cp-d", 3) is None


async def test_take_request_refuses_what_is_not_a_running_keyless_request(store: Store) -> None:
    assert await store.take_request(T, "unknown", "cp-b", 1) is None
    claimed = await store.claim(T, "k", "cp-a", "fp", "keyed", LEASE)
    assert claimed.outcome == Outcome.CLAIMED
    assert await store.take_request(T, "keyed", "cp-b", 1) is None  # keyed requests move by claim (TAKEOVER)
    assert await store.append_many([LogAppend(T, "keyed", "cp-a", 1, 0, tokens(1))]) == [True]
    assert await store.start_request(T, "failed", "cp-a")
    assert await store.finish(T, "failed", "cp-a", 1, b"err", KEEP, failed=True)
    assert await store.take_request(T, "failed", "cp-b", 1) is None


async def test_one_taker_wins(store: Store, peer: Store) -> None:
    assert await store.start_request(T, "r1", "cp-a")
    stores = [store, peer] * 8
    taken = await asyncio.gather(*(s.take_request(T, "r1", f"cp-{i}", 1) for i, s in enumerate(stores)))
    assert sorted(taken, key=lambda e: e or 0) == [None] * 15 + [2]
    winner = f"cp-{taken.index(2)}"
    info = await store.lookup_request(T, "r1")
    assert info is not None and (info.owner, info.epoch) == (winner, 2)


async def test_a_follower_sees_the_new_owner_continue(store: Store, peer: Store) -> None:
    assert await store.start_request(T, "r1", "cp-a")
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, tokens(1))]) == [True]
    waiting = asyncio.create_task(peer.tail(T, "r1", 1, timeout_s=10))
    assert await store.take_request(T, "r1", "cp-b", 1) == 2
    assert await store.append_many([LogAppend(T, "r1", "cp-b", 2, 1, tokens(2))]) == [True]
    got = await asyncio.wait_for(waiting, 5)
    assert got is not None and got.entries == tokens(2)


@pytest.fixture
async def small(store_url: str, clock: Clock):
    """A store that keeps payloads of at most 16 bytes."""
    s = make_store(store_url, clock, max_payload_bytes=16)
    yield s
    await s.close()


async def test_payloads_over_the_limit_are_refused_before_anything_is_written(small: Store) -> None:
    big = b"x" * 17
    with pytest.raises(ValueError, match="17 bytes is over the store's limit of 16 bytes"):
        await small.claim(T, "k", "cp-a", "fp", "r1", LEASE, payload=big)
    with pytest.raises(ValueError, match="over the store's limit"):
        await small.claim_item(T, "job", "1", "cp-a", "fp", "r2", LEASE, payload=big)
    with pytest.raises(ValueError, match="over the store's limit"):
        await small.start_request(T, "r3", "cp-a", payload=big)
    assert await small.get(T, "k") is None and await small.list_batch(T, "job") == []
    for rid in ("r1", "r2", "r3"):
        assert await small.lookup_request(T, rid) is None
    # At the limit is fine.
    ok = b"y" * 16
    claimed = await small.claim(T, "k", "cp-a", "fp", "r1", LEASE, payload=ok)
    assert claimed.record is not None and claimed.record.payload == ok
    assert (await small.claim_item(T, "job", "1", "cp-a", "fp", "r2", LEASE, payload=ok)).outcome == Outcome.CLAIMED
    assert await small.start_request(T, "r3", "cp-a", payload=ok)


async def test_default_payload_limit_is_one_mebibyte(store: Store) -> None:
    assert MAX_PAYLOAD_BYTES == 1 << 20
    with pytest.raises(ValueError, match="over the store's limit"):
        await store.start_request(T, "r1", "cp-a", payload=b"z" * (MAX_PAYLOAD_BYTES + 1))
    assert await store.start_request(T, "r1", "cp-a", payload=b"z" * MAX_PAYLOAD_BYTES)
    info = await store.lookup_request(T, "r1")
    assert info is not None and len(info.payload) == MAX_PAYLOAD_BYTES
