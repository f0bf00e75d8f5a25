"""`coalesce serve --demo`: a short tour through the public API once the server is up."""

from __future__ import annotations

import asyncio
import time

from clients.aio import AsyncCoalesceClient
from clients.retry import NO_RETRY


async def run_demo(address: str) -> None:
    async with AsyncCoalesceClient(address) as client, AsyncCoalesceClient(address, retry=NO_RETRY) as plain:
        info = await client.model_info()
        print(
            f"\n[demo] model {info.model} ({info.architecture}), context {info.max_context}, {info.workers} worker(s)"
        )

        print("[demo] streamed generation: ", end="", flush=True)
        async for chunk in client.generate("Once upon a time", max_tokens=24, temperature=1.0, seed=1, stream=True):
            print(repr(chunk.text)[1:-1], end="", flush=True)
        print()

        started = time.perf_counter()
        results = await asyncio.gather(
            *(
                client.generate(f"request {i}: " + "x" * (8 * i), max_tokens=32, ignore_eos=True).result()
                for i in range(16)
            )
        )
        took = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        print(f"[demo] 16 concurrent requests, continuously batched: {tokens} tokens in {took:.2f} s")

        first = await client.generate("pay once", idempotency_key="demo-key", max_tokens=16).result()
        again = await client.generate("pay once", idempotency_key="demo-key", max_tokens=16).result()
        print(
            f"[demo] same idempotency key twice: {first.dedup_outcome}, then {again.dedup_outcome} (same tokens: "
            f"{first.token_ids == again.token_ids})"
        )

        twins = await asyncio.gather(*(plain.generate("twins", max_tokens=32).result() for _ in range(4)))
        print(f"[demo] 4 identical requests at once: outcomes {[t.dedup_outcome for t in twins]}")

        whole = await client.generate("resume me", max_tokens=24, seed=7, temperature=0.8).result()
        gen = plain.generate("resume me", max_tokens=24, seed=7, temperature=0.8, stream=True)
        head: list[int] = []
        async for chunk in gen:
            head += chunk.token_ids
            if len(head) >= 6:
                break
        await gen.aclose()  # the stream is dropped; the server keeps generating for the grace period
        assert gen.request_id is not None
        rest = await plain.resume(gen.request_id, len(head)).result()
        print(
            f"[demo] dropped a stream after {len(head)} tokens, resumed from that offset: "
            f"{len(rest.token_ids)} more, identical to an unbroken run: {head + rest.token_ids == whole.token_ids}"
        )
        print("[demo] done; still serving. Ctrl-C stops.\n", flush=True)
