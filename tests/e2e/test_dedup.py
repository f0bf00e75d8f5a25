"""Dedup end to end (docs/architecture.md, "The dedup decision"): two control-plane processes sharing one real
redis-server, each driving its own worker process; and `coalesce serve` on the memory store."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator

import grpc
import pytest
from serve_process import BUILTIN, Replica, ServeProcess, pair_of

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError, Result

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(redis_module: object) -> Iterator[tuple[Replica, Replica]]:
    pair = pair_of(redis_module.url)  # type: ignore[attr-defined]
    yield pair
    for r in pair:
        r.stop()


async def _many(addresses: list[str], prompt: str, key: str, n: int, **opts: object) -> list[Result]:
    clients = [AsyncCoalesceClient(a) for a in addresses]
    try:
        gens = [clients[i % len(clients)].generate(prompt, idempotency_key=key, **opts).result() for i in range(n)]  # type: ignore[arg-type]
        return list(await asyncio.gather(*gens))
    finally:
        for c in clients:
            await c.close()


def test_same_key_through_two_replicas_runs_once(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    before = a.step_tokens() + b.step_tokens()
    results = asyncio.run(_many([a.address, b.address], "one key, two replicas", "k-32", 32, max_tokens=16,
                                ignore_eos=True, stream=True))  # fmt: skip
    assert len({tuple(r.token_ids) for r in results}) == 1 and len(results[0].token_ids) == 16
    outcomes = sorted(r.dedup_outcome or "" for r in results)
    assert outcomes.count("miss") == 1 and outcomes.count("coalesced") == 31
    prompt = results[0].usage.prompt_tokens if results[0].usage else 0
    computed = a.step_tokens() + b.step_tokens() - before
    assert computed == prompt + 16 - 1  # exactly one inference: the prompt once, then one token per decode


def test_reused_key_is_refused_and_success_replays(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    with CoalesceClient(a.address, retry=NO_RETRY) as ca, CoalesceClient(b.address, retry=NO_RETRY) as cb:
        first = ca.generate("replay me", idempotency_key="k-replay", max_tokens=8).result()
        before = a.step_tokens() + b.step_tokens()
        again = cb.generate("replay me", idempotency_key="k-replay", max_tokens=8).result()
        assert a.step_tokens() + b.step_tokens() == before  # no worker step
        assert again.dedup_outcome == "replayed"
        assert (again.token_ids, again.text, again.request_id) == (first.token_ids, first.text, first.request_id)
        with pytest.raises(CoalesceError) as err:
            cb.generate("another payload", idempotency_key="k-replay", max_tokens=8).result()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.value.reason == "IDEMPOTENCY_KEY_REUSED"


def test_store_down_refuses_keyed_requests_then_recovers(
    replicas: tuple[Replica, Replica], redis_module: object
) -> None:
    a, _ = replicas
    redis = redis_module
    with CoalesceClient(a.address, retry=NO_RETRY) as client:
        before = a.step_tokens()
        redis.stop()  # type: ignore[attr-defined]
        try:
            with pytest.raises(CoalesceError) as err:
                client.generate("while redis is down", idempotency_key="k-down", max_tokens=4).result()
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert "dedup store is unavailable" in err.value.message
            assert a.step_tokens() == before  # no inference ran for the keyed request
            assert client.generate("no key needs no store", max_tokens=4).result().finish_reason == "length"
        finally:
            redis.start()  # type: ignore[attr-defined]
        result = client.generate("while redis is down", idempotency_key="k-down", max_tokens=4).result()
        assert result.dedup_outcome == "miss" and len(result.token_ids) == 4


@pytest.mark.parametrize("opts", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 77}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("key", ["k-kill", ""], ids=["keyed", "keyless"])
def test_replica_killed_mid_generation_resumes_on_the_other(
    redis_server: object, opts: dict[str, object], key: str
) -> None:
    """A keyed request is taken over when its record's lease runs out; a keyless one (it used to hang until
    the caller's deadline) when its replica's heartbeat does, from the payload its request index keeps."""
    a, b = pair_of(redis_server.url)  # type: ignore[attr-defined]
    try:
        common = {"max_tokens": 48, "ignore_eos": True, "dedup": "off", **opts}
        with CoalesceClient(b.address) as cb:
            undisturbed = cb.generate("kill the owner", idempotency_key="k-ref", **common).result().token_ids  # type: ignore[arg-type]
        with CoalesceClient(a.address, retry=NO_RETRY) as ca:
            gen = ca.generate("kill the owner", idempotency_key=key or None, stream=True, **common)  # type: ignore[arg-type]
            received: list[int] = []
            for chunk in gen:
                received += chunk.token_ids
                if len(received) >= 8:
                    break
            request_id = gen.request_id
            os.kill(a.cp.proc.pid, signal.SIGKILL)
        assert request_id is not None
        with CoalesceClient(b.address, timeout=60) as cb:
            rest = cb.resume(request_id, len(received)).result()
        assert received + rest.token_ids == undisturbed and rest.finish_reason == "length"
    finally:
        a.stop()
        b.stop()


@pytest.fixture(scope="module")
def serve() -> Iterator[ServeProcess]:
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "32", env={"COALESCE_POOLS__BATCH__MAX_WAIT_MS": "20"})
    yield server
    server.stop()


def test_identical_requests_coalesce_and_a_follower_cancel_spares_the_rest(serve: ServeProcess) -> None:
    async def run() -> tuple[list[tuple[list[int], Result]], list[str], bool]:
        async with AsyncCoalesceClient(serve.address) as client:
            gens = [client.generate("same content", max_tokens=40, ignore_eos=True, stream=True) for _ in range(8)]
            firsts = await asyncio.gather(*(anext(g) for g in gens))
            follower = next(c for c in firsts if c.dedup_outcome == "coalesced")
            cancelled = await client.cancel(follower.request_id)
            kept = [(g, c) for g, c in zip(gens, firsts, strict=True) if c is not follower]
            rests = await asyncio.gather(*(g.result() for g, _ in kept))
            outcomes = [c.dedup_outcome or "" for c in firsts]
            return [(c.token_ids, r) for (_, c), r in zip(kept, rests, strict=True)], outcomes, cancelled

    results, outcomes, cancelled = asyncio.run(run())
    assert cancelled
    assert sorted(outcomes) == ["coalesced"] * 7 + ["miss"]
    assert all(rest.finish_reason == "length" for _, rest in results)
    sequences = {tuple(first + rest.token_ids) for first, rest in results}
    assert len(sequences) == 1 and len(next(iter(sequences))) == 40


def test_batch_resubmission_runs_only_what_failed(serve: ServeProcess) -> None:
    from protos.coalesce.v1 import inference_pb2

    def items() -> list[tuple[str, inference_pb2.GenerateRequest]]:
        out = []
        for i in range(20):
            slow = i < 7
            sampling = inference_pb2.SamplingParams(max_tokens=1500 if slow else 6, ignore_eos=True)
            out.append(
                (f"{i}", inference_pb2.GenerateRequest(text=f"item {i}", request_id=f"b1-{i}", sampling=sampling))
            )
        return out

    with CoalesceClient(serve.address, retry=NO_RETRY) as client:
        first = client.submit_batch("b1", items())
        assert (first.queued, first.skipped) == (20, 0)
        for i in range(7):
            assert client.cancel(f"b1-{i}")
        final = {s.seq_id: s for s in client.watch_batch("b1")}
        states = [final[f"{i}"].state for i in range(20)]
        assert states[:7] == [inference_pb2.ITEM_STATE_FAILED] * 7
        assert states[7:] == [inference_pb2.ITEM_STATE_SUCCESS] * 13
        again = client.submit_batch("b1", [(seq, req) for seq, req in items()])
        assert (again.queued, again.skipped) == (7, 13)
        for i in range(7):
            client.cancel(f"b1-{i}")  # keep the suite fast: these are the long ones
        final = {s.seq_id: s for s in client.watch_batch("b1")}
        assert sum(s.state == inference_pb2.ITEM_STATE_SUCCESS for s in final.values()) == 13


def test_identical_keyless_requests_coalesce_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas

    async def run() -> list[Result]:
        clients = [AsyncCoalesceClient(r.address, retry=NO_RETRY) for r in (a, b)]
        try:  # long enough that every copy arrives while the first is still in flight
            gens = [
                c.generate("same words, two replicas", max_tokens=160, ignore_eos=True).result() for c in clients * 8
            ]
            return list(await asyncio.gather(*gens))
        finally:
            for c in clients:
                await c.close()

    before = a.step_tokens() + b.step_tokens()
    results = asyncio.run(run())
    assert len({tuple(r.token_ids) for r in results}) == 1 and len(results[0].token_ids) == 160
    assert sorted(r.dedup_outcome or "" for r in results) == ["coalesced"] * 15 + ["miss"]
    assert len({r.request_id for r in results}) == 16  # each request keeps its own id
    prompt = results[0].usage.prompt_tokens if results[0].usage else 0
    assert a.step_tokens() + b.step_tokens() - before == prompt + 160 - 1  # computed once


def test_a_content_follower_takes_over_when_the_leaders_replica_dies(redis_server: object) -> None:
    a, b = pair_of(redis_server.url)  # type: ignore[attr-defined]
    try:
        opts = {"max_tokens": 60, "ignore_eos": True, "temperature": 0.8, "seed": 11}
        with CoalesceClient(b.address, retry=NO_RETRY) as cb:
            undisturbed = cb.generate("leader lost", dedup="off", **opts).result().token_ids  # type: ignore[arg-type]
        with CoalesceClient(a.address, retry=NO_RETRY) as ca, CoalesceClient(b.address, retry=NO_RETRY) as cb:
            leader = ca.generate("leader lost", stream=True, **opts)  # type: ignore[arg-type]
            assert next(iter(leader)).token_ids
            follower = cb.generate("leader lost", stream=True, **opts)  # type: ignore[arg-type]
            received: list[int] = []
            for chunk in follower:
                assert received or chunk.dedup_outcome == "coalesced"
                received += chunk.token_ids
                if len(received) >= 8:
                    break
            os.kill(a.cp.proc.pid, signal.SIGKILL)
            for chunk in follower:  # the same stream goes on: B now computes it
                received += chunk.token_ids
        assert received == undisturbed
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("where", ["same replica", "other replica"])
def test_a_coalesced_keyless_request_resumes_on_the_other_replica(redis_server: object, where: str) -> None:
    """A request that reads an identical one's computation is indexed and logged under its own id too, so any
    replica resumes it (found by bench/soak.py: it was NOT_FOUND)."""
    a, b = pair_of(redis_server.url)  # type: ignore[attr-defined]
    try:
        with CoalesceClient(a.address, retry=NO_RETRY) as ca, CoalesceClient(b.address, retry=NO_RETRY) as cb:
            opts = {"max_tokens": 64, "ignore_eos": True, "temperature": 0.0}
            leader = ca.generate("the same words", stream=True, **opts)  # type: ignore[arg-type]
            assert next(iter(leader)).token_ids
            follower = (ca if where == "same replica" else cb).generate("the same words", stream=True, **opts)  # type: ignore[arg-type]
            first = next(iter(follower))
            assert first.dedup_outcome == "coalesced" and first.request_id
            resumer = cb if where == "same replica" else ca
            rest = resumer.resume(first.request_id, len(first.token_ids)).result()
            assert len(first.token_ids) + len(rest.token_ids) == 64 and rest.finish_reason == "length"
    finally:
        a.stop()
        b.stop()
