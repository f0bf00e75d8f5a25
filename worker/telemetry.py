"""Worker-side spans: one `worker.step` span per Step, linked to the requests it served.

On only when `OTEL_EXPORTER_OTLP_ENDPOINT` is set (`coalesce serve` passes its environment to the workers it
spawns, so they export to the same collector). A step serves many requests, so it starts its own trace and
carries one span link per distinct request traceparent (SequenceWork.traceparent) instead of a parent.
"""

from __future__ import annotations

import os
import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from protos.coalesce.v1 import worker_pb2


def _link_context(traceparent: str) -> trace.SpanContext | None:
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    try:
        ctx = trace.SpanContext(int(parts[1], 16), int(parts[2], 16), True, trace.TraceFlags(int(parts[3], 16)))
    except ValueError:
        return None
    return ctx if ctx.is_valid else None


class StepSpans:
    """Records `worker.step` spans after the fact, from the step's start time and its response."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("coalesce.worker")

    @classmethod
    def from_env(cls, service_name: str = "coalesce-worker") -> StepSpans | None:
        if not os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
            return None
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        return cls(provider)

    def record(self, req: worker_pb2.StepRequest, resp: worker_pb2.StepResponse, start_ns: int) -> None:
        seen: set[str] = set()
        links = []
        for work in req.seqs:
            if work.traceparent and work.traceparent not in seen:
                seen.add(work.traceparent)
                ctx = _link_context(work.traceparent)
                if ctx is not None:
                    links.append(trace.Link(ctx, {"coalesce.seq_id": work.seq_id}))
        attrs = {
            "coalesce.step.id": req.step_id,
            "coalesce.step.batch_size": len(req.seqs),
            "coalesce.step.tokens": resp.num_tokens,
            "coalesce.step.sampled": len(resp.tokens),
            "coalesce.step.forward_ms": resp.forward_ms,
        }
        span = self.tracer.start_span("worker.step", links=links, attributes=attrs, start_time=start_ns)
        span.end(time.time_ns())

    def shutdown(self) -> None:
        self.provider.shutdown()
