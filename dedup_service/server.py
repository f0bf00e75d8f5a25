"""Thin gRPC `coalesce.v1.DedupService` over a `Store`: for operators and internal callers.

The control plane calls the library directly. A stored result is read as a serialized
`coalesce.v1.GenerateResponse` (the whole generation in one message): that is what the control plane stores.

The tenant is the caller's, from its bearer token (the same tokens as the public API, docs/security.md): a
caller sees and purges only its own tenant's records. A request's `tenant` field, when set, must be that
tenant. With internal_tls the service also requires client certificates signed by the internal CA.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from dedup_service.factory import make_store
from dedup_service.model import RUNNING, Record, RequestInfo, State, StoreUnavailable
from dedup_service.store import Store
from protos.coalesce.v1 import dedup_pb2, dedup_pb2_grpc, inference_pb2
from rpc.malformed import TolerantDecoding
from rpc.standard_services import add_standard_services
from security.settings import AuthSettings, ConfigError, InternalTlsSettings
from security.tls import internal_server_credentials
from security.tokens import Authenticator, Unauthenticated

T = TypeVar("T")

SERVICE_NAME = dedup_pb2.DESCRIPTOR.services_by_name["DedupService"].full_name

RECORD_STATES = {
    State.INIT: dedup_pb2.RECORD_STATE_INIT,
    State.PROCESSING: dedup_pb2.RECORD_STATE_PROCESSING,
    State.SUCCESS: dedup_pb2.RECORD_STATE_SUCCESS,
    State.FAILED: dedup_pb2.RECORD_STATE_FAILED,
}
ITEM_STATES = {
    State.INIT: inference_pb2.ITEM_STATE_INIT,
    State.PROCESSING: inference_pb2.ITEM_STATE_PROCESSING,
    State.SUCCESS: inference_pb2.ITEM_STATE_SUCCESS,
    State.FAILED: inference_pb2.ITEM_STATE_FAILED,
}


class DedupServicer(dedup_pb2_grpc.DedupServiceServicer):
    def __init__(self, store: Store, auth: Authenticator) -> None:
        self.store = store
        self.auth = auth

    async def _tenant(self, request: Any, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant (UNAUTHENTICATED without a valid token); a `tenant` field must name it."""
        try:
            tenant = self.auth.tenant(context.invocation_metadata())
        except Unauthenticated as exc:
            await _abort(context, grpc.StatusCode.UNAUTHENTICATED, str(exc))
        if request.tenant and request.tenant != tenant:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, "the tenant field names another tenant than "
                         "the caller's token; leave it empty")  # fmt: skip
        return tenant

    async def Lookup(self, request: dedup_pb2.LookupRequest, context: grpc.aio.ServicerContext) -> Any:
        tenant = await self._tenant(request, context)
        kind, target = await _target(request, context)
        if kind == "idempotency_key":
            rec = await _call(context, self.store.get(tenant, target))
            if rec is None:
                await _abort(context, grpc.StatusCode.NOT_FOUND, f"no record for idempotency key {target!r}")
            info = await _call(context, self.store.lookup_request(tenant, rec.request_id))
            return self._record(rec, info)
        info = await _call(context, self.store.lookup_request(tenant, target))
        if info is None:
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"no request {target!r}")
        if not info.key:
            return dedup_pb2.LookupResponse(
                state=RECORD_STATES[info.state],
                owner=info.owner,
                epoch=info.epoch,
                request_id=info.request_id,
                logged_tokens=info.logged_tokens,
            )
        rec = await _call(context, self.store.get(tenant, info.key))
        if rec is None or rec.request_id != target:  # the key's record expired or now names a newer request
            await _abort(context, grpc.StatusCode.NOT_FOUND, f"no record for request {target!r}")
        return self._record(rec, info)

    async def Purge(self, request: dedup_pb2.PurgeRequest, context: grpc.aio.ServicerContext) -> Any:
        tenant = await self._tenant(request, context)
        kind, target = await _target(request, context)
        if kind == "idempotency_key":
            purged = await _call(context, self.store.purge(tenant, target))
        else:
            purged = await _call(context, self.store.purge_request(tenant, target))
        return dedup_pb2.PurgeResponse(purged=purged)

    async def ListBatch(self, request: dedup_pb2.ListBatchRequest, context: grpc.aio.ServicerContext) -> Any:
        tenant = await self._tenant(request, context)
        if not request.batch_id:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "batch_id must not be empty")
        items = await _call(context, self.store.list_batch(tenant, request.batch_id))
        response = dedup_pb2.ListBatchResponse()
        for item in items:
            status = response.items.add(seq_id=item.seq_id)
            rec = item.record
            if rec is None:
                status.error = "no record: released after a server-side failure, or expired; resubmit to run it"
                continue
            status.state, status.request_id, status.error = ITEM_STATES[rec.state], rec.request_id, rec.error
            if rec.state == State.SUCCESS:
                result = _result(rec)
                status.text = result.text
                status.token_ids.extend(result.token_ids)
                status.finish_reason = result.finish_reason
                status.usage.CopyFrom(result.usage)
        return response

    def _record(self, rec: Record, info: RequestInfo | None) -> dedup_pb2.LookupResponse:
        deadline = rec.lease_until if rec.state in RUNNING else rec.expires_at
        return dedup_pb2.LookupResponse(
            state=RECORD_STATES[rec.state],
            owner=rec.owner,
            epoch=rec.epoch,
            fingerprint=rec.fingerprint,
            request_id=rec.request_id,
            logged_tokens=info.logged_tokens if info else 0,
            ttl_ms=max(0, round((deadline - self.store.clock()) * 1000)),
            text=_result(rec).text if rec.state == State.SUCCESS else "",
            error=rec.error,
        )


