"""A Session: many generations multiplexed on one bidi stream, keyed by the caller's stream_id. Its errors
carry the unary errors' google.rpc details (docs/api.md, "Sessions").

Memory is bounded whatever the caller does: at most `session_max_streams` streams open at once, and at most
`session_buffer` messages waiting for a caller that reads slowly. When the buffer is full, the streams pause
(their tokens stay in the generation's log, sent as one merged chunk later) and the session stops reading
the caller's requests, so gRPC's flow control pushes back on the caller. A stream is forgotten when it ends
but for the count of tokens it sent (for acks), kept for the last ENDED_KEPT streams.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from control_plane.admission import KEY_HEADER, Metadata, streams
from control_plane.cancel import cancel_all
from control_plane.config import Settings
from control_plane.errors import ApiError, exhausted, invalid, out_of_range, stream_id_in_use, stream_not_found
from control_plane.generation import View
from protos.coalesce.v1 import inference_pb2
from rpc.malformed import Malformed

ENDED_KEPT = 4096


class Service(Protocol):
    """What a Session uses of the InferenceService: the same paths as the unary RPCs."""

    settings: Settings

    async def start(
        self, request: inference_pb2.GenerateRequest, tenant: str, metadata: Metadata | None, prefix: str
    ) -> View: ...

    def follow(
        self, view: View, offset: int, stream: bool, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]: ...

    async def resume(self, request_id: str, offset: int, tenant: str, prefix: str) -> View: ...

    def cancel_view(self, view: View) -> bool: ...


class Session:
    def __init__(self, service: Service, tenant: str, context: grpc.aio.ServicerContext) -> None:
        self.service = service
        self.tenant = tenant
        self.context = context
        self.metadata = context.invocation_metadata()
        if any(k == KEY_HEADER for k, _ in self.metadata or ()):  # one call, many generations: one key cannot do
            raise invalid(KEY_HEADER, "not allowed on a Session call; set generate.request.idempotency_key")
        self.outbox: asyncio.Queue[inference_pb2.SessionResponse | None] = asyncio.Queue(
            service.settings.session_buffer
        )
        self.tasks: dict[str, asyncio.Task[None]] = {}  # open streams, by stream_id
        self.views: dict[str, View] = {}
        # Completion tokens sent per stream_id (what an ack may acknowledge), for the last ENDED_KEPT streams.
        self.sent: OrderedDict[str, int] = OrderedDict()

    async def read(self, requests: AsyncIterator[inference_pb2.SessionRequest | Malformed]) -> None:
        try:
            async for req in requests:
                await self._handle(req)
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        finally:
            task = asyncio.current_task()
            if task is None or not task.cancelling():  # cancelled: the caller is gone, nobody reads on
                await self.outbox.put(None)

    def _running(self, sid: str) -> bool:
        return sid in self.tasks and not self.tasks[sid].done()

    async def _handle(self, req: inference_pb2.SessionRequest | Malformed) -> None:
        """One message; a refused one gets an error under its stream_id and changes nothing else."""
        if isinstance(req, Malformed):  # that message is refused; the session and its streams go on
            await self._error("", ApiError(grpc.StatusCode.INVALID_ARGUMENT, req.error, "MALFORMED_MESSAGE"), False)
            return
        sid = req.stream_id
        action = req.WhichOneof("action")
        try:
            if not sid:
                raise invalid("stream_id", "must not be empty")
            if action in ("generate", "resume"):
                if self._running(sid):
                    raise stream_id_in_use(sid, action)
                self._check_room()
            if action == "generate":
                request = req.generate.request
                view = await self.service.start(request, self.tenant, self.metadata, prefix="generate.request.")
                self._spawn(sid, view, 0, streams(request, self.service.settings))
            elif action == "resume":
                view = await self.service.resume(req.resume.request_id, req.resume.offset, self.tenant, "resume.")
                self._spawn(sid, view, req.resume.offset, True)
            elif action == "cancel":
                if sid not in self.views:
                    raise stream_not_found(sid)
                self.service.cancel_view(self.views[sid])
            elif action == "ack":  # the log is kept for the resume window whatever the caller acknowledged
                if sid not in self.sent:
                    raise stream_not_found(sid)
                if req.ack.offset > self.sent[sid]:
                    raise out_of_range("ack.offset", f"{req.ack.offset} is beyond the {self.sent[sid]} tokens sent "
                                       "on this stream")  # fmt: skip
            else:
                raise invalid("action", "set one of generate, cancel, resume, ack")
        except ApiError as err:
            await self._error(sid, err, continues=self._running(sid))

    def _check_room(self) -> None:
        limit = self.service.settings.session_max_streams
        if len(self.tasks) >= limit:
            raise exhausted(f"{len(self.tasks)} streams are open on this session; at most {limit}", 1.0,
                            reason="STREAM_LIMIT")  # fmt: skip

    def _spawn(self, sid: str, view: View, offset: int, stream: bool) -> None:
        self.views[sid] = view
        self.sent[sid] = offset
        self.sent.move_to_end(sid)
        while len(self.sent) > ENDED_KEPT + len(self.tasks):
            self.sent.popitem(last=False)
        self.tasks[sid] = asyncio.create_task(self._pump(sid, view, offset, stream))

    async def _pump(self, sid: str, view: View, offset: int, stream: bool) -> None:
        try:
            async for chunk in self.service.follow(view, offset, stream, self.context):
                self.sent[sid] = chunk.offset + len(chunk.token_ids)
                await self.outbox.put(inference_pb2.SessionResponse(stream_id=sid, chunk=chunk))
        except ApiError as err:
            await self._error(sid, err, continues=False)
        finally:  # an ended stream is forgotten (but for its count of tokens sent): the session stays bounded
            self.tasks.pop(sid, None)
            self.views.pop(sid, None)

    async def _error(self, sid: str, err: ApiError, continues: bool) -> None:
        """`continues`: only the message was refused; the generation under `sid` goes on."""
        error = inference_pb2.SessionError(
            code=err.code.value[0],
            message=err.message,
            reason=err.reason,
            details=err.details(),
            generation_continues=continues,
        )
        await self.outbox.put(inference_pb2.SessionResponse(stream_id=sid, error=error))

    async def close(self) -> None:
        await cancel_all(self.tasks.values())
