"""Process entry points: `coalesce serve` (control plane + spawned workers, embedded defaults) and
`coalesce control-plane` (against workers started elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from control_plane.config import Settings
from control_plane.dedup import Deduper
from control_plane.dispatcher import Dispatcher
from control_plane.observer import Fanout
from control_plane.server import InferenceService
from control_plane.telemetry.logs import configure_logging
from control_plane.telemetry.setup import Telemetry
from control_plane.worker_procs import WorkerProcess, spawn_workers
from dedup_service import make_store
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
DRAIN_S = 10.0
BUILTIN_NOTE = (
    "note: the built-in model's output is noise; `--model smollm2`, a .gguf file or a checkpoint directory loads a "
    "real model"
)


async def serve_control_plane(
    settings: Settings,
    addresses: list[str],
    on_ready: Callable[[int, Dispatcher], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the public API until `stop` is set; then drain: NOT_SERVING, finish in-flight calls, stop."""
    stop = stop or asyncio.Event()
    telemetry = Telemetry.start(settings)
    dispatcher = Dispatcher(settings, addresses, observer=telemetry.observer)
    await dispatcher.start()
    telemetry.bind(dispatcher)
    store = make_store(settings.store)
    deduper = Deduper(dispatcher, store, settings)
    dispatcher.observer = Fanout(deduper, dispatcher.observer)  # dedup bookkeeping before telemetry
    deduper.start()
    server = grpc.aio.server(
        interceptors=telemetry.interceptors,
        options=[
            ("grpc.max_receive_message_length", settings.max_request_bytes),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ],
    )
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(InferenceService(dispatcher, deduper, settings), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    try:
        if on_ready is not None:
            result = on_ready(port, dispatcher)
            if result is not None:
                await result
        await stop.wait()
    finally:
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(grace=DRAIN_S)
        await dispatcher.stop()
        await deduper.stop()
        await store.close()
        telemetry.stop()  # flushes buffered spans


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _supervise(workers: list[WorkerProcess]) -> None:
    while True:
        await asyncio.sleep(0.2)
        for w in workers:
            w.ensure_running()


def run_serve(settings: Settings, demo: bool = False, workers: list[WorkerProcess] | None = None) -> None:
    """`coalesce serve`: spawn the workers first (before any gRPC object exists here), then serve. `workers`:
    already spawned (the CLI starts them before importing this module, so models load meanwhile)."""
    configure_logging(settings.log_format)
    if workers is None:
        workers = spawn_workers(settings.worker, settings.workers)

    async def main() -> None:
        stop = asyncio.Event()
        _install_signals(stop)
        supervisor = asyncio.create_task(_supervise(workers))

        async def ready(port: int, dispatcher: Dispatcher) -> None:
            info = dispatcher.info
            print(
                f"coalesce serving {info.model_name} on {settings.host}:{port} "
                f"({len(workers)} worker(s), {info.device}, {info.dtype}); Ctrl-C stops",
                flush=True,
            )
            if info.model_name == "builtin":
                print(BUILTIN_NOTE, flush=True)
            if demo:
                from control_plane.demo import run_demo

                await run_demo(f"{settings.host}:{port}")

        serving = asyncio.create_task(serve_control_plane(settings, [w.address for w in workers], ready, stop))
        try:
            await asyncio.wait({serving, supervisor}, return_when=asyncio.FIRST_COMPLETED)
            if supervisor.done():  # a worker exited for bad input (it printed why): stop, do not wait for it
                serving.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await serving
                supervisor.result()
            await serving
        finally:
            supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await supervisor

    try:
        asyncio.run(main())
    finally:
        for w in workers:
            w.stop()
        print("coalesce stopped", flush=True)


def run_control_plane(settings: Settings) -> None:
    """`coalesce control-plane --worker HOST:PORT ...`."""
    configure_logging(settings.log_format)

    async def main() -> None:
        stop = asyncio.Event()
        _install_signals(stop)

        def ready(port: int, dispatcher: Dispatcher) -> None:
            print(
                f"coalesce control plane on {settings.host}:{port} -> {', '.join(settings.worker_addresses)}",
                flush=True,
            )

        await serve_control_plane(settings, settings.worker_addresses, ready, stop)

    asyncio.run(main())
