"""Token logs: batched appends, reads from any offset, tails, expected-offset refusal, finish and keep window."""

from __future__ import annotations

import asyncio

from dedup_clock import Clock
from hypothesis import given
from hypothesis import strategies as st

from dedup_service import LogAppend, LogEntry, Outcome, State, Store
from dedup_service.memory import MemoryStore
from dedup_service.timing import RUNNING_GC_S

T, KEEP = "tenant-a", 30.0


def tokens(*ids: int) -> list[LogEntry]:
    return [LogEntry(i, f"<{i}>") for i in ids]


async def start(store: Store, *rids: str, owner: str = "cp-a") -> None:
    for rid in rids:
        assert await store.start_request(T, rid, owner)


async def test_append_many_in_one_call_and_read_from_any_offset(store: Store) -> None:
    await start(store, "r1", "r2", "r3")
    first = [LogAppend(T, "r1", "cp-a", 1, 0, tokens(1, 2)), LogAppend(T, "r2", "cp-a", 1, 0, tokens(7))]
    first.append(LogAppend(T, "r3", "cp-a", 1, 0, [LogEntry(5, "é", b"\x08\x05\x15\x00\x00\x80\xbf")]))
    assert await store.append_many(first) == [True, True, True]
    assert await store.append_many(
        [LogAppend(T, "r1", "cp-a", 1, 2, tokens(3, 4)), LogAppend(T, "r2", "cp-a", 1, 1, [])]
    ) == [
        True,
        True,
    ]

    whole = await store.read(T, "r1", 0)
    assert whole is not None and whole.entries == tokens(1, 2, 3, 4) and whole.next_offset == 4
    assert not whole.finished
    middle = await store.read(T, "r1", 1, limit=2)
    assert middle is not None and middle.entries == tokens(2, 3) and middle.next_offset == 3
    past = await store.read(T, "r1", 9)
    assert past is not None and past.entries == [] and past.next_offset == 9
    r3 = await store.read(T, "r3", 0)
    assert r3 is not None and r3.entries == [LogEntry(5, "é", b"\x08\x05\x15\x00\x00\x80\xbf")]
    assert await store.read(T, "unknown", 0) is None


async def test_append_refused_at_the_wrong_offset_or_epoch(store: Store) -> None:
    await start(store, "r1")
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, tokens(1, 2))]) == [True]
    refused = [
        LogAppend(T, "r1", "cp-a", 1, 1, tokens(2)),  # a duplicate
        LogAppend(T, "r1", "cp-a", 1, 3, tokens(4)),  # a gap
        LogAppend(T, "r1", "cp-b", 1, 2, tokens(3)),  # another owner
        LogAppend(T, "r1", "cp-a", 2, 2, tokens(3)),  # another epoch
        LogAppend(T, "nope", "cp-a", 1, 0, tokens(3)),  # an unknown request
    ]
    # Refusals are per request: the good append in the same call goes through.
    assert await store.append_many([*refused, LogAppend(T, "r1", "cp-a", 1, 2, tokens(3))]) == [False] * 5 + [True]
    log = await store.read(T, "r1", 0)
    assert log is not None and log.entries == tokens(1, 2, 3)


async def test_tail_wakes_on_append_and_finish(store: Store, peer: Store) -> None:
    await start(store, "r1")
    waiting = asyncio.create_task(peer.tail(T, "r1", 0, timeout_s=10))
    await asyncio.sleep(0.05)  # let the tail block (a real wait, not a time policy)
    assert not waiting.done()
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, tokens(1))]) == [True]
    got = await asyncio.wait_for(waiting, 5)
    assert got is not None and got.entries == tokens(1) and got.next_offset == 1

    waiting = asyncio.create_task(peer.tail(T, "r1", 1, timeout_s=10))
    await asyncio.sleep(0.05)
    assert await store.finish(T, "r1", "cp-a", 1, b"finish-info", KEEP)
    done = await asyncio.wait_for(waiting, 5)
    assert done is not None and done.entries == [] and done.finished and done.finish_info == b"finish-info"


async def test_tail_times_out_empty(store: Store) -> None:
    await start(store, "r1")
    got = await store.tail(T, "r1", 0, timeout_s=0.05)
    assert got is not None and got.entries == [] and not got.finished
    assert await store.tail(T, "unknown", 0, timeout_s=0.05) is None


async def test_finish_and_keep_window(store: Store, clock: Clock) -> None:
    await start(store, "r1")
    await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, tokens(1, 2))])
    assert not await store.finish(T, "r1", "cp-b", 1, b"x", KEEP)  # fenced
    assert await store.finish(T, "r1", "cp-a", 1, b"stop", KEEP)
    assert not await store.finish(T, "r1", "cp-a", 1, b"again", KEEP)
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 1, 2, tokens(3))]) == [False]

    partial = await store.read(T, "r1", 0, limit=1)
    assert partial is not None and not partial.finished  # more entries follow
    rest = await store.read(T, "r1", 1)
    assert rest is not None and rest.entries == tokens(2) and rest.finished and rest.finish_info == b"stop"
    info = await store.lookup_request(T, "r1")
    assert info is not None and info.finished and info.state == State.SUCCESS and info.logged_tokens == 2

    clock.advance(KEEP - 1)
    assert await store.read(T, "r1", 0) is not None
    clock.advance(2)  # the resume window is over
    assert await store.read(T, "r1", 0) is None
    assert await store.tail(T, "r1", 0, timeout_s=0.01) is None
    assert await store.lookup_request(T, "r1") is None


async def test_failed_keyless_request(store: Store) -> None:
    await start(store, "r1")
    assert await store.finish(T, "r1", "cp-a", 1, b"err", KEEP, failed=True)
    info = await store.lookup_request(T, "r1")
    assert info is not None and info.state == State.FAILED


async def test_claim_after_release_starts_a_fresh_log(store: Store) -> None:
    await store.claim(T, "k", "cp-a", "fp", "r1", 10)
    await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, tokens(1, 2))])
    await store.fail(T, "k", "cp-a", 1, "worker lost", 60, retryable=True)
    retry = await store.claim(T, "k", "cp-a", "fp", "r1", 10)
    assert retry.outcome == Outcome.CLAIMED
    log = await store.read(T, "r1", 0)
    assert log is not None and log.entries == []
    assert await store.append_many([LogAppend(T, "r1", "cp-a", 2, 0, tokens(9))]) == [True]


@given(
    st.integers(min_value=-(2**31), max_value=2**31 - 1),
    st.text(),
    st.binary(),
)
def test_log_entry_packs_losslessly(token_id: int, text: str, logprob: bytes) -> None:
    entry = LogEntry(token_id, text, logprob)
    assert LogEntry.unpack(entry.pack()) == entry


async def test_memory_sweep_drops_what_redis_would_expire(clock: Clock) -> None:
    store = MemoryStore(clock)
    await store.claim(T, "k", "cp-a", "fp", "r1", 10)
    await store.succeed(T, "k", "cp-a", 1, b"ok", 60)
    await store.finish(T, "r1", "cp-a", 1, b"", KEEP)
    await store.claim_content(T, "fp", "r2", "cp-a", 10)
    await store.start_request(T, "r3", "cp-a")  # abandoned while running
    await store.heartbeat("cp-a", 10)
    store.sweep()
    assert await store.get(T, "k") is not None  # nothing is dropped early
    assert await store.alive("cp-a")
    clock.advance(RUNNING_GC_S + 1)
    store.sweep()
    assert not (store._records or store._reqs or store._logs or store._content or store._alive)
