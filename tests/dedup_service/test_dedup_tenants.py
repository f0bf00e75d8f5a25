"""Request ids are scoped per tenant: the index and token logs of (tenant, request id), on both backends."""

from __future__ import annotations

import asyncio

from dedup_clock import Clock

from dedup_service import LogAppend, LogEntry, Outcome, State, Store

A, B = "tenant-a", "tenant-b"
LEASE, KEEP, RETAIN = 10.0, 30.0, 3600.0


def tokens(*ids: int) -> list[LogEntry]:
    return [LogEntry(i, f"<{i}>") for i in ids]


async def log_of(store: Store, tenant: str, rid: str) -> list[int]:
    got = await store.read(tenant, rid, 0)
    assert got is not None
    return [e.token_id for e in got.entries]


async def test_two_tenants_run_the_same_request_id_at_once(store: Store, peer: Store) -> None:
    # A keyed request of tenant A and a keyless one of tenant B, both named "r1".
    assert (await store.claim(A, "k", "cp-a", "fp", "r1", LEASE)).outcome == Outcome.CLAIMED
    assert await peer.start_request(B, "r1", "cp-b")
    # Each writes its own log; an append names its tenant, so the other's (owner, epoch) do not match.
    assert await store.append_many(
        [LogAppend(A, "r1", "cp-a", 1, 0, tokens(1, 2)), LogAppend(B, "r1", "cp-a", 1, 0, tokens(9))]
    ) == [True, False]
    assert await peer.append_many([LogAppend(B, "r1", "cp-b", 1, 0, tokens(7))]) == [True]
    assert await log_of(peer, A, "r1") == [1, 2]
    assert await log_of(store, B, "r1") == [7]

    a, b = await peer.lookup_request(A, "r1"), await store.lookup_request(B, "r1")
    assert a is not None and (a.tenant, a.key, a.owner, a.logged_tokens) == (A, "k", "cp-a", 2)
    assert b is not None and (b.tenant, b.key, b.owner, b.logged_tokens) == (B, "", "cp-b", 1)

    # Finishing one leaves the other running.
    assert await peer.finish(B, "r1", "cp-b", 1, b"b-done", KEEP)
    assert not await store.finish(A, "r1", "cp-b", 1, b"x", KEEP)
    a_log, b_log = await store.read(A, "r1", 0), await store.read(B, "r1", 0)
    assert a_log is not None and not a_log.finished
    assert b_log is not None and b_log.finished and b_log.finish_info == b"b-done"
    a_info = await store.lookup_request(A, "r1")
    assert a_info is not None and a_info.state == State.INIT and not a_info.finished

    # Record writes (renew, processing, success) move only their tenant's index entry.
    assert await store.mark_processing(A, "k", "cp-a", 1)
    assert await store.succeed(A, "k", "cp-a", 1, b"a-done", RETAIN)
    a_info, b_info = await store.lookup_request(A, "r1"), await store.lookup_request(B, "r1")
    assert a_info is not None and a_info.state == State.SUCCESS
    assert b_info is not None and b_info.state == State.SUCCESS and b_info.key == ""

    # Purging one tenant's request leaves the other's.
    assert await peer.purge_request(B, "r1")
    assert await store.lookup_request(B, "r1") is None and await store.read(B, "r1", 0) is None
    assert await log_of(store, A, "r1") == [1, 2]


async def test_request_id_in_use_only_within_the_tenant(store: Store) -> None:
    assert (await store.claim(A, "k1", "cp", "fp", "r1", LEASE)).outcome == Outcome.CLAIMED
    assert await store.start_request(A, "plain", "cp")
    # Tenant B is told nothing about A's ids: it gets them as if they were free.
    assert (await store.claim(B, "k2", "cp", "fp", "r1", LEASE)).outcome == Outcome.CLAIMED
    assert (await store.claim(B, "k3", "cp", "fp", "plain", LEASE)).outcome == Outcome.CLAIMED
    assert (await store.claim_item(B, "job", "1", "cp", "fp", "r1x", LEASE)).outcome == Outcome.CLAIMED
    assert (await store.claim_item(A, "job", "1", "cp", "fp", "r1x", LEASE)).outcome == Outcome.CLAIMED
    assert await store.start_request(B, "other", "cp")
    assert await store.start_request(A, "other", "cp")
    # Within a tenant an id names one request.
    assert (await store.claim(A, "k4", "cp", "fp", "r1", LEASE)).outcome == Outcome.REQUEST_ID_IN_USE
    assert (await store.claim(A, "k4", "cp", "fp", "plain", LEASE)).outcome == Outcome.REQUEST_ID_IN_USE
    assert (await store.claim_item(A, "job", "2", "cp", "fp", "r1", LEASE)).outcome == Outcome.REQUEST_ID_IN_USE
    assert not await store.start_request(A, "r1", "cp")
    assert not await store.start_request(B, "r1", "cp")
    # The same key and id again is the same request (ATTACH), not a clash.
    assert (await store.claim(A, "k1", "cp-2", "fp", "r1", LEASE)).outcome == Outcome.ATTACH


