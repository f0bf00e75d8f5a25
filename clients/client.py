"""The synchronous Coalesce client: generations that resume by themselves, sessions, cancel, batches.

with CoalesceClient("127.0.0.1:50051", token="team-a") as client:
    for chunk in client.generate("Hello", max_tokens=32):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from clients.retry import ABANDON_TIMEOUT_S, Progress, RetryPolicy, next_delay, stream_broken
from clients.session import Session
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

T = TypeVar("T")
ITEM_ENDED = (inference_pb2.ITEM_STATE_SUCCESS, inference_pb2.ITEM_STATE_FAILED)


class Generation:
    """An iterator of Chunks that hides stream breaks: before the first chunk it resends Generate with the
    same idempotency key, after it it calls Resume from the number of tokens received. A `timeout` is the
    deadline of the whole generation, retries and resumes included."""

    def __init__(
        self,
        client: CoalesceClient,
        request: inference_pb2.GenerateRequest,
        resume_from: int | None,
        timeout: float | None = None,
        own_key: bool = False,
    ):
        self.request = request
        self._client = client
        self._deadline = deadline_of(timeout)
        self._own_key = own_key  # the key is ours (for retries), not the caller's wish to resume later
        self._progress = Progress()
        if resume_from is not None:  # a Generation made by `client.resume` starts in the resume state
            self._progress.request_id, self._progress.offset = request.request_id, resume_from
        self._chunks = self._run()

    @property
    def request_id(self) -> str | None:
        return self._progress.request_id

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def result(self) -> Result:
        """Everything (left) of the generation, collected."""
        return collect(self)

    def close(self) -> None:
        """Stop reading. The server keeps generating for its resume grace period; see `cancel`."""
        self._chunks.close()

    def cancel(self) -> bool:
        """Stop the generation on the server (frees its KV blocks) and stop reading."""
        self.close()
        return self._client.cancel(self.request_id) if self.request_id else False

    def _run(self) -> Generator[Chunk, None, None]:
        client, progress, attempt = self._client, self._progress, 0
        while True:
            resume = progress.resume_request()
            timeout = time_left(self._deadline)
            try:
                if resume is None:
                    call = client._stub.Generate(self.request, metadata=client._metadata(self.request), timeout=timeout)
                else:
                    call = client._stub.Resume(resume, metadata=client._metadata(), timeout=timeout)
                try:
                    for msg in call:
                        chunk = progress.accept(chunk_from_proto(msg if resume is None else msg.chunk))
                        if chunk is None:
                            continue
                        attempt = 0
                        yield chunk
                        if progress.finished:
                            return
                finally:
                    call.cancel()  # no-op when done; frees the RPC when the caller stops early
                err = stream_broken()
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._abandon()
            attempt = client._backoff(attempt, err)

    def _abandon(self) -> None:
        """Our deadline passed and we will not come back: free the work our own key kept resumable."""
        request_id = self._progress.request_id or self.request.request_id
        if self._own_key and request_id:
            request = inference_pb2.CancelRequest(request_id=request_id)
            with contextlib.suppress(grpc.RpcError):
                self._client._stub.Cancel(request, metadata=self._client._metadata(), timeout=ABANDON_TIMEOUT_S)


class CoalesceClient:
    """A channel to a control plane. Thread-safe; share one per process. `retry=NO_RETRY` turns retries,
    automatic resume and the automatic idempotency key off."""

    def __init__(
        self,
        address: str,
        token: str | None = None,
        *,
        tls: Tls | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.address = address
        self.retry = retry or RetryPolicy()
        self._token = token if token is not None else default_token()
        self._timeout = timeout  # for unary calls; streams last as long as the generation
        self._sleep = sleep
        self._channel = (
            grpc.secure_channel(address, tls.credentials(), options=CHANNEL_OPTIONS)
            if tls is not None
            else grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        )
        self._stub = inference_pb2_grpc.InferenceServiceStub(self._channel)

    def __enter__(self) -> CoalesceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _metadata(self, request: inference_pb2.GenerateRequest | None = None) -> Metadata:
        return call_metadata(self._token, request.idempotency_key if request is not None else "")

    def generate(
        self,
        prompt: str | Sequence[int] | inference_pb2.ChatMessages | inference_pb2.GenerateRequest,
        *,
        timeout: float | None = None,
        **options: Unpack[GenerateOptions],
    ) -> Generation:
        """Start a generation; options are `build_request`'s (max_tokens, temperature, seed, stop, pool,
        stream, idempotency_key, request_id, dedup, model, ...). Nothing is sent until the first chunk is read.
        `timeout`: seconds for the whole generation; past it DEADLINE_EXCEEDED is raised and the server stops
        the work unless the caller gave a key or asked for `resumable` (docs/api.md, "Deadlines")."""
        request = prompt if isinstance(prompt, inference_pb2.GenerateRequest) else build_request(prompt, **options)
        keyed = with_key(request, self.retry.enabled)
        own_key = keyed.idempotency_key != request.idempotency_key and not request.resumable
        return Generation(self, keyed, resume_from=None, timeout=timeout, own_key=own_key)

    def chat(self, messages: Iterable[Message], **options: Unpack[GenerateOptions]) -> Generation:
        """A reply to a conversation ({"role": "user", "content": "..."} dicts or (role, content) pairs), rendered by
        the server through the model's chat template; it stops at the model's end-of-turn token."""
        return self.generate(chat_messages(messages), **options)

    def resume(self, request_id: str, offset: int) -> Generation:
        """The rest of a generation from `offset` (itself resumed again if its stream breaks)."""
        return Generation(self, inference_pb2.GenerateRequest(request_id=request_id), resume_from=offset)

    def session(self) -> Session:
        """A bidirectional Session stream multiplexing many generations; close it (or use `with`)."""
        return Session(self._stub, self._metadata())

    def cancel(self, request_id: str) -> bool:
        """Cancel a generation; False when it had already finished."""
        return self._unary(self._stub.Cancel, inference_pb2.CancelRequest(request_id=request_id)).cancelled

    def model_info(self) -> inference_pb2.GetModelInfoResponse:
        return self._unary(self._stub.GetModelInfo, inference_pb2.GetModelInfoRequest())

    def submit_batch(
        self, batch_id: str, items: Iterable[inference_pb2.BatchItem | tuple[str, inference_pb2.GenerateRequest]]
    ) -> inference_pb2.SubmitBatchResponse:
        """Submit (or resubmit: items that succeeded are skipped) a batch job; items are BatchItems or
        (seq_id, GenerateRequest) pairs."""
        request = inference_pb2.SubmitBatchRequest(batch_id=batch_id, items=batch_items(items))
        return self._unary(self._stub.SubmitBatch, request)

    def get_batch(self, batch_id: str) -> list[inference_pb2.BatchItemStatus]:
        return list(self._unary(self._stub.GetBatch, inference_pb2.GetBatchRequest(batch_id=batch_id)).items)

    def watch_batch(self, batch_id: str) -> Iterator[inference_pb2.BatchItemStatus]:
        """Item states as they change until every item has ended; reconnects after a break (the server
        starts each watch with every item's current state, so nothing is missed)."""
        attempt = 0
        while True:
            call = self._stub.WatchBatch(inference_pb2.WatchBatchRequest(batch_id=batch_id), metadata=self._metadata())
            try:
                for msg in call:
                    attempt = 0
                    yield msg.item
                return
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            finally:
                call.cancel()
            attempt = self._backoff(attempt, err)

    def _unary(self, rpc: Callable[..., T], request: Any) -> T:
        """A unary call, retried per the policy: every unary RPC here is safe to repeat."""
        attempt = 0
        while True:
            try:
                return rpc(request, metadata=self._metadata(), timeout=self._timeout)
            except grpc.RpcError as exc:
                err = error_from_rpc(exc)
            attempt = self._backoff(attempt, err)

    def _backoff(self, attempt: int, err: CoalesceError) -> int:
        """Sleep before the next attempt, or raise `err` when the policy gives up."""
        delay = next_delay(self.retry, attempt, err)
        if delay is None:
            raise err
        self._sleep(delay)
        return attempt + 1