async def _target(request: Any, context: grpc.aio.ServicerContext) -> tuple[str, str]:
    """(which target field is set, its value), or INVALID_ARGUMENT."""
    kind = request.WhichOneof("target")
    if kind is None or not getattr(request, kind):
        await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "set a non-empty idempotency_key or request_id")
    return kind, getattr(request, kind)


async def _call(context: grpc.aio.ServicerContext, op: Awaitable[T]) -> T:
    try:
        return await op
    except StoreUnavailable as e:
        await _abort(context, grpc.StatusCode.UNAVAILABLE, str(e))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("grpc.aio abort returns only by raising")


def _result(rec: Record) -> inference_pb2.GenerateResponse:
    try:
        return inference_pb2.GenerateResponse.FromString(rec.result)
    except DecodeError:
        return inference_pb2.GenerateResponse()  # not ours to interpret: show the state without the text


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_dedup(
    store: Store,
    auth: Authenticator,
    host: str = "127.0.0.1",
    port: int = 0,
    on_ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    tls: InternalTlsSettings | None = None,
) -> None:
    """Serve DedupService (plus grpc.health.v1 and reflection) until `stop` is set (or forever).

    Port 0 picks a free port; `on_ready` gets the bound address. The caller owns (and closes) the store.
    """
    server = grpc.aio.server(interceptors=[TolerantDecoding()])
    dedup_pb2_grpc.add_DedupServiceServicer_to_server(DedupServicer(store, auth), server)
    health = add_standard_services(server, [SERVICE_NAME])
    if tls is not None and tls.enabled:
        bound = server.add_secure_port(_address(host, port), internal_server_credentials(tls))
    else:
        bound = server.add_insecure_port(_address(host, port))
    await server.start()
    for name in ("", SERVICE_NAME):
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    if on_ready is not None:
        on_ready(_address(host, bound))
    try:
        if stop is None:
            await server.wait_for_termination()
        else:
            await stop.wait()
    finally:
        await health.enter_graceful_shutdown()
        await server.stop(grace=2)


def run_dedup_service(
    store_url: str, host: str, port: int, auth: AuthSettings, tls: InternalTlsSettings | None = None
) -> None:
    """`coalesce dedup-service`: serve until SIGINT/SIGTERM, printing the address once listening."""
    if not (auth.disabled or auth.configured):
        raise ConfigError("auth is on but no tokens are configured: set auth.tokens_file or auth.tokens "
                          "(docs/security.md), or auth.disabled: true")  # fmt: skip
    authenticator = Authenticator(auth)

    async def main() -> None:
        store = make_store(store_url)  # inside the loop: the Redis client binds to it
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            ready = lambda a: print(f"dedup service listening on {a}", flush=True)  # noqa: E731
            await serve_dedup(store, authenticator, host, port, ready, stop, tls)
        finally:
            await store.close()

    asyncio.run(main())
