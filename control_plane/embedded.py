"""Process entry points: `coalesce serve` (control plane + spawned workers, embedded defaults) and
`coalesce control-plane` (against workers started elsewhere)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2

from control_plane.admission import Admission, longest_token_bytes
from control_plane.chat import ChatTemplate
from control_plane.config import Settings
from control_plane.dedup import Dedup, new_owner
from control_plane.dispatcher import Dispatcher
from control_plane.local_serve import prepare, worker_env
from control_plane.replication import Replicator
from control_plane.server import InferenceService
from control_plane.telemetry.logs import configure_logging
from control_plane.telemetry.setup import Telemetry
from control_plane.validation import Limits
from control_plane.worker_procs import WorkerProcess, spawn_workers
from dedup_service import make_store
from protos.coalesce.v1 import inference_pb2, inference_pb2_grpc
from rpc.limits import INTERNAL_MESSAGE_BYTES
from rpc.malformed import TolerantDecoding
from rpc.standard_services import add_standard_services
from security.settings import ConfigError
from security.tls import public_server_credentials
from security.tokens import Authenticator
from worker.config import BUILTIN_NOTE

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
DRAIN_S = 10.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")


async def serve_control_plane(
    settings: Settings,
    addresses: list[str],
    on_ready: Callable[[int, Dispatcher], Awaitable[None] | None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the public API until `stop` is set; then drain: NOT_SERVING, finish in-flight calls, stop."""
    stop = stop or asyncio.Event()
    auth = authenticator(settings)
    telemetry = Telemetry.start(settings)
    store = make_store(settings.store)
    journal = Replicator(store, new_owner(), settings)
    dispatcher = Dispatcher(settings, addresses, observer=telemetry.observer, journal=journal)
    await dispatcher.start()
    telemetry.bind(dispatcher)
    assert dispatcher.tokenizer is not None
    info, tokenizer = dispatcher.info, dispatcher.tokenizer
    chat = ChatTemplate.for_model(info.chat_template, info.special_tokens, tokenizer, info.eos_token_ids)
    limits = Limits.of(info, settings, longest_token_bytes(tokenizer), chat)
    admission = Admission(dispatcher.tokenizer, limits, settings)
    dedup = Dedup(dispatcher, store, journal, admission, settings, telemetry.observer)
    dedup.start()
    server = grpc.aio.server(
        interceptors=[TolerantDecoding(), *telemetry.interceptors],
        options=[
            ("grpc.max_receive_message_length", settings.max_request_bytes),
            ("grpc.max_send_message_length", INTERNAL_MESSAGE_BYTES),
        ],
    )
    service = InferenceService(admission, dedup, dispatcher, store, auth, settings)
    inference_pb2_grpc.add_InferenceServiceServicer_to_server(service, server)
    health_servicer = add_standard_services(server, [SERVICE_NAME])
    address = f"{settings.host}:{settings.port}"
    if settings.tls.enabled:
        port = server.add_secure_port(address, public_server_credentials(settings.tls))
    else:
        port = server.add_insecure_port(address)
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
        await dedup.stop()
        await store.close()
        telemetry.stop()  # flushes buffered spans


def authenticator(settings: Settings) -> Authenticator:
    """Who may call: the configured tokens, or nobody checked when auth is disabled explicitly."""
    if settings.auth.disabled:
        if settings.host not in LOOPBACK:
            log.warning("auth is disabled and the API listens on %s: any caller is trusted", settings.host)
    elif not settings.auth.configured:
        raise ConfigError(
            "auth is on but no tokens are configured: set auth.tokens_file or auth.tokens (docs/security.md), "
            "or auth.disabled: true"
        )
    return Authenticator(settings.auth)


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _supervise(workers: list[WorkerProcess]) -> None:
    while True:
        await asyncio.sleep(0.2)
        for w in workers:
            w.ensure_running()


def run_serve(
    settings: Settings, then: Callable[[str], Awaitable[None]] | None = None, workers: list[WorkerProcess] | None = None
) -> None:
    """`coalesce serve`: spawn the workers first (before any gRPC object exists here), then serve. `workers`:
    already spawned (the CLI starts them before importing this module, so models load meanwhile), with
    `settings` from control_plane.local_serve.prepare. `then` runs once serving (e.g. the CLI's demo)."""
    configure_logging(settings.log_format)
    if workers is None:
        settings = prepare(settings)
        workers = spawn_workers(settings.worker, settings.workers, env=worker_env(settings))
    authenticator(settings)  # a configuration that cannot work fails here, in one line, before serving

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
            if then is not None:  # e.g. the CLI's demo tour, as a client of this server
                await then(f"{settings.host}:{port}")

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
    authenticator(settings)  # a configuration that cannot work fails here, in one line, before serving

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
