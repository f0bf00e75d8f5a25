"""Sessions: many generations multiplexed on one bidirectional `Session` RPC, sync (a reader thread) and
asyncio (a reader task). Responses are routed by stream_id to per-generation queues, so a SessionError
ends only the generation it names; a broken session ends every generation still open on it.

Sessions do not resume by themselves: after a break, `resume(request_id, offset)` on a new session (or
the client's `resume`) continues any generation from the offset its Progress reached.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import grpc

from clients.retry import Progress
from clients.types import (
    Chunk,
    CoalesceError,
    GenerateOptions,
    Metadata,
    Result,
    build_request,
    chunk_from_proto,
    collect,
    error_from_rpc,
    session_error,
)
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

if TYPE_CHECKING:  # typing.Unpack is 3.12+; annotations are never evaluated at run time
    from typing_extensions import Unpack

# What a generation's queue carries: chunks, then None (finished) or the error that ended it.
Item = Chunk | CoalesceError | None
Prompt = str | Sequence[int] | inference_pb2.ChatMessages | inference_pb2.GenerateRequest


G = TypeVar("G", bound="_Stream")


class _Stream:
    """What sync and asyncio session generations share: their state and the handling of one queued item."""

    def __init__(self, session: _SessionBase[Any], stream_id: str, progress: Progress) -> None:
        self.stream_id = stream_id
        self._session = session
        self._progress = progress
        self._done = False

    @property
    def request_id(self) -> str | None:
        return self._progress.request_id

    @property
    def offset(self) -> int:
        """Tokens received so far: what to pass to `resume` after a break."""
        return self._progress.offset

    def cancel(self) -> None:
        """Ask the server to stop this generation; its iterator ends with a "cancelled" chunk."""
        self._session.cancel(self.stream_id)

    def ack(self) -> None:
        self._session.ack(self.stream_id, self._progress.offset)

    def _take(self, item: Item) -> Chunk | None:
        """The chunk to hand out for a queued item (None: read on); marks the end, raises the error."""
        if item is None or isinstance(item, CoalesceError):
            self._done = True
            if item is not None:
                raise item
            return None
        return self._progress.accept(item)


class _SessionBase(ABC, Generic[G]):
    """Stream ids, messages and routing: the part of a session that does no I/O. Subclasses provide
    `_send` (enqueue one request) and `_open` (register a generation)."""

    def __init__(self) -> None:
        self._streams: dict[str, G] = {}
        self._ids = itertools.count(1)
        self._ended: CoalesceError | None = None
        self._closing = False

    @abstractmethod
    def _send(self, msg: inference_pb2.SessionRequest) -> None: ...

    @abstractmethod
    def _open(self, stream_id: str | None, request_id: str | None, offset: int) -> G: ...

    def start(self, prompt: Prompt, *, stream_id: str | None = None, **options: Unpack[GenerateOptions]) -> G:
        """Start a generation (options as `build_request`'s); its chunks come from the returned iterator."""
        request = prompt if isinstance(prompt, inference_pb2.GenerateRequest) else build_request(prompt, **options)
        gen = self._open(stream_id, None, 0)
        self._send(
            inference_pb2.SessionRequest(
                stream_id=gen.stream_id, generate=inference_pb2.SessionGenerate(request=request)
            )
        )
        return gen

    def resume(self, request_id: str, offset: int, *, stream_id: str | None = None) -> G:
        """The rest of any generation from `offset`, on this session."""
        gen = self._open(stream_id, request_id, offset)
        resume = inference_pb2.SessionResume(request_id=request_id, offset=offset)
        self._send(inference_pb2.SessionRequest(stream_id=gen.stream_id, resume=resume))
        return gen

    def cancel(self, stream_id: str) -> None:
        self._send(inference_pb2.SessionRequest(stream_id=stream_id, cancel=inference_pb2.SessionCancel()))

    def ack(self, stream_id: str, offset: int) -> None:
        self._send(inference_pb2.SessionRequest(stream_id=stream_id, ack=inference_pb2.SessionAck(offset=offset)))

    def _new_id(self, stream_id: str | None) -> str:
        if stream_id is None:
            stream_id = next(sid for sid in map(str, self._ids) if sid not in self._streams)
        if stream_id in self._streams:
            raise ValueError(f"stream id {stream_id!r} is already open on this session")
        return stream_id

    def _route(self, resp: inference_pb2.SessionResponse) -> list[tuple[G, Item]]:
        """What to queue, and where, for one response; nothing for an unknown or already ended stream."""
        gen = self._streams.get(resp.stream_id)
        if gen is None:
            return []
        if resp.HasField("error"):
            if resp.error.generation_continues:  # only a message was refused (we send none that can be)
                return []
            del self._streams[resp.stream_id]
            return [(gen, session_error(resp.error))]
        chunk = chunk_from_proto(resp.chunk)
        if chunk.finish_reason is None:
            return [(gen, chunk)]
        del self._streams[resp.stream_id]
        return [(gen, chunk), (gen, None)]

    def _end(self, exc: BaseException | None) -> list[G]:
        """Record why the session ended; the generations still open, to be told."""
        if self._closing:
            self._ended = CoalesceError(
                grpc.StatusCode.CANCELLED, "the session was closed before this generation finished"
            )
        elif isinstance(exc, grpc.RpcError):
            self._ended = error_from_rpc(exc)
        else:
            self._ended = CoalesceError(
                grpc.StatusCode.UNAVAILABLE, "the session ended before this generation finished"
            )
        open_gens, self._streams = list(self._streams.values()), {}
        return open_gens

    @staticmethod
    def _progress(request_id: str | None, offset: int) -> Progress:
        progress = Progress()
        progress.request_id, progress.offset = request_id, offset
        return progress


class SessionGeneration(_Stream):
    """One generation on a Session: an iterator of Chunks; a SessionError is raised from here only."""

    def __init__(self, session: Session, stream_id: str, progress: Progress) -> None:
        super().__init__(session, stream_id, progress)
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        while not self._done:
            chunk = self._take(self._queue.get())
            if chunk is not None:
                return chunk
        raise StopIteration

    def result(self) -> Result:
        return collect(self)


class Session(_SessionBase[SessionGeneration]):
    """A sync session; requests go through a queue that gRPC's sender thread drains."""

    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub, metadata: Metadata) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[inference_pb2.SessionRequest | None] = queue.SimpleQueue()
        self._call = stub.Session(iter(self._outbox.get, None), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name="coalesce-session", daemon=True)
        self._reader.start()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the session; generations still open raise CANCELLED (they stay resumable on the server)."""
        self._closing = True
        self._outbox.put(None)
        self._call.cancel()
        self._reader.join(timeout=10)

    def _send(self, msg: inference_pb2.SessionRequest) -> None:
        self._outbox.put(msg)

    def _open(self, stream_id: str | None, request_id: str | None, offset: int) -> SessionGeneration:
        with self._lock:
            gen = SessionGeneration(self, self._new_id(stream_id), self._progress(request_id, offset))
            if self._ended is not None:
                gen._queue.put(self._ended)
            else:
                self._streams[gen.stream_id] = gen
        return gen

    def _read(self) -> None:
        exc: BaseException | None = None
        try:
            for resp in self._call:
                with self._lock:
                    routed = self._route(resp)
                for gen, item in routed:
                    gen._queue.put(item)
        except grpc.RpcError as e:
            exc = e
        with self._lock:
            open_gens = self._end(exc)
        for gen in open_gens:
            gen._queue.put(self._ended)


class AsyncSessionGeneration(_Stream):
    """One generation on an AsyncSession: an async iterator of Chunks."""

    def __init__(self, session: AsyncSession, stream_id: str, progress: Progress) -> None:
        super().__init__(session, stream_id, progress)
        self._queue: asyncio.Queue[Item] = asyncio.Queue()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        while not self._done:
            chunk = self._take(await self._queue.get())
            if chunk is not None:
                return chunk
        raise StopAsyncIteration

    async def result(self) -> Result:
        return collect([chunk async for chunk in self])


class AsyncSession(_SessionBase[AsyncSessionGeneration]):
    """An asyncio session. start/resume/cancel/ack only enqueue, so they are plain methods; create it
    inside the running loop (it starts a reader task)."""

    def __init__(self, stub: inference_pb2_grpc.InferenceServiceStub, metadata: Metadata) -> None:
        super().__init__()
        self._outbox: asyncio.Queue[inference_pb2.SessionRequest | None] = asyncio.Queue()
        self._call = stub.Session(self._requests(), metadata=metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def __aenter__(self) -> AsyncSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """End the session; generations still open raise CANCELLED (they stay resumable on the server)."""
        self._closing = True
        self._outbox.put_nowait(None)
        self._call.cancel()
        await self._reader

    def _send(self, msg: inference_pb2.SessionRequest) -> None:
        self._outbox.put_nowait(msg)

    def _open(self, stream_id: str | None, request_id: str | None, offset: int) -> AsyncSessionGeneration:
        gen = AsyncSessionGeneration(self, self._new_id(stream_id), self._progress(request_id, offset))
        if self._ended is not None:
            gen._queue.put_nowait(self._ended)
        else:
            self._streams[gen.stream_id] = gen
        return gen

    async def _requests(self) -> AsyncIterator[inference_pb2.SessionRequest]:
        while (msg := await self._outbox.get()) is not None:
            yield msg

    async def _read(self) -> None:
        exc: BaseException | None = None
        try:
            async for resp in self._call:
                for gen, item in self._route(resp):
                    gen._queue.put_nowait(item)
        except grpc.RpcError as e:
            exc = e
        except asyncio.CancelledError:
            if not self._closing:  # our own close cancels the call; anything else is a real cancellation
                raise
        for gen in self._end(exc):
            gen._queue.put_nowait(self._ended)
