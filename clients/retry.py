"""Retry and resume policy, as pure functions and one small state class that the sync and asyncio clients
drive the same way. Nothing here does I/O or sleeps; the clients inject the sleep.

Which failures are retried follows AIP-194: UNAVAILABLE always (with an idempotency key a resent Generate
runs at most once, and Resume only reads); RESOURCE_EXHAUSTED only when the server says when to come back
(RetryInfo), because without it the quota may be a daily one; everything else is the caller's to handle
(DEADLINE_EXCEEDED in particular: the caller's deadline is spent, retrying would overrun it).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from clients.types import Chunk, CoalesceError
from protos.coalesce.v1 import inference_pb2


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter. `max_attempts` counts calls in a row that made no
    progress (the first included), so a long stream that breaks now and then, but moves on each time,
    is always resumed."""

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    # A server asking for a longer pause than this gets its error surfaced instead of a silent wait.
    max_retry_after: float = 60.0

    @property
    def enabled(self) -> bool:
        return self.max_attempts > 1


NO_RETRY = RetryPolicy(max_attempts=1)
# After its deadline passed, a generation the client keyed itself is cancelled (best effort) within this.
ABANDON_TIMEOUT_S = 2.0


def is_retryable(err: CoalesceError) -> bool:
    if err.code == grpc.StatusCode.UNAVAILABLE:
        return True
    return err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.retry_after is not None


def backoff(policy: RetryPolicy, attempt: int, rand: Callable[[], float] = random.random) -> float:
    """Delay before retry number `attempt` (0-based): uniform in [0, cap), the cap growing exponentially.
    Full jitter spreads a crowd of clients that failed together (e.g. a control-plane restart)."""
    cap = min(policy.max_backoff, policy.initial_backoff * policy.multiplier**attempt)
    return cap * rand()


def next_delay(
    policy: RetryPolicy, attempt: int, err: CoalesceError, rand: Callable[[], float] = random.random
) -> float | None:
    """Seconds to wait before retrying after `err`, or None to give up and raise it. `attempt` is the
    number of retries already made without progress."""
    if attempt + 1 >= policy.max_attempts or not is_retryable(err):
        return None
    if err.retry_after is not None:
        return err.retry_after if err.retry_after <= policy.max_retry_after else None
    return backoff(policy, attempt, rand)


def stream_broken() -> CoalesceError:
    """A stream that ended with OK status but no finish reason was cut (e.g. a proxy or replica restart)."""
    return CoalesceError(grpc.StatusCode.UNAVAILABLE, "the stream ended before the generation finished")


class Progress:
    """What the caller has received of one generation: its id, the next expected token offset, whether it
    finished. `accept` is the guard that makes resumed streams seamless: no duplicate, no gap."""

    __slots__ = ("finished", "offset", "request_id")

    def __init__(self) -> None:
        self.request_id: str | None = None
        self.offset = 0
        self.finished = False

    def resume_request(self) -> inference_pb2.ResumeRequest | None:
        """Where to pick up after a break; None while the id is unknown (then Generate is resent instead)."""
        if self.request_id is None:
            return None
        return inference_pb2.ResumeRequest(request_id=self.request_id, offset=self.offset)

    def accept(self, chunk: Chunk) -> Chunk | None:
        """The part of `chunk` the caller has not seen, or None when it is all old. A gap raises DATA_LOSS.

        Tokens before the expected offset are dropped. The text of a partly old chunk cannot be split per
        token without the tokenizer; servers honour the offset, so that case is only defended for token ids.
        """
        if chunk.offset > self.offset:
            raise CoalesceError(
                grpc.StatusCode.DATA_LOSS,
                f"tokens {self.offset}..{chunk.offset - 1} of request {self.request_id} never arrived",
            )
        skip = self.offset - chunk.offset
        if skip:
            if skip >= len(chunk.token_ids) and chunk.finish_reason is None:
                return None
            text = chunk.text if skip < len(chunk.token_ids) else ""
            chunk = replace(
                chunk,
                offset=self.offset,
                token_ids=chunk.token_ids[skip:],
                logprobs=chunk.logprobs[skip:],
                text=text,
            )
        if not chunk.request_id and self.request_id:  # resumed chunks may leave the id out
            chunk.request_id = self.request_id
        self.request_id = chunk.request_id or self.request_id
        self.offset += len(chunk.token_ids)
        self.finished = chunk.finish_reason is not None
        return chunk
