"""The in-process token log: any offset, no duplicate, no gap, lagging readers get merged chunks."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from control_plane.errors import ApiError
from control_plane.generation import Generation, View
from protos.coalesce.v1 import inference_pb2


async def _collect(gen: Generation, offset: int = 0, stream: bool = True) -> list[inference_pb2.GenerateResponse]:
    return [chunk async for chunk in gen.follow(offset, stream)]


async def test_live_readers_see_every_token_once() -> None:
    gen = Generation("r1", "t", prompt_tokens=3, queue_ms=4.5)
    readers = [asyncio.create_task(_collect(gen, offset)) for offset in (0, 0, 2)]
    await asyncio.sleep(0)
    for i in range(5):
        gen.append(10 + i, f"<{i}>")
        await asyncio.sleep(0)
    gen.finish(inference_pb2.FINISH_REASON_LENGTH, now=1.0)
    for reader, offset in zip(readers, (0, 0, 2), strict=True):
        chunks = await reader
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == [10, 11, 12, 13, 14][offset:]
        assert [c.offset for c in chunks] == sorted({c.offset for c in chunks})
        assert "".join(c.text for c in chunks) == "".join(f"<{i}>" for i in range(offset, 5))
        last = chunks[-1]
        assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 5 and last.usage.prompt_tokens == 3
    first = (await _collect(gen, 0))[0]
    assert first.queue_ms == 4.5 and first.dedup_outcome == inference_pb2.DEDUP_OUTCOME_MISS


async def test_a_lagging_reader_gets_one_merged_chunk() -> None:
    gen = Generation("r2", "t", prompt_tokens=1)
    for i in range(100):
        gen.append(i, "x")
    gen.finish(inference_pb2.FINISH_REASON_STOP, now=0.0)
    chunks = await _collect(gen, 40)
    assert len(chunks) == 1
    assert chunks[0].offset == 40 and list(chunks[0].token_ids) == list(range(40, 100))


async def test_unstreamed_reader_gets_one_final_message() -> None:
    gen = Generation("r3", "t", prompt_tokens=1)
    reader = asyncio.create_task(_collect(gen, 0, stream=False))
    for i in range(3):
        gen.append(i, str(i))
        await asyncio.sleep(0)
    gen.finish(inference_pb2.FINISH_REASON_LENGTH, now=0.0)
    (only,) = await reader
    assert list(only.token_ids) == [0, 1, 2] and only.text == "012" and only.finish_reason


async def test_a_cancelled_reader_does_not_disturb_the_others() -> None:
    gen = Generation("r4", "t", prompt_tokens=1)
    quitter = asyncio.create_task(_collect(gen))
    stayer = asyncio.create_task(_collect(gen))
    await asyncio.sleep(0)
    quitter.cancel()
    await asyncio.sleep(0)
    gen.append(1, "a")
    gen.finish(inference_pb2.FINISH_REASON_LENGTH, now=0.0)
    assert [t for c in await stayer for t in c.token_ids] == [1]


async def test_failure_reaches_readers_after_the_tokens_they_missed() -> None:
    gen = Generation("r5", "t", prompt_tokens=1)
    gen.append(1, "a")
    gen.finish(inference_pb2.FINISH_REASON_ERROR, now=0.0, error=ApiError(grpc.StatusCode.INTERNAL, "boom"))
    seen: list[int] = []
    with pytest.raises(ApiError, match="boom"):
        async for chunk in gen.follow(0):
            seen.extend(chunk.token_ids)
    assert seen == [1]


async def test_a_cancelled_view_ends_at_its_cancel_point_from_any_offset() -> None:
    gen = Generation("r6", "t", prompt_tokens=2)
    leader, follower = View("r6", gen), View("r7", gen, inference_pb2.DEDUP_OUTCOME_COALESCED)
    for i in range(10):
        gen.append(i, str(i))
    follower.cancel()  # the computation goes on for the leader
    gen.append(10, "10")
    for offset in (0, 3, 10):
        for stream in (True, False):
            chunks = [c async for c in follower.follow(offset, stream)]
            assert [t for c in chunks for t in c.token_ids] == list(range(offset, 10))
            assert chunks[0].offset == offset and chunks[-1].finish_reason == inference_pb2.FINISH_REASON_CANCELLED
            assert chunks[-1].usage.completion_tokens == 10 and chunks[0].request_id == "r7"
    assert follower.final_length == 10 and leader.final_length is None and not gen.done
