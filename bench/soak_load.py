"""The soak's load (bench/soak.py): a pool of prompts whose greedy outputs are known, the good tenant's clients
that carry each keyed, streamed request to its end across replica deaths, and the tally that checks every
completed request token for token against its reference.

A client task sticks to one replica, as a connection through a load balancer does. When its calls fail with
UNAVAILABLE after the Python client's own retries (the replica is gone, or its store is), it moves to the other
replica and resumes there from the offset it reached (`resume(request_id, offset)`), or, before it knew the
request id, sends the request again with the same idempotency key. A Resume the store no longer knows
(NOT_FOUND: Redis came back empty) is sent again with its key too; the key then runs it once more, and the
tokens received before must be the start of what comes back.
"""

from __future__ import annotations

import asyncio
import difflib
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from clients.aio import AsyncCoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError

REQUEST_DEADLINE_S = 180.0  # a request that has not completed by then (across every failover) has stalled
GREEDY = {"ignore_eos": True, "temperature": 0.0}
# What the hostile tenant is expected to be refused: its flood past max_per_tenant, its session past
# session_max_streams (docs/api.md, "Errors").
HOSTILE_EXPECTED = {"TENANT_LIMIT", "STREAM_LIMIT"}


@dataclass(frozen=True, slots=True)
class Prompt:
    text: str
    max_tokens: int
    reference: tuple[int, ...] = ()


def prompt_pool(n: int, rng: random.Random, min_tokens: int, max_tokens: int) -> list[Prompt]:
    """n distinct prompts of varied length and output length (references are filled in by `references`)."""
    words = ["soak", "fence", "epoch", "lease", "journal", "replica", "worker", "stream", "resume", "tenant"]
    texts = [f"soak prompt {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 24))) for i in range(n)]
    return [Prompt(text, rng.randint(min_tokens, max_tokens)) for text in texts]


def compare(reference: tuple[int, ...], got: list[int]) -> tuple[int, int]:
    """(tokens of the reference missing from `got`, tokens of `got` not in the reference)."""
    if tuple(got) == reference:
        return 0, 0
    blocks = difflib.SequenceMatcher(None, reference, got, autojunk=False).get_matching_blocks()
    matched = sum(b.size for b in blocks)
    return len(reference) - matched, len(got) - matched


def error_name(err: CoalesceError) -> str:
    return f"{err.code.name} {err.reason}" if err.reason else err.code.name


@dataclass
class Tally:
    """Everything the summary counts. Only this module and the chaos events write it, on one event loop."""

    served: Counter[str] = field(default_factory=Counter)  # completed requests, by tenant
    tokens: Counter[str] = field(default_factory=Counter)  # their tokens, by tenant
    expected: Counter[str] = field(default_factory=Counter)  # "tenant CODE REASON" -> count
    unexpected: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)  # dedup outcome of the first chunk
    mismatched = 0  # completed requests whose tokens differ from the reference
    lost_tokens = 0
    duplicated_tokens = 0
    gaps = 0  # offsets that did not follow on (the client's DATA_LOSS, or our own check)
    failovers = 0  # moves to the other replica after UNAVAILABLE
    resends = 0  # keyed requests sent again after their Resume was NOT_FOUND
    problems: list[str] = field(default_factory=list)  # the first few, in words
    checks_failed: list[str] = field(default_factory=list)

    def note(self, problem: str) -> None:
        if len(self.problems) < 20:
            self.problems.append(problem)

    def check(self, tenant: str, prompt: Prompt, tokens: list[int], finish: str | None, what: str) -> bool:
        """A completed request: its tokens must be its prompt's reference, ended by its length."""
        self.served[tenant] += 1
        self.tokens[tenant] += len(tokens)
        lost, extra = compare(prompt.reference, tokens)
        if lost or extra or finish != "length":
            self.mismatched += 1
            self.lost_tokens += lost
            self.duplicated_tokens += extra
            self.note(f"{what}: {len(tokens)} tokens (finish {finish}), expected {len(prompt.reference)}: "
                      f"{lost} lost, {extra} extra")  # fmt: skip
            return False
        return True

    def error(self, tenant: str, err: CoalesceError, what: str) -> None:
        expected = tenant == "hostile" and err.reason in HOSTILE_EXPECTED
        (self.expected if expected else self.unexpected)[f"{tenant} {error_name(err)}"] += 1
        if err.code == grpc.StatusCode.DATA_LOSS:
            self.gaps += 1
        if not expected:
            self.note(f"{what}: {err}")


class Clients:
    """One AsyncCoalesceClient per (address, token, retrying). Channels to addresses that died stay open
    until the end: a task may still be unwinding a call on one."""

    def __init__(self) -> None:
        self._clients: dict[tuple[str, str, bool], AsyncCoalesceClient] = {}

    def get(self, address: str, token: str, retry: bool = True) -> AsyncCoalesceClient:
        key = (address, token, retry)
        if key not in self._clients:
            self._clients[key] = AsyncCoalesceClient(address, token, retry=None if retry else NO_RETRY)
        return self._clients[key]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


