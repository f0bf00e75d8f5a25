"""One worker: its Info, its Scheduler, and the Step stream that runs the scheduler's plans on it.

The loop keeps up to two steps in flight (the scheduler's lookahead): while the worker runs step N, step N+1
is already queued on the stream, so the worker starts it the moment N is done, and the round trip and the
control plane's work for N (complete, schedule N+2, text, fan-out) overlap N+1's forward pass. Results are
read and completed in order. A lost worker (the stream breaks, the process died) hands every sequence back
to the dispatcher for recompute (the steps in flight are discarded) and the link reconnects with backoff;
a restarted worker starts a fresh session. A step that raised on the worker is not a lost worker: its
sequences would raise again, so they end with an error and only the others are recomputed
(rpc/step_failure.py). What is in flight is the scheduler's (`Scheduler.oldest`); the link
only carries plans and results.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from control_plane.config import Settings
from control_plane.scheduler import MAX_INFLIGHT, Scheduler
from control_plane.sequence import SeqEvent, Sequence
from control_plane.step_plan import StepPlan
from protos.coalesce.v1 import worker_pb2, worker_pb2_grpc
from rpc.limits import INTERNAL_CHANNEL_OPTIONS
from rpc.step_failure import failed_step
from security.internal import call_metadata
from security.tls import internal_channel_credentials

log = logging.getLogger(__name__)

# A sequence in flight at this many worker losses ends with an error: a request that crashes its worker would
# otherwise crash it again at each recompute, forever, and take every request batched with it along.
MAX_WORKER_LOSSES = 3

# Capped at 0.25 s: a worker still loading its model is polled often enough that serving starts within a
# quarter second of it being ready (a start is ~3 s in all).
BACKOFF_S = (0.05, 0.1, 0.2, 0.25)


class WorkerLost(Exception):
    """The Step stream broke: the worker's sequences must be recomputed."""


