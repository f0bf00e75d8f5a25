"""The worker's gRPC edge: WorkerService (Info, Step), health and reflection over grpc.aio.

Each RPC maps to one short method; all decisions live in the Engine. The forward pass runs in a thread so
the event loop keeps answering health checks and Info while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from protos.coalesce.v1 import worker_pb2, worker_pb2_grpc
from worker.config import WorkerSettings
from worker.engine import Engine, StepError
from worker.pipeline import StepPipeline
from worker.runner import ModelRunner
from worker.telemetry import StepSpans

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
# The tokenizer alone can be several MB; gRPC's default receive limit is 4 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
GRACE_S = 5.0


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    """One scheduler session at a time over an Engine (None until the model has loaded)."""

    def __init__(
        self,
        engine: Engine | None = None,
        clock: Callable[[], float] = time.perf_counter,
        spans: StepSpans | None = None,
    ) -> None:
        self.engine = engine
        self.clock = clock
        self.spans = spans  # None: tracing off, no per-step cost
        self._session_active = False

    async def _ready(self, context: grpc.aio.ServicerContext) -> Engine:
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker is still loading its model")
        assert self.engine is not None
        return self.engine

    async def Info(self, request: worker_pb2.InfoRequest, context: grpc.aio.ServicerContext) -> worker_pb2.InfoResponse:
        return (await self._ready(context)).info()

    async def Step(
        self, request_iterator: AsyncIterator[worker_pb2.StepRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepResponse]:
        engine = await self._ready(context)
        if self._session_active:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "another scheduler session is active")
        self._session_active = True
        try:
            # The engine's lock makes this wait for a step still running from a cancelled session.
            await asyncio.to_thread(engine.reset)
            async for done in StepPipeline(engine, self.clock).run(request_iterator):
                if isinstance(done.error, StepError):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(done.error))
                if done.error is not None:  # a model failure: end this session, keep the worker serving
                    log.error("step %d failed", done.request.step_id, exc_info=done.error)
                    await context.abort(grpc.StatusCode.INTERNAL, f"step {done.request.step_id} failed: {done.error!r}")
                assert done.response is not None
                if self.spans is not None:
                    self.spans.record(done.request, done.response, done.started_ns)
                yield done.response
        finally:
            self._session_active = False


def _startup_lines(settings: WorkerSettings, engine: Engine, port: int) -> list[str]:
    info = engine.info()
    lines = [
        f"coalesce worker listening on {settings.host}:{port} "
        f"(model {info.model_name}, device {info.device}, {info.num_blocks} KV blocks, KV {info.kv_cache_dtype})"
    ]
    if info.model_name == "builtin":
        lines.append(
            "note: the builtin model has random weights, so its output is noise; --model DIR loads a real checkpoint"
        )
    return lines


async def serve_worker(
    settings: WorkerSettings,
    on_ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
    *,
    runner: ModelRunner | None = None,
) -> None:
    """Serve until `stop` is set or the task is cancelled, then stop gracefully.

    Binds first (health NOT_SERVING, Info/Step UNAVAILABLE), then loads the model unless `runner` is given,
    then reports SERVING and calls `on_ready(bound_port)`.
    """
    service = WorkerService(spans=StepSpans.from_env())
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(service, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    try:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if runner is None:
            runner = await asyncio.to_thread(ModelRunner.from_settings, settings)
        service.engine = Engine(runner)
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        if on_ready is not None:
            on_ready(port)
        await (stop or asyncio.Event()).wait()
    finally:
        await health_servicer.enter_graceful_shutdown()
        await server.stop(GRACE_S)
        if service.spans is not None:
            service.spans.shutdown()  # flush the last steps' spans


def run_worker(settings: WorkerSettings) -> None:
    """The `coalesce worker` command: load the model, serve, stop cleanly on SIGINT/SIGTERM."""
    # Loaded before any gRPC object exists; the listening line below then has everything it names.
    runner = ModelRunner.from_settings(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        def ready(port: int) -> None:
            for line in _startup_lines(settings, Engine(runner), port):
                print(line, flush=True)

        await serve_worker(settings, ready, stop, runner=runner)

    asyncio.run(main())
