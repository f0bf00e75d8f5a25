"""Leaving, against a real `coalesce serve`: on SIGTERM, queued requests are refused at once (UNAVAILABLE
DRAINING, retryable) while running ones finish within drain_s; a request whose caller left while it was
still queued is dropped, not computed for nobody."""

from __future__ import annotations

import asyncio
import queue
import signal
import threading
import time

import pytest
from serve_process import BUILTIN, ServeProcess, scrape

from clients.aio import AsyncCoalesceClient
from clients.client import CoalesceClient
from clients.retry import NO_RETRY
from clients.types import CoalesceError
from control_plane.worker_procs import free_port

pytestmark = pytest.mark.slow
ONE_AT_A_TIME = {"COALESCE_POOLS__INTERACTIVE__MAX_BATCH": "1", "COALESCE_POOLS__INTERACTIVE__MAX_WAIT_MS": "0"}


def test_sigterm_refuses_the_queue_at_once_and_lets_running_requests_finish() -> None:
    metrics = free_port()
    server = ServeProcess(
        *BUILTIN, "--kv-cache-mb", "16", "--metrics-port", str(metrics), env={**ONE_AT_A_TIME, "COALESCE_DRAIN_S": "60"}
    )
    events: queue.Queue[tuple[str, str]] = queue.Queue()
    started = threading.Event()

    def call(name: str, max_tokens: int) -> None:
        with CoalesceClient(server.address, retry=NO_RETRY) as client:
            try:
                tokens = 0
                for chunk in client.generate(name, max_tokens=max_tokens, ignore_eos=True, stream=True):
                    tokens += len(chunk.token_ids)
                    started.set()
                events.put((name, f"done {tokens}"))
            except CoalesceError as err:
                events.put((name, f"{err.code.name} {err.reason}"))

    running = threading.Thread(target=call, args=("running", 1900))
    running.start()
    assert started.wait(60)
    queued = [threading.Thread(target=call, args=(f"queued {i}", 50)) for i in range(6)]
    for t in queued:
        t.start()
    # SIGTERM once all six wait behind the one running (a fixed sleep let a fast machine finish it first).
    deadline = time.monotonic() + 30
    while waiting(metrics) < 6:
        assert time.monotonic() < deadline, "the six never queued"
        time.sleep(0.02)
    server.proc.send_signal(signal.SIGTERM)
    for t in [running, *queued]:
        t.join(90)
    order = [events.get_nowait() for _ in range(events.qsize())]
    assert order[-1] == ("running", "done 1900"), order  # finished within drain_s, after the refusals
    assert sorted(outcome for name, outcome in order if name != "running") == ["UNAVAILABLE DRAINING"] * 6
    assert server.proc.wait(60) == 0


def waiting(metrics_port: int) -> float:
    return sum(v for k, v in scrape(metrics_port).items() if k.startswith("coalesce_waiting_sequences{"))


def test_a_request_left_while_queued_is_dropped() -> None:
    metrics = free_port()
    server = ServeProcess(*BUILTIN, "--kv-cache-mb", "16", "--metrics-port", str(metrics), env=ONE_AT_A_TIME)

    async def leave_the_queue() -> None:
        async with AsyncCoalesceClient(server.address, retry=NO_RETRY) as client:
            first = client.generate("first", max_tokens=1900, ignore_eos=True, stream=True)
            await first.__anext__()  # it runs; the others will queue behind it
            queued = [client.generate(f"q{i}", max_tokens=400, ignore_eos=True, stream=True) for i in range(10)]
            readers = [asyncio.create_task(g.__anext__()) for g in queued]
            await asyncio.sleep(0.5)
            for task in readers:
                task.cancel()  # the callers hang up before their first token
            await asyncio.gather(*readers, return_exceptions=True)
            await first.aclose()

    try:
        asyncio.run(leave_the_queue())
        cancelled = 0.0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and cancelled < 10:
            samples = scrape(metrics)
            cancelled = samples.get('coalesce_requests_total{finish_reason="cancelled",pool="interactive"}', 0.0)
            time.sleep(0.2)
        assert cancelled == 10  # dropped at once (the first, started, is left to the resume grace period)
        assert scrape(metrics).get('coalesce_requests_total{finish_reason="length",pool="interactive"}', 0.0) == 0
    finally:
        server.stop()