async def test_takeover_and_purge_keep_to_the_tenant(store: Store, peer: Store, clock: Clock) -> None:
    for tenant in (A, B):
        assert (await store.claim(tenant, "k", "cp-a", "fp", "r1", LEASE)).outcome == Outcome.CLAIMED
    assert await store.append_many(
        [LogAppend(A, "r1", "cp-a", 1, 0, tokens(1, 2)), LogAppend(B, "r1", "cp-a", 1, 0, tokens(5))]
    ) == [True, True]
    assert await store.renew(B, "k", "cp-a", 1, LEASE * 3)

    clock.advance(LEASE + 1)  # A's owner lease ran out; B's was renewed
    took = await peer.claim(A, "k", "cp-b", "fp", "other", LEASE)
    assert took.outcome == Outcome.TAKEOVER and took.record is not None and took.record.epoch == 2
    assert (await peer.claim(B, "k", "cp-b", "fp", "other", LEASE)).outcome == Outcome.ATTACH
    # A's log is kept for its new owner and fences the old one; B's is untouched.
    assert await store.append_many(
        [LogAppend(A, "r1", "cp-a", 1, 2, tokens(3)), LogAppend(B, "r1", "cp-a", 1, 1, tokens(6))]
    ) == [False, True]
    assert await peer.append_many([LogAppend(A, "r1", "cp-b", 2, 2, tokens(3))]) == [True]
    assert await log_of(store, A, "r1") == [1, 2, 3]
    assert await log_of(store, B, "r1") == [5, 6]
    b_info = await peer.lookup_request(B, "r1")
    assert b_info is not None and (b_info.owner, b_info.epoch) == ("cp-a", 1)

    assert await peer.purge(A, "k")
    assert await store.read(A, "r1", 0) is None and await store.lookup_request(A, "r1") is None
    assert await log_of(store, B, "r1") == [5, 6]


async def test_tenant_and_id_strings_cannot_collide(store: Store) -> None:
    # Pairs whose naive "tenant:id" joins are equal; each is its own request with its own log.
    pairs = [("a:b", "c"), ("a", "b:c"), ("a%3Ab", "c"), ("a%3A", "b:c"), ("", "a:b:c"), ("a:b:c", "")]
    for i, (tenant, rid) in enumerate(pairs):
        assert await store.start_request(tenant, rid, f"cp-{i}"), (tenant, rid)
        assert await store.append_many([LogAppend(tenant, rid, f"cp-{i}", 1, 0, tokens(i))]) == [True]
    for i, (tenant, rid) in enumerate(pairs):
        info = await store.lookup_request(tenant, rid)
        assert info is not None and info.owner == f"cp-{i}"
        assert await log_of(store, tenant, rid) == [i]


async def test_a_tail_wakes_for_its_own_tenant_only(store: Store, peer: Store) -> None:
    assert await store.start_request(A, "r1", "cp-a")
    assert await store.start_request(B, "r1", "cp-b")
    waiting = asyncio.create_task(peer.tail(A, "r1", 0, timeout_s=10))
    await asyncio.sleep(0.05)  # let the tail block (a real wait, not a time policy)
    assert await store.append_many([LogAppend(B, "r1", "cp-b", 1, 0, tokens(9))]) == [True]
    await asyncio.sleep(0.05)
    assert not waiting.done()  # B's token is not A's
    assert await store.append_many([LogAppend(A, "r1", "cp-a", 1, 0, tokens(1))]) == [True]
    got = await asyncio.wait_for(waiting, 5)
    assert got is not None and got.entries == tokens(1)
