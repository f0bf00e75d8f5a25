"""One generation's in-process token log and its fan-out to subscribers (caller, duplicates, resumers).

The step loop appends synchronously (no awaits on the hot path); each subscriber follows from its own
offset and receives everything new as one chunk, so a slow reader gets fewer, larger messages instead
of falling behind (Python gRPC moves ~10^4 messages/s per process; docs/architecture.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from control_plane.errors import ApiError, out_of_range
from protos.coalesce.v1 import common_pb2, inference_pb2

FinishReason = inference_pb2.FinishReason


@dataclass(slots=True, eq=False)
class Generation:
    """The tokens of one computation, as they are produced; readable from any offset while it is kept.

    The dispatcher is its only writer for computations that run here; the follower, for ones mirrored from
    another replica's token log (docs/architecture.md, "Records and their owners").
    """

    request_id: str
    tenant: str
    prompt_tokens: int
    max_tokens: int = 0  # the completion budget; 0 when unknown (followed from another replica's log)
    admitted: bool = False  # its first step was scheduled (queue_ms and cached_tokens are known)
    queue_ms: float = 0.0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    logprobs: list[common_pb2.TokenLogprob | None] = field(default_factory=list)
    finish_reason: int = inference_pb2.FINISH_REASON_UNSPECIFIED
    error: ApiError | None = None
    # Requests reading this computation that have not cancelled; at 0 the computation is aborted.
    interest: int = 1
    # Readers currently attached; when it drops to 0 the resume grace period starts.
    subscribers: int = 0
    detached_at: float | None = None
    # Batch items run with nobody reading: never abandoned.
    detached_ok: bool = False
    finished_at: float | None = None
    _wake: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED

    def append(self, token_id: int, text: str, logprob: common_pb2.TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        self.texts.append(text)
        self.logprobs.append(logprob)
        self.wake()

    def finish(self, reason: int, now: float, error: ApiError | None = None) -> None:
        if self.done:
            return
        self.finish_reason = reason
        self.error = error
        self.finished_at = now
        self.wake()

    def usage(self, completion_tokens: int | None = None) -> inference_pb2.Usage:
        return inference_pb2.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=len(self.token_ids) if completion_tokens is None else completion_tokens,
            cached_prompt_tokens=self.cached_tokens,
        )

    def chunk(self, start: int, end: int, view: View | None = None) -> inference_pb2.GenerateResponse:
        """Tokens [start, end) as one response; the last chunk carries finish and usage, the first the outcome."""
        msg = inference_pb2.GenerateResponse(
            request_id=view.request_id if view else self.request_id,
            offset=start,
            token_ids=self.token_ids[start:end],
            text="".join(self.texts[start:end]),
        )
        if any(lp is not None for lp in self.logprobs[start:end]):
            msg.logprobs.extend(lp or common_pb2.TokenLogprob() for lp in self.logprobs[start:end])
        if start == 0:
            msg.dedup_outcome = view.dedup_outcome if view else inference_pb2.DEDUP_OUTCOME_MISS  # type: ignore[assignment]
            msg.queue_ms = self.queue_ms
        if view is not None and view.cancelled_at == end:
            msg.finish_reason = inference_pb2.FINISH_REASON_CANCELLED
            msg.usage.CopyFrom(self.usage(end))
        elif self.done and end == len(self.token_ids):
            msg.finish_reason = self.finish_reason  # type: ignore[assignment]
            msg.usage.CopyFrom(self.usage())
        return msg

    async def follow(
        self, offset: int, stream: bool = True, view: View | None = None
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """Everything from `offset` on, live. With stream=False, one message at the end. A view's own cancel
        ends its readers at the tokens the request had then, while the computation may go on for other views."""
        pos = offset
        while True:
            end = len(self.token_ids)
            last = view.final_length if view is not None else (end if self.done else None)
            if last is not None:
                if pos > last:  # it ended short of the offset asked for
                    raise out_of_range("offset", f"{pos} is beyond the {last} tokens of this finished generation")
                if self.error is not None and not (view is not None and view.cancelled):
                    if stream and pos < last:
                        yield self.chunk(pos, last, view)
                    raise self.error
                yield self.chunk(pos, last, view)  # the last chunk (maybe without tokens) carries finish and usage
                return
            if stream and pos < end:
                yield self.chunk(pos, end, view)
                pos = end
            else:
                await self._wait()

    def wake(self) -> None:
        """Wake every reader (new tokens, the finish, or a view was cancelled)."""
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)
        self._wake = None

    async def _wait(self) -> None:
        if self._wake is None:
            self._wake = asyncio.get_running_loop().create_future()
        # shield: a reader that is cancelled must not cancel the future the other readers wait on.
        await asyncio.shield(self._wake)


@dataclass(slots=True, eq=False)
class View:
    """One request's handle on a generation: its own request id and dedup outcome, and its own cancel.

    Identical requests share one Generation through several views; cancelling a view ends
    that request only (at the tokens it had), and the computation stops when no view is interested any more.
    """

    request_id: str
    gen: Generation
    dedup_outcome: int = inference_pb2.DEDUP_OUTCOME_MISS
    # Kept when its caller's deadline passes: it has an idempotency key or asked to be resumable
    # (docs/api.md, "Deadlines").
    resumable: bool = False
    # The tokens the request had when it was cancelled (where its output ends); None while not cancelled.
    cancelled_at: int | None = None

    @property
    def tenant(self) -> str:
        return self.gen.tenant

    @property
    def cancelled(self) -> bool:
        return self.cancelled_at is not None

    @property
    def done(self) -> bool:
        return self.cancelled or self.gen.done

    @property
    def final_length(self) -> int | None:
        """How many tokens this request ended with; None while it runs."""
        if self.cancelled_at is not None:
            return self.cancelled_at
        return len(self.gen.token_ids) if self.gen.done else None

    def cancel(self) -> None:
        """End this request at the tokens it has (the dispatcher's; it also drops the view's interest)."""
        self.cancelled_at = len(self.gen.token_ids)

    def follow(self, offset: int, stream: bool = True) -> AsyncIterator[inference_pb2.GenerateResponse]:
        return self.gen.follow(offset, stream, self)
