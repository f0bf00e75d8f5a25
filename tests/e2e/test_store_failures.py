"""When the shared store or a replica fails, against real processes and a real redis-server: a Redis restart
without persistence ends no stream early (the journal claims the lost requests again and rewrites their
logs). (A keyless request whose replica died: tests/e2e/test_dedup.py.)"""

from __future__ import annotations

import asyncio

import pytest
from serve_process import Replica

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY

pytestmark = pytest.mark.slow
STREAMS = 8  # one batch of the interactive pool: all run when Redis goes
GREEDY = {"max_tokens": 300, "ignore_eos": True, "temperature": 0.0}


def test_a_redis_restart_without_persistence_ends_no_stream(redis_server: object) -> None:
    replica = Replica(redis_server.url)  # type: ignore[attr-defined]
    try:
        with CoalesceClient(replica.address) as client:
            reference = client.generate("the same prompt", idempotency_key="ref", **GREEDY).result()  # type: ignore[arg-type]

        async def streams() -> list[tuple[list[int], str | None]]:
            async with AsyncCoalesceClient(replica.address, retry=NO_RETRY) as client:
                gens = [client.generate("the same prompt", idempotency_key=f"k{i}", stream=True, **GREEDY)  # type: ignore[arg-type]
                        for i in range(STREAMS)]  # fmt: skip
                all_started = asyncio.Event()
                counts = [0] * STREAMS

                async def read(i: int) -> tuple[list[int], str | None]:
                    tokens: list[int] = []
                    finish = None
                    async for chunk in gens[i]:
                        tokens += chunk.token_ids
                        finish = chunk.finish_reason or finish
                        counts[i] = len(tokens)
                        if all(c >= 10 for c in counts):
                            all_started.set()
                    return tokens, finish

                readers = [asyncio.create_task(read(i)) for i in range(STREAMS)]
                await asyncio.wait_for(all_started.wait(), 120)
                redis_server.proc.kill()  # type: ignore[attr-defined]  # kill -9: nothing persisted, all lost
                redis_server.proc.wait()  # type: ignore[attr-defined]
                await asyncio.sleep(1.0)
                redis_server.start()  # type: ignore[attr-defined]  # back, empty
                return list(await asyncio.wait_for(asyncio.gather(*readers), 180))

        try:
            results = asyncio.run(streams())
        except TimeoutError:
            raise AssertionError("streams stalled:\n" + "".join(replica.cp.lines[-40:])) from None
        for tokens, finish in results:
            assert (tokens, finish) == (reference.token_ids, "length")  # whole, not cut short as CANCELLED
        assert any("claimed again" in line for line in replica.cp.lines)  # the journal re-claimed them
    finally:
        replica.stop()
