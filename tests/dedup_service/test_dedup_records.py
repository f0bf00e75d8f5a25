"""Idempotency records, takeover and fencing, request index, content dedup, batches: both backends."""

from __future__ import annotations

import asyncio

from dedup_clock import Clock

from dedup_service import LogAppend, LogEntry, Outcome, State, Store

T, K, FP = "tenant-a", "key-1", "f" * 64
LEASE, KEEP, RETAIN = 10.0, 30.0, 3600.0


async def claim(store: Store, owner: str = "cp-a", fp: str = FP, rid: str = "req-1", key: str = K):
    return await store.claim(T, key, owner, fp, rid, LEASE)


async def test_claim_attach_replay(store: Store, clock: Clock) -> None:
    first = await claim(store)
    assert first.outcome == Outcome.CLAIMED
    rec = first.record
    assert rec is not None
    assert (rec.state, rec.owner, rec.epoch, rec.request_id) == (State.INIT, "cp-a", 1, "req-1")
    assert rec.lease_until == clock.now + LEASE

    # Same payload from another replica while the owner lives: attach to its request.
    attach = await claim(store, owner="cp-b", rid="req-2")
    assert attach.outcome == Outcome.ATTACH
    assert attach.record is not None and (attach.record.owner, attach.record.request_id) == ("cp-a", "req-1")

    assert await store.mark_processing(T, K, "cp-a", 1)
    assert await store.succeed(T, K, "cp-a", 1, b"result-bytes", RETAIN)
    replay = await claim(store, owner="cp-b", rid="req-3")
    assert replay.outcome == Outcome.REPLAY
    assert replay.record is not None and replay.record.result == b"result-bytes"

    # Past retention the key is free again; the epoch keeps growing.
    clock.advance(RETAIN + 1)
    assert await store.get(T, K) is None
    again = await claim(store, owner="cp-b", rid="req-4")
    assert again.outcome == Outcome.CLAIMED and again.record is not None and again.record.epoch == 2


async def test_key_reused_with_other_payload(store: Store) -> None:
    await claim(store)
    reused = await claim(store, fp="0" * 64, rid="req-2")
    assert reused.outcome == Outcome.KEY_REUSED
    # Keys are per tenant: another tenant's same key is its own.
    other = await store.claim("tenant-b", K, "cp-a", "0" * 64, "req-b", LEASE)
    assert other.outcome == Outcome.CLAIMED


async def test_renew_keeps_the_lease(store: Store, clock: Clock) -> None:
    await claim(store)
    clock.advance(LEASE - 1)
    assert await store.renew(T, K, "cp-a", 1, LEASE)
    clock.advance(LEASE - 1)  # past the first lease, within the renewed one
    assert (await claim(store, owner="cp-b")).outcome == Outcome.ATTACH


async def test_takeover_fences_the_stale_owner(store: Store, clock: Clock) -> None:
    await claim(store)
    assert await store.mark_processing(T, K, "cp-a", 1)
    assert await store.append_many([LogAppend(T, "req-1", "cp-a", 1, 0, [LogEntry(1, "a"), LogEntry(2, "b")])]) == [
        True
    ]

    clock.advance(LEASE + 0.001)
    took = await claim(store, owner="cp-b", rid="req-other")
    assert took.outcome == Outcome.TAKEOVER
    rec = took.record
    assert rec is not None
    assert (rec.owner, rec.epoch, rec.request_id, rec.state) == ("cp-b", 2, "req-1", State.INIT)

    # The new owner continues from the logged tokens.
    log = await store.read(T, "req-1", 0)
    assert log is not None and [e.token_id for e in log.entries] == [1, 2]

    # The old owner (epoch 1) can write nothing: not the record, not the log.
    assert not await store.renew(T, K, "cp-a", 1, LEASE)
    assert not await store.mark_processing(T, K, "cp-a", 1)
    assert not await store.succeed(T, K, "cp-a", 1, b"stale", RETAIN)
    assert not await store.fail(T, K, "cp-a", 1, "stale", RETAIN, retryable=True)
    assert await store.append_many([LogAppend(T, "req-1", "cp-a", 1, 2, [LogEntry(9)])]) == [False]
    assert not await store.finish(T, "req-1", "cp-a", 1, b"stale", KEEP)
    # Nor can another owner claiming the new epoch number.
    assert not await store.renew(T, K, "cp-c", 2, LEASE)
    after = await store.get(T, K)
    assert after is not None and (after.owner, after.epoch, after.state) == ("cp-b", 2, State.INIT)

    assert await store.append_many([LogAppend(T, "req-1", "cp-b", 2, 2, [LogEntry(3, "c")])]) == [True]
    assert await store.succeed(T, K, "cp-b", 2, b"done", RETAIN)
    info = await store.lookup_request(T, "req-1")
    assert info is not None
    assert (info.owner, info.epoch, info.state, info.logged_tokens) == ("cp-b", 2, State.SUCCESS, 3)


