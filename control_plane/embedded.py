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
from control_plane.config import Settings
from control_plane.dedup import Dedup, new_owner
from control_plane.dispatcher import Dispatcher
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
from security.internal import TOKEN_ENV, new_token
from security.local_token import TENANT as LOCAL_TENANT
from security.local_token import ensure_local_token
from security.settings import AuthSettings, ConfigError
from security.tls import public_server_credentials
from security.tokens import Authenticator, digest

log = logging.getLogger(__name__)

SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
DRAIN_S = 10.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")
BUILTIN_NOTE = "note: the built-in model's output is noise; `--model DIR` loads a Hugging Face checkpoint"


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
    limits = Limits.of(dispatcher.info, settings, longest_token_bytes(dispatcher.tokenizer))
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


def with_local_auth(settings: Settings) -> Settings:
    """`coalesce serve` with no tokens configured: accept the local token (made once, readable by this user
    only), which the CLI and the Python client on this machine send by default."""
    if settings.auth.disabled or settings.auth.configured:
        return settings
    token, path = ensure_local_token()
    print(f"auth: accepting the local token in {path} (tenant {LOCAL_TENANT!r}); see docs/security.md", flush=True)
    return settings.model_copy(update={"auth": AuthSettings(tokens={digest(token): LOCAL_TENANT})})


def _install_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def _supervise(workers: list[WorkerProcess]) -> None:
    while True:
        await asyncio.sleep(0.2)
        for w in workers:
            w.ensure_running()


def run_serve(settings: Settings, then: Callable[[str], Awaitable[None]] | None = None) -> None:
    """`coalesce serve`: spawn the workers first (before any gRPC object exists here), then serve."""
    configure_logging(settings.log_format)
    settings = with_local_auth(settings)
    authenticator(settings)  # a configuration that cannot work fails here, in one line, before serving
    # The workers serve only this process: a fresh shared secret, passed in their environment.
    settings = settings.model_copy(update={"internal_token": settings.internal_token or new_token()})
    workers = spawn_workers(settings.worker, settings.workers, env={TOKEN_ENV: settings.internal_token})

    async def main() -> None:
        stop = asyncio.Event()
        _install_signals(stop)
        supervisor = asyncio.create_task(_supervise(workers))

        async def ready(port: int, dispatcher: Dispatcher) -> None:
            info = dispatcher.info
            print(
                f"coalesce serving {info.model_name} on {settings.host}:{port} "
                f"({len(workers)} worker(s), {info.device}); Ctrl-C stops",
                flush=True,
            )
            if info.model_name == "builtin":
                print(BUILTIN_NOTE, flush=True)
            if then is not None:  # e.g. the CLI's demo tour, as a client of this server
                await then(f"{settings.host}:{port}")

        try:
            await serve_control_plane(settings, [w.address for w in workers], ready, stop)
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
