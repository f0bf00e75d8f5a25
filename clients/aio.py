"""The asyncio Coalesce client: the same API and policy as `clients.client`, with awaitables.

    async with AsyncCoalesceClient("127.0.0.1:50051") as client:
        async for chunk in client.generate("Hello", max_tokens=32):
            print(chunk.text, end="", flush=True)

Create it inside the running event loop (grpc.aio channels belong to the loop they were made in).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from clients.retry import ABANDON_TIMEOUT_S, Progress, RetryPolicy, next_delay, stream_broken
from clients.session import AsyncSession
from clients.types import (
    CHANNEL_OPTIONS,
    Chunk,
    CoalesceError,
    GenerateOptions,
    Message,
    Metadata,
    Result,
    Tls,
    batch_items,
    build_request,
    call_metadata,
    chat_messages,
    chunk_from_proto,
    collect,
    deadline_of,
    default_token,
    error_from_rpc,
    time_left,
    with_key,
)
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

if TYPE_CHECKING:  # typing.Unpack is 3.12+; annotations are never evaluated at run time
    from typing_extensions import Unpack


class AsyncGeneration:
    """An async iterator of Chunks with the sync Generation's resume and deadline behaviour."""

    def __init__(
        self,
        client: AsyncCoalesceClient,
        request: inference_pb2.GenerateRequest,
        resume_from: int | None,
        timeout: float | None = None,
        own_key: bool = False,
    ):
        self.request = request
        self._client = client
        self._deadline = deadline_of(timeout)
        self._own_key = own_key
        self._progress = Progress()
        if resume_from is not None:
            self._progress.request_id, self._progress.offset = request.request_id, resume_from
        self._chunks = self._run()

    @property
    def request_id(self) -> str | None:
        return self._progress.request_id

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        return await anext(self._chunks)

    async def result(self) -> Result:
        return collect([chunk async for chunk in self])

    async def aclose(self) -> None:
        """Stop reading; the server keeps generating for its resume grace period."""
        await self._chunks.aclose()

    async def cancel(self) -> bool:
        await self.aclose()
        return await self._client.cancel(self.request_id) if self.request_id else False

    async def _run(self) -> AsyncGenerator[Chunk, None]:
        client, progress, attempt = self._client, self._progress, 0
        while True:
            resume = progress.resume_request()
            timeout = time_left(self._deadline)
            if resume is None:
                call: Any = client._stub.Generate(
                    self.request, metadata=client._metadata(self.request), timeout=timeout
                )
            else:
                call = client._stub.Resume(resume, metadata=client._metadata(), timeout=timeout)
            try:
                async for msg in call:
                    chunk = progress.accept(chunk_from_proto(msg if resume is None else msg.chunk))
                    if chunk is None:
                        continue
                    attempt = 0
                    yield chunk
                    if progress.finished:
                        return
                err = stream_broken()
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            finally:
                call.cancel()
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                await self._abandon()
            attempt = await client._backoff(attempt, err)

    async def _abandon(self) -> None:
        """Our deadline passed and we will not come back: free the work our own key kept resumable."""
        request_id = self._progress.request_id or self.request.request_id
        if self._own_key and request_id:
            request = inference_pb2.CancelRequest(request_id=request_id)
            with contextlib.suppress(grpc.RpcError):
                await self._client._stub.Cancel(request, metadata=self._client._metadata(), timeout=ABANDON_TIMEOUT_S)


class AsyncCoalesceClient:
    """An asyncio channel to a control plane; `retry=NO_RETRY` turns retries and resume off."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        tls: Tls | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.address = address
        self.retry = retry or RetryPolicy()
        self._token = token if token is not None else default_token()
        self._timeout = timeout
        self._sleep = sleep
        self._channel = (
            grpc.aio.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS)
            if tls is not None
            else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        )
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    async def __aenter__(self) -> AsyncCoalesceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _metadata(self, request: inference_pb2.GenerateRequest | None = None) -> Metadata:
        return call_metadata(self._token, request.idempotency_key if request is not None else "")

    def generate(
        self,
        prompt: str | Sequence[int] | inference_pb2.ChatMessages | inference_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> AsyncGeneration:
        """Start a generation (options as `build_request`'s, `timeout` as the sync client's); nothing is sent
        until it is iterated."""
        request = prompt if isinstance(prompt, inference_pb2.GenerateRequest) else build_request(prompt, **options)
        keyed = with_key(request, self.retry.enabled)
        own_key = keyed.idempotency_key != request.idempotency_key and not request.resumable
        return AsyncGeneration(self, keyed, resume_from=None, timeout=timeout, own_key=own_key)

    def chat(self, messages: Iterable[Message], **options: Unpack[GenerateOptions]) -> AsyncGeneration:
        """A reply to a conversation ({"role": "user", "content": "..."} dicts or (role, content) pairs), rendered by
        the server through the model's chat template; it stops at the model's end-of-turn token."""
        return self.generate(chat_messages(messages), **options)

    def resume(self, request_id: str, offset: int) -> AsyncGeneration:
        return AsyncGeneration(self, inference_pb2.GenerateRequest(request_id=request_id), resume_from=offset)

    def session(self) -> AsyncSession:
        return AsyncSession(self._stub, self._metadata())

    async def cancel(self, request_id: str) -> bool:
        response = await self._unary(self._stub.Cancel, inference_pb2.CancelRequest(request_id=request_id))
        return bool(response.cancelled)

    async def model_info(self) -> inference_pb2.GetModelInfoResponse:
        response: inference_pb2.GetModelInfoResponse = await self._unary(
            self._stub.GetModelInfo, inference_pb2.GetModelInfoRequest()
        )
        return response

    async def submit_batch(
        self, batch_id: str, items: Iterable[inference_pb2.BatchItem | tuple[str, inference_pb2.GenerateRequest]]
    ) -> inference_pb2.SubmitBatchResponse:
        request = inference_pb2.SubmitBatchRequest(batch_id=batch_id, items=batch_items(items))
        response: inference_pb2.SubmitBatchResponse = await self._unary(self._stub.SubmitBatch, request)
        return response

    async def get_batch(self, batch_id: str) -> list[inference_pb2.BatchItemStatus]:
        response = await self._unary(self._stub.GetBatch, inference_pb2.GetBatchRequest(batch_id=batch_id))
        return list(response.items)

    async def watch_batch(self, batch_id: str) -> AsyncIterator[inference_pb2.BatchItemStatus]:
        """Item states as they change until every item has ended; reconnects after a break."""
        attempt = 0
        while True:
            call: Any = self._stub.WatchBatch(
                inference_pb2.WatchBatchRequest(batch_id=batch_id), metadata=self._metadata()
            )
            try:
                async for msg in call:
                    attempt = 0
                    yield msg.item
                return
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            finally:
                call.cancel()
            attempt = await self._backoff(attempt, err)

    async def _unary(self, rpc: Callable[..., Any], request: Any) -> Any:
        attempt = 0
        while True:
            try:
                return await rpc(request, metadata=self._metadata(), timeout=self._timeout)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            attempt = await self._backoff(attempt, err)

    async def _backoff(self, attempt: int, err: CoalesceError) -> int:
        delay = next_delay(self.retry, attempt, err)
        if delay is None:
            raise err
        await self._sleep(delay)
        return attempt + 1
