"""Shared fixtures: a real redis-server on a free port, and real grpc.aio servers on 127.0.0.1.
Authentication is on in every server the tests start (tests.session_env.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["smollm2_fixtures"]  # SmolLM2's converted cache and transformers reference, once per session

import tests.session_env  # noqa: E402, F401  (sets the environment every test and spawned process inherits)

# What a test passes to start a server: functions that add servicers to it (grpc's `add_*_to_server`).
AddServicers = Callable[[grpc.aio.Server], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RedisTls:
    """PEM files for a TLS-only redis-server: its certificate and key, and the CA that signed it (and the
    clients' certificates, when `auth_clients`)."""

    ca: Path
    cert: Path
    key: Path
    auth_clients: bool = False


class RedisServer:
    """A redis-server child process on a free port, with nothing persisted.

    `extra_args` go to redis-server as they are (e.g. "--maxmemory", "2mb"); with `tls` it listens with TLS
    only, and `url` is a rediss:// URL (without the CA: a test adds its `ssl_*` options)."""

    def __init__(self, tmp: Path, extra_args: Sequence[str] = (), tls: RedisTls | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run the README's test command, which installs it")
        self.port = free_port()
        self.tls = tls
        self._args = [exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp)]
        if tls is None:
            self.url = f"redis://127.0.0.1:{self.port}/0"
            self._args += ["--port", str(self.port)]
        else:
            self.url = f"rediss://127.0.0.1:{self.port}/0"
            self._args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(tls.cert)]
            self._args += ["--tls-key-file", str(tls.key), "--tls-ca-cert-file", str(tls.ca)]
            self._args += ["--tls-auth-clients", "yes" if tls.auth_clients else "no"]
        self._args += list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def client(self) -> redis.Redis:
        """A plain synchronous client (trusting the test CA, presenting its client certificate under TLS)."""
        if self.tls is None:
            return redis.Redis(port=self.port)
        return redis.Redis(
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.tls.ca),
            ssl_certfile=str(self.tls.cert),
            ssl_keyfile=str(self.tls.key),
        )

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}: {self._args}") from None
                time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server per test; `.stop()` / `.start()` let a test take the store away and back."""
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def redis_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One redis-server shared by a module's tests (for tests that start slow processes once)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def grpc_server() -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Start grpc.aio servers on 127.0.0.1 with a free port: `address = await grpc_server(add_fn, ...)`.

    Each add_fn adds servicers to the server (e.g. a `functools.partial` of `add_XServicer_to_server`).
    Servers are stopped at teardown.
    """
    servers: list[grpc.aio.Server] = []

    async def start(*add_servicers: AddServicers) -> str:
        server = grpc.aio.server()
        for add in add_servicers:
            add(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(grace=None)
