"""The worker's gRPC edge: WorkerService (Info, Step), health and reflection over grpc.aio.

Each RPC maps to one short method; all decisions live in the Engine. The forward pass runs in a thread so
the event loop keeps answering health checks and Info while the model computes.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2

from protos.coalesce.v1 import worker_pb2, worker_pb2_grpc
from rpc.limits import INTERNAL_CHANNEL_OPTIONS
from rpc.malformed import TolerantDecoding
from rpc.standard_services import add_standard_services
from rpc.step_failure import failed_step_metadata
from security.internal import RequireToken
from security.settings import ConfigError, InternalTlsSettings
from security.tls import internal_server_credentials
from worker.config import BUILTIN_NOTE, WorkerSettings
from worker.engine import Engine, StepError
from worker.parent import die_with
from worker.pipeline import StepPipeline
from worker.runner import ModelRunner
from worker.telemetry import StepSpans

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name
GRPC_OPTIONS = INTERNAL_CHANNEL_OPTIONS  # the tokenizer alone can be several MB (gRPC's default limit: 4 MiB)
GRACE_S = 5.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")


class WorkerService(worker_pb2_grpc.WorkerServiceServicer):
    """One scheduler session at a time over an Engine (None until the model has loaded)."""

    def __init__(self, engine: Engine | None = None, spans: StepSpans | None = None) -> None:
        self.engine = engine
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
            async for done in StepPipeline(engine).run(request_iterator):
                if done.error is not None:
                    # A failed step ends this session (the worker keeps serving); the metadata tells the control
                    # plane to end that step's sequences rather than recompute them (rpc/step_failure.py).
                    step_id, failed = done.request.step_id, failed_step_metadata(done.request.step_id)
                    if isinstance(done.error, StepError):
                        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(done.error), failed)
                    log.error("step %d failed", step_id, exc_info=done.error)  # a model failure
                    await context.abort(grpc.StatusCode.INTERNAL, f"step {step_id} failed: {done.error!r}", failed)
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
        f"(model {info.model_name}, device {info.device}, dtype {info.dtype}, {info.num_blocks} KV blocks, "
        f"KV {info.kv_cache_dtype})"
    ]
    if info.model_name == "builtin":
        lines.append(BUILTIN_NOTE)
    return lines


def check_access(settings: WorkerSettings, token: str, tls: InternalTlsSettings | None, open_access: bool) -> None:
    """A worker serves only its control plane (docs/security.md): bound beyond loopback it needs the internal
    token or mTLS, unless auth is disabled explicitly."""
    if not (token or (tls is not None and tls.enabled) or open_access or settings.host in LOOPBACK):
        raise ConfigError(
            f"a worker listening on {settings.host} must serve only its control plane: set internal_token "
            "(COALESCE_INTERNAL_TOKEN) or internal_tls (docs/security.md), or auth.disabled: true"
        )


async def serve_worker(
    settings: WorkerSettings,
    on_ready: Callable[[int], None] | None = None,
    stop: asyncio.Event | None = None,
    *,
    runner: ModelRunner | None = None,
    engine: Engine | None = None,
    token: str = "",
    tls: InternalTlsSettings | None = None,
) -> None:
    """Serve until `stop` is set or the task is cancelled, then stop gracefully.

    Binds first (health NOT_SERVING, Info/Step UNAVAILABLE), then loads the model unless `runner` is given,
    then reports SERVING and calls `on_ready(bound_port)`. With `token`, Info and Step need it as a bearer
    token; with `tls`, callers need a client certificate the internal CA signed.
    """
    service = WorkerService(spans=StepSpans.from_env())
    interceptors: list[grpc.aio.ServerInterceptor] = [TolerantDecoding()]
    if token:
        interceptors.append(RequireToken(token, (SERVICE_NAME,)))
    server = grpc.aio.server(interceptors=interceptors, options=GRPC_OPTIONS)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(service, server)
    health_servicer = add_standard_services(server, [SERVICE_NAME])
    address = f"{settings.host}:{settings.port}"
    if tls is not None and tls.enabled:
        port = server.add_secure_port(address, internal_server_credentials(tls))
    else:
        port = server.add_insecure_port(address)
    await server.start()
    try:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if engine is None:
            if runner is None:
                runner = await asyncio.to_thread(ModelRunner.from_settings, settings)
            engine = Engine(runner)
        service.engine = engine
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


def run_worker(
    settings: WorkerSettings,
    *,
    token: str = "",
    tls: InternalTlsSettings | None = None,
    open_access: bool = False,
    parent_pid: int = 0,
) -> None:
    """The `coalesce worker` command: load the model, serve, stop cleanly on SIGINT/SIGTERM (and when the
    `coalesce serve` that spawned it, `parent_pid`, dies)."""
    check_access(settings, token, tls, open_access)
    if parent_pid:
        die_with(parent_pid)
    # Loaded before any gRPC object exists; the listening line below then has everything it names.
    runner = ModelRunner.from_settings(settings)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        engine = Engine(runner)

        def ready(port: int) -> None:
            for line in _startup_lines(settings, engine, port):
                print(line, flush=True)

        await serve_worker(settings, ready, stop, runner=runner, engine=engine, token=token, tls=tls)

    asyncio.run(main())
