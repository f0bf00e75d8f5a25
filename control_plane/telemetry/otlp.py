"""The control plane's OTLP/gRPC span exporter: the SDK's, with a leaner encoder.

The SDK's encoder (opentelemetry-exporter-otlp-proto-common) builds every attribute as messages that are then
copied, through several layers of Python calls, and hashes the Resource (a JSON dump) once per span: ~45 us
per span on the exporter thread, on the cores the model uses (docs/observability.md, "What tracing costs").
This one writes each span in place in the request (protobuf `add()` and setattr) and groups by the resource's
identity: ~18 us. It sends through the SDK's exporter, which keeps the standard `OTEL_EXPORTER_OTLP_*`
settings (endpoint, headers, TLS, retries). The message equals the SDK's but for a link's
trace_state, which the SDK leaves out (`tests/telemetry/test_otlp_encoding.py`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanContext, StatusCode

# OTLP span flags: whether the parent (or a link's span) is remote is known, and whether it is.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_STATUS = {StatusCode.UNSET: 0, StatusCode.OK: 1, StatusCode.ERROR: 2}


_FIELD = {str: "string_value", bool: "bool_value", int: "int_value", float: "double_value", bytes: "bytes_value"}


def _set(value: common_pb2.AnyValue, v: Any) -> None:
    field = _FIELD.get(type(v))
    if field is not None:
        setattr(value, field, v)
    elif isinstance(v, str | bool | int | float | bytes):  # a subclass (an IntEnum, a str enum)
        setattr(value, _FIELD[next(t for t in _FIELD if isinstance(v, t))], v)
    elif isinstance(v, Mapping):
        value.kvlist_value.SetInParent()
        _fill(value.kvlist_value.values, v)
    elif isinstance(v, Sequence):
        value.array_value.SetInParent()  # an empty array is still an array
        for x in v:
            _set(value.array_value.values.add(), x)
    else:
        value.string_value = str(v)


def _fill(out: Any, attrs: Mapping[str, Any] | None) -> None:
    """Attributes appended in place to a repeated KeyValue field (no message built and then copied)."""
    if attrs:
        for k, v in attrs.items():
            _set(out.add(key=k).value, v)


def _flags(ctx: SpanContext | None) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if ctx is not None and ctx.is_remote else 0)


def _add_span(out: Any, span: ReadableSpan) -> None:
    ctx = span.context
    assert ctx is not None
    pb = out.add(
        trace_id=ctx.trace_id.to_bytes(16, "big"), span_id=ctx.span_id.to_bytes(8, "big"), name=span.name,
        kind=span.kind.value + 1,  # OTLP counts from SPAN_KIND_UNSPECIFIED = 0
        start_time_unix_nano=span.start_time, end_time_unix_nano=span.end_time, flags=_flags(span.parent),
        dropped_attributes_count=span.dropped_attributes, dropped_events_count=span.dropped_events,
        dropped_links_count=span.dropped_links,
    )  # fmt: skip
    if ctx.trace_state:
        pb.trace_state = ctx.trace_state.to_header()
    if span.parent is not None:
        pb.parent_span_id = span.parent.span_id.to_bytes(8, "big")
    _fill(pb.attributes, span.attributes)
    pb.status.code = _STATUS[span.status.status_code]
    if span.status.description:
        pb.status.message = span.status.description
    for e in span.events:
        event = pb.events.add(time_unix_nano=e.timestamp, name=e.name, dropped_attributes_count=e.dropped_attributes)
        _fill(event.attributes, e.attributes)
    for lk in span.links:
        link = pb.links.add(trace_id=lk.context.trace_id.to_bytes(16, "big"),
                            span_id=lk.context.span_id.to_bytes(8, "big"), flags=_flags(lk.context),
                            dropped_attributes_count=lk.dropped_attributes)  # fmt: skip
        if lk.context.trace_state:
            link.trace_state = lk.context.trace_state.to_header()
        _fill(link.attributes, lk.attributes)


def encode(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """One export request: spans grouped by resource, then by instrumentation scope."""
    request = ExportTraceServiceRequest()
    groups: dict[int, tuple[Any, dict[int, Any]]] = {}
    for span in spans:
        resource, scope = span.resource, span.instrumentation_scope
        group = groups.get(id(resource))  # identity, not Resource.__hash__ (a JSON dump per call)
        if group is None:
            resource_spans = request.resource_spans.add(schema_url=resource.schema_url)
            _fill(resource_spans.resource.attributes, resource.attributes)
            group = groups[id(resource)] = (resource_spans, {})
        scoped = group[1].get(id(scope))
        if scoped is None:
            scoped = group[1][id(scope)] = group[0].scope_spans.add()
            if scope is not None:
                scoped.scope.name, scoped.scope.version = scope.name, scope.version or ""
                scoped.schema_url = scope.schema_url or ""
                _fill(scoped.scope.attributes, scope.attributes)
        _add_span(scoped.spans, span)
    return request


class LeanSpanExporter(OTLPSpanExporter):
    """OTLPSpanExporter with `encode` above instead of the SDK's encoder."""

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        return encode(data)
