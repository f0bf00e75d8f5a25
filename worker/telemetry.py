"""Worker-side spans: one `worker.step` span per Step, linked to the requests it served.

On only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (`coalesce serve` passes its environment to the workers it
spawns, so they export to the same collector). A step serves many requests, so it starts its own trace and
carries one span link per distinct request traceparent (SequenceWork.traceparent) instead of a parent. A
step with no sampled request is not exported.

Why not the SDK's Span objects: a step links to every request in it, and through the SDK each link costs
~25 us (a Link, its attributes wrapped twice, then the Python OTLP encoder): ~0.8 ms of CPU per step of 32
sequences, on the worker's event loop and its exporter thread, where it slows the step loop (about 70 us
this way; docs/observability.md, "What tracing costs").
So each step's span is written once, directly as an OTLP protobuf, and sent in batches by one thread through
the SDK's OTLP exporter, which keeps the standard `OTEL_EXPORTER_OTLP_*` settings (endpoint, headers, TLS,
compression, retries); batching follows `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` and
`OTEL_BSP_MAX_QUEUE_SIZE` as the SDK's BatchSpanProcessor does.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.resource.v1 import resource_pb2
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource

from protos.coalesce.v1 import worker_pb2

SCOPE = "coalesce.worker"
# OTLP span flags: the "is remote" bit is known; links point at another process's spans (remote).
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
LINK_CACHE = 4096
_INTERNAL = trace_pb2.Span.SPAN_KIND_INTERNAL


def _env_int(name: str, default: int) -> int:
    try:
        return max(1, int(os.environ.get(name, default)))
    except ValueError:
        return default


def _link(traceparent: str, seq_id: int) -> trace_pb2.Span.Link | None:
    """The span link to a request's W3C traceparent (None when it does not parse, is all zeros, or the request
    was not sampled: its spans were never exported, so a link would point at nothing)."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return None
    try:
        trace_id, span_id, flags = bytes.fromhex(parts[1]), bytes.fromhex(parts[2]), int(parts[3], 16)
    except ValueError:
        return None
    if not any(trace_id) or not any(span_id) or not flags & 0x01:
        return None
    attrs = [_kv("coalesce.seq_id", seq_id)]
    return trace_pb2.Span.Link(trace_id=trace_id, span_id=span_id, flags=flags | _HAS_IS_REMOTE | _IS_REMOTE,
                               attributes=attrs)  # fmt: skip


def _kv(key: str, value: Any) -> common_pb2.KeyValue:
    if isinstance(value, bool):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(bool_value=value))
    if isinstance(value, int):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(int_value=value))
    if isinstance(value, float):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(double_value=value))
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(string_value=str(value)))


def _nonzero_id(bits: int) -> bytes:
    return (random.getrandbits(bits) or 1).to_bytes(bits // 8, "big")


class _Batches:
    """Spans built in place in the pending export request (never copied) by the step loop, and exported by one
    daemon thread every schedule delay, or as soon as a full batch waits. At most `max_queue` spans wait:
    beyond, new ones are dropped (a collector that is down never grows the worker's memory)."""

    def __init__(self, send: Callable[[ExportTraceServiceRequest], Any], resource: resource_pb2.Resource,
                 delay_s: float, max_batch: int, max_queue: int) -> None:  # fmt: skip
        self._send, self._resource = send, resource
        self._delay_s, self._max_batch, self._max_full = delay_s, max_batch, max(1, max_queue // max_batch)
        self._full: collections.deque[ExportTraceServiceRequest] = collections.deque()
        self._pending, self._spans = self._new()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="coalesce-step-spans", daemon=True)
        self._thread.start()

    def _new(self) -> tuple[ExportTraceServiceRequest, Any]:
        request = ExportTraceServiceRequest()
        scoped = request.resource_spans.add(resource=self._resource).scope_spans.add()
        scoped.scope.name = SCOPE
        return request, scoped.spans

    def add(self, **fields: Any) -> None:
        """One span, built in place in the pending batch (under the lock: the thread may take the batch)."""
        with self._lock:
            if len(self._spans) >= self._max_batch:
                if len(self._full) >= self._max_full:
                    self.dropped += 1
                    return
                self._full.append(self._pending)
                self._pending, self._spans = self._new()
                self._wake.set()
            self._spans.add(**fields)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self._delay_s)
            self._wake.clear()
            self.flush()
        self.flush()

    def flush(self) -> None:
        with self._lock:
            if len(self._spans):
                self._full.append(self._pending)
                self._pending, self._spans = self._new()
            batches, self._full = self._full, collections.deque()
        for batch in batches:
            self._send(batch)

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout_s)


