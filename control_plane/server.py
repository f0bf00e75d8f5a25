"""The public gRPC edge: InferenceService over the dispatcher. Each RPC is one short method; decisions
live in admission, the dispatcher and the scheduler."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from control_plane.admission import build_spec, streams, tenant_of
from control_plane.config import Settings
from control_plane.dispatcher import Dispatcher
from control_plane.errors import ApiError, invalid
from control_plane.generation import Generation
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)


class InferenceService(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self, dispatcher: Dispatcher, settings: Settings) -> None:
        self.dispatcher = dispatcher
        self.settings = settings

    # -- admission ---------------------------------------------------------------------------------------
    def _start(self, request: inference_pb2.GenerateRequest, tenant: str, prefix: str = "") -> Generation:
        d = self.dispatcher
        assert d.tokenizer is not None and d.limits is not None
        spec = build_spec(request, tenant, d.tokenizer, d.limits, self.settings, prefix=prefix)
        existing = d.generations.get(spec.request_id)
        if existing is not None:
            raise ApiError(grpc.StatusCode.ALREADY_EXISTS, f"request_id {spec.request_id!r} is already in use",
                           "REQUEST_ID_IN_USE")  # fmt: skip
        return d.submit(spec)

    async def _follow(
        self, gen: Generation, offset: int, stream: bool
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        self.dispatcher.attach(gen)
        try:
            async for chunk in gen.follow(offset, stream):
                yield chunk
        finally:
            self.dispatcher.detach(gen)

    # -- RPCs --------------------------------------------------------------------------------------------
    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        try:
            gen = self._start(request, tenant_of(context.invocation_metadata()))
            await context.send_initial_metadata((("x-request-id", gen.request_id),))
            async for chunk in self._follow(gen, 0, streams(request, self.settings)):
                yield chunk
        except ApiError as err:
            await err.abort(context)

    async def Resume(
        self, request: inference_pb2.ResumeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.ResumeResponse]:
        try:
            gen = self._resumable(request.request_id, request.offset, tenant_of(context.invocation_metadata()))
            async for chunk in self._follow(gen, request.offset, True):
                yield inference_pb2.ResumeResponse(chunk=chunk)
        except ApiError as err:
            await err.abort(context)

    def _resumable(self, request_id: str, offset: int, tenant: str) -> Generation:
        if not request_id:
            raise invalid("request_id", "must not be empty")
        gen = self.dispatcher.get(request_id, tenant)
        if offset > len(gen.token_ids):
            raise invalid("offset", f"{offset} is beyond the {len(gen.token_ids)} tokens generated so far")
        return gen

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
            workers=sum(link.connected.is_set() for link in self.dispatcher.links),
        )

    async def Session(
        self, request_iterator: AsyncIterator[inference_pb2.SessionRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.SessionResponse]:
        session = _Session(self, tenant_of(context.invocation_metadata()))
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

    def __init__(self, service: InferenceService, tenant: str) -> None:
        self.service = service
        self.tenant = tenant
        self.outbox: asyncio.Queue[inference_pb2.SessionResponse | None] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.request_ids: dict[str, str] = {}

    async def read(self, requests: AsyncIterator[inference_pb2.SessionRequest]) -> None:
        try:
            async for req in requests:
                self._handle(req)
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        finally:
            self.outbox.put_nowait(None)

    def _handle(self, req: inference_pb2.SessionRequest) -> None:
        sid = req.stream_id
        action = req.WhichOneof("action")
        try:
            if action == "generate":
                if sid in self.tasks and not self.tasks[sid].done():
                    raise invalid("stream_id", f"{sid!r} is already in use on this session")
                gen = self.service._start(req.generate.request, self.tenant, prefix="generate.request.")
                self._spawn(sid, gen, 0, streams(req.generate.request, self.service.settings))
            elif action == "resume":
                gen = self.service._resumable(req.resume.request_id, req.resume.offset, self.tenant)
                self._spawn(sid, gen, req.resume.offset, True)
            elif action == "cancel":
                request_id = self.request_ids.get(sid)
                if request_id is None:
                    raise invalid("stream_id", f"{sid!r} names no generation on this session")
                self.service.dispatcher.cancel(request_id, self.tenant)
            elif action == "ack":
                pass  # offsets are kept per generation; nothing is trimmed before the resume window ends
            else:
                raise invalid("action", "set one of generate, cancel, resume, ack")
        except ApiError as err:
            self._error(sid, err)

    def _spawn(self, sid: str, gen: Generation, offset: int, stream: bool) -> None:
        self.request_ids[sid] = gen.request_id
        self.tasks[sid] = asyncio.create_task(self._pump(sid, gen, offset, stream))

    async def _pump(self, sid: str, gen: Generation, offset: int, stream: bool) -> None:
        try:
            async for chunk in self.service._follow(gen, offset, stream):
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
