"""The telemetry Observer: turns the dispatcher's hooks into spans, Prometheus metrics and event logs.

Every hook runs on the event loop thread, synchronously, so the per-request state below needs no locks.
A request's spans hang off the span that was current when it was queued: the Generate call's SERVER span
(the tracing interceptor's), or, for a generation on a multiplexed Session stream, a `generate` span of its
own under the Session span. Span times come from the dispatcher's clock, converted once to epoch ns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import Span

from control_plane.observer import Observer
from control_plane.sequence import POOLS
from control_plane.telemetry import logs
from control_plane.telemetry.metrics import BusyMeter, Metrics, SchedulerCollector, Snapshot
from control_plane.telemetry.tracing import TRACER_NAME, epoch_ns
from protos.coalesce.v1 import inference_pb2

if TYPE_CHECKING:
    from control_plane.dispatcher import Dispatcher
    from control_plane.generation import Generation
    from control_plane.request import Request
    from control_plane.sequence import SeqEvent, Sequence
    from control_plane.step_plan import StepPlan
    from control_plane.worker_link import WorkerLink
    from protos.coalesce.v1 import worker_pb2

OPERATION = "text_completion"
FINISH_REASONS = ("stop", "length", "cancelled", "error")
DEDUP_OUTCOMES = {
    "idempotency": ("miss", "coalesced", "replayed", "takeover"),
    "content": ("miss", "coalesced", "takeover"),
}


def kv_dtype(info: worker_pb2.InfoResponse | None, converted: bool) -> str:
    """What a worker's KV cache holds now: "int8", or the model's dtype ("" before its Info)."""
    if info is None:
        return ""
    return "int8" if converted or info.kv_cache_dtype == "int8" else info.dtype


def finish_name(reason: int) -> str:
    """FINISH_REASON_STOP -> "stop"."""
    return inference_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


@dataclass(slots=True)
class _Request:
    """What one generation's telemetry needs between hooks (dispatcher clock seconds)."""

    pool: str
    start: float  # queued
    labels: tuple[str, str, str]
    trace_id: str = ""
    span: Span | None = None  # the request's span (the server span, or our own on a Session)
    owned: bool = False  # we started `span`, so we end it
    dwell: float = 0.0
    first: float | None = None  # first token
    tokens: int = 0
    resumed: bool = False  # continued from logged tokens: no TTFT to measure


