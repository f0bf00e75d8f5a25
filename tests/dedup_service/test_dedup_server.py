"""DedupService over a real grpc.aio server, on both backends."""

from __future__ import annotations

import asyncio
import functools
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from dedup_clock import Clock
from grpc_checks import check_standard_services
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from dedup_service import LogAppend, LogEntry, Store, make_store
from dedup_service.server import DedupServicer, serve_dedup
from protos.coalesce.v1 import dedup_pb2, dedup_pb2_grpc, inference_pb2
from security.settings import AuthSettings
from security.tokens import Authenticator, digest

T = "tenant-a"
TOKENS = {f"secret-of-{t}": t for t in (T, "tenant-b")}
AUTH = Authenticator(AuthSettings(tokens={digest(token): tenant for token, tenant in TOKENS.items()}))


class AsTenant(grpc.aio.UnaryUnaryClientInterceptor):
    """Calls carry the bearer token of the tenant their request names (an operator acting as that tenant)."""

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        token = next((tok for tok, tenant in TOKENS.items() if tenant == request.tenant), "")
        metadata = [*(details.metadata or ()), ("authorization", f"Bearer {token}")] if token else details.metadata
        return await continuation(details._replace(metadata=metadata), request)


@pytest.fixture
async def stub(
    store: Store, grpc_server: Callable[..., Awaitable[str]]
) -> AsyncIterator[dedup_pb2_grpc.DedupServiceStub]:
    add = functools.partial(dedup_pb2_grpc.add_DedupServiceServicer_to_server, DedupServicer(store, AUTH))
    address = await grpc_server(add)
    async with grpc.aio.insecure_channel(address, interceptors=[AsTenant()]) as channel:
        yield dedup_pb2_grpc.DedupServiceStub(channel)


