"""The internal token: a shared secret the control plane presents to its workers, so that a worker serves
only its control plane (with or without mTLS). `coalesce serve` makes a fresh one per run for the workers it
spawns (passed in their environment, never on a command line)."""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from security.tokens import bearer

TOKEN_ENV = "COALESCE_INTERNAL_TOKEN"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """What the control plane sends with each call to a worker."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class RequireToken(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls to `services` without the token; other services (health, reflection) pass."""

    def __init__(self, token: str, services: tuple[str, ...]) -> None:
        self.token = token.encode()
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        presented = bearer(tuple(details.invocation_metadata or ())) or ""
        if hmac.compare_digest(presented.encode(), self.token):
            return handler
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "this worker serves only its control plane: the internal token is missing or wrong"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover  (makes this an async generator, as streaming handlers are)

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary, **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
