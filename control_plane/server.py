"""The public gRPC edge: InferenceService. Each RPC is one short method: admission builds the request record,
dedup decides and acts, the view streams the tokens (docs/architecture.md, "A request's life"; docs/api.md)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from control_plane.admission import Admission, Metadata, idempotency_key, streams
from control_plane.batch_jobs import MAX_ITEMS, BatchJobs
from control_plane.config import Settings
from control_plane.dedup import Dedup
from control_plane.dispatcher import Dispatcher
from control_plane.errors import ApiError, invalid, unauthenticated
from control_plane.generation import View
from control_plane.session import Session
from control_plane.telemetry.tracing import current_traceparent
from control_plane.validation import MAX_KEY_BYTES, MAX_LOGPROBS, MAX_REQUEST_ID_CHARS, MAX_STOP_BYTES
from dedup_service import Store
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc
from security.tokens import Authenticator, Unauthenticated


def traceparent_of(metadata: Metadata | None) -> str:
    """The trace context workers link their step spans to: our server span (when tracing is on)."""
    return current_traceparent() or next((str(v) for k, v in metadata or () if k == "traceparent"), "")


# The server's deadline is the client's plus the time the request took to arrive, so the client's own cancel
# at its deadline lands a little before ours: a call that ends this close to its deadline has expired.
DEADLINE_SLACK_S = 0.5


def deadline_passed(context: grpc.aio.ServicerContext) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= DEADLINE_SLACK_S


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(
        self,
        admission: Admission,
        dedup: Dedup,
        dispatcher: Dispatcher,
        store: Store,
        auth: Authenticator,
        settings: Settings,
    ) -> None:
        self.admission = admission
        self.auth = auth
        self.dedup = dedup
        self.dispatcher = dispatcher
        self.settings = settings
        self.batches = BatchJobs(admission, dedup, store)

    def tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant, from its bearer token (UNAUTHENTICATED without a valid one)."""
        try:
            return self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            raise unauthenticated(str(exc)) from None

    async def start(
        self, request: inference_pb2.GenerateRequest, tenant: str, metadata: Metadata | None, prefix: str = ""
    ) -> View:
        """Admit a GenerateRequest and open the caller's view of it."""
        key = idempotency_key(request, metadata, prefix)
        admitted = self.admission.admit(request, tenant, key, traceparent_of(metadata), prefix)
        return await self.dedup.open(admitted)

    async def follow(
        self, view: View, offset: int, stream: bool, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        """The view's chunks from `offset`, counted as a reader (the resume grace period starts without one).
        A caller whose deadline passed will not come back: its request is cancelled unless it is resumable."""
        self.dispatcher.attach(view.gen)
        try:
            async for chunk in view.follow(offset, stream):
                yield chunk
        finally:
            self.dispatcher.detach(view.gen)
            # Its caller left before it started (it waited in the queue): nobody will read it. Once it has
            # started, the resume grace period applies (docs/api.md, "Resume").
            never_started = not view.gen.admitted and not view.gen.token_ids and view.gen.subscribers == 0
            if (deadline_passed(context) or never_started) and not view.resumable:
                self.dispatcher.cancel_view(view)

    async def resume(self, request_id: str, offset: int, tenant: str, prefix: str = "") -> View:
        return await self.dedup.resume(request_id, offset, tenant, prefix)

    def cancel_view(self, view: View) -> bool:
        return self.dispatcher.cancel_view(view)

    def cancel(self, request_id: str, tenant: str) -> bool:
        if not request_id:
            raise invalid("request_id", "must not be empty")
        return self.dispatcher.cancel(request_id, tenant)

    # -- RPCs --------------------------------------------------------------------------------------------
    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            view = await self.start(request, self.tenant(context), context.invocation_metadata())
            await context.send_initial_metadata((("x-request-id", view.request_id),))
            async for chunk in self.follow(view, 0, streams(request, self.settings), context):
                yield chunk
        except ApiError as err:
            await err.abort(context)

    async def Resume(
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.ResumeResponse]:
        try:
            view = await self.resume(request.request_id, request.offset, self.tenant(context))
            async for chunk in self.follow(view, request.offset, True, context):
                yield inference_pb2.ResumeResponse(chunk=chunk)
        except ApiError as err:
            await err.abort(context)

    async def Cancel(
        self, request: inference_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.CancelResponse:
        try:
            cancelled = self.cancel(request.request_id, self.tenant(context))
            return inference_pb2.CancelResponse(cancelled=cancelled)
        except ApiError as err:
            await err.abort(context)
            raise  # unreachable: abort raises

    async def GetModelInfo(
        self, request: inference_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetModelInfoResponse:
        try:
            self.tenant(context)
        except ApiError as err:
            await err.abort(context)
        info, s = self.dispatcher.info, self.settings
        limits = inference_pb2.RequestLimits(
            max_request_bytes=s.max_request_bytes,
            max_prompt_bytes=self.admission.limits.max_prompt_bytes,
            max_stop_strings=s.max_stop_strings,
            max_stop_bytes=MAX_STOP_BYTES,
            max_logprobs=MAX_LOGPROBS,
            default_max_tokens=s.default_max_tokens,
            max_request_id_chars=MAX_REQUEST_ID_CHARS,
            max_idempotency_key_bytes=MAX_KEY_BYTES,
            max_batch_items=MAX_ITEMS,
            resume_grace_s=s.resume_grace_s,
        )
        return inference_pb2.GetModelInfoResponse(
            model=info.model_name,
            architecture=info.architecture,
            vocab_size=info.vocab_size,
            max_context=info.max_context,
            eos_token_ids=info.eos_token_ids,
            kv_cache_dtype=info.kv_cache_dtype,
            workers=sum(link.connected.is_set() for link in self.dispatcher.links),
            dtype=info.dtype,
            has_chat_template=bool(info.chat_template),
            limits=limits,
        )

    async def SubmitBatch(
        self, request: inference_pb2.SubmitBatchRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.SubmitBatchResponse:
        try:
            return await self.batches.submit(request, self.tenant(context))
        except ApiError as err:
            await err.abort(context)
            raise

    async def GetBatch(
        self, request: inference_pb2.GetBatchRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.GetBatchResponse:
        try:
            items = await self.batches.items(request.batch_id, self.tenant(context))
            return inference_pb2.GetBatchResponse(batch_id=request.batch_id, items=items)
        except ApiError as err:
            await err.abort(context)
            raise

    async def WatchBatch(
        self, request: inference_pb2.WatchBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.WatchBatchResponse]:
        try:
            async for item in self.batches.watch(request.batch_id, self.tenant(context)):
                yield inference_pb2.WatchBatchResponse(item=item)
        except ApiError as err:
            await err.abort(context)

    async def Session(
        self, request_iterator: AsyncIterator[inference_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.SessionResponse]:
        try:
            session = Session(self, self.tenant(context), context)
        except ApiError as err:
            await err.abort(context)
            return
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while (message := await session.outbox.get()) is not None:
                yield message
        finally:
            reader.cancel()
            await session.close()
