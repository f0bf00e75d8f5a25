"""Shared fixtures: a real redis-server on a free port, and real grpc.aio servers on 127.0.0.1.
Authentication is on in every server the tests start (tests.session_env.py)."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator
from pathlib import Path

import grpc
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["smollm2_fixtures"]  # SmolLM2's converted cache and transformers reference, once per session

import tests.session_env  # noqa: E402, F401  (sets the environment every test and spawned process inherits)
from bench.common import RedisServer, RedisTls  # noqa: E402, F401  (re-exported for tests)

# What a test passes to start a server: functions that add servicers to it (grpc's `add_*_to_server`).
AddServicers = Callable[[grpc.aio.Server], None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a `coalesce` process (tests/e2e/serve_process.py) shows that process's last output:
    a hang or a lost request is diagnosed from the server's side, not only from the client's stack."""
    report = yield
    if report.failed:
        for name, value in getattr(item, "funcargs", {}).items():
            lines = getattr(value, "lines", None)
            if isinstance(lines, list) and hasattr(value, "proc"):
                report.sections.append((f"output of fixture {name!r} (last 80 lines)", "".join(lines[-80:])))
    return report
