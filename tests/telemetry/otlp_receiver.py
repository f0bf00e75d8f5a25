"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceServiceServicer on 127.0.0.1.

It keeps every span it is sent, with its service name, and lets a test wait for the spans it expects (the
exporters batch, so spans arrive some time after the work they describe).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class Received:
    service: str
    span: trace_pb2.Span

    @property
    def name(self) -> str:
        return self.span.name

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    @property
    def attrs(self) -> dict[str, Any]:
        return {kv.key: _value(kv.value) for kv in self.span.attributes}

    @property
    def duration_ms(self) -> float:
        return (self.span.end_time_unix_nano - self.span.start_time_unix_nano) / 1e6


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[Received]], None]) -> None:
        self.sink = sink

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            service = next((_value(kv.value) for kv in rs.resource.attributes if kv.key == "service.name"), "")
            got += [Received(service, span) for ss in rs.scope_spans for span in ss.spans]
        self.sink(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """`with OtlpReceiver() as r:` serves on `r.endpoint` (http://127.0.0.1:PORT) until the block ends."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self._add), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[Received]) -> None:
        with self._lock:
            self.spans += spans

    def __enter__(self) -> OtlpReceiver:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None)

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.spans)

    def wait_for(self, done: Callable[[list[Received]], bool], timeout: float = 15.0) -> list[Received]:
        """Spans received so far, once `done(spans)` holds (AssertionError after `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.snapshot()
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted({(s.service, s.name) for s in spans})
                raise AssertionError(f"spans did not arrive within {timeout} s; got {len(spans)}: {names}")
            time.sleep(0.05)
