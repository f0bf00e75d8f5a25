"""Requests that do not parse: INVALID_ARGUMENT naming the message type, instead of grpc's UNKNOWN
"Unexpected DecodeError" (and a traceback in the log). A unary request that does not parse ends its call;
on a request stream the handler receives a `Malformed` in place of the message and decides what must end
(a Session answers that one message with an error and goes on)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True, slots=True)
class Malformed:
    """A request message that did not parse, and why."""

    error: str


def _tolerant(deserialize: Callable[[bytes], Any], type_name: str) -> Callable[[bytes], Any]:
    def run(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, invalid UTF-8 in a string field, ...
            return Malformed(f"the message is not a valid {type_name}: {exc}")

    return run


class TolerantDecoding(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        message_class = getattr(handler.request_deserializer, "__self__", None)  # FromString's class
        kind = getattr(getattr(message_class, "DESCRIPTOR", None), "full_name", "request message")
        kwargs = {
            "request_deserializer": _tolerant(handler.request_deserializer, kind),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_unary(handler.unary_unary), **kwargs)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_streaming(handler.unary_stream), **kwargs)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(handler.stream_unary, **kwargs)
        return grpc.stream_stream_rpc_method_handler(handler.stream_stream, **kwargs)


def _unary(behavior: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        return await behavior(request, context)

    return run


def _streaming(behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
    async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if isinstance(request, Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.error)
        async for message in behavior(request, context):
            yield message

    return run