async def code_of(call: Awaitable[object]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_lookup_by_key_and_request_id(store: Store, stub: dedup_pb2_grpc.DedupServiceStub, clock: Clock) -> None:
    await store.claim(T, "k1", "cp-a", "ab" * 32, "r1", 10)
    await store.mark_processing(T, "k1", "cp-a", 1)
    await store.append_many([LogAppend(T, "r1", "cp-a", 1, 0, [LogEntry(1, "a"), LogEntry(2, "b")])])
    clock.advance(4)

    running = await stub.Lookup(dedup_pb2.LookupRequest(tenant=T, idempotency_key="k1"))
    assert running.state == dedup_pb2.RECORD_STATE_PROCESSING
    assert (running.owner, running.epoch, running.request_id) == ("cp-a", 1, "r1")
    assert (running.fingerprint, running.logged_tokens, running.ttl_ms) == ("ab" * 32, 2, 6000)

    result = inference_pb2.GenerateResponse(request_id="r1", token_ids=[1, 2], text="ab")
    await store.succeed(T, "k1", "cp-a", 1, result.SerializeToString(), 3600)
    done = await stub.Lookup(dedup_pb2.LookupRequest(tenant=T, request_id="r1"))
    assert (done.state, done.text, done.ttl_ms) == (dedup_pb2.RECORD_STATE_SUCCESS, "ab", 3_600_000)

    await store.start_request(T, "plain", "cp-b")
    plain = await stub.Lookup(dedup_pb2.LookupRequest(tenant=T, request_id="plain"))
    assert (plain.state, plain.owner, plain.epoch) == (dedup_pb2.RECORD_STATE_PROCESSING, "cp-b", 1)


async def test_lookup_errors(store: Store, stub: dedup_pb2_grpc.DedupServiceStub) -> None:
    await store.claim(T, "k1", "cp-a", "fp", "r1", 10)
    code, details = await code_of(stub.Lookup(dedup_pb2.LookupRequest(tenant=T, idempotency_key="nope")))
    assert code == grpc.StatusCode.NOT_FOUND and "idempotency key 'nope'" in details
    code, details = await code_of(stub.Lookup(dedup_pb2.LookupRequest(tenant=T, request_id="nope")))
    assert code == grpc.StatusCode.NOT_FOUND and "request 'nope'" in details
    # Another tenant's record does not exist for you.
    code, _ = await code_of(stub.Lookup(dedup_pb2.LookupRequest(tenant="tenant-b", request_id="r1")))
    assert code == grpc.StatusCode.NOT_FOUND
    for bad in (  # (a request naming no tenant is the caller's own: test_the_tenant_comes_from_the_callers_token)
        dedup_pb2.LookupRequest(tenant=T),
        dedup_pb2.LookupRequest(tenant=T, request_id=""),
    ):
        code, _ = await code_of(stub.Lookup(bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await code_of(stub.Purge(dedup_pb2.PurgeRequest(tenant=T)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, _ = await code_of(stub.ListBatch(dedup_pb2.ListBatchRequest(tenant=T)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_purge(store: Store, stub: dedup_pb2_grpc.DedupServiceStub) -> None:
    await store.claim(T, "k1", "cp-a", "fp", "r1", 10)
    await store.start_request(T, "plain", "cp-a")
    assert (await stub.Purge(dedup_pb2.PurgeRequest(tenant=T, idempotency_key="k1"))).purged
    assert not (await stub.Purge(dedup_pb2.PurgeRequest(tenant=T, idempotency_key="k1"))).purged
    assert not (await stub.Purge(dedup_pb2.PurgeRequest(tenant="tenant-b", request_id="plain"))).purged
    assert (await stub.Purge(dedup_pb2.PurgeRequest(tenant=T, request_id="plain"))).purged
    assert await store.get(T, "k1") is None and await store.lookup_request(T, "plain") is None


async def test_same_request_id_in_two_tenants(store: Store, stub: dedup_pb2_grpc.DedupServiceStub) -> None:
    await store.claim(T, "k1", "cp-a", "fp", "r1", 10)
    await store.start_request("tenant-b", "r1", "cp-b")
    await store.append_many([LogAppend("tenant-b", "r1", "cp-b", 1, 0, [LogEntry(1, "a")])])
    a = await stub.Lookup(dedup_pb2.LookupRequest(tenant=T, request_id="r1"))
    b = await stub.Lookup(dedup_pb2.LookupRequest(tenant="tenant-b", request_id="r1"))
    assert (a.owner, a.fingerprint, a.logged_tokens) == ("cp-a", "fp", 0)
    assert (b.owner, b.fingerprint, b.logged_tokens) == ("cp-b", "", 1)
    # Purging tenant B's request leaves tenant A's.
    assert (await stub.Purge(dedup_pb2.PurgeRequest(tenant="tenant-b", request_id="r1"))).purged
    code, _ = await code_of(stub.Lookup(dedup_pb2.LookupRequest(tenant="tenant-b", request_id="r1")))
    assert code == grpc.StatusCode.NOT_FOUND
    assert (await stub.Lookup(dedup_pb2.LookupRequest(tenant=T, request_id="r1"))).owner == "cp-a"
    assert (await stub.Purge(dedup_pb2.PurgeRequest(tenant=T, request_id="r1"))).purged
    assert await store.get(T, "k1") is None


async def test_list_batch(store: Store, stub: dedup_pb2_grpc.DedupServiceStub) -> None:
    for seq in ("2", "1", "3"):
        await store.claim_item(T, "job", seq, "cp-a", f"fp{seq}", f"r{seq}", 10)
    usage = inference_pb2.Usage(prompt_tokens=3, completion_tokens=2)
    result = inference_pb2.GenerateResponse(
        token_ids=[5, 6], text="hi", finish_reason=inference_pb2.FINISH_REASON_STOP, usage=usage
    )
    await store.succeed(T, "batch/job/1", "cp-a", 1, result.SerializeToString(), 3600)
    await store.fail(T, "batch/job/3", "cp-a", 1, "bad prompt", 3600, retryable=False)

    items = (await stub.ListBatch(dedup_pb2.ListBatchRequest(tenant=T, batch_id="job"))).items
    assert [i.seq_id for i in items] == ["1", "2", "3"]
    assert items[0].state == inference_pb2.ITEM_STATE_SUCCESS
    assert (list(items[0].token_ids), items[0].text, items[0].usage.completion_tokens) == ([5, 6], "hi", 2)
    assert items[0].finish_reason == inference_pb2.FINISH_REASON_STOP and items[0].request_id == "r1"
    assert items[1].state == inference_pb2.ITEM_STATE_INIT
    assert (items[2].state, items[2].error) == (inference_pb2.ITEM_STATE_FAILED, "bad prompt")
    other = await stub.ListBatch(dedup_pb2.ListBatchRequest(tenant="tenant-b", batch_id="job"))
    assert list(other.items) == []


async def test_unavailable_when_redis_is_down(redis_server, grpc_server, clock: Clock) -> None:
    store = make_store(redis_server.url, clock)
    address = await grpc_server(
        functools.partial(dedup_pb2_grpc.add_DedupServiceServicer_to_server, DedupServicer(store, AUTH))
    )
    try:
        async with grpc.aio.insecure_channel(address, interceptors=[AsTenant()]) as channel:
            stub = dedup_pb2_grpc.DedupServiceStub(channel)
            redis_server.stop()
            code, details = await code_of(stub.Lookup(dedup_pb2.LookupRequest(tenant=T, idempotency_key="k")))
            assert code == grpc.StatusCode.UNAVAILABLE and "redis store" in details
            redis_server.start()
            code, _ = await code_of(stub.Lookup(dedup_pb2.LookupRequest(tenant=T, idempotency_key="k")))
            assert code == grpc.StatusCode.NOT_FOUND
    finally:
        await store.close()


async def test_serve_dedup_with_health_and_reflection() -> None:
    store = make_store("memory")
    ready: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()
    serving = asyncio.create_task(serve_dedup(store, AUTH, "127.0.0.1", 0, ready.set_result, stop))
    address = await asyncio.wait_for(ready, 10)
    async with grpc.aio.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = await health.Check(health_pb2.HealthCheckRequest(service="coalesce.v1.DedupService"))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        async for response in reflect.ServerReflectionInfo(iter([request])):
            names = {s.name for s in response.list_services_response.service}
            assert "coalesce.v1.DedupService" in names

    def standard() -> None:
        with grpc.insecure_channel(address) as sync_channel:
            check_standard_services(sync_channel, "coalesce.v1.DedupService")

    await asyncio.to_thread(standard)
    stop.set()
    await asyncio.wait_for(serving, 10)


def test_run_dedup_service_prints_its_address_and_stops_on_sigterm() -> None:
    code = (
        "from dedup_service.server import run_dedup_service; from security.settings import AuthSettings; "
        "run_dedup_service('memory', '127.0.0.1', 0, AuthSettings(disabled=True))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("dedup service listening on 127.0.0.1:"), line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_the_tenant_comes_from_the_callers_token(
    store: Store, grpc_server: Callable[..., Awaitable[str]]
) -> None:
    await store.claim(T, "k1", "cp-a", "fp", "r1", 10)
    add = functools.partial(dedup_pb2_grpc.add_DedupServiceServicer_to_server, DedupServicer(store, AUTH))
    address = await grpc_server(add)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = dedup_pb2_grpc.DedupServiceStub(channel)
        b = (("authorization", "Bearer secret-of-tenant-b"),)
        # Tenant B naming tenant A: refused; not naming it: B's own (empty) records, A's key untouched.
        code, _ = await code_of(stub.Purge(dedup_pb2.PurgeRequest(tenant=T, idempotency_key="k1"), metadata=b))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert not (await stub.Purge(dedup_pb2.PurgeRequest(idempotency_key="k1"), metadata=b)).purged
        assert await store.get(T, "k1") is not None
        for metadata in ((), (("authorization", "Bearer guess"),)):
            code, _ = await code_of(stub.Lookup(dedup_pb2.LookupRequest(idempotency_key="k1"), metadata=metadata))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        a = (("authorization", f"Bearer secret-of-{T}"),)
        assert (await stub.Lookup(dedup_pb2.LookupRequest(idempotency_key="k1"), metadata=a)).request_id == "r1"
