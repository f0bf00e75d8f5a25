"""Tracing setup and the gRPC server span.

Tracing is on only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set: then a TracerProvider with a batching OTLP gRPC
exporter is installed, and `TracingInterceptor` opens one SERVER span per InferenceService call, continuing
the caller's W3C trace context from gRPC metadata. With it unset nothing is installed: the interceptor is
not added and `current_traceparent()` returns "" after one cheap check.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

TRACER_NAME = "coalesce.control_plane"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACED_SERVICE = "coalesce.v1.InferenceService"

_provider: TracerProvider | None = None
# monotonic -> epoch offset, taken once so every span time converted from the dispatcher's clock agrees.
_EPOCH_OFFSET_NS = time.time_ns() - time.monotonic_ns()


def setup_tracing(service_name: str = "coalesce-control-plane") -> TracerProvider | None:
    """Install the OTLP-exporting provider when the endpoint is configured (call after spawning workers)."""
    global _provider
    if not os.environ.get(ENDPOINT_ENV):
        return None
    if _provider is None:
        # Imported here: the exporter pulls in a gRPC channel we do not want to build when tracing is off.
        from control_plane.telemetry.otlp import LeanSpanExporter

        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
        _provider = TracerProvider(resource=resource)
        _provider.add_span_processor(BatchSpanProcessor(LeanSpanExporter()))
        trace.set_tracer_provider(_provider)
    return _provider


def shutdown_tracing() -> None:
    """Flush and stop the exporter (spans still buffered are sent)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def epoch_ns(monotonic_s: float) -> int:
    """A `time.monotonic()` reading as the epoch nanoseconds spans want."""
    return int(monotonic_s * 1e9) + _EPOCH_OFFSET_NS


def current_traceparent() -> str:
    """The W3C traceparent of the current span ("" when tracing is off or nothing is being traced)."""
    if _provider is None:
        return ""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


Behavior = Callable[..., Any]


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """One SERVER span per InferenceService RPC, current while the handler runs (also across the yields of
    streaming handlers, so the dispatcher's hooks see it). Health and reflection calls are not traced."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer(TRACER_NAME)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or not method.startswith(f"/{TRACED_SERVICE}/"):
            return handler
        metadata = {k: v for k, v in (details.invocation_metadata or ()) if isinstance(v, str)}
        return _wrap(handler, self.tracer, method, metadata)


def _wrap(handler: grpc.RpcMethodHandler, tracer: trace.Tracer, method: str, metadata: dict[str, str]) -> Any:
    name = method.lstrip("/")
    attributes = {"rpc.system": "grpc", "rpc.service": TRACED_SERVICE, "rpc.method": name.rsplit("/", 1)[1]}

    def span() -> Any:
        parent = propagate.extract(metadata)
        return tracer.start_as_current_span(
            name, context=parent, kind=SpanKind.SERVER, attributes=attributes, record_exception=False,
            set_status_on_exception=False,
        )  # fmt: skip

    def streaming(behavior: Behavior) -> Behavior:
        # The span is current only while the handler runs (each step of its generator), never across a yield:
        # grpc may close this generator from another context, where detaching a context attached across the
        # yield fails (and logs a traceback per call).
        async def run(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            s = tracer.start_span(name, context=propagate.extract(metadata), kind=SpanKind.SERVER,
                                  attributes=attributes)  # fmt: skip
            current = trace.set_span_in_context(s)
            messages = behavior(request, context).__aiter__()
            try:
                while True:
                    token = otel_context.attach(current)
                    try:
                        message = await messages.__anext__()
                    except StopAsyncIteration:
                        break
                    finally:
                        otel_context.detach(token)
                    yield message
            finally:
                _set_status(s, context)
                s.end()

        return run

    def unary(behavior: Behavior) -> Behavior:
        async def run(request: Any, context: grpc.aio.ServicerContext) -> Any:
            with span() as s:
                try:
                    return await behavior(request, context)
                finally:
                    _set_status(s, context)

        return run

    kwargs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kwargs)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kwargs)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kwargs)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kwargs)
    return handler


def _set_status(span: trace.Span, context: grpc.aio.ServicerContext) -> None:
    """The gRPC status the handler ended with (an abort sets it on the context before raising)."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, f"{code.name}: {context.details() or ''}"))
    else:
        span.set_attribute("rpc.grpc.status_code", 0 if code is None else int(code))
