"""A session's steps run back to back on one thread.

The control plane keeps up to two steps queued on the Step stream. Reading them on the event loop and
handing each to a fresh thread hop costs a turnaround per step during which the model idles; instead an
async reader fills a queue and one engine thread drains it, so the next forward pass starts as soon as
the last one ends. Responses go back to the loop in order.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from protos.coalesce.v1 import worker_pb2
from worker.engine import Engine


@dataclass(slots=True)
class Done:
    """One step's outcome: its response, or the exception that ended the session."""

    request: worker_pb2.StepRequest
    response: worker_pb2.StepResponse | None
    error: BaseException | None
    started_ns: int


class StepPipeline:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[worker_pb2.StepRequest | None] = queue.SimpleQueue()
        self._stopped = False

    async def run(self, requests: AsyncIterator[worker_pb2.StepRequest]) -> AsyncIterator[Done]:
        """Each step's outcome, in order; stops after the first error (later queued steps never run)."""
        loop = asyncio.get_running_loop()
        outbox: asyncio.Queue[Done | None] = asyncio.Queue()
        thread = threading.Thread(target=self._work, args=(loop, outbox), name="engine", daemon=True)
        thread.start()
        feeder = asyncio.create_task(self._feed(requests))
        try:
            while (done := await outbox.get()) is not None:
                yield done
                if done.error is not None:
                    return
        finally:
            # A step already queued must never run after this session (the next one resets the engine).
            self._stopped = True
            feeder.cancel()
            self._inbox.put(None)

    async def _feed(self, requests: AsyncIterator[worker_pb2.StepRequest]) -> None:
        try:
            async for req in requests:
                self._inbox.put(req)
        finally:
            self._inbox.put(None)

    def _work(self, loop: asyncio.AbstractEventLoop, outbox: asyncio.Queue[Done | None]) -> None:
        while not self._stopped and (req := self._inbox.get()) is not None and not self._stopped:
            started_ns = time.time_ns()
            try:
                resp = self.engine.step(req)
            except Exception as exc:  # reported to the session, which ends; the worker keeps serving
                loop.call_soon_threadsafe(outbox.put_nowait, Done(req, None, exc, started_ns))
                return
            loop.call_soon_threadsafe(outbox.put_nowait, Done(req, resp, None, started_ns))
        loop.call_soon_threadsafe(outbox.put_nowait, None)
