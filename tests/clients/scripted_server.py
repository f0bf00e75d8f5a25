"""A scripted InferenceService for the client tests: a real grpc.aio servicer whose "model" is a formula
(token i is 1000 + i, its text is f"{prompt}:{i} ") and whose failures are set by a Script: UNAVAILABLE or
RESOURCE_EXHAUSTED (with RetryInfo) before the first chunk, a break after N chunks, a stream that ends
without a finish reason, Resume streams that overlap or break. It records what clients sent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

CHUNK = 2  # tokens per chunk
DEFAULT_TOKENS = 8


@dataclass
class Script:
    unavailable_before_first: int = 0  # Generate calls that fail with UNAVAILABLE before any chunk
    exhausted_before_first: int = 0  # ... with RESOURCE_EXHAUSTED + RetryInfo(retry_delay)
    retry_delay: float = 0.25
    break_after_chunks: int | None = None  # the next Generate aborts UNAVAILABLE after this many chunks
    end_without_finish: bool = False  # ... or ends with OK status instead (once)
    resume_overlap: int = 0  # tokens Resume re-sends before the requested offset
    resume_breaks: int = 0  # Resume calls that abort after CHUNK tokens past their start


def tokens(prompt: str, n: int, start: int = 0) -> tuple[list[int], str]:
    return [1000 + i for i in range(start, n)], "".join(f"{prompt}:{i} " for i in range(start, n))


def prompt_of(request: inference_pb2.GenerateRequest) -> str:
    return request.text if request.HasField("text") else "ids"


def chunks(request_id: str, request: inference_pb2.GenerateRequest, start: int) -> list[inference_pb2.GenerateResponse]:
    n = request.sampling.max_tokens or DEFAULT_TOKENS
    out = []
    for offset in range(start, n, CHUNK):
        ids, text = tokens(prompt_of(request), min(offset + CHUNK, n), offset)
        out.append(inference_pb2.GenerateResponse(request_id=request_id, offset=offset, token_ids=ids, text=text))
    out[0].dedup_outcome, out[0].queue_ms = inference_pb2.DEDUP_OUTCOME_MISS, 1.5
    out[-1].finish_reason = inference_pb2.FINISH_REASON_LENGTH
    out[-1].usage.CopyFrom(inference_pb2.Usage(prompt_tokens=3, completion_tokens=n))
    return out


def merged(parts: list[inference_pb2.GenerateResponse]) -> inference_pb2.GenerateResponse:
    """The single message of a stream=false Generate."""
    one = inference_pb2.GenerateResponse()
    one.CopyFrom(parts[0])
    for part in parts[1:]:
        one.token_ids.extend(part.token_ids)
        one.text += part.text
    one.finish_reason = parts[-1].finish_reason
    one.usage.CopyFrom(parts[-1].usage)
    return one


def bad_prompt_details() -> list[any_pb2.Any]:
    """What the real server attaches to a bad field: BadRequest and ErrorInfo."""
    bad = error_details_pb2.BadRequest(
        field_violations=[error_details_pb2.BadRequest.FieldViolation(field="text", description="must not be 'bad'")]
    )
    details = [any_pb2.Any(), any_pb2.Any()]
    details[0].Pack(bad)
    details[1].Pack(error_details_pb2.ErrorInfo(reason="BAD_PROMPT", domain="coalesce"))
    return details


def bad_prompt_status() -> grpc.Status:
    status = status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="prompt: must not be 'bad'")
    status.details.extend(bad_prompt_details())
    return rpc_status.to_status(status)


def exhausted_status(delay: float) -> grpc.Status:
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=int(delay * 1e9)))
    info = error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="coalesce")
    details = [any_pb2.Any(), any_pb2.Any()]
    details[0].Pack(retry)
    details[1].Pack(info)
    status = status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="the interactive queue is full")
    status.details.extend(details)
    return rpc_status.to_status(status)


@dataclass
class Call:
    """What one Generate call carried."""

    key_field: str
    key_header: str | None
    authorization: str | None
    request_id: str
    time_remaining: float | None  # the call's deadline, as the server saw it


@dataclass
class ScriptedInference(inference_pb2_grpc.InferenceServiceServicer):
    script: Script = field(default_factory=Script)
    generate_calls: list[Call] = field(default_factory=list)
    resume_calls: list[tuple[str, int]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    session_actions: list[tuple[str, str]] = field(default_factory=list)
    session_calls: int = 0
    requests: dict[str, inference_pb2.GenerateRequest] = field(default_factory=dict)
    batches: dict[str, dict[str, inference_pb2.BatchItemStatus]] = field(default_factory=dict)

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        md = dict(context.invocation_metadata() or ())
        request_id = request.request_id or f"req-{len(self.requests) + 1}"
        self.generate_calls.append(
            Call(
                request.idempotency_key,
                md.get("x-idempotency-key"),
                md.get("authorization"),
                request_id,
                context.time_remaining(),
            )
        )
        s = self.script
        if prompt_of(request) == "bad":
            await context.abort_with_status(bad_prompt_status())
        if s.unavailable_before_first:
            s.unavailable_before_first -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        if s.exhausted_before_first:
            s.exhausted_before_first -= 1
            await context.abort_with_status(exhausted_status(s.retry_delay))
        self.requests[request_id] = request
        parts = chunks(request_id, request, 0)
        if not request.stream:
            yield merged(parts)
            return
        for n, part in enumerate(parts):
            if n == s.break_after_chunks:
                s.break_after_chunks = None
                if s.end_without_finish:
                    s.end_without_finish = False
                    return
                await context.abort(grpc.StatusCode.UNAVAILABLE, "connection to the control plane lost")
            yield part
            if prompt_of(request) == "hang":
                await asyncio.Event().wait()  # one chunk, then nothing until the call ends

    async def Resume(
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.ResumeResponse]:
        self.resume_calls.append((request.request_id, request.offset))
        original = self.requests.get(request.request_id)
        if original is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"request {request.request_id} not found")
        assert original is not None
        start = max(0, request.offset - self.script.resume_overlap)
        for part in chunks(request.request_id, original, start):
            if self.script.resume_breaks and part.offset >= request.offset + CHUNK:
                self.script.resume_breaks -= 1
                await context.abort(grpc.StatusCode.UNAVAILABLE, "replica restarting")
            yield inference_pb2.ResumeResponse(chunk=part)

    async def Cancel(
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CancelResponse:
        self.cancelled.append(request.request_id)
        return inference_pb2.CancelResponse(cancelled=request.request_id in self.requests)

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        return inference_pb2.GetModelInfoResponse(model="scripted", vocab_size=2000, max_context=64, workers=1)

    async def Session(
        self, request_iterator: AsyncIterator[inference_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.SessionResponse]:
        self.session_calls += 1
        out: asyncio.Queue[inference_pb2.SessionResponse | None] = asyncio.Queue()
        tasks: dict[str, asyncio.Task[None]] = {}

        async def run(stream_id: str, request_id: str, request: inference_pb2.GenerateRequest, start: int) -> None:
            if prompt_of(request) == "bad":
                err = inference_pb2.SessionError(
                    code=3, message="prompt: must not be 'bad'", reason="BAD_PROMPT", details=bad_prompt_details()
                )
                out.put_nowait(inference_pb2.SessionResponse(stream_id=stream_id, error=err))
                return
            self.requests[request_id] = request
            sent = start
            try:
                for part in chunks(request_id, request, start):
                    out.put_nowait(inference_pb2.SessionResponse(stream_id=stream_id, chunk=part))
                    sent = part.offset + len(part.token_ids)
                    await asyncio.sleep(0)  # let other generations interleave (scheduling, not timing)
                    if prompt_of(request) == "hang":
                        await asyncio.Event().wait()  # runs until cancelled
            except asyncio.CancelledError:
                end = inference_pb2.GenerateResponse(
                    request_id=request_id, offset=sent, finish_reason=inference_pb2.FINISH_REASON_CANCELLED
                )
                out.put_nowait(inference_pb2.SessionResponse(stream_id=stream_id, chunk=end))

        async def pump() -> None:
            async for msg in request_iterator:
                action = msg.WhichOneof("action") or ""
                self.session_actions.append((msg.stream_id, action))
                if action == "generate":
                    rid = msg.generate.request.request_id or f"{msg.stream_id}-req"
                    tasks[msg.stream_id] = asyncio.create_task(run(msg.stream_id, rid, msg.generate.request, 0))
                elif action == "resume":
                    original = self.requests[msg.resume.request_id]
                    coro = run(msg.stream_id, msg.resume.request_id, original, msg.resume.offset)
                    tasks[msg.stream_id] = asyncio.create_task(coro)
                elif action == "cancel":
                    tasks[msg.stream_id].cancel()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            out.put_nowait(None)

        pumping = asyncio.create_task(pump())
        try:
            while (resp := await out.get()) is not None:
                yield resp
        finally:
            pumping.cancel()
            for task in tasks.values():
                task.cancel()

    async def SubmitBatch(
        self, request: inference_pb2.SubmitBatchRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SubmitBatchResponse:
        batch = self.batches.setdefault(request.batch_id, {})
        queued = skipped = 0
        for item in request.items:
            if item.seq_id in batch and batch[item.seq_id].state == inference_pb2.ITEM_STATE_SUCCESS:
                skipped += 1
                continue
            queued += 1
            status = inference_pb2.BatchItemStatus(seq_id=item.seq_id, request_id=f"{request.batch_id}/{item.seq_id}")
            if prompt_of(item.request) == "fail":
                status.state, status.error = inference_pb2.ITEM_STATE_FAILED, "worker lost"
            else:
                n = item.request.sampling.max_tokens or DEFAULT_TOKENS
                ids, text = tokens(prompt_of(item.request), n)
                status.state, status.text, status.finish_reason = (
                    inference_pb2.ITEM_STATE_SUCCESS,
                    text,
                    inference_pb2.FINISH_REASON_LENGTH,
                )
                status.token_ids.extend(ids)
                status.usage.CopyFrom(inference_pb2.Usage(prompt_tokens=3, completion_tokens=n))
            batch[item.seq_id] = status
        return inference_pb2.SubmitBatchResponse(batch_id=request.batch_id, queued=queued, skipped=skipped)

    async def GetBatch(
        self, request: inference_pb2.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetBatchResponse:
        if request.batch_id not in self.batches:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"batch {request.batch_id} not found")
        items = [self.batches[request.batch_id][k] for k in sorted(self.batches[request.batch_id])]
        return inference_pb2.GetBatchResponse(batch_id=request.batch_id, items=items)

    async def WatchBatch(
        self, request: inference_pb2.WatchBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.WatchBatchResponse]:
        """Every item first as INIT, then in its final state, like a batch running before one's eyes."""
        if request.batch_id not in self.batches:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"batch {request.batch_id} not found")
        items = [self.batches[request.batch_id][k] for k in sorted(self.batches[request.batch_id])]
        for item in items:
            init = inference_pb2.BatchItemStatus(seq_id=item.seq_id, state=inference_pb2.ITEM_STATE_INIT)
            yield inference_pb2.WatchBatchResponse(item=init)
        for item in items:
            yield inference_pb2.WatchBatchResponse(item=item)


async def serve(
    grpc_server: Callable[..., Awaitable[str]], script: Script | None = None
) -> tuple[str, ScriptedInference]:
    """Start a ScriptedInference with the `grpc_server` fixture: its address and the servicer."""
    servicer = ScriptedInference(script or Script())
    address = await grpc_server(partial(inference_pb2_grpc.add_InferenceServiceServicer_to_server, servicer))
    return address, servicer


def expected(prompt: str = "hi", n: int = DEFAULT_TOKENS) -> tuple[list[int], str]:
    """A whole scripted generation's token ids and text."""
    return tokens(prompt, n)
