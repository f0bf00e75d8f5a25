"""Replicas and the exclusive ownership of workers, on both backends, by the injected clock."""

from __future__ import annotations

from dedup_clock import Clock

from dedup_service import Store

LEASE_S = 10.0


async def test_replicas_are_those_whose_heartbeat_holds(store: Store, clock: Clock) -> None:
    await store.heartbeat("cp-b", LEASE_S)
    await store.heartbeat("cp-a", LEASE_S)
    assert await store.replicas() == ["cp-a", "cp-b"]
    clock.advance(6)
    await store.heartbeat("cp-a", LEASE_S)
    clock.advance(5)  # cp-b's beat is 11 s old
    assert await store.replicas() == ["cp-a"] and not await store.alive("cp-b")


async def test_a_worker_has_one_owner_until_its_lease_expires_or_it_is_released(
    store: Store, peer: Store, clock: Clock
) -> None:
    assert await store.claim_worker("w0:50061", "cp-a", LEASE_S)
    assert not await peer.claim_worker("w0:50061", "cp-b", LEASE_S)  # another replica holds it
    assert await store.claim_worker("w0:50061", "cp-a", LEASE_S)  # a renewal
    assert await peer.claim_worker("w1:50061", "cp-b", LEASE_S)
    assert await store.worker_owners() == {"w0:50061": "cp-a", "w1:50061": "cp-b"}
    clock.advance(LEASE_S + 1)  # cp-a stopped renewing (it died): its worker is free
    assert await peer.worker_owners() == {}
    assert await peer.claim_worker("w0:50061", "cp-b", LEASE_S)
    assert not await store.release_worker("w0:50061", "cp-a")  # not its any more
    assert await peer.release_worker("w0:50061", "cp-b")
    assert await store.claim_worker("w0:50061", "cp-a", LEASE_S)  # released: free at once