class StepSpans:
    """Records `worker.step` spans after the fact, from the step's start time and its response."""

    def __init__(self, send: Callable[[ExportTraceServiceRequest], Any], resource: Resource, delay_s: float = 5.0,
                 max_batch: int = 512, max_queue: int = 2048) -> None:  # fmt: skip
        """`send(request)` delivers one ExportTraceServiceRequest (an OTLP exporter's `export`, or a test's)."""
        res = resource_pb2.Resource(attributes=[_kv(k, v) for k, v in resource.attributes.items()])
        self._batches = _Batches(send, res, delay_s, max_batch, max_queue)
        # A running sequence is in every step until it ends: its link is built once (bounded, cleared when full).
        self._links: dict[tuple[str, int], trace_pb2.Span.Link | None] = {}
        self._close: Callable[[], Any] | None = None

    @classmethod
    def from_env(cls, service_name: str = "coalesce-worker") -> StepSpans | None:
        if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return None
        # Imported here: the exporter pulls in a gRPC channel we do not want to build when tracing is off.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        class _Prebuilt(OTLPSpanExporter):
            """The SDK's OTLP/gRPC exporter, handed requests already encoded."""

            def _translate_data(self, data: Any) -> ExportTraceServiceRequest:
                return data

            def _count_data(self, data: Any) -> int:
                return sum(len(s.spans) for r in data.resource_spans for s in r.scope_spans)

        exporter = _Prebuilt()
        spans = cls(exporter.export, Resource.create({"service.name": service_name}),
                    _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000, _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512),
                    _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048))  # fmt: skip
        spans._close = exporter.shutdown
        return spans

    def _link(self, traceparent: str, seq_id: int) -> trace_pb2.Span.Link | None:
        key = (traceparent, seq_id)
        if key not in self._links:
            if len(self._links) >= LINK_CACHE:
                self._links.clear()
            self._links[key] = _link(traceparent, seq_id)
        return self._links[key]

    def record(self, req: worker_pb2.StepRequest, resp: worker_pb2.StepResponse, start_ns: int) -> None:
        seen: set[str] = set()
        links = []
        for work in req.seqs:
            if work.traceparent and work.traceparent not in seen:
                seen.add(work.traceparent)
                link = self._link(work.traceparent, work.seq_id)
                if link is not None:
                    links.append(link)
        if not links:  # no traced request in this step: nothing would ever find its span
            return
        attrs = [
            _kv("coalesce.step.id", req.step_id),
            _kv("coalesce.step.batch_size", len(req.seqs)),
            _kv("coalesce.step.tokens", resp.num_tokens),
            _kv("coalesce.step.sampled", len(resp.tokens)),
            _kv("coalesce.step.forward_ms", resp.forward_ms),
        ]
        self._batches.add(
            trace_id=_nonzero_id(128), span_id=_nonzero_id(64), name="worker.step", kind=_INTERNAL,
            start_time_unix_nano=start_ns, end_time_unix_nano=time.time_ns(), attributes=attrs, links=links,
            flags=0x01 | _HAS_IS_REMOTE,  # sampled; no parent
        )  # fmt: skip

    def flush(self) -> None:
        """Send what is queued now (on the caller's thread)."""
        self._batches.flush()

    def shutdown(self) -> None:
        """Send what is queued, then close the exporter."""
        self._batches.stop()
        if self._close is not None:
            self._close()
