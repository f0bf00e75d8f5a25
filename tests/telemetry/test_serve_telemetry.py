"""`coalesce serve` as a real process exporting to a real OTLP receiver and serving /metrics (docs/observability.md).

One server for the module: traces are checked per request by trace id, metrics by the change between two
scrapes, so the tests do not depend on each other's traffic.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from otlp_receiver import OtlpReceiver, Received
from prometheus_client.parser import text_string_to_metric_families

from clients.aio import AsyncCoalesceClient
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc
from tests.e2e.serve_process import BUILTIN, ServeProcess
from tests.session_env import AUTH

pytestmark = pytest.mark.slow
GENERATE = "coalesce.v1.InferenceService/Generate"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Served:
    def __init__(self, serve: ServeProcess, receiver: OtlpReceiver, metrics_port: int) -> None:
        self.serve, self.receiver, self.metrics_url = serve, receiver, f"http://127.0.0.1:{metrics_port}/metrics"

    def scrape(self) -> dict[str, float]:
        """Every sample as 'name{label="v",...}' -> value."""
        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}"] = s.value
        return out


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with OtlpReceiver() as receiver:
        metrics_port = _free_port()
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "COALESCE_LOG_FORMAT": "json",
            "COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "20",
        }
        serve = ServeProcess(*BUILTIN, "--kv-cache-mb", "64", "--metrics-port", str(metrics_port), env=env)
        try:
            yield Served(serve, receiver, metrics_port)
        finally:
            assert serve.stop() == 0, "".join(serve.lines[-30:])


def generate(
    address: str, prompt: str, max_tokens: int = 6, key: str = ""
) -> tuple[str, str, list[inference_pb2.GenerateResponse]]:
    """One Generate call under a caller's span of our own: (trace id, caller span id, responses)."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    sampling = inference_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = inference_pb2.GenerateRequest(text=prompt, sampling=sampling, idempotency_key=key)
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        chunks = list(
            stub.Generate(request, metadata=[AUTH, ("traceparent", f"00-{trace_id}-{span_id}-01")], timeout=30)
        )
    return trace_id, span_id, chunks


def _in_trace(spans: list[Received], trace_id: str) -> list[Received]:
    return [s for s in spans if s.trace_id == trace_id and s.service == "coalesce-control-plane"]


def test_one_trace_per_request_with_the_callers_trace_id(served: Served) -> None:
    calls = [generate(served.serve.address, f"trace me {i}") for i in range(3)]
    for trace_id, caller_span, chunks in calls:
        spans = served.receiver.wait_for(
            lambda got, t=trace_id: {"dedup.lookup", "batch.buffer", GENERATE} <= {s.name for s in _in_trace(got, t)}
        )
        mine = {s.name: s for s in _in_trace(spans, trace_id)}
        server = mine[GENERATE]
        assert server.parent_id == caller_span  # the caller's context was continued, not replaced
        assert server.attrs["coalesce.request_id"] == chunks[0].request_id
        assert server.attrs["gen_ai.usage.output_tokens"] == sum(len(c.token_ids) for c in chunks)
        assert server.attrs["gen_ai.response.finish_reasons"] == [inference_pb2.FinishReason.Name(
            chunks[-1].finish_reason).removeprefix("FINISH_REASON_").lower()]  # fmt: skip
        assert mine["batch.buffer"].parent_id == mine["dedup.lookup"].parent_id == server.span_id
        assert set(mine) == {GENERATE, "dedup.lookup", "batch.buffer"}  # three spans per request (observability.md)
        # Every span naming this request sits in this one trace.
        named = [s for s in served.receiver.snapshot() if s.attrs.get("coalesce.request_id") == chunks[0].request_id]
        assert {s.trace_id for s in named} == {trace_id}


def test_batch_buffer_dwell_matches_the_queue_time_the_client_saw(served: Served) -> None:
    trace_id, _, chunks = generate(served.serve.address, "how long did I wait")
    spans = served.receiver.wait_for(lambda got: any(s.name == "batch.buffer" for s in _in_trace(got, trace_id)))
    [buffer] = [s for s in _in_trace(spans, trace_id) if s.name == "batch.buffer"]
    queue_ms = chunks[0].queue_ms
    assert buffer.attrs["coalesce.batch.dwell_ms"] == pytest.approx(queue_ms, rel=1e-5, abs=1e-3)
    assert buffer.duration_ms == pytest.approx(queue_ms, abs=0.01)
    assert buffer.attrs["coalesce.pool"] == "interactive"