@dataclass(eq=False)
class WorkerLink:
    address: str
    settings: Settings
    # Called synchronously after each step (no awaits on the hot path): (link, plan, events, response, loop_s);
    # loop_s is the wall time between this step's completion and the previous one's (or its send, when the
    # worker was idle before it): the time per step as the control plane sees it.
    on_step: Callable[[WorkerLink, StepPlan, list[SeqEvent], worker_pb2.StepResponse, float], None]
    # Called when the worker was lost ("lost": its sequences were requeued for recompute in this link's
    # scheduler, `requeued` of them running), is still down with work waiting here ("down"), or came back
    # with another cache ("replaced": the scheduler was replaced, so everything must be resubmitted).
    on_lost: Callable[[WorkerLink, int, str], None]
    # Called before on_lost with the sequences that end instead of being recomputed (those of a step that raised
    # on the worker, or in flight at their MAX_WORKER_LOSSES-th loss), and the error that ended the stream.
    on_failed: Callable[[WorkerLink, list[Sequence], str], None]
    clock: Callable[[], float] = time.monotonic
    info: worker_pb2.InfoResponse | None = None
    scheduler: Scheduler | None = None
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    _wake: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: bool = False
    _failed: list[Sequence] = field(default_factory=list)  # of the step the worker reported failing

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return call_metadata(self.settings.internal_token)

    # -- called by the dispatcher ------------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        """Queue a sequence (raises QueueFull)."""
        assert self.scheduler is not None
        self.scheduler.add(seq)
        self._wake.set()

    def abort(self, seq_id: int) -> None:
        if self.scheduler is not None:
            self.scheduler.abort(seq_id)
            self._wake.set()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------------------
    async def run(self) -> None:
        attempt = 0
        async with self._channel() as channel:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            while not self._stopping:
                try:
                    await self._connect(stub)
                    attempt = 0
                    await self._session(stub)
                except (grpc.aio.AioRpcError, WorkerLost) as exc:
                    self._lose(exc)
                    await asyncio.sleep(BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)])
                    attempt += 1

    def _channel(self) -> grpc.aio.Channel:
        """To the worker: mTLS when internal_tls is set (docs/security.md), else plaintext."""
        tls = self.settings.internal_tls
        if not tls.enabled:
            return grpc.aio.insecure_channel(self.address, options=INTERNAL_CHANNEL_OPTIONS)
        creds, options = internal_channel_credentials(tls)
        return grpc.aio.secure_channel(self.address, creds, options=INTERNAL_CHANNEL_OPTIONS + options)

    async def _connect(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        info = await stub.Info(worker_pb2.InfoRequest(), timeout=10, metadata=self._metadata)
        replaced = self.info is not None and _geometry(info) != _geometry(self.info)
        if self.scheduler is None or replaced:
            pools, sched = self.settings.pools, self.settings.scheduler
            self.scheduler = Scheduler(
                info.num_blocks,
                info.block_size,
                pools,
                sched,
                info.max_context,
                self.clock,
                info.kv_block_units or 1,
                info.kv_tail_blocks,
            )
        self.info = info
        self.connected.set()
        log.info("worker %s connected: %s, %d KV blocks", self.address, info.model_name, info.num_blocks)
        if replaced:
            self.on_lost(self, 0, "replaced")

    async def _session(self, stub: worker_pb2_grpc.WorkerServiceStub) -> None:
        assert self.scheduler is not None
        scheduler = self.scheduler
        call = stub.Step(metadata=self._metadata)
        step_id, last = 0, 0.0

        async def send() -> bool:
            """Plan the next step and send it; False when there is nothing to send."""
            nonlocal step_id
            plan = scheduler.schedule()
            if plan is None:
                return False
            step_id += 1
            try:
                await call.write(plan.to_request(step_id))
            except asyncio.InvalidStateError:  # grpc.aio's answer when the call ended: the worker died while idle
                raise WorkerLost(f"worker {self.address} ended the step stream") from None
            return True

        try:
            while not self._stopping:
                if not scheduler.inflight:
                    if not await send():
                        await self._idle(scheduler)
                        continue
                    last = time.perf_counter()  # the worker was idle: this step's time starts now
                if scheduler.inflight < MAX_INFLIGHT:
                    await send()  # the lookahead: work that arrived (or was freed) since the last completion
                try:
                    resp = await call.read()
                except grpc.aio.AioRpcError as exc:
                    if failed_step(exc) == step_id - scheduler.inflight + 1:  # the oldest step in flight raised
                        self._failed = [w.seq for w in scheduler.oldest.works if w.current]
                    raise
                if resp is grpc.aio.EOF:
                    raise WorkerLost(f"worker {self.address} ended the step stream")
                done = scheduler.oldest
                events = scheduler.complete(done, {t.seq_id: t.token.token_id for t in resp.tokens})
                now = time.perf_counter()
                loop_s, last = now - last, now
                try:
                    # Keep the worker fed before handling this step's tokens, so text, fan-out and telemetry
                    # overlap its forward passes (a stop string found in this step wastes the sequence's
                    # token in the step already queued: the scheduler drops it and releases it after).
                    if scheduler.inflight < MAX_INFLIGHT:
                        await send()
                finally:  # even when the worker is gone: these tokens were computed and must reach readers
                    self.on_step(self, done, events, resp, loop_s)
        finally:
            call.cancel()

    async def _idle(self, scheduler: Scheduler) -> None:
        """Sleep until new work arrives or the batch buffer's max_wait expires."""
        self._wake.clear()
        wakeup = scheduler.next_wakeup()
        timeout = None if wakeup is None else max(0.0, wakeup - self.clock())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)

    def _lose(self, exc: Exception) -> None:
        was_connected = self.connected.is_set()
        self.connected.clear()
        failed, self._failed = self._failed, []
        if self._stopping or self.scheduler is None:
            return
        step_failed = bool(failed)  # else the worker was lost: it counts against what was in flight
        if not step_failed:
            for seq in self.scheduler.in_flight():
                seq.worker_losses += 1
                if seq.worker_losses >= MAX_WORKER_LOSSES:
                    failed.append(seq)
        requeued = self.scheduler.requeue_all()
        detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
        if failed:
            self.on_failed(self, failed, detail or "")
            ended = {id(seq) for seq in failed}
            requeued = [seq for seq in requeued if id(seq) not in ended]
        if was_connected:
            # After a failed step the worker is up, but its session (and so its cache) ended with the step.
            what = "ended its session" if step_failed else "lost"
            log.warning("worker %s %s (%s); %d sequences requeued for recompute", self.address, what, detail,
                        len(requeued))  # fmt: skip
            self.on_lost(self, len(requeued), "lost")
        elif self.scheduler.has_work():  # still down: what waits here may move to a worker that is up
            self.on_lost(self, 0, "down")


def _geometry(info: worker_pb2.InfoResponse) -> tuple[int, int, int, int, int]:
    """What the scheduler is built for: a worker that comes back with another cache needs a new one."""
    return info.num_blocks, info.block_size, info.max_context, info.kv_block_units, info.kv_tail_blocks