@dataclass
class TelemetryObserver(Observer):
    """Metrics always; spans when `tracer` is given; JSON-able event logs when `events` is set."""

    metrics: Metrics
    tracer: trace.Tracer | None = None
    events: bool = False
    clock: Callable[[], float] = time.monotonic
    model: str = ""
    _requests: dict[str, _Request] = field(default_factory=dict)
    _busy: dict[str, BusyMeter] = field(default_factory=dict)
    _links: list[WorkerLink] = field(default_factory=list)

    @classmethod
    def create(cls, events: bool = False, tracing: bool = False) -> TelemetryObserver:
        return cls(Metrics(), trace.get_tracer(TRACER_NAME) if tracing else None, events)

    def bind(self, dispatcher: Dispatcher) -> None:
        """After `dispatcher.start()` (on the event loop): learn the model, export its workers' state."""
        import asyncio

        self._links = dispatcher.links
        self.model = dispatcher.info.model_name
        self._declare([link.address for link in self._links])
        self.metrics.registry.register(SchedulerCollector(asyncio.get_running_loop(), self.snapshot))

    def _declare(self, workers: list[str]) -> None:
        """Create every known label set at zero, so each series exists before its first event."""
        m = self.metrics
        for pool in POOLS:
            for hist in (m.ttft, m.ttft_no_queue, m.tpot, m.duration):
                hist.labels(OPERATION, self.model, pool)
            m.dwell.labels(pool)
            m.preemptions.labels(pool)
            for reason in FINISH_REASONS:
                m.requests.labels(pool, reason)
        for kind, outcomes in DEDUP_OUTCOMES.items():
            for outcome in outcomes:
                m.dedup.labels(kind, outcome)
        for worker in workers:
            m.worker_lost.labels(worker)

    def snapshot(self) -> list[Snapshot]:
        now = self.clock()
        snaps = []
        for link in self._links:
            if link.scheduler is not None:
                stats = link.scheduler.stats()
                busy = self._meter(link.address, now).fraction(now)
                snaps.append(Snapshot(link.address, stats, busy, kv_dtype(link.info, stats.kv_int8)))
        return snaps

    def _meter(self, worker: str, now: float) -> BusyMeter:
        return self._busy.setdefault(worker, BusyMeter(now))

    # -- request hooks -----------------------------------------------------------------------------------
    def on_request(self, gen: Generation, request: Request, now: float) -> None:
        req = _Request(request.pool, now, (OPERATION, self.model, request.pool), resumed=bool(gen.token_ids))
        if self.tracer is not None:
            req.span, req.owned = self._request_span(now)
            req.span.set_attributes(self._request_attributes(request))
            req.trace_id = f"{req.span.get_span_context().trace_id:032x}"
        self._requests[gen.request_id] = req
        if self.events:
            logs.event("request.start", f"request {gen.request_id} queued", request_id=gen.request_id,
                       trace_id=req.trace_id, pool=request.pool, prompt_tokens=len(request.prompt_ids),
                       max_tokens=request.max_tokens)  # fmt: skip

    def _request_span(self, now: float) -> tuple[Span, bool]:
        assert self.tracer is not None
        current = trace.get_current_span()
        if current.is_recording() and getattr(current, "name", "").endswith("/Generate"):
            return current, False
        # On a Session stream (or outside any call) each generation gets its own span.
        return self.tracer.start_span(f"{OPERATION} {self.model}", start_time=epoch_ns(now)), True

    def _request_attributes(self, request: Request) -> dict[str, str | int | float]:
        s = request.sampling
        attrs: dict[str, str | int | float] = {
            "gen_ai.operation.name": OPERATION,
            "gen_ai.request.model": self.model,
            "gen_ai.request.max_tokens": request.max_tokens,
            "gen_ai.request.temperature": s.temperature,
            "gen_ai.request.top_p": s.top_p,
            "gen_ai.usage.input_tokens": len(request.prompt_ids),
            "coalesce.request_id": request.request_id,
            "coalesce.pool": request.pool,
        }
        if request.caller_seed is not None:
            # OTLP ints are int64: a uint64 seed above it would fail to export (and log a traceback per span).
            seed = request.caller_seed
            attrs["gen_ai.request.seed"] = seed - 2**64 if seed >= 2**63 else seed
        return attrs

    def on_dedup(self, kind: str, outcome: str, request_id: str) -> None:
        self.metrics.dedup.labels(kind, outcome).inc()
        trace_id = ""
        if self.tracer is not None:
            attrs = {"coalesce.dedup.kind": kind, "coalesce.dedup.outcome": outcome, "coalesce.request_id": request_id}
            span = self.tracer.start_span("dedup.lookup", attributes=attrs)
            span.end()
            trace_id = f"{span.get_span_context().trace_id:032x}"
        if self.events:
            logs.event("dedup", f"request {request_id}: {kind} dedup {outcome}", request_id=request_id,
                       trace_id=trace_id, kind=kind, outcome=outcome)  # fmt: skip

    def on_admitted(self, seq: Sequence, gen: Generation, now: float) -> None:
        req = self._requests.get(gen.request_id)
        admitted = seq.first_scheduled_at if seq.first_scheduled_at is not None else now
        dwell = max(0.0, admitted - seq.arrival)
        self.metrics.dwell.labels(seq.pool).observe(dwell)
        if req is None:
            return
        req.dwell = dwell
        if req.span is not None and self.tracer is not None:
            parent = trace.set_span_in_context(req.span)
            attrs: dict[str, str | float] = {"coalesce.batch.dwell_ms": dwell * 1000, "coalesce.pool": seq.pool}
            buffer = self.tracer.start_span("batch.buffer", parent, attributes=attrs, start_time=epoch_ns(seq.arrival))
            buffer.end(epoch_ns(admitted))

    def on_tokens(self, gen: Generation, count: int, now: float) -> None:
        req = self._requests.get(gen.request_id)
        if req is None:
            return
        req.tokens += count
        if req.first is None:
            req.first = now
            if not req.resumed:
                self._first_token(req, now)

    def _first_token(self, req: _Request, now: float) -> None:
        ttft = now - req.start
        self.metrics.ttft.labels(*req.labels).observe(ttft)
        self.metrics.ttft_no_queue.labels(*req.labels).observe(max(0.0, ttft - req.dwell))
        # No prefill / decode spans: this attribute and `batch.buffer` place the first token (docs/observability.md).
        if req.span is not None and req.span.is_recording():
            req.span.set_attribute("gen_ai.response.time_to_first_chunk", ttft)

    def on_finish(self, gen: Generation, now: float) -> None:
        req = self._requests.pop(gen.request_id, None)
        if req is None:
            return
        reason = finish_name(gen.finish_reason)
        self.metrics.requests.labels(req.pool, reason).inc()
        self.metrics.duration.labels(*req.labels).observe(now - req.start)
        if req.first is not None and req.tokens >= 2:
            self.metrics.tpot.labels(*req.labels).observe((now - req.first) / (req.tokens - 1))
        if req.span is not None:
            self._end_spans(req, gen, reason, now)
        if self.events:
            logs.event("request.finish", f"request {gen.request_id} finished: {reason}", request_id=gen.request_id,
                       trace_id=req.trace_id, finish_reason=reason, output_tokens=len(gen.token_ids),
                       queue_ms=round(req.dwell * 1000, 3), duration_ms=round((now - req.start) * 1000, 3))  # fmt: skip

    def _end_spans(self, req: _Request, gen: Generation, reason: str, now: float) -> None:
        assert req.span is not None
        if req.span.is_recording():  # a caller that hung up ended the server span already
            req.span.set_attributes({
                "gen_ai.usage.input_tokens": gen.prompt_tokens,
                "gen_ai.usage.output_tokens": len(gen.token_ids),
                "gen_ai.usage.cache_read.input_tokens": gen.cached_tokens,
                "gen_ai.response.finish_reasons": [reason],
                "coalesce.batch.dwell_ms": req.dwell * 1000,
            })  # fmt: skip
        if req.owned:
            req.span.end(epoch_ns(now))

    # -- worker hooks ------------------------------------------------------------------------------------
    def on_step(
        self, link: WorkerLink, plan: StepPlan, events: list[SeqEvent], resp: worker_pb2.StepResponse, loop_s: float
    ) -> None:
        m = self.metrics
        m.steps.inc()
        m.forward_s.inc(resp.forward_ms / 1000)
        m.loop_s.inc(loop_s)
        m.batch_size.observe(len(plan.works))
        m.step_tokens.observe(plan.num_tokens)
        self._meter(link.address, self.clock()).add(self.clock(), resp.forward_ms / 1000)
        for seq in plan.preempted:
            m.preemptions.labels(seq.pool).inc()
            if self.events:
                trace_id = seq.traceparent.split("-")[1] if seq.traceparent.count("-") == 3 else ""
                logs.event("preemption", f"request {seq.request_id} preempted for recompute",
                           request_id=seq.request_id, trace_id=trace_id, worker=link.address, pool=seq.pool,
                           preemptions=seq.preemptions)  # fmt: skip

    def on_worker_lost(self, link: WorkerLink, requeued: int) -> None:
        self.metrics.worker_lost.labels(link.address).inc()
        if self.events:
            logs.event("worker.lost", f"worker {link.address} lost; {requeued} sequences requeued",
                       logging.WARNING, worker=link.address, requeued=requeued)  # fmt: skip