def test_worker_step_spans_link_to_the_request(served: Served) -> None:
    trace_id, _, _ = generate(served.serve.address, "link my steps", max_tokens=8)

    def linked(spans: list[Received]) -> list[Received]:
        return [
            s for s in spans if s.name == "worker.step" and any(lk.trace_id.hex() == trace_id for lk in s.span.links)
        ]

    def ready(got: list[Received]) -> bool:  # the server span ends last: wait for it, not just any span
        return len(linked(got)) >= 2 and any(s.name == GENERATE for s in _in_trace(got, trace_id))

    spans = served.receiver.wait_for(ready)
    server = next(s for s in _in_trace(spans, trace_id) if s.name == GENERATE)
    steps = linked(spans)
    assert {s.service for s in steps} == {"coalesce-worker"}
    assert all(
        lk.span_id.hex() == server.span_id for s in steps for lk in s.span.links if lk.trace_id.hex() == trace_id
    )
    assert all(s.attrs["coalesce.step.batch_size"] >= 1 and s.attrs["coalesce.step.tokens"] >= 1 for s in steps)


def _plain_miss(address: str) -> tuple[str, str]:
    trace_id, _, _ = generate(address, "nothing to share here")
    return trace_id, "content"


def _replayed(address: str) -> tuple[str, str]:
    generate(address, "say it twice", key="telemetry-replay")
    trace_id, _, _ = generate(address, "say it twice", key="telemetry-replay")
    return trace_id, "idempotency"


def _coalesced(address: str) -> tuple[str, str]:
    prompt, started = "one computation, two readers", threading.Event()

    def lead() -> None:  # streams, so the follower can be sent once the leader is surely running
        sampling = inference_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
        request = inference_pb2.GenerateRequest(text=prompt, sampling=sampling, stream=True)
        with grpc.insecure_channel(address) as channel:
            for _ in inference_pb2_grpc.InferenceServiceStub(channel).Generate(request, metadata=[AUTH], timeout=60):
                started.set()

    leader = threading.Thread(target=lead)
    leader.start()
    try:
        assert started.wait(30)
        trace_id, _, chunks = generate(address, prompt, 400)
        assert chunks[0].dedup_outcome == inference_pb2.DEDUP_OUTCOME_COALESCED
        return trace_id, "content"
    finally:
        leader.join()


# (outcome, send): `send` makes the request whose trace must hold a dedup.lookup span with that outcome and
# returns (trace id, expected kind).
DEDUP_CASES: list[tuple[str, Callable[[str], tuple[str, str]]]] = [
    ("miss", _plain_miss),
    ("replayed", _replayed),
    ("coalesced", _coalesced),
]


@pytest.mark.parametrize(("outcome", "send"), DEDUP_CASES, ids=[c[0] for c in DEDUP_CASES])
def test_dedup_span_outcome(served: Served, outcome: str, send: Callable[[str], tuple[str, str]]) -> None:
    trace_id, kind = send(served.serve.address)
    spans = served.receiver.wait_for(lambda got: any(s.name == "dedup.lookup" for s in _in_trace(got, trace_id)))
    [lookup] = [s for s in _in_trace(spans, trace_id) if s.name == "dedup.lookup"]
    assert (lookup.attrs["coalesce.dedup.kind"], lookup.attrs["coalesce.dedup.outcome"]) == (kind, outcome)


SERIES = [
    "gen_ai_server_time_to_first_token_seconds_count", "coalesce_time_to_first_token_without_queue_seconds_count",
    "gen_ai_server_time_per_output_token_seconds_count", "gen_ai_server_request_duration_seconds_count",
    "coalesce_batch_buffer_dwell_seconds_count", "coalesce_running_sequences", "coalesce_waiting_sequences",
    "coalesce_step_batch_size_count", "coalesce_step_tokens_count", "coalesce_kv_blocks_used",
    "coalesce_kv_blocks_free", "coalesce_prefix_cache_query_tokens_total", "coalesce_prefix_cache_hit_tokens_total",
    "coalesce_dedup_total", "coalesce_preemptions_total", "coalesce_worker_busy_fraction", "coalesce_requests_total",
    "coalesce_worker_lost_total", "coalesce_steps_total", "coalesce_step_forward_seconds_total",
    "coalesce_step_loop_seconds_total", "coalesce_kv_cache_dtype",
]  # fmt: skip


