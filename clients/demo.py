"""`coalesce serve --demo`: a short tour through the public API once the server is up.

With a chat model (SmolLM2 by default) the prompts are chat messages and the answers are real; the builtin
noise model has no chat template, so it gets plain text prompts.
"""

from __future__ import annotations

import asyncio
import time

from clients.aio import AsyncCoalesceClient
from clients.retry import NO_RETRY
from clients.types import chat_messages
from protos.coalesce.v1 import inference_pb2

# Questions a 135M-parameter model mostly gets right (it is small: expect the odd wrong answer elsewhere).
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Japan?",
    "Name three primary colors.",
    "What is 2 plus 2?",
    "What is the chemical symbol for gold?",
    "What is the boiling point of water in Celsius?",
    "How many continents are there?",
    "What is the opposite of 'hot'?",
    "How many days are in a week?",
    "What language is spoken in Brazil?",
    "Which ocean is the largest?",
    "What color is the sky on a clear day?",
    "How many legs does a spider have?",
    "Who painted the Mona Lisa?",
    "Which planet is known as the Red Planet?",
    "Who wrote Romeo and Juliet?",
]


def _prompt(question: str, chat: bool) -> str | inference_pb2.ChatMessages:
    return chat_messages([("user", question)]) if chat else question


def _one_line(text: str, width: int = 100) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


async def run_demo(address: str) -> None:
    async with AsyncCoalesceClient(address) as client, AsyncCoalesceClient(address, retry=NO_RETRY) as plain:
        info = await client.model_info()
        chat = info.has_chat_template
        print(
            f"\n[demo] model {info.model} ({info.architecture}, {info.dtype}), context {info.max_context}, "
            f"{info.workers} worker(s); prompts are {'chat messages' if chat else 'plain text (no chat template)'}"
        )

        print(f"[demo] streamed: {QUESTIONS[0]!r} -> ", end="", flush=True)
        async for chunk in client.generate(_prompt(QUESTIONS[0], chat), max_tokens=48, stream=True):
            print(chunk.text.replace("\n", " "), end="", flush=True)
        print()

        started = time.perf_counter()
        results = await asyncio.gather(*(client.generate(_prompt(q, chat), max_tokens=48).result() for q in QUESTIONS))
        took = time.perf_counter() - started
        tokens = sum(len(r.token_ids) for r in results)
        print(
            f"[demo] {len(QUESTIONS)} concurrent requests, continuously batched: {tokens} tokens in {took:.2f} s "
            f"({tokens / took:.0f} tokens/s); a few of the answers:"
        )
        for question, result in list(zip(QUESTIONS, results, strict=True))[1:5]:
            print(f"         {question!r} -> {_one_line(result.text)!r}")

        once = _prompt("Write a haiku about the sea.", chat)
        first = await client.generate(once, idempotency_key="demo-key", max_tokens=32).result()
        again = await client.generate(once, idempotency_key="demo-key", max_tokens=32).result()
        print(
            f"[demo] same idempotency key twice: {first.dedup_outcome}, then {again.dedup_outcome} (same tokens: "
            f"{first.token_ids == again.token_ids})"
        )

        twins = await asyncio.gather(
            *(plain.generate(_prompt("Tell me a fun fact.", chat), max_tokens=32).result() for _ in range(4))
        )
        print(f"[demo] 4 identical requests at once: outcomes {[t.dedup_outcome for t in twins]}")

        story = _prompt("Tell me a short story about a robot.", chat)
        gen = plain.generate(story, max_tokens=24, seed=7, temperature=0.8, stream=True)
        head: list[int] = []
        async for chunk in gen:
            head += chunk.token_ids
            if len(head) >= 6:
                break
        await gen.aclose()  # the stream is dropped; the server keeps generating for the grace period
        assert gen.request_id is not None
        rest = await plain.resume(gen.request_id, len(head)).result()
        # The request's whole log, read from offset 0: what an unbroken stream would have received. (A second
        # request with the same seed is no reference: with quantized weights its numerics depend on how its
        # steps are batched, docs/architecture.md.)
        whole = await plain.resume(gen.request_id, 0).result()
        print(
            f"[demo] dropped a stream after {len(head)} tokens, resumed from that offset: "
            f"{len(rest.token_ids)} more, identical to an unbroken run: {head + rest.token_ids == whole.token_ids}"
        )
        print("[demo] done; still serving. Ctrl-C stops.\n", flush=True)
