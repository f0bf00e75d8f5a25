"""The telemetry Observer's arithmetic and spans, driven by hand with an injected clock (no sleeps, no sockets).

Times below are the dispatcher's clock in seconds. One request: queued at 10.00, admitted at 10.05 (50 ms in
the batch buffer), first token at 10.10, two more at 10.12 and 10.14, finished at 10.14.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from control_plane.generation import Generation
from control_plane.request import Request
from control_plane.sequence import Sequence
from control_plane.telemetry.metrics import GENAI, BusyMeter, Metrics
from control_plane.telemetry.observer import TelemetryObserver
from protos.coalesce.v1 import inference_pb2, worker_pb2

MODEL = ("text_completion", "tiny", "interactive")


def _run_one(observer: TelemetryObserver) -> Generation:
    # The worker's noise seed (any uint64) is not the caller's: the span records the caller's.
    spec = Request("r1", "t", [1, 2, 3, 4], 3, "interactive", worker_pb2.WorkerSampling(seed=2**64 - 5), caller_seed=7)
    gen = Generation("r1", "t", prompt_tokens=4)
    seq = Sequence(1, "r1", "t", "interactive", [1, 2, 3, 4], 3, arrival=10.0, first_scheduled_at=10.05)
    seq.cached_prompt_tokens = 2
    observer.on_request(gen, spec, 10.0)
    gen.cached_tokens = 2
    observer.on_admitted(seq, gen, 10.06)
    for t in (10.10, 10.12, 10.14):
        gen.append(5, "x")
        observer.on_tokens(gen, 1, t)
    gen.finish(inference_pb2.FINISH_REASON_LENGTH, 10.14)
    observer.on_finish(gen, 10.14)
    return gen


def _value(m: Metrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    assert value is not None, f"no sample {name} {labels}"
    return value


def test_ttft_with_and_without_queue_itl_and_duration() -> None:
    observer = TelemetryObserver(Metrics(), model="tiny")
    _run_one(observer)
    m, genai = observer.metrics, dict(zip(GENAI, MODEL, strict=True))
    assert _value(m, "gen_ai_server_time_to_first_token_seconds_sum", **genai) == pytest.approx(0.10)
    assert _value(m, "coalesce_time_to_first_token_without_queue_seconds_sum", **genai) == pytest.approx(0.05)
    # Two tokens after the first, 40 ms apart in all: 20 ms per output token.
    assert _value(m, "gen_ai_server_time_per_output_token_seconds_sum", **genai) == pytest.approx(0.02)
    assert _value(m, "gen_ai_server_request_duration_seconds_sum", **genai) == pytest.approx(0.14)
    assert _value(m, "coalesce_batch_buffer_dwell_seconds_sum", pool="interactive") == pytest.approx(0.05)
    assert _value(m, "coalesce_requests_total", pool="interactive", finish_reason="length") == 1
    assert not observer._requests  # nothing kept after the finish


def test_one_token_request_has_no_time_per_output_token() -> None:
    observer = TelemetryObserver(Metrics(), model="tiny")
    gen = Generation("r2", "t", prompt_tokens=1)
    spec = Request("r2", "t", [1], 1, "batch", worker_pb2.WorkerSampling())
    observer.on_request(gen, spec, 0.0)
    observer.on_tokens(gen, 1, 0.3)
    observer.on_finish(gen, 0.3)
    labels = {"gen_ai_operation_name": MODEL[0], "gen_ai_request_model": "tiny", "pool": "batch"}
    assert observer.metrics.registry.get_sample_value("gen_ai_server_time_per_output_token_seconds_count", labels) in (
        None,
        0.0,
    )
    # Never admitted through the hook (no dwell known): TTFT without queue equals TTFT.
    assert _value(observer.metrics, "coalesce_time_to_first_token_without_queue_seconds_sum", **labels) == 0.3


def test_spans_follow_the_clock_and_hang_off_the_request_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = TelemetryObserver(Metrics(), tracer=provider.get_tracer("test"), model="tiny")
    _run_one(observer)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    # The request span, its batch-buffer dwell and nothing per phase: TTFT on the request span places the first
    # token (docs/observability.md, "What tracing costs").
    assert set(spans) == {"text_completion tiny", "batch.buffer"}
    request, buffer = spans["text_completion tiny"], spans["batch.buffer"]  # no server span was current: ours
    assert buffer.parent is not None and request.context is not None
    assert buffer.parent.span_id == request.context.span_id
    assert buffer.attributes is not None and buffer.attributes["coalesce.batch.dwell_ms"] == pytest.approx(50)
    assert buffer.end_time is not None and buffer.start_time is not None
    assert (buffer.end_time - buffer.start_time) / 1e6 == pytest.approx(50, abs=0.001)
    assert request.start_time == buffer.start_time  # queued at 10.00
    assert (request.end_time or 0) - (request.start_time or 0) == pytest.approx(140e6, abs=1000)  # finished 10.14
    attrs = request.attributes or {}
    assert attrs["gen_ai.usage.output_tokens"] == 3 and attrs["gen_ai.usage.cache_read.input_tokens"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ("length",) and attrs["gen_ai.request.seed"] == 7
    assert attrs["gen_ai.response.time_to_first_chunk"] == pytest.approx(0.10)


def test_dedup_decision_is_a_span_and_a_count() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = TelemetryObserver(Metrics(), tracer=provider.get_tracer("test"))
    observer.on_dedup("content", "miss", "r9")
    [span] = exporter.get_finished_spans()
    assert span.name == "dedup.lookup" and span.attributes is not None
    assert (span.attributes["coalesce.dedup.kind"], span.attributes["coalesce.dedup.outcome"]) == ("content", "miss")
    assert _value(observer.metrics, "coalesce_dedup_total", kind="content", outcome="miss") == 1


def test_busy_fraction_over_a_sliding_window() -> None:
    meter = BusyMeter(now=0.0, window_s=10.0)
    meter.add(1.0, 0.5)
    meter.add(2.0, 0.5)
    assert meter.fraction(4.0) == pytest.approx(1.0 / 4.0)
    meter.add(6.0, 1.0)  # rolls: the first half (1 s busy in 6 s) is kept as the previous half
    assert meter.fraction(8.0) == pytest.approx(2.0 / 8.0)
    assert meter.fraction(30.0) == 0.0  # a long idle gap forgets everything
