"""The journal when the store's token log is shorter than what it believes it wrote, against a real
redis-server: after a Redis restart without persistence, or a takeover of a generation this replica had
computed further than its log (tests/e2e/test_store_failures.py stalled so under load: every append was
refused at its offset, the request was fenced out as if another replica owned it, taken over again, and
refused again, forever). The record is still ours: the log is rewritten from what it holds."""

from __future__ import annotations

import asyncio

from control_plane.config import load_settings
from control_plane.generation import Generation
from control_plane.replication import Replicator
from dedup_service import Store, make_store
from tests.conftest import RedisServer

TENANT = "t"


async def _owned(
    store: Store, journal: Replicator, i: int, tokens: list[int], flushed: int | None = None
) -> Generation:
    gen = Generation(f"req-{i}", TENANT, prompt_tokens=3)
    claim = await store.claim(TENANT, f"key-{i}", "replica-a", f"fp-{i}", gen.request_id, 30, payload=b"p")
    assert claim.record is not None
    for t in tokens:
        gen.append(t, "x")
    journal.own(gen, epoch=claim.record.epoch, key=f"key-{i}", fingerprint=f"fp-{i}", payload=b"p", flushed=flushed)
    return gen


async def _log(store: Store, gen: Generation) -> list[int]:
    piece = await store.read(TENANT, gen.request_id, 0)
    assert piece is not None
    return [e.token_id for e in piece.entries]


async def test_a_log_shorter_than_believed_is_rewritten_not_fenced(redis_server: RedisServer) -> None:
    store = make_store(redis_server.url)
    journal = Replicator(store, "replica-a", load_settings())
    # Owned as a takeover owns a generation it followed: all its tokens taken for logged, but the log is empty.
    gen = await _owned(store, journal, 0, [7, 8])
    gen.append(9, "x")
    assert await journal.flush() == []
    assert journal.held(TENANT, gen.request_id) is not None
    assert await journal.flush() == []
    assert await _log(store, gen) == [7, 8, 9]
    await store.close()


async def test_flush_and_renew_after_a_restart_keep_every_request(redis_server: RedisServer) -> None:
    store = make_store(redis_server.url)
    journal = Replicator(store, "replica-a", load_settings())
    gens = [await _owned(store, journal, i, [7], flushed=0) for i in range(8)]
    assert await journal.flush() == []
    redis_server.client().flushall()  # what a restart without persistence leaves
    for gen in gens:
        gen.append(8, "x")
    assert await asyncio.gather(journal.flush(), journal.renew()) == [[], []]
    assert len(journal.owned) == len(gens)
    assert await journal.flush() == []
    for gen in gens:
        assert await _log(store, gen) == [7, 8]
    await store.close()
