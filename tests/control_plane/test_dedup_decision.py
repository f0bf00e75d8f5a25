"""The dedup decision without processes: a real store (memory, or a redis-server from the fixture for what
needs a shared store), this replica's registry (a Dispatcher with no workers), and an injected store clock."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from control_plane.config import load_settings
from control_plane.dedup_decision import CONTENT_COALESCED, Attach, Decider, Follow, Lead, Refuse, Replay
from control_plane.dispatcher import Dispatcher
from control_plane.generation import Generation, View
from control_plane.request import Request
from dedup_service import Store, make_store
from protos.coalesce.v1 import inference_pb2, worker_pb2

COALESCED, REPLAYED = inference_pb2.DEDUP_OUTCOME_COALESCED, inference_pb2.DEDUP_OUTCOME_REPLAYED
LEASE_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def request(request_id: str, key: str = "", fp: str = "fp-a", shareable: bool = True, tenant: str = "t") -> Request:
    payload = inference_pb2.GenerateRequest(text=fp, request_id=request_id).SerializeToString() if key else b""
    return Request(request_id, tenant, [1, 2, 3], 4, "interactive", worker_pb2.WorkerSampling(seed=1),
                   fingerprint=fp, shareable=shareable, key=key, payload=payload)  # fmt: skip


def running(registry: Dispatcher, req: Request) -> View:
    """What Dedup does when it leads: the registry knows the request, and its content when shareable."""
    view = registry.register(View(req.request_id, Generation(req.request_id, req.tenant, 3)))
    if req.shareable:
        registry.leaders[(req.tenant, req.fingerprint)] = view
    return view


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def store(clock: Clock) -> AsyncIterator[Store]:
    s = make_store("memory", clock)
    yield s
    await s.close()


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Dispatcher:
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    return Dispatcher(load_settings(), [])


@pytest.fixture
def decider(store: Store, registry: Dispatcher) -> Decider:
    return Decider(store, registry, "replica-a", LEASE_S)


async def test_a_new_unkeyed_request_leads_alone_on_one_replica(decider: Decider) -> None:
    assert await decider.decide(request("r1")) == Lead(("content", "miss"))


async def test_an_unkeyed_id_in_use_here_is_refused(decider: Decider, registry: Dispatcher) -> None:
    running(registry, request("r1"))
    refused = await decider.decide(request("r1", fp="other"))
    assert isinstance(refused, Refuse) and refused.error.code == grpc.StatusCode.ALREADY_EXISTS


async def test_identical_deterministic_requests_attach_to_the_one_running(
    decider: Decider, registry: Dispatcher
) -> None:
    leader = running(registry, request("r1"))
    assert await decider.decide(request("r2")) == Attach(leader, "r2", COALESCED, CONTENT_COALESCED)
    # Not shareable (unseeded sampling, or dedup OFF): computed again.
    assert await decider.decide(request("r3", shareable=False)) == Lead(("content", "miss"))
    # Another tenant never shares.
    assert await decider.decide(request("r4", tenant="u")) == Lead(("content", "miss"))


async def test_a_finished_leader_is_not_attached_to(decider: Decider, registry: Dispatcher) -> None:
    leader = running(registry, request("r1"))
    leader.gen.finish(inference_pb2.FINISH_REASON_STOP, 0.0)
    assert isinstance(await decider.decide(request("r2")), Lead)


async def test_a_keyed_request_claims_then_its_retries_attach_then_replay(
    decider: Decider, registry: Dispatcher, store: Store
) -> None:
    first = request("r1", key="k")
    assert await decider.decide(first) == Lead(("idempotency", "miss"), epoch=1, key="k", log=False)
    view = running(registry, first)
    retry = request("other-id", key="k")  # a retry may carry another request id: the key's wins
    assert await decider.decide(retry) == Attach(view, "r1", COALESCED, ("idempotency", "coalesced"))
    view.gen.finish(inference_pb2.FINISH_REASON_STOP, 0.0)  # finished here, its SUCCESS not yet written
    assert await decider.decide(retry) == Attach(view, "r1", REPLAYED, ("idempotency", "replayed"))
    assert await store.succeed("t", "k", "replica-a", 1, b"", 60)
    replay = await decider.decide(retry)
    assert isinstance(replay, Replay) and replay.record.request_id == "r1"


async def test_a_key_reused_with_another_payload_is_refused(decider: Decider) -> None:
    await decider.decide(request("r1", key="k", fp="fp-a"))
    refused = await decider.decide(request("r2", key="k", fp="fp-b"))
    assert isinstance(refused, Refuse) and refused.report is None
    assert (refused.error.code, refused.error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "IDEMPOTENCY_KEY_REUSED")


async def test_a_failure_by_the_request_replays_as_an_error(decider: Decider, store: Store) -> None:
    await decider.decide(request("r1", key="k"))
    await store.fail("t", "k", "replica-a", 1, "INVALID_ARGUMENT: bad", 60, retryable=False)
    refused = await decider.decide(request("r1", key="k"))
    assert isinstance(refused, Refuse) and refused.report == ("idempotency", "replayed")
    assert (refused.error.code, refused.error.message) == (grpc.StatusCode.INVALID_ARGUMENT, "bad")


async def test_a_key_running_elsewhere_is_followed_and_taken_over_when_its_lease_expires(
    store: Store, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    here, there = Dispatcher(load_settings(), []), Dispatcher(load_settings(), [])
    a, b = Decider(store, here, "replica-a", LEASE_S), Decider(store, there, "replica-b", LEASE_S)
    assert isinstance(await a.decide(request("r1", key="k")), Lead)
    assert await b.decide(request("r1", key="k")) == Follow("r1", "r1", ("idempotency", "coalesced"), key="k")
    clock.now += LEASE_S + 1  # replica a stopped renewing: b takes the key over at the next epoch
    takeover = await b.decide(request("r1", key="k"))
    assert isinstance(takeover, Lead) and takeover.report == ("idempotency", "takeover")
    assert takeover.takeover is not None and takeover.epoch == 2 and takeover.takeover.payload


async def test_a_keyed_request_rides_on_an_identical_unkeyed_one_with_one_replica(
    decider: Decider, registry: Dispatcher
) -> None:
    leader = running(registry, request("r1"))
    ride = await decider.decide(request("r2", key="k"))
    assert ride == Attach(leader, "r2", COALESCED, CONTENT_COALESCED, ride_epoch=1)


async def test_with_a_shared_store_content_leads_on_one_replica_and_is_followed_on_another(
    redis_server: object, clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    url = redis_server.url  # type: ignore[attr-defined]
    store_a, store_b = make_store(url, clock), make_store(url, clock)
    try:
        a = Decider(store_a, Dispatcher(load_settings(), []), "replica-a", LEASE_S)
        b = Decider(store_b, Dispatcher(load_settings(), []), "replica-b", LEASE_S)
        assert await a.decide(request("r1")) == Lead(("content", "miss"), content="fp-a", log=True)
        assert await b.decide(request("r2")) == Follow("r1", "r2", CONTENT_COALESCED, content=True)
        # Keyed requests never ride on a local computation when replicas share the store: the key decides.
        lead = await b.decide(request("r3", key="k"))
        assert lead == Lead(("idempotency", "miss"), epoch=1, key="k", log=True)
    finally:
        await store_a.close()
        await store_b.close()


async def test_batch_items_run_once_and_again_after_failing_by_their_request(decider: Decider, store: Store) -> None:
    item = request("i1", key="batch/b/1")
    lead = await decider.decide_item(item, "b", "1")
    assert isinstance(lead, Lead) and lead.key.startswith("batch/") and lead.report is None
    assert await decider.decide_item(item, "b", "1") is None  # running: skipped
    await store.fail("t", lead.key, "replica-a", lead.epoch, "INVALID_ARGUMENT: bad", 60, retryable=False)
    again = await decider.decide_item(item, "b", "1")
    assert isinstance(again, Lead) and again.epoch > lead.epoch
    await store.succeed("t", again.key, "replica-a", again.epoch, b"", 60)
    assert await decider.decide_item(item, "b", "1") is None  # succeeded: skipped


async def test_request_ids_are_each_tenants_own(decider: Decider, registry: Dispatcher) -> None:
    running(registry, request("r1", tenant="a"))
    assert await decider.decide(request("r1", fp="other", tenant="b")) == Lead(("content", "miss"))
