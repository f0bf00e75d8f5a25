"""The control plane's lean OTLP encoder writes exactly what the SDK's encoder writes."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from control_plane.telemetry.otlp import encode


def test_same_request_as_the_sdk_encoder() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "coalesce-control-plane", "n": 3}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer, other = provider.get_tracer("coalesce.control_plane"), provider.get_tracer("other", "1.2")
    caller = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    parent = trace.set_span_in_context(trace.NonRecordingSpan(caller))
    server = tracer.start_span("svc/Generate", parent, kind=SpanKind.SERVER, attributes={"rpc.method": "Generate"},
                               start_time=1_000)  # fmt: skip
    child = tracer.start_span("batch.buffer", trace.set_span_in_context(server), start_time=2_000,
                              attributes={"coalesce.batch.dwell_ms": 1.5, "coalesce.pool": "interactive"})  # fmt: skip
    child.end(3_000)
    server.set_attributes({"gen_ai.response.finish_reasons": ["stop"], "ok": True, "seed": -5, "raw": b"\x01"})
    server.add_event("first token", {"tokens": 1}, timestamp=2_500)
    server.set_status(Status(StatusCode.ERROR, "CANCELLED: gone"))
    server.end(4_000)
    linked = other.start_span("worker.step", links=[Link(caller, {"coalesce.seq_id": 4})], start_time=5_000)
    linked.end(6_000)
    spans = exporter.get_finished_spans()
    ours, sdk = encode(spans), encode_spans(spans)
    # The one difference: the SDK leaves out a link's trace_state, which OTLP has a field for.
    [link] = ours.resource_spans[0].scope_spans[1].spans[0].links
    assert link.trace_state == "k=v"
    link.ClearField("trace_state")
    assert str(ours) == str(sdk) and ours == sdk