async def test_failure_by_the_request_replays(store: Store, clock: Clock) -> None:
    await claim(store)
    assert await store.fail(T, K, "cp-a", 1, "prompt too long", RETAIN, retryable=False)
    replay = await claim(store, owner="cp-b", rid="req-2")
    assert replay.outcome == Outcome.REPLAY_ERROR
    assert replay.record is not None and replay.record.error == "prompt too long"
    clock.advance(RETAIN + 1)
    assert (await claim(store, owner="cp-b", rid="req-2")).outcome == Outcome.CLAIMED


async def test_failure_by_the_server_releases_the_key(store: Store) -> None:
    await claim(store)
    assert await store.fail(T, K, "cp-a", 1, "worker lost", RETAIN, retryable=True)
    assert await store.get(T, K) is None
    # A retry (even with the same request id) runs anew, in a higher epoch.
    retry = await claim(store, owner="cp-a", rid="req-1")
    assert retry.outcome == Outcome.CLAIMED
    assert retry.record is not None and retry.record.epoch == 2
    # The first run's stale writes are refused although owner and request id are the same.
    assert not await store.succeed(T, K, "cp-a", 1, b"late", RETAIN)
    assert await store.append_many([LogAppend(T, "req-1", "cp-a", 1, 0, [LogEntry(5)])]) == [False]


async def test_purge(store: Store) -> None:
    await claim(store)
    await store.append_many([LogAppend(T, "req-1", "cp-a", 1, 0, [LogEntry(1)])])
    assert await store.purge(T, K)
    assert await store.get(T, K) is None
    assert await store.read(T, "req-1", 0) is None
    assert await store.lookup_request(T, "req-1") is None
    assert not await store.purge(T, K)
    # The purged owner is fenced out; the key is free for a new run.
    assert not await store.succeed(T, K, "cp-a", 1, b"late", RETAIN)
    fresh = await claim(store, owner="cp-b")
    assert fresh.outcome == Outcome.CLAIMED and fresh.record is not None and fresh.record.epoch == 2


async def test_request_index(store: Store) -> None:
    await claim(store)
    info = await store.lookup_request(T, "req-1")
    assert info is not None and (info.tenant, info.key, info.owner, info.epoch) == (T, K, "cp-a", 1)
    assert info.state == State.INIT and info.logged_tokens == 0 and not info.finished
    # Not your tenant: not found.
    assert await store.lookup_request("tenant-b", "req-1") is None
    assert not await store.purge_request("tenant-b", "req-1")
    # A request id names one request of its tenant: another key or a keyless request cannot take it.
    assert (await claim(store, key="key-2", rid="req-1")).outcome == Outcome.REQUEST_ID_IN_USE
    assert not await store.start_request(T, "req-1", "cp-b")

    assert await store.start_request(T, "plain", "cp-b")
    plain = await store.lookup_request(T, "plain")
    assert plain is not None and (plain.key, plain.epoch, plain.state) == ("", 1, State.PROCESSING)
    assert await store.purge_request(T, "plain")
    assert await store.lookup_request(T, "plain") is None
    assert await store.purge_request(T, "req-1")
    assert await store.get(T, K) is None


async def test_content_dedup(store: Store, clock: Clock) -> None:
    lead = await store.claim_content(T, FP, "req-1", "cp-a", LEASE)
    assert lead == (True, "req-1")
    assert await store.claim_content(T, FP, "req-2", "cp-b", LEASE) == (False, "req-1")
    assert await store.claim_content("tenant-b", FP, "req-3", "cp-b", LEASE) == (True, "req-3")
    clock.advance(LEASE - 1)
    assert await store.renew_content(T, FP, "req-1", LEASE)
    clock.advance(LEASE - 1)
    assert (await store.claim_content(T, FP, "req-2", "cp-b", LEASE)).leader is False
    clock.advance(LEASE + 1)  # the leader died: the next identical request leads
    assert await store.claim_content(T, FP, "req-4", "cp-b", LEASE) == (True, "req-4")
    assert not await store.renew_content(T, FP, "req-1", LEASE)
    assert not await store.release_content(T, FP, "req-1")
    assert await store.release_content(T, FP, "req-4")
    assert await store.claim_content(T, FP, "req-5", "cp-a", LEASE) == (True, "req-5")


async def test_batch_items(store: Store) -> None:
    for seq in ("10", "2", "1"):
        result = await store.claim_item(T, "job/1", seq, "cp-a", FP + seq, f"b-{seq}", LEASE)
        assert result.outcome == Outcome.CLAIMED
    assert await store.succeed(T, "batch/job%2F1/1", "cp-a", 1, b"one", RETAIN)
    assert await store.fail(T, "batch/job%2F1/2", "cp-a", 1, "worker lost", RETAIN, retryable=True)
    items = await store.list_batch(T, "job/1")
    assert [i.seq_id for i in items] == ["1", "2", "10"]
    assert items[0].record is not None and items[0].record.state == State.SUCCESS
    assert items[0].record.result == b"one"
    assert items[1].record is None  # released: a resubmission runs it again
    assert items[2].record is not None and items[2].record.state == State.INIT
    # Resubmission: the succeeded item replays, the released one is claimed anew.
    assert (await store.claim_item(T, "job/1", "1", "cp-b", FP + "1", "b-1x", LEASE)).outcome == Outcome.REPLAY
    assert (await store.claim_item(T, "job/1", "2", "cp-b", FP + "2", "b-2", LEASE)).outcome == Outcome.CLAIMED
    assert await store.list_batch("tenant-b", "job/1") == []
    assert await store.list_batch(T, "job") == []