def _total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.split("{")[0] == name)


def test_metrics_during_and_after_a_load(served: Served) -> None:
    n = 24
    before = served.scrape()
    during: list[dict[str, float]] = []

    async def load() -> None:
        async with AsyncCoalesceClient(served.serve.address) as client:
            gens = [client.generate(f"load {i} " * (1 + i % 5), max_tokens=12, ignore_eos=True).result()
                    for i in range(n)]  # fmt: skip
            task = asyncio.gather(*gens)
            await asyncio.sleep(0.2)
            during.append(await asyncio.to_thread(served.scrape))
            await task

    threading.Thread(target=lambda: asyncio.run(load())).run()  # its own loop, outside pytest-asyncio's
    after = served.scrape()
    for name in SERIES:
        assert any(k.split("{")[0] == name for k in during[0]), f"{name} missing while loaded"
    delta = {name: _total(after, name) - _total(before, name) for name in SERIES}
    assert delta["coalesce_requests_total"] == n
    assert delta["gen_ai_server_time_to_first_token_seconds_count"] == n
    assert delta["coalesce_time_to_first_token_without_queue_seconds_count"] == n
    assert delta["gen_ai_server_request_duration_seconds_count"] == n
    assert delta["gen_ai_server_time_per_output_token_seconds_count"] == n  # 12 tokens each
    ttft = _total(after, "gen_ai_server_time_to_first_token_seconds_sum") - _total(
        before, "gen_ai_server_time_to_first_token_seconds_sum")  # fmt: skip
    no_queue = _total(after, "coalesce_time_to_first_token_without_queue_seconds_sum") - _total(
        before, "coalesce_time_to_first_token_without_queue_seconds_sum")  # fmt: skip
    assert ttft >= no_queue > 0
    assert delta["coalesce_steps_total"] >= 12 and delta["coalesce_step_forward_seconds_total"] > 0
    assert delta["coalesce_step_loop_seconds_total"] >= delta["coalesce_step_forward_seconds_total"]
    assert delta["coalesce_prefix_cache_query_tokens_total"] > 0
    assert _total(after, "coalesce_kv_blocks_used") + _total(after, "coalesce_kv_blocks_free") > 0
    kv_dtype = {k: v for k, v in after.items() if k.startswith("coalesce_kv_cache_dtype{")}
    assert kv_dtype and all('dtype="float32"' in k and v == 1 for k, v in kv_dtype.items())  # the default cache
    assert 0 < _total(during[0], "coalesce_worker_busy_fraction") <= 1
    assert _total(after, "coalesce_running_sequences") == _total(after, "coalesce_waiting_sequences") == 0


def test_json_event_logs_carry_the_trace_id(served: Served) -> None:
    trace_id, _, chunks = generate(served.serve.address, "log me")
    line = served.serve.wait_for_line(rf'"event": "request.finish".*"request_id": "{chunks[0].request_id}"', 10)
    assert f'"trace_id": "{trace_id}"' in line and line.lstrip().startswith("{")
    assert os.environ.get("COALESCE_LOG_FORMAT") is None  # the setting went to the server only


def test_session_generations_get_a_span_each_under_the_session_span(served: Served) -> None:
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    requests = [
        inference_pb2.SessionRequest(stream_id=sid, generate=inference_pb2.SessionGenerate(request=inference_pb2.
            GenerateRequest(text=f"session {sid}", sampling=inference_pb2.SamplingParams(max_tokens=4))))
        for sid in ("a", "b")
    ]  # fmt: skip
    with grpc.insecure_channel(served.serve.address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        responses = list(stub.Session(iter(requests), metadata=[AUTH, ("traceparent", f"00-{trace_id}-{caller}-01")]))
    assert {r.stream_id for r in responses if r.chunk.finish_reason} == {"a", "b"}

    def generations(spans: list[Received]) -> list[Received]:
        return [s for s in _in_trace(spans, trace_id) if s.name.startswith("text_completion ")]

    spans = served.receiver.wait_for(lambda got: len(generations(got)) == 2)
    [session] = [s for s in _in_trace(spans, trace_id) if s.name.endswith("/Session")]
    assert session.parent_id == caller
    assert all(
        g.parent_id == session.span_id and g.attrs["gen_ai.usage.output_tokens"] >= 1 for g in generations(spans)
    )
