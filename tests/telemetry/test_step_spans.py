"""The worker's `worker.step` spans, built as OTLP protobufs and handed to a send function (no sockets)."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource

from protos.coalesce.v1 import worker_pb2
from worker.telemetry import StepSpans

A = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
B = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
UNSAMPLED = "00-5bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-00"


def _step(step_id: int, parents: list[str]) -> tuple[worker_pb2.StepRequest, worker_pb2.StepResponse]:
    req = worker_pb2.StepRequest(step_id=step_id)
    for seq_id, traceparent in enumerate(parents):
        req.seqs.add(seq_id=seq_id, traceparent=traceparent)
    resp = worker_pb2.StepResponse(step_id=step_id, num_tokens=len(parents), forward_ms=2.5)
    for _ in parents:
        resp.tokens.add()
    return req, resp


def test_a_step_links_each_request_once_and_carries_its_sizes() -> None:
    sent: list[ExportTraceServiceRequest] = []
    spans = StepSpans(sent.append, Resource.create({"service.name": "coalesce-worker"}))
    try:
        # seq 2 repeats A (one link per distinct request); "", a malformed and an unsampled one are not linked.
        req, resp = _step(7, [A, B, A, "", "00-zz-yy-01", UNSAMPLED])
        spans.record(req, resp, start_ns=1_000)
        req, resp = _step(8, ["", UNSAMPLED])  # nothing traced in this step: no span
        spans.record(req, resp, start_ns=2_000)
        spans.flush()
    finally:
        spans.shutdown()
    [request] = sent
    [resource_spans] = request.resource_spans
    service = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}["service.name"]
    assert service == "coalesce-worker"
    [scoped] = resource_spans.scope_spans
    [span] = scoped.spans
    assert span.name == "worker.step" and span.start_time_unix_nano == 1_000 < span.end_time_unix_nano
    assert len(span.trace_id) == 16 and len(span.span_id) == 8 and not span.parent_span_id
    attrs = {kv.key: kv.value for kv in span.attributes}
    assert attrs["coalesce.step.id"].int_value == 7 and attrs["coalesce.step.batch_size"].int_value == 6
    assert attrs["coalesce.step.tokens"].int_value == 6 and attrs["coalesce.step.sampled"].int_value == 6
    assert attrs["coalesce.step.forward_ms"].double_value == 2.5
    links = [(lk.trace_id.hex(), lk.span_id.hex(), lk.attributes[0].value.int_value) for lk in span.links]
    assert links == [(A[3:35], A[36:52], 0), (B[3:35], B[36:52], 1)]
    assert all(lk.flags & 0x300 == 0x300 for lk in span.links)  # remote span contexts


def test_every_step_is_sent_in_batches_of_at_most_max_batch() -> None:
    sent: list[ExportTraceServiceRequest] = []
    spans = StepSpans(sent.append, Resource.create({}), delay_s=86_400, max_batch=2, max_queue=8)
    try:
        for step_id in range(7):
            req, resp = _step(step_id, [A])
            spans.record(req, resp, start_ns=1)
        spans.flush()
    finally:
        spans.shutdown()
    batches = [r.resource_spans[0].scope_spans[0].spans for r in sent]
    ids = [kv.value.int_value for b in batches for s in b for kv in s.attributes if kv.key == "coalesce.step.id"]
    # A full batch wakes the exporter thread, so batches may be sent from either thread: order is not promised.
    assert sorted(ids) == list(range(7)) and all(1 <= len(b) <= 2 for b in batches)
