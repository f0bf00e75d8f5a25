"""A step that raises on the worker ends its requests with INTERNAL instead of being recomputed forever.

Before, the control plane took the failed session for a lost worker and recomputed every sequence, so a request
whose step always raises was retried without end and held every request batched with it (rpc/step_failure.py).
Here a real worker (builtin model, in process) runs an Engine that raises on one prompt token, behind a real
control plane; both on 127.0.0.1, driven through the async client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from clients.aio import AsyncCoalesceClient
from clients.types import CoalesceError
from control_plane.config import load_settings
from control_plane.dispatcher import Dispatcher
from control_plane.embedded import serve_control_plane
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


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    settings = WorkerSettings(model="builtin", device="cpu", dtype="float32", host="127.0.0.1", port=0, kv_cache_mb=8)
    engine = PoisonedEngine(await asyncio.to_thread(ModelRunner.from_settings, settings))
    stop = asyncio.Event()
    worker_port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    worker = asyncio.create_task(serve_worker(settings, worker_port.set_result, stop, engine=engine))
    address = f"127.0.0.1:{await worker_port}"
    ready: asyncio.Future[Stack] = asyncio.get_running_loop().create_future()
    cp_settings = load_settings(host="127.0.0.1", port=0, drain_s=1)

    def on_ready(port: int, dispatcher: Dispatcher) -> None:
        ready.set_result(Stack(f"127.0.0.1:{port}", dispatcher))

    control = asyncio.create_task(serve_control_plane(cp_settings, [address], on_ready, stop))
    up = await ready
    tokenizer = up.dispatcher.tokenizer
    assert tokenizer is not None
    (PoisonedEngine.poison_id,) = tokenizer.encode(POISON, add_special_tokens=False).ids
    try:
        yield up
    finally:
        stop.set()
        await asyncio.gather(control, worker)


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
