"""rediss://: the Redis store over TLS, against a TLS-only redis-server with a test CA (tls_certs.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from dedup_clock import Clock

from dedup_service import LogAppend, LogEntry, Outcome, StoreUnavailable, make_store
from tests.conftest import RedisServer, RedisTls
from tests.tls_certs import CertAuthority


@pytest.fixture
def ca(tmp_path: Path) -> CertAuthority:
    return CertAuthority(tmp_path)


def tls_server(folder: Path, ca: CertAuthority, auth_clients: bool) -> RedisServer:
    cert, key = ca.issue("redis-server")
    return RedisServer(folder, tls=RedisTls(ca.path, cert, key, auth_clients))


@pytest.fixture
def tls_redis(tmp_path: Path, ca: CertAuthority) -> Iterator[RedisServer]:
    server = tls_server(tmp_path, ca, auth_clients=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def mtls_redis(tmp_path: Path, ca: CertAuthority) -> Iterator[RedisServer]:
    server = tls_server(tmp_path, ca, auth_clients=True)
    try:
        yield server
    finally:
        server.stop()


async def round_trip(url: str, clock: Clock) -> None:
    store = make_store(url, clock)
    try:
        assert (await store.claim("t", "k", "cp-a", "fp", "r1", 10)).outcome == Outcome.CLAIMED
        assert await store.append_many([LogAppend("t", "r1", "cp-a", 1, 0, [LogEntry(7, "x")])]) == [True]
        log = await store.read("t", "r1", 0)
        assert log is not None and log.entries == [LogEntry(7, "x")]
    finally:
        await store.close()


async def refused(url: str, clock: Clock, port: int) -> None:
    store = make_store(url, clock)
    try:
        with pytest.raises(StoreUnavailable, match="redis store is unavailable") as err:
            await store.get("t", "k")
        assert str(port) not in str(err.value) and "127.0.0.1" not in str(err.value)
    finally:
        await store.close()


async def test_rediss_with_the_ca_works_and_without_it_is_unavailable(
    tls_redis: RedisServer, ca: CertAuthority, clock: Clock
) -> None:
    await round_trip(f"{tls_redis.url}?ssl_ca_certs={ca.path}", clock)
    # The server's certificate is not signed by a CA the client trusts.
    await refused(tls_redis.url, clock, tls_redis.port)
    other = CertAuthority(ca.folder, "another CA")
    await refused(f"{tls_redis.url}?ssl_ca_certs={other.path}", clock, tls_redis.port)
    # A plain connection to the TLS port gets nowhere either.
    await refused(tls_redis.url.replace("rediss://", "redis://"), clock, tls_redis.port)


async def test_rediss_with_a_client_certificate(mtls_redis: RedisServer, ca: CertAuthority, clock: Clock) -> None:
    cert, key = ca.issue("control-plane")
    base = f"{mtls_redis.url}?ssl_ca_certs={ca.path}"
    await round_trip(f"{base}&ssl_certfile={cert}&ssl_keyfile={key}&ssl_cert_reqs=required", clock)
    # The server asks for a client certificate: without one the handshake fails.
    await refused(base, clock, mtls_redis.port)
