"""The client library against a real grpc.aio server on 127.0.0.1 running a scripted InferenceService:
resume after breaks, retries with the same idempotency key, error details, sessions, batches; sync
(in a thread, the server owns the loop) and asyncio alike. Backoff sleeps are recorded, never slept."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from scripted_server import Script, expected, serve

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY, Progress, RetryPolicy, backoff, next_delay
from clients.types import Chunk, CoalesceError, Message, build_request

Server = Callable[..., Awaitable[str]]
KINDS = pytest.mark.parametrize("kind", ["sync", "aio"])


async def generate(
    kind: str, address: str, prompt: str = "hi", retry: RetryPolicy | None = None, **options: Any
) -> tuple[list[Chunk], list[float]]:
    """All chunks of one generation through the sync or asyncio client, and the backoff delays asked for."""
    sleeps: list[float] = []
    if kind == "sync":

        def run() -> list[Chunk]:
            with CoalesceClient(address, token="team-a", retry=retry, sleep=sleeps.append) as client:
                return list(client.generate(prompt, **options))

        return await asyncio.to_thread(run), sleeps

    async def record(delay: float) -> None:
        sleeps.append(delay)

    async with AsyncCoalesceClient(address, token="team-a", retry=retry, sleep=record) as client:
        return [chunk async for chunk in client.generate(prompt, **options)], sleeps


def assert_seamless(chunks: list[Chunk], prompt: str = "hi") -> None:
    """Exactly the whole generation: offsets contiguous, no duplicate, no gap, one finish at the end."""
    ids, text = expected(prompt)
    assert [t for c in chunks for t in c.token_ids] == ids
    assert "".join(c.text for c in chunks) == text
    offsets = [c.offset for c in chunks]
    assert offsets == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert [c.finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["length"]


async def test_sync_result_sends_bearer_token_and_an_automatic_key(grpc_server: Server) -> None:
    address, svc = await serve(grpc_server)

    def run() -> Any:
        with CoalesceClient(address, token="team-a") as client:
            return client.generate("hi").result()

    result = await asyncio.to_thread(run)
    assert (result.token_ids, result.text) == expected()
    assert (result.request_id, result.finish_reason, result.dedup_outcome, result.queue_ms) == (
        "req-1",
        "length",
        "miss",
        1.5,
    )
    assert result.usage is not None and result.usage.completion_tokens == 8
    call = svc.generate_calls[0]
    assert call.authorization == "Bearer team-a"
    assert uuid.UUID(call.key_field) and call.key_header == call.key_field


@KINDS
async def test_chat_sends_the_conversation_as_messages(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server)
    turns: list[Message] = [{"role": "system", "content": "be brief"}, ("user", "hi")]
    if kind == "sync":

        def run() -> Any:
            with CoalesceClient(address) as client:
                return client.chat(turns, max_tokens=4, request_id="c1").result()

        result = await asyncio.to_thread(run)
    else:
        async with AsyncCoalesceClient(address) as client:
            result = await client.chat(turns, max_tokens=4, request_id="c1").result()
    assert result.token_ids == expected("ids", 4)[0]
    request = svc.requests["c1"]
    assert request.WhichOneof("prompt") == "messages" and request.sampling.max_tokens == 4
    assert [(m.role, m.content) for m in request.messages.messages] == [("system", "be brief"), ("user", "hi")]


@KINDS
async def test_resume_after_a_mid_stream_break(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server, Script(break_after_chunks=2))
    chunks, sleeps = await generate(kind, address)
    assert_seamless(chunks)
    assert svc.resume_calls == [("req-1", 4)]
    assert len(svc.generate_calls) == 1 and len(sleeps) == 1


@KINDS
async def test_resume_drops_resent_tokens_and_survives_a_second_break(grpc_server: Server, kind: str) -> None:
    script = Script(break_after_chunks=1, resume_overlap=2, resume_breaks=1)
    address, svc = await serve(grpc_server, script)
    chunks, _ = await generate(kind, address)
    assert_seamless(chunks)
    assert svc.resume_calls == [("req-1", 2), ("req-1", 4)]


@KINDS
async def test_a_stream_ending_without_finish_reason_is_resumed(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server, Script(break_after_chunks=3, end_without_finish=True))
    chunks, _ = await generate(kind, address)
    assert_seamless(chunks)
    assert svc.resume_calls == [("req-1", 6)]


@KINDS
@pytest.mark.parametrize("key", [None, "caller-key"])
async def test_retry_before_the_first_chunk_reuses_the_idempotency_key(
    grpc_server: Server, kind: str, key: str | None
) -> None:
    address, svc = await serve(grpc_server, Script(unavailable_before_first=2))
    chunks, sleeps = await generate(kind, address, idempotency_key=key)
    assert_seamless(chunks)
    keys = {(c.key_field, c.key_header) for c in svc.generate_calls}
    assert len(svc.generate_calls) == 3 and len(keys) == 1
    sent = keys.pop()[0]
    assert sent == key if key else uuid.UUID(sent)
    assert svc.resume_calls == []
    assert 0 <= sleeps[0] < 0.1 and 0 <= sleeps[1] < 0.2  # full jitter under a doubling cap


@KINDS
async def test_resource_exhausted_waits_as_retry_info_says(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server, Script(exhausted_before_first=1, retry_delay=0.25))
    chunks, sleeps = await generate(kind, address)
    assert_seamless(chunks)
    assert sleeps == [0.25] and len(svc.generate_calls) == 2


@KINDS
async def test_error_details_reach_the_caller_when_retries_are_off(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server, Script(exhausted_before_first=1, retry_delay=0.25))
    with pytest.raises(CoalesceError) as caught:
        await generate(kind, address, retry=NO_RETRY)
    err = caught.value
    assert (err.code, err.reason, err.retry_after) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL", 0.25)
    assert str(err) == "RESOURCE_EXHAUSTED: the interactive queue is full"
    assert svc.generate_calls[0].key_field == ""  # no retries, so no key is invented


@KINDS
async def test_invalid_argument_is_raised_at_once(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server)
    with pytest.raises(CoalesceError) as caught:
        await generate(kind, address, prompt="bad")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message == "prompt: must not be 'bad'"
    assert (caught.value.reason, caught.value.field_violations) == ("BAD_PROMPT", [("text", "must not be 'bad'")])
    assert len(svc.generate_calls) == 1


@KINDS
@pytest.mark.parametrize("key", [None, "mine"])
async def test_a_timeout_is_the_deadline_and_frees_the_clients_own_generation(
    grpc_server: Server, kind: str, key: str | None
) -> None:
    """The client's automatic key makes a generation resumable on the server; when its own deadline passes
    it will not come back, so it cancels it. A key the caller chose means "keep it": no cancel."""
    address, svc = await serve(grpc_server)
    with pytest.raises(CoalesceError) as caught:
        await generate(kind, address, prompt="hang", timeout=0.5, idempotency_key=key)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    remaining = svc.generate_calls[0].time_remaining
    assert remaining is not None and 0 < remaining < 1  # the deadline reached the server
    assert len(svc.generate_calls) == 1  # DEADLINE_EXCEEDED is not retried
    assert svc.cancelled == ([] if key else ["req-1"])


def test_build_request_names_the_model() -> None:
    assert build_request("x", model="llama").model == "llama"


@KINDS
async def test_retries_are_bounded(grpc_server: Server, kind: str) -> None:
    address, svc = await serve(grpc_server, Script(unavailable_before_first=10))
    with pytest.raises(CoalesceError) as caught:
        await generate(kind, address, retry=RetryPolicy(max_attempts=3))
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(svc.generate_calls) == 3


@KINDS
async def test_unstreamed_generation_is_one_chunk(grpc_server: Server, kind: str) -> None:
    address, _ = await serve(grpc_server)
    chunks, _ = await generate(kind, address, stream=False, max_tokens=5)
    assert len(chunks) == 1 and (chunks[0].token_ids, chunks[0].text) == expected("hi", 5)


async def test_sync_session_multiplexes_generations_cancel_and_errors(grpc_server: Server) -> None:
    address, svc = await serve(grpc_server)

    def run() -> tuple[Any, ...]:
        with CoalesceClient(address) as client, client.session() as session:
            a, b = session.start("a", max_tokens=6), session.start("b", max_tokens=4)
            hang, bad = session.start("hang"), session.start("bad")
            first = next(hang)  # the scripted "hang" sends one chunk, then waits to be cancelled
            hang.cancel()
            rest = list(hang)
            with pytest.raises(CoalesceError) as caught:
                list(bad)
            return a.result(), b.result(), [first, *rest], caught.value

    a, b, hang, err = await asyncio.to_thread(run)
    assert (a.token_ids, a.text) == expected("a", 6) and (b.token_ids, b.text) == expected("b", 4)
    assert [t for c in hang for t in c.token_ids] == [1000, 1001] and hang[-1].finish_reason == "cancelled"
    assert (err.code, err.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "BAD_PROMPT")
    assert err.field_violations == [("text", "must not be 'bad'")]
    assert svc.session_calls == 1 and ("3", "cancel") in svc.session_actions


async def test_async_session_multiplexes_and_resumes(grpc_server: Server) -> None:
    address, svc = await serve(grpc_server)
    async with AsyncCoalesceClient(address) as client, client.session() as session:
        gens = [session.start(p, max_tokens=4) for p in ("a", "b")] + [session.start("hang", stream_id="h")]
        hang = gens[2]
        first = await anext(hang)
        hang.cancel()
        results = await asyncio.gather(gens[0].result(), gens[1].result(), hang.result())
        resumed = await session.resume("1-req", 2).result()
    assert [(r.token_ids, r.text) for r in results[:2]] == [expected("a", 4), expected("b", 4)]
    assert first.token_ids == [1000, 1001] and results[2].finish_reason == "cancelled"
    assert resumed.token_ids == [1002, 1003] and resumed.text == "a:2 a:3 "
    assert svc.session_calls == 1


async def test_closing_a_session_ends_open_generations(grpc_server: Server) -> None:
    address, _ = await serve(grpc_server)
    async with AsyncCoalesceClient(address) as client:
        session = client.session()
        hang = session.start("hang")
        await anext(hang)
        await session.close()
        with pytest.raises(CoalesceError) as caught:
            await anext(hang)
    assert caught.value.code == grpc.StatusCode.CANCELLED

    def run_sync() -> CoalesceError:
        with CoalesceClient(address) as client:
            session = client.session()
            hang = session.start("hang")
            next(hang)
            session.close()
            with pytest.raises(CoalesceError) as caught:
                next(hang)
            return caught.value

    assert (await asyncio.to_thread(run_sync)).code == grpc.StatusCode.CANCELLED


async def test_unary_calls_and_batches(grpc_server: Server) -> None:
    address, svc = await serve(grpc_server)
    items = [("s1", build_request("x", max_tokens=2)), ("s2", build_request("fail"))]
    async with AsyncCoalesceClient(address) as client:
        assert (await client.model_info()).model == "scripted"
        submitted = await client.submit_batch("b1", items)
        again = await client.submit_batch("b1", items)
        states = [item.state async for item in client.watch_batch("b1")]
        final = await client.get_batch("b1")
        with pytest.raises(CoalesceError) as caught:
            await client.get_batch("nope")
    assert (submitted.queued, again.queued, again.skipped) == (2, 1, 1)
    assert states == [1, 1, 3, 4] and [i.text for i in final] == ["x:0 x:1 ", ""]
    assert caught.value.code == grpc.StatusCode.NOT_FOUND

    def run() -> tuple[bool, Any]:
        with CoalesceClient(address) as client:
            gen = client.generate("hi")
            next(gen)
            return gen.cancel(), client.get_batch("b1")

    cancelled, final_sync = await asyncio.to_thread(run)
    assert cancelled and svc.cancelled == ["req-1"] and len(final_sync) == 2


def test_backoff_policy_is_bounded_and_jittered() -> None:
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=0.3)
    assert [round(backoff(policy, n, rand=lambda: 1.0), 3) for n in range(4)] == [0.1, 0.2, 0.3, 0.3]
    unavailable = CoalesceError(grpc.StatusCode.UNAVAILABLE, "down")
    assert next_delay(policy, 0, unavailable, rand=lambda: 0.5) == 0.05
    assert next_delay(policy, 3, unavailable) is None  # the fourth failure in a row gives up
    for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
        assert next_delay(policy, 0, CoalesceError(code, "no")) is None
    exhausted = grpc.StatusCode.RESOURCE_EXHAUSTED
    assert next_delay(policy, 0, CoalesceError(exhausted, "full")) is None  # no RetryInfo: maybe a daily quota
    assert next_delay(policy, 0, CoalesceError(exhausted, "full", retry_after=2.0)) == 2.0
    assert next_delay(policy, 0, CoalesceError(exhausted, "full", retry_after=3600)) is None


def test_progress_drops_old_tokens_and_refuses_gaps() -> None:
    progress = Progress()
    assert progress.accept(Chunk("r", 0, [1, 2], "ab")) is not None
    assert progress.accept(Chunk("r", 0, [1, 2], "ab")) is None
    trimmed = progress.accept(Chunk("", 1, [2, 3, 4], "bcd"))
    assert trimmed is not None and (trimmed.request_id, trimmed.offset, trimmed.token_ids) == ("r", 2, [3, 4])
    assert progress.resume_request() is not None and progress.offset == 4
    with pytest.raises(CoalesceError) as caught:
        progress.accept(Chunk("r", 6, [7], "g"))
    assert caught.value.code == grpc.StatusCode.DATA_LOSS
