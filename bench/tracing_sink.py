"""A minimal OTLP trace receiver for benchmarks: counts the spans it is sent and keeps nothing."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class SpanCounter(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans = 0

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def otlp_sink() -> Iterator[tuple[str, SpanCounter]]:
    """(OTLP endpoint URL, counter) of a receiver on 127.0.0.1, stopped on exit."""
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    counter = SpanCounter()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(counter, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", counter
    finally:
        server.stop(grace=None)
