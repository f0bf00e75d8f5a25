"""Prometheus metrics, on their own CollectorRegistry. The table in docs/observability.md lists
every series; the GenAI histograms use the OpenTelemetry GenAI semantic conventions' bucket boundaries.

Counters and histograms are updated by the Observer on the event loop. Scheduler state (running/waiting per
pool, KV blocks, prefix-cache totals) is read at scrape time by `SchedulerCollector`, which hops onto the
event loop to take the snapshot, because the scheduler is not thread-safe and the HTTP server is a thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from control_plane.scheduler import Stats

# Semantic-convention bucket boundaries (gen_ai.server.* metrics), in seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
DWELL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
GENAI = ("gen_ai_operation_name", "gen_ai_request_model", "pool")


class Metrics:
    """Every series the control plane exports; one instance per process (its own registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.ttft = Histogram("gen_ai_server_time_to_first_token_seconds",
            "Time to first token including batch-buffer queueing: enqueue to first token", GENAI,
            buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.ttft_no_queue = Histogram("coalesce_time_to_first_token_without_queue_seconds",
            "Time to first token minus batch-buffer dwell: admission to first token", GENAI,
            buckets=TTFT_BUCKETS, registry=r)  # fmt: skip
        self.tpot = Histogram("gen_ai_server_time_per_output_token_seconds",
            "Mean time per output token after the first (inter-token latency), per request", GENAI,
            buckets=TPOT_BUCKETS, registry=r)  # fmt: skip
        self.duration = Histogram("gen_ai_server_request_duration_seconds",
            "Request duration: enqueue to finish", GENAI, buckets=DURATION_BUCKETS, registry=r)  # fmt: skip
        self.dwell = Histogram("coalesce_batch_buffer_dwell_seconds",
            "Time a request waited in its pool's batch buffer before admission", ["pool"],
            buckets=DWELL_BUCKETS, registry=r)  # fmt: skip
        self.requests = Counter("coalesce_requests_total", "Finished generations by finish reason",
            ["pool", "finish_reason"], registry=r)  # fmt: skip
        self.dedup = Counter("coalesce_dedup_total", "Dedup decisions", ["kind", "outcome"], registry=r)
        self.preemptions = Counter("coalesce_preemptions_total", "Sequences preempted for recompute", ["pool"],
            registry=r)  # fmt: skip
        self.worker_lost = Counter("coalesce_worker_lost_total", "Times a worker's Step stream broke", ["worker"],
            registry=r)  # fmt: skip
        self.batch_size = Histogram("coalesce_step_batch_size", "Sequences in one step", buckets=BATCH_BUCKETS,
            registry=r)  # fmt: skip
        self.step_tokens = Histogram("coalesce_step_tokens", "Tokens run through the model in one step",
            buckets=TOKEN_BUCKETS, registry=r)  # fmt: skip
        # The serve-load benchmark reads these three by name: keep them unlabelled.
        self.steps = Counter("coalesce_steps_total", "Steps run on all workers", registry=r)
        self.forward_s = Counter("coalesce_step_forward_seconds_total",
            "Worker forward-pass time summed over steps (StepResponse.forward_ms)", registry=r)  # fmt: skip
        self.loop_s = Counter("coalesce_step_loop_seconds_total",
            "Control-plane step loop time summed over steps (send to complete)", registry=r)  # fmt: skip


class BusyMeter:
    """Busy fraction over a sliding window of two halves: (previous + current busy) / their wall time."""

    def __init__(self, now: float, window_s: float = 10.0) -> None:
        self.half = window_s / 2
        self.start = now
        self.busy = 0.0
        self.prev_busy = 0.0
        self.prev_len = 0.0

    def add(self, now: float, seconds: float) -> None:
        self._roll(now)
        self.busy += seconds

    def fraction(self, now: float) -> float:
        self._roll(now)
        wall = self.prev_len + (now - self.start)
        return 0.0 if wall <= 0 else min(1.0, (self.prev_busy + self.busy) / wall)

    def _roll(self, now: float) -> None:
        if now - self.start >= self.half:
            # A long idle gap leaves nothing of the old window behind.
            stale = now - self.start >= 2 * self.half
            self.prev_busy, self.prev_len = (0.0, 0.0) if stale else (self.busy, now - self.start)
            self.busy, self.start = 0.0, now


@dataclass(slots=True)
class Snapshot:
    worker: str
    stats: Stats
    busy: float
    kv_dtype: str = ""  # what the worker's KV cache holds now: the model's dtype or "int8"


class SchedulerCollector(Collector):
    """Per-worker scheduler gauges and prefix-cache counters, taken on the event loop at scrape time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, snapshot: Callable[[], list[Snapshot]]) -> None:
        self.loop = loop
        self.snapshot = snapshot

    def _take(self) -> list[Snapshot]:
        try:
            running_here = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            running_here = False
        if running_here or self.loop.is_closed():
            return self.snapshot() if running_here else []
        future: concurrent.futures.Future[list[Snapshot]] = concurrent.futures.Future()

        def take() -> None:
            try:
                future.set_result(self.snapshot())
            except Exception as exc:  # reported to the scraping thread
                future.set_exception(exc)

        self.loop.call_soon_threadsafe(take)
        try:
            return future.result(timeout=2.0)
        except (TimeoutError, RuntimeError):
            return []  # the loop is stuck or stopping: better no gauges than a hung scrape

    def collect(self) -> Iterable[Metric]:
        snaps = self._take()
        running = GaugeMetricFamily("coalesce_running_sequences", "Sequences running (holding KV)",
                                    labels=["worker", "pool"])  # fmt: skip
        waiting = GaugeMetricFamily("coalesce_waiting_sequences", "Sequences in the batch buffer",
                                    labels=["worker", "pool"])  # fmt: skip
        used = GaugeMetricFamily("coalesce_kv_blocks_used", "KV blocks held by sequences", labels=["worker"])
        free = GaugeMetricFamily("coalesce_kv_blocks_free", "KV blocks free or evictable", labels=["worker"])
        queries = CounterMetricFamily("coalesce_prefix_cache_query_tokens", "Prompt tokens looked up in the "
                                      "prefix cache at admission", labels=["worker"])  # fmt: skip
        hits = CounterMetricFamily("coalesce_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                   labels=["worker"])  # fmt: skip
        busy = GaugeMetricFamily("coalesce_worker_busy_fraction",
                                 "Fraction of wall time the worker spent in forward passes (last ~10 s)",
                                 labels=["worker"])  # fmt: skip
        kv_dtype = GaugeMetricFamily("coalesce_kv_cache_dtype", "1 for the dtype the worker's KV cache holds now "
                                     "(the model's, or int8 once an auto cache converted)",
                                     labels=["worker", "dtype"])  # fmt: skip
        for s in snaps:
            if s.kv_dtype:
                kv_dtype.add_metric([s.worker, s.kv_dtype], 1)
            for pool, n in s.stats.running.items():
                running.add_metric([s.worker, pool], n)
            for pool, n in s.stats.waiting.items():
                waiting.add_metric([s.worker, pool], n)
            used.add_metric([s.worker], s.stats.kv_used)
            free.add_metric([s.worker], s.stats.kv_free)
            queries.add_metric([s.worker], s.stats.prefix_queries)
            hits.add_metric([s.worker], s.stats.prefix_hits)
            busy.add_metric([s.worker], s.busy)
        yield from (running, waiting, used, free, queries, hits, busy, kv_dtype)


def serve_metrics(metrics: Metrics, port: int, host: str) -> Callable[[], None]:
    """Start the /metrics HTTP server in a daemon thread; returns the function that stops it."""
    server, _thread = start_http_server(port, addr=host, registry=metrics.registry)
    return server.shutdown