@dataclass
class Load:
    """What the load and the chaos events share: prompts, tokens, clients, the tally, the live addresses."""

    prompts: list[Prompt]
    tokens: dict[str, str]  # tenant -> bearer token
    live: Callable[[], list[str]]  # control-plane addresses answering now, in replica order
    run: str  # unique per soak: idempotency keys never meet an earlier run's
    tally: Tally = field(default_factory=Tally)
    clients: Clients = field(default_factory=Clients)
    stopping: asyncio.Event = field(default_factory=asyncio.Event)

    async def pick(self, prefer: int, avoid: str | None = None) -> str:
        """The preferred replica's address, or another live one; waits while none answers."""
        while True:
            live = self.live()
            if live:
                if avoid in live and len(live) > 1:
                    live = [a for a in live if a != avoid]
                return live[prefer % len(live)]
            await asyncio.sleep(0.1)


@dataclass(slots=True)
class Done:
    tokens: list[int]
    outcome: str | None  # dedup outcome of the first chunk of the last call that started from 0
    request_id: str | None


async def carry(load: Load, prompt: Prompt, *, key: str, prefer: int, what: str, tenant: str = "good",
                request_id: str | None = None, tokens: list[int] | None = None) -> Done | None:  # fmt: skip
    """A keyed, greedy, streamed request (or, with `request_id`, the rest of one from len(tokens)), carried to its
    end across failures; checked against the prompt's reference. None when it failed (counted)."""
    tokens = list(tokens or [])
    seen = list(tokens)  # the longest prefix received: what a resent request must repeat
    finish = outcome = None
    avoid: str | None = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + REQUEST_DEADLINE_S
    while True:
        address = await load.pick(prefer, avoid)
        client = load.clients.get(address, load.tokens[tenant])
        if request_id is None:
            gen = client.generate(prompt.text, idempotency_key=key, stream=True, max_tokens=prompt.max_tokens,
                                  **GREEDY)  # type: ignore[arg-type]  # fmt: skip
        else:
            gen = client.resume(request_id, len(tokens))
        try:
            async for chunk in gen:
                if chunk.offset != len(tokens):
                    load.tally.gaps += 1
                    load.tally.note(f"{what}: chunk at offset {chunk.offset}, {len(tokens)} tokens received")
                if not tokens and chunk.dedup_outcome:
                    outcome = chunk.dedup_outcome
                tokens += chunk.token_ids
                request_id = chunk.request_id or request_id
                finish = chunk.finish_reason or finish
            break
        except CoalesceError as err:
            if loop.time() > deadline:
                load.tally.error(tenant, err, f"{what}: gave up after {REQUEST_DEADLINE_S:.0f} s")
                return None
            if err.code == grpc.StatusCode.UNAVAILABLE:  # the replica (or its store) is gone: the other one
                load.tally.failovers += 1
                avoid = address
                await asyncio.sleep(0.2)
                continue
            if err.code == grpc.StatusCode.NOT_FOUND and request_id is not None and key:
                load.tally.resends += 1  # the store forgot the request: the key runs it again
                seen = max(seen, tokens, key=len)
                request_id, tokens = None, []
                continue
            load.tally.error(tenant, err, what)
            return None
    if tokens[: len(seen)] != seen:
        load.tally.note(f"{what}: tokens received before a resend differ from those after it")
        load.tally.mismatched += 1
    load.tally.outcomes[outcome or "(resumed)"] += 1
    load.tally.check(tenant, prompt, tokens, finish, what)
    return Done(tokens, outcome, request_id)


async def good_client(load: Load, index: int, seed: int) -> None:
    """One of the good tenant's client tasks: keyed requests back to back until the soak stops."""
    rng = random.Random(seed)
    n = 0
    while not load.stopping.is_set():
        prompt = rng.choice(load.prompts)
        await carry(load, prompt, key=f"{load.run}-c{index}-{n}", prefer=index, what=f"client {index} #{n}")
        n += 1


async def references(load: Load, addresses: list[str]) -> list[Prompt]:
    """Each prompt's greedy output, computed once on every replica: they must agree, or nothing can be checked."""
    token = load.tokens["good"]

    async def one(address: str, i: int, prompt: Prompt) -> list[int]:
        client = load.clients.get(address, token)
        result = await client.generate(prompt.text, idempotency_key=f"{load.run}-ref-{address}-{i}",
                                       max_tokens=prompt.max_tokens, dedup="off", **GREEDY).result()  # type: ignore[arg-type]  # fmt: skip
        return result.token_ids

    outputs = await asyncio.gather(*(one(a, i, p) for a in addresses for i, p in enumerate(load.prompts)))
    n = len(load.prompts)
    per_replica = [outputs[k * n : (k + 1) * n] for k in range(len(addresses))]
    for i in range(n):
        if any(r[i] != per_replica[0][i] for r in per_replica) or len(per_replica[0][i]) != load.prompts[i].max_tokens:
            raise RuntimeError(f"prompt {i}: the replicas' greedy outputs differ; exactness cannot be checked")
    return [Prompt(p.text, p.max_tokens, tuple(per_replica[0][i])) for i, p in enumerate(load.prompts)]
