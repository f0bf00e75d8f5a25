"""The public gRPC edge: InferenceService. Each RPC is one short method; decisions live in admission,
dedup, the dispatcher and the scheduler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from control_plane.admission import streams, tenant_of
from control_plane.batch_jobs import BatchJobs
from control_plane.config import Settings
from control_plane.dedup import Deduper
from control_plane.dispatcher import Dispatcher
from control_plane.errors import ApiError, invalid
from control_plane.generation import View
from control_plane.telemetry.tracing import current_traceparent
from control_plane.validation import check_idempotency_key
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str | bytes], ...]


def idempotency_key(request: inference_pb2.GenerateRequest, metadata: Metadata | None) -> str:
    key = request.idempotency_key or next((str(v) for k, v in metadata or () if k == "x-idempotency-key"), "")
    check_idempotency_key(key)
    return key


def traceparent_of(metadata: Metadata | None) -> str:
    """The trace context workers link their step spans to: our server span (when tracing is on)."""
    return current_traceparent() or next((str(v) for k, v in metadata or () if k == "traceparent"), "")


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, dispatcher: Dispatcher, deduper: Deduper, settings: Settings) -> None:
        self.dispatcher = dispatcher
        self.deduper = deduper
        self.settings = settings
        self.batches = BatchJobs(deduper)

    async def start(self, request: inference_pb2.GenerateRequest, metadata: Metadata | None, prefix: str = "") -> View:
        return await self.deduper.generate(
            request, tenant_of(metadata), idempotency_key(request, metadata), traceparent_of(metadata), prefix
        )

    async def follow(self, view: View, offset: int, stream: bool) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self.dispatcher.attach(view.gen)
        try:
            async for chunk in view.follow(offset, stream):
                yield chunk
        finally:
            self.dispatcher.detach(view.gen)

    # -- RPCs --------------------------------------------------------------------------------------------
    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            view = await self.start(request, context.invocation_metadata())
            await context.send_initial_metadata((("x-request-id", view.request_id),))
            async for chunk in self.follow(view, 0, streams(request, self.settings)):
                yield chunk
        except ApiError as err:
            await err.abort(context)

    async def Resume(
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.ResumeResponse]:
        try:
            tenant = tenant_of(context.invocation_metadata())
            view = await self.deduper.resume(request.request_id, request.offset, tenant)
            async for chunk in self.follow(view, request.offset, True):
                yield inference_pb2.ResumeResponse(chunk=chunk)
        except ApiError as err:
            await err.abort(context)

    async def Cancel(
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CancelResponse:
        try:
            if not request.request_id:
                raise invalid("request_id", "must not be empty")
            cancelled = self.dispatcher.cancel(request.request_id, tenant_of(context.invocation_metadata()))
            return inference_pb2.CancelResponse(cancelled=cancelled)
        except ApiError as err:
            await err.abort(context)
            raise  # unreachable: abort raises

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        info = self.dispatcher.info
        return inference_pb2.GetModelInfoResponse(
            model=info.model_name,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_context=info.max_context,
            eos_token_ids=info.eos_token_ids,
            kv_cache_dtype=info.kv_cache_dtype,
            workers=sum(link.connected.is_set() for link in self.dispatcher.links),
        )

    async def SubmitBatch(
        self, request: inference_pb2.SubmitBatchRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SubmitBatchResponse:
        try:
            return await self.batches.submit(request, tenant_of(context.invocation_metadata()))
        except ApiError as err:
            await err.abort(context)
            raise

    async def GetBatch(
        self, request: inference_pb2.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetBatchResponse:
        try:
            items = await self.batches.items(request.batch_id, tenant_of(context.invocation_metadata()))
            return inference_pb2.GetBatchResponse(batch_id=request.batch_id, items=items)
        except ApiError as err:
            await err.abort(context)
            raise

    async def WatchBatch(
        self, request: inference_pb2.WatchBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.WatchBatchResponse]:
        try:
            async for item in self.batches.watch(request.batch_id, tenant_of(context.invocation_metadata())):
                yield inference_pb2.WatchBatchResponse(item=item)
        except ApiError as err:
            await err.abort(context)

    async def Session(
        self, request_iterator: AsyncIterator[inference_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.SessionResponse]:
        session = _Session(self, context.invocation_metadata())
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while True:
                message = await session.outbox.get()
                if message is None:
                    return
                yield message
        finally:
            reader.cancel()
            await session.close()


class _Session:
    """Generations multiplexed on one bidi stream, keyed by the caller's stream_id."""

    def __init__(self, service: InferenceService, metadata: Metadata | None) -> None:
        self.service = service
        self.metadata = metadata
        self.tenant = tenant_of(metadata)
        self.outbox: asyncio.Queue[inference_pb2.SessionResponse | None] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.request_ids: dict[str, str] = {}

    async def read(self, requests: AsyncIterator[inference_pb2.SessionRequest]) -> None:
        try:
            async for req in requests:
                await self._handle(req)
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        finally:
            self.outbox.put_nowait(None)

    async def _handle(self, req: inference_pb2.SessionRequest) -> None:
        sid = req.stream_id
        action = req.WhichOneof("action")
        try:
            if action == "generate":
                if sid in self.tasks and not self.tasks[sid].done():
                    raise invalid("stream_id", f"{sid!r} is already in use on this session")
                request = req.generate.request
                view = await self.service.start(request, self.metadata, prefix="generate.request.")
                self._spawn(sid, view, 0, streams(request, self.service.settings))
            elif action == "resume":
                view = await self.service.deduper.resume(req.resume.request_id, req.resume.offset, self.tenant)
                self._spawn(sid, view, req.resume.offset, True)
            elif action == "cancel":
                request_id = self.request_ids.get(sid)
                if request_id is None:
                    raise invalid("stream_id", f"{sid!r} names no generation on this session")
                self.service.dispatcher.cancel(request_id, self.tenant)
            elif action == "ack":
                pass  # the log is kept for the resume window whatever the caller acknowledged
            else:
                raise invalid("action", "set one of generate, cancel, resume, ack")
        except ApiError as err:
            self._error(sid, err)

    def _spawn(self, sid: str, view: View, offset: int, stream: bool) -> None:
        self.request_ids[sid] = view.request_id
        self.tasks[sid] = asyncio.create_task(self._pump(sid, view, offset, stream))

    async def _pump(self, sid: str, view: View, offset: int, stream: bool) -> None:
        try:
            async for chunk in self.service.follow(view, offset, stream):
                self.outbox.put_nowait(inference_pb2.SessionResponse(stream_id=sid, chunk=chunk))
        except ApiError as err:
            self._error(sid, err)

    def _error(self, sid: str, err: ApiError) -> None:
        error = inference_pb2.SessionError(code=err.code.value[0], message=err.message, reason=err.reason)
        self.outbox.put_nowait(inference_pb2.SessionResponse(stream_id=sid, error=error))

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
