"""Sharing the workers found by DNS between replicas: the fair-share policy (pure), and a Fleet's turns
against a real memory store and a real Dispatcher, with a resolver the test controls (no sleeps)."""

from __future__ import annotations

import pytest

from control_plane.config import load_settings
from control_plane.dispatcher import Dispatcher
from control_plane.fleet import Fleet, share
from dedup_service import make_store

W = ["w0:1", "w1:1", "w2:1", "w3:1"]


def test_a_lone_replica_takes_every_worker() -> None:
    assert share(W, {}, [], "a") == (W, [])


def test_replicas_split_the_workers_and_a_newcomer_gets_its_share() -> None:
    owners = dict.fromkeys(W, "a")
    claim, release = share(W, owners, ["a", "b"], "a")
    assert (claim, release) == ([], ["w2:1", "w3:1"])  # b holds none of its 2: a gives 2 up
    assert share(W, {"w0:1": "a", "w1:1": "a"}, ["a", "b"], "b") == (["w2:1", "w3:1"], [])
    assert share(W, {"w0:1": "a", "w1:1": "a", "w2:1": "b"}, ["a", "b"], "a") == ([], [])  # b: 1 of 2, still free


def test_a_dead_replicas_workers_are_taken_when_its_leases_run_out() -> None:
    # b died: its leases ran out, so the store reports its workers unowned; a alone takes them all.
    assert share(W, {"w0:1": "a", "w1:1": "a"}, ["a"], "a") == (["w2:1", "w3:1"], [])


def test_uneven_counts_round_up_and_nobody_thrashes() -> None:
    three = W[:3]
    assert share(three, {"w0:1": "a", "w1:1": "a", "w2:1": "b"}, ["a", "b"], "a") == ([], [])
    assert share(three, {"w0:1": "a", "w1:1": "a", "w2:1": "b"}, ["a", "b"], "b") == ([], [])


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_fleets_on_one_store_drive_disjoint_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    settings = load_settings(worker_dns="workers.test:1", lease_s=3)
    clock = Clock()
    store = make_store("memory", clock)
    store.shared = True  # the policy of a shared store, in one process

    async def resolve(target: str) -> list[str]:
        assert target == "workers.test:1"
        return ["10.0.0.1:1", "10.0.0.2:1"]

    a, b = Dispatcher(settings, []), Dispatcher(settings, [])
    fa, fb = Fleet(a, store, "a", settings, resolve), Fleet(b, store, "b", settings, resolve)
    try:
        await fa.turn()
        assert {link.address for link in a.links} == {"10.0.0.1:1", "10.0.0.2:1"}  # alone: both
        await fb.turn()  # b appears: nothing free yet
        await fa.turn()  # a sees b below its share and hands one over
        await fb.turn()
        driven_a, driven_b = {link.address for link in a.links}, {link.address for link in b.links}
        assert len(driven_a) == len(driven_b) == 1 and driven_a.isdisjoint(driven_b)
        clock.now += 10  # a stops renewing (it died): b takes its worker
        await fb.turn()
        assert {link.address for link in b.links} == {"10.0.0.1:1", "10.0.0.2:1"}
    finally:
        await a.stop()
        await b.stop()
