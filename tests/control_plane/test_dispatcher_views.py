"""The dispatcher's request bookkeeping without workers: views, cancel, and the resume grace period driven
by an injected clock (no sleeps)."""

from __future__ import annotations

import pytest

from control_plane.config import load_settings
from control_plane.dispatcher import Dispatcher
from control_plane.errors import ApiError
from control_plane.generation import Generation, View
from protos.coalesce.v1 import inference_pb2

COALESCED, CANCELLED = inference_pb2.DEDUP_OUTCOME_COALESCED, inference_pb2.FINISH_REASON_CANCELLED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> tuple[Dispatcher, Clock]:
    monkeypatch.delenv("COALESCE_CONFIG", raising=False)
    clock = Clock()
    return Dispatcher(load_settings(resume_grace_s=30), [], clock=clock), clock


def _running(d: Dispatcher, request_id: str, tenant: str = "t") -> View:
    return d.register(View(request_id, Generation(request_id, tenant, prompt_tokens=3)))


def test_a_follower_cancel_spares_the_leader_and_the_last_cancel_stops_it(setup: tuple[Dispatcher, Clock]) -> None:
    d, _ = setup
    leader = _running(d, "a")
    follower = d.join(leader, "b", COALESCED)
    assert d.cancel("b", "t") is True
    assert follower.done and not leader.gen.done and leader.gen.interest == 1
    assert d.cancel("b", "t") is False  # already over
    assert d.cancel("a", "t") is True
    assert leader.gen.done and leader.gen.finish_reason == CANCELLED


def test_other_tenants_never_see_a_request(setup: tuple[Dispatcher, Clock]) -> None:
    d, _ = setup
    _running(d, "secret", tenant="owner")
    with pytest.raises(ApiError, match="unknown or expired"):
        d.cancel("secret", "intruder")


def test_an_abandoned_generation_is_cancelled_after_the_grace_period(setup: tuple[Dispatcher, Clock]) -> None:
    d, clock = setup
    view = _running(d, "a")
    d.attach(view.gen)
    d.detach(view.gen)  # the stream dropped
    clock.now += 29.9
    d.sweep(clock.now)
    assert not view.gen.done
    d.attach(view.gen)  # a resume arrived in time: the grace period is over
    clock.now += 60
    d.sweep(clock.now)
    assert not view.gen.done
    d.detach(view.gen)
    clock.now += 30
    d.sweep(clock.now)
    assert view.gen.finish_reason == CANCELLED


def test_batch_items_are_never_abandoned(setup: tuple[Dispatcher, Clock]) -> None:
    d, clock = setup
    view = _running(d, "item")
    view.gen.detached_ok = True
    d.attach(view.gen)
    d.detach(view.gen)
    clock.now += 3600
    d.sweep(clock.now)
    assert not view.gen.done


def test_finished_generations_are_forgotten_after_the_resume_window(setup: tuple[Dispatcher, Clock]) -> None:
    d, clock = setup
    view = _running(d, "a")
    view.gen.finish(inference_pb2.FINISH_REASON_LENGTH, clock.now)
    clock.now += 29
    d.sweep(clock.now)
    assert d.get("a", "t") is view  # still resumable
    clock.now += 1
    d.sweep(clock.now)
    with pytest.raises(ApiError, match="unknown or expired"):
        d.get("a", "t")


def test_a_generation_nobody_ever_reads_is_abandoned_after_the_grace_period(setup: tuple[Dispatcher, Clock]) -> None:
    d, clock = setup
    view = _running(d, "orphan")  # its caller went away before reading (e.g. its deadline passed)
    clock.now += 30
    d.sweep(clock.now)
    assert view.gen.finish_reason == CANCELLED


def test_cancel_keeps_the_tokens_the_request_had(setup: tuple[Dispatcher, Clock]) -> None:
    d, _ = setup
    leader = _running(d, "a")
    follower = d.join(leader, "b", COALESCED)
    for token in range(4):
        leader.gen.append(token, "x")
    assert d.cancel_view(follower) is True and d.cancel_view(follower) is False
    leader.gen.append(4, "x")
    assert follower.final_length == 4 and leader.final_length is None
