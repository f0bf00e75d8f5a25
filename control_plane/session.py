"""A Session: many generations multiplexed on one bidi stream, keyed by the caller's stream_id.

Memory is bounded whatever the caller does: at most `session_max_streams` streams open at once, and at most
`session_buffer` messages waiting for a caller that reads slowly. When the buffer is full, the streams pause
(their tokens stay in the generation's log, sent as one merged chunk later) and the session stops reading
the caller's requests, so gRPC's flow control pushes back on the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import grpc

from control_plane.admission import Metadata, streams
from control_plane.config import Settings
from control_plane.errors import ApiError, exhausted, invalid
from control_plane.generation import View
from protos.coalesce.v1 import inference_pb2
from security.malformed import Malformed


class Service(Protocol):
    """What a Session uses of the InferenceService: the same paths as the unary RPCs."""

    settings: Settings

    async def start(
        self, request: inference_pb2.GenerateRequest, tenant: str, metadata: Metadata | None, prefix: str
    ) -> View: ...

    def follow(self, view: View, offset: int, stream: bool) -> AsyncIterator[inference_pb2.GenerateResponse]: ...

    async def resume(self, request_id: str, offset: int, tenant: str) -> View: ...

    def cancel(self, request_id: str, tenant: str) -> bool: ...


class Session:
    def __init__(self, service: Service, tenant: str, metadata: Metadata | None) -> None:
        self.service = service
        self.tenant = tenant
        self.metadata = metadata
        self.outbox: asyncio.Queue[inference_pb2.SessionResponse | None] = asyncio.Queue(
            service.settings.session_buffer
        )
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.request_ids: dict[str, str] = {}

    async def read(self, requests: AsyncIterator[inference_pb2.SessionRequest]) -> None:
        try:
            async for req in requests:
                await self._handle(req)
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        finally:
            task = asyncio.current_task()
            if task is None or not task.cancelling():  # cancelled: the caller is gone, nobody reads on
                await self.outbox.put(None)

    async def _handle(self, req: inference_pb2.SessionRequest | Malformed) -> None:
        if isinstance(req, Malformed):  # that message is refused; the session and its streams go on
            await self._error("", ApiError(grpc.StatusCode.INVALID_ARGUMENT, req.error, "MALFORMED_MESSAGE"))
            return
        sid = req.stream_id
        action = req.WhichOneof("action")
        try:
            if action in ("generate", "resume"):
                self._check_room(sid)
            if action == "generate":
                if sid in self.tasks and not self.tasks[sid].done():
                    raise invalid("stream_id", f"{sid!r} is already in use on this session")
                request = req.generate.request
                view = await self.service.start(request, self.tenant, self.metadata, prefix="generate.request.")
                self._spawn(sid, view, 0, streams(request, self.service.settings))
            elif action == "resume":
                view = await self.service.resume(req.resume.request_id, req.resume.offset, self.tenant)
                self._spawn(sid, view, req.resume.offset, True)
            elif action == "cancel":
                request_id = self.request_ids.get(sid)
                if request_id is None:
                    raise invalid("stream_id", f"{sid!r} names no generation on this session")
                self.service.cancel(request_id, self.tenant)
            elif action == "ack":
                pass  # the log is kept for the resume window whatever the caller acknowledged
            else:
                raise invalid("action", "set one of generate, cancel, resume, ack")
        except ApiError as err:
            await self._error(sid, err)

    def _check_room(self, sid: str) -> None:
        open_streams = sum(not task.done() for task in self.tasks.values())
        if open_streams >= self.service.settings.session_max_streams:
            raise exhausted(f"{open_streams} streams are open on this session; at most "
                            f"{self.service.settings.session_max_streams}", 1.0, reason="STREAM_LIMIT")  # fmt: skip

    def _spawn(self, sid: str, view: View, offset: int, stream: bool) -> None:
        self.request_ids[sid] = view.request_id
        self.tasks[sid] = asyncio.create_task(self._pump(sid, view, offset, stream))

    async def _pump(self, sid: str, view: View, offset: int, stream: bool) -> None:
        try:
            async for chunk in self.service.follow(view, offset, stream):
                await self.outbox.put(inference_pb2.SessionResponse(stream_id=sid, chunk=chunk))
        except ApiError as err:
            await self._error(sid, err)

    async def _error(self, sid: str, err: ApiError) -> None:
        error = inference_pb2.SessionError(code=err.code.value[0], message=err.message, reason=err.reason)
        await self.outbox.put(inference_pb2.SessionResponse(stream_id=sid, error=error))

    async def close(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