async def test_concurrent_claims_elect_one_owner(store: Store, peer: Store) -> None:
    stores = [store, peer] * 16
    results = await asyncio.gather(*(s.claim(T, K, f"cp-{i}", FP, f"req-{i}", LEASE) for i, s in enumerate(stores)))
    outcomes = [r.outcome for r in results]
    assert outcomes.count(Outcome.CLAIMED) == 1
    assert outcomes.count(Outcome.ATTACH) == 31
    owners = {r.record.owner for r in results if r.record is not None}
    assert len(owners) == 1


# Serialized protobufs: arbitrary bytes, including NUL and sequences that are not UTF-8.
PAYLOAD = b"\x0a\x05hello\x00\x12\x03\xff\xfe\xc3\x28\x80" + bytes(range(256))


async def test_payload_round_trip(store: Store) -> None:
    claimed = await store.claim(T, K, "cp-a", FP, "req-1", LEASE, payload=PAYLOAD)
    assert claimed.outcome == Outcome.CLAIMED
    assert claimed.record is not None and claimed.record.payload == PAYLOAD
    got = await store.get(T, K)
    assert got is not None and got.payload == PAYLOAD
    # A claim without a payload stores none; other keys' payloads are their own.
    plain = await claim(store, key="key-2", rid="req-2")
    assert plain.record is not None and plain.record.payload == b""
    got2 = await store.get(T, "key-2")
    assert got2 is not None and got2.payload == b""


async def test_payload_kept_across_takeover_and_finish(store: Store, peer: Store, clock: Clock) -> None:
    await store.claim(T, K, "cp-a", FP, "req-1", LEASE, payload=PAYLOAD)
    assert await store.renew(T, K, "cp-a", 1, LEASE)
    assert await store.mark_processing(T, K, "cp-a", 1)
    # Attaching with another payload does not change the stored one.
    attach = await peer.claim(T, K, "cp-b", FP, "req-2", LEASE, payload=b"other")
    assert attach.outcome == Outcome.ATTACH and attach.record is not None and attach.record.payload == PAYLOAD

    # The owner dies; another replica takes over and gets the original request to re-run.
    clock.advance(LEASE + 0.001)
    took = await peer.claim(T, K, "cp-b", FP, "req-3", LEASE, payload=b"")
    assert took.outcome == Outcome.TAKEOVER
    assert took.record is not None and took.record.payload == PAYLOAD
    after_takeover = await store.get(T, K)
    assert after_takeover is not None and after_takeover.payload == PAYLOAD

    assert await peer.renew(T, K, "cp-b", 2, LEASE)
    assert await peer.mark_processing(T, K, "cp-b", 2)
    assert await peer.succeed(T, K, "cp-b", 2, b"done", RETAIN)
    done = await store.get(T, K)
    assert done is not None and done.state == State.SUCCESS
    assert (done.result, done.payload) == (b"done", PAYLOAD)
    replay = await store.claim(T, K, "cp-c", FP, "req-4", LEASE, payload=b"x")
    assert replay.outcome == Outcome.REPLAY and replay.record is not None and replay.record.payload == PAYLOAD


async def test_payload_kept_after_failure_and_replaced_after_release(store: Store) -> None:
    await store.claim(T, K, "cp-a", FP, "req-1", LEASE, payload=PAYLOAD)
    assert await store.fail(T, K, "cp-a", 1, "worker lost", RETAIN, retryable=True)
    # Released: the retry's claim creates a new record with its own payload.
    retry = await store.claim(T, K, "cp-a", FP, "req-1", LEASE, payload=b"\x00retry")
    assert retry.outcome == Outcome.CLAIMED and retry.record is not None
    assert (retry.record.epoch, retry.record.payload) == (2, b"\x00retry")
    assert await store.fail(T, K, "cp-a", 2, "prompt too long", RETAIN, retryable=False)
    failed = await store.get(T, K)
    assert failed is not None and (failed.state, failed.payload) == (State.FAILED, b"\x00retry")


async def test_batch_item_payload(store: Store, clock: Clock) -> None:
    claimed = await store.claim_item(T, "job", "1", "cp-a", FP, "b-1", LEASE, payload=PAYLOAD)
    assert claimed.outcome == Outcome.CLAIMED and claimed.record is not None and claimed.record.payload == PAYLOAD
    clock.advance(LEASE + 0.001)
    took = await store.claim_item(T, "job", "1", "cp-b", FP, "b-1x", LEASE, payload=b"")
    assert took.outcome == Outcome.TAKEOVER and took.record is not None and took.record.payload == PAYLOAD
    items = await store.list_batch(T, "job")
    assert [i.seq_id for i in items] == ["1"]
    assert items[0].record is not None and items[0].record.payload == PAYLOAD
