"""A request whose step raises on the worker, or crashes it, ends with INTERNAL instead of being recomputed forever.

Before, the control plane took a failed session for a lost worker and recomputed every sequence, so a request
whose step always fails was retried without end and held every request batched with it (rpc/step_failure.py,
control_plane/worker_link.py). Here real workers (builtin model) raise at, or die at, a step holding one prompt
token, behind a real control plane; all on 127.0.0.1, driven through the async client.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from clients.aio import AsyncCoalesceClient
from clients.types import CoalesceError
from control_plane.config import load_settings
from control_plane.dispatcher import Dispatcher
from control_plane.embedded import serve_control_plane
from control_plane.worker_link import MAX_WORKER_LOSSES
from control_plane.worker_procs import free_port
from protos.coalesce.v1 import worker_pb2
from worker.config import WorkerSettings
from worker.engine import Engine
from worker.runner import ModelRunner
from worker.server import serve_worker

POISON = "~"  # a prompt with this character makes the worker's step raise


class PoisonedEngine(Engine):
    """The real engine, except that a step holding the poison token raises, as a model failure would."""

    poison_id = -1

    def step(self, req: worker_pb2.StepRequest) -> worker_pb2.StepResponse:
        if any(self.poison_id in work.token_ids for work in req.seqs):
            raise RuntimeError("poisoned step")
        return super().step(req)


@dataclass
class Stack:
    address: str
    dispatcher: Dispatcher


async def control_plane(worker: str) -> tuple[Stack, asyncio.Event, asyncio.Task[None]]:
    """A real control plane in this loop, driving the worker at `worker`; set the event to stop it."""
    ready: asyncio.Future[Stack] = asyncio.get_running_loop().create_future()

    def on_ready(port: int, dispatcher: Dispatcher) -> None:
        ready.set_result(Stack(f"127.0.0.1:{port}", dispatcher))

    stop = asyncio.Event()
    settings = load_settings(host="127.0.0.1", port=0, drain_s=1)
    task = asyncio.create_task(serve_control_plane(settings, [worker], on_ready, stop))
    return await ready, stop, task


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    """A control plane over an in-process worker whose engine raises at the poison token."""
    settings = WorkerSettings(model="builtin", device="cpu", dtype="float32", host="127.0.0.1", port=0, kv_cache_mb=8)
    engine = PoisonedEngine(await asyncio.to_thread(ModelRunner.from_settings, settings))
    stop = asyncio.Event()
    worker_port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    worker = asyncio.create_task(serve_worker(settings, worker_port.set_result, stop, engine=engine))
    up, cp_stop, control = await control_plane(f"127.0.0.1:{await worker_port}")
    tokenizer = up.dispatcher.tokenizer
    assert tokenizer is not None
    (PoisonedEngine.poison_id,) = tokenizer.encode(POISON, add_special_tokens=False).ids
    try:
        yield up
    finally:
        cp_stop.set()
        stop.set()
        await asyncio.gather(control, worker)


@pytest.fixture
def crashing_worker() -> Iterator[tuple[str, list[int]]]:
    """tests/control_plane/crashing_worker.py on a fixed port, restarted whenever it dies (as `coalesce serve`
    restarts its workers); yields its address and the list of its exit codes so far."""
    port, exits, stopping, lock = free_port(), [], threading.Event(), threading.Lock()
    script = Path(__file__).with_name("crashing_worker.py")
    procs: list[subprocess.Popen[bytes]] = []

    def supervise() -> None:
        while True:
            with lock:  # never start one after the teardown stopped the last
                if stopping.is_set():
                    return
                procs.append(subprocess.Popen([sys.executable, str(script), str(port), POISON]))
            exits.append(procs[-1].wait())

    thread = threading.Thread(target=supervise, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}", exits
    finally:
        with lock:
            stopping.set()
            if procs:
                procs[-1].terminate()
        thread.join(timeout=30)


async def test_a_failing_step_ends_its_request_with_internal_and_the_worker_serves_on(stack: Stack) -> None:
    async with AsyncCoalesceClient(stack.address, timeout=60) as client:
        with pytest.raises(CoalesceError) as err:
            await client.generate(f"a {POISON} prompt", max_tokens=8).result()
        assert err.value.code == grpc.StatusCode.INTERNAL
        assert err.value.reason == "WORKER_STEP_FAILED"
        assert "not retried" in str(err.value)
        # The worker serves the next request (a fresh session), and nothing of the failed one is left.
        after = await client.generate("a fine prompt", max_tokens=8).result()
        assert len(after.token_ids) == 8
    scheduler = stack.dispatcher.links[0].scheduler
    assert scheduler is not None and not scheduler.seqs  # (the last finished one's release may be pending)
    assert scheduler.bm.num_used == 0
    assert not stack.dispatcher.running


async def test_a_request_that_crashes_its_worker_ends_after_three_crashes(
    crashing_worker: tuple[str, list[int]],
) -> None:
    address, exits = crashing_worker
    up, stop, control = await control_plane(address)
    try:
        async with AsyncCoalesceClient(up.address, timeout=120) as client:
            with pytest.raises(CoalesceError) as err:
                await client.generate(f"a {POISON} prompt", max_tokens=8).result()
            assert err.value.code == grpc.StatusCode.INTERNAL
            assert err.value.reason == "WORKER_STEP_FAILED"
            assert exits == [1] * MAX_WORKER_LOSSES  # it crashed the worker that often, then was not retried
            after = await client.generate("a fine prompt", max_tokens=8).result()
            assert len(after.token_ids) == 8
        scheduler = up.dispatcher.links[0].scheduler
        assert scheduler is not None and not scheduler.seqs and scheduler.bm.num_used == 0
    finally:
        stop.set()
        await control
