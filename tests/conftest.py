"""Shared fixtures: a real redis-server on a free port, and real grpc.aio servers on 127.0.0.1."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["smollm2_fixtures"]  # SmolLM2's converted cache and transformers reference, once per session

# What a test passes to start a server: functions that add servicers to it (grpc's `add_*_to_server`).
AddServicers = Callable[[grpc.aio.Server], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A redis-server child process on a free port, with nothing persisted."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed: run the README's test command, which installs it")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._args = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self._args += ["--dir", str(tmp)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(self._args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
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
