"""Scheduler lookahead: step N+1 is planned while step N is in flight (at most two plans), completed in order.

Examples of what the property test checks at random: positions and budgets of N+1, wasted tokens after an
EOS, aborts and preemptions while two steps are in flight, exactly-once releases, max_tokens not overshot.
"""

from __future__ import annotations

import pytest

from control_plane.scheduler import MAX_INFLIGHT, Scheduler
from control_plane.sequence import Status
from control_plane.step_plan import StepPlan
from tests.control_plane.test_scheduler import make, req, step, works


def plan(s: Scheduler) -> StepPlan:
    p = s.schedule()
    assert p is not None
    return p


def tokens(p: StepPlan, token: int) -> dict[int, int]:
    """What the worker returns for plan `p`: `token` for every sampling sequence."""
    return {w.seq.seq_id: token for w in p.works if w.sample}


def test_next_step_continues_from_the_step_in_flight() -> None:
    s, _ = make(block_size=4, budget=64, ratio=64.0)
    long, short = req(100, max_tokens=5), req(3, max_tokens=5)
    s.add(short)
    s.add(long)
    n, n1 = plan(s), plan(s)
    assert works(n) == {short.seq_id: (3, 0), long.seq_id: (61, 0)}  # short samples; long's first chunk
    # N+1: short decodes the token N samples (fed by the worker), long's next chunk starts where N's ends.
    assert works(n1) == {short.seq_id: (0, 3), long.seq_id: (39, 61)}
    assert next(w for w in n1.works if w.seq is short).new_blocks == [] and len(short.block_table) == 1
    with pytest.raises(RuntimeError):
        s.schedule()  # at most MAX_INFLIGHT plans
    assert MAX_INFLIGHT == 2
    assert s.prefix_match(long.prompt_ids, "tenant") == 0  # nothing published before its step completes
    s.complete(n, tokens(n, 5))
    assert s.prefix_match(long.prompt_ids, "tenant") == 60 and short.output_ids == [5]
    n2 = plan(s)  # short's decode at position 4 crosses into a second block, planned while N+1 runs
    assert works(n2) == {short.seq_id: (0, 4), long.seq_id: (0, 100)}
    assert next(w for w in n2.works if w.seq is short).new_blocks == [short.block_table[1]]
    s.complete(n1, tokens(n1, 6))
    s.complete(n2, tokens(n2, 7))
    assert short.output_ids == [5, 6, 7] and long.output_ids == [6, 7]
    assert short.num_computed == short.num_scheduled == 5 and short.pending == 0


def test_eos_at_n_wastes_the_token_of_n_plus_1_and_releases_once_after_it() -> None:
    s, _ = make()
    a = req(10, max_tokens=50, eos_ids=frozenset({9}))
    s.add(a)
    step(s, token=5)  # prefill; a decodes from now on
    n, n1 = plan(s), plan(s)
    assert works(n)[a.seq_id] == (0, 10) and works(n1)[a.seq_id] == (0, 11)
    [event] = s.complete(n, {a.seq_id: 9})  # EOS: a ends, its blocks are freed now
    assert (event.token, event.finish_reason) == (9, "stop") and a.status is Status.FINISHED and not a.block_table
    assert not n1.release  # planned before the EOS was known: N+1 still decodes a on the worker
    n2 = plan(s)  # planned while N+1 runs: the release goes here, after N+1's use of a on the worker
    assert n2.release == [a.seq_id] and not n2.works
    assert s.complete(n1, {a.seq_id: 4}) == [] and a.output_ids == [5, 9]  # the wasted token is dropped
    s.complete(n2, {})
    assert s.schedule() is None and not s.has_work()


def test_abort_while_two_steps_are_in_flight() -> None:
    s, _ = make()
    a, b = req(10, max_tokens=50), req(10, max_tokens=50)
    s.add(a)
    s.add(b)
    step(s)
    n, n1 = plan(s), plan(s)
    s.abort(a.seq_id)
    assert a.status is Status.FINISHED and not a.block_table
    assert [e.seq for e in s.complete(n, tokens(n, 3))] == [b]
    n2 = plan(s)
    assert n2.release == [a.seq_id] and [w.seq for w in n2.works] == [b]
    assert [e.seq for e in s.complete(n1, tokens(n1, 4))] == [b]
    s.complete(n2, tokens(n2, 5))
    assert a.output_ids == [5] and b.output_ids == [5, 3, 4, 5]
    assert not plan(s).release  # exactly once


def test_preempting_a_sequence_with_a_step_in_flight_drops_its_result() -> None:
    # 8 blocks of 4 tokens, batch quota 6: three 7-token prompts take 2 blocks each; their second decode
    # (position 8) needs a 3rd block each, so N+1 preempts the newest, whose decode N is still in flight.
    s, _ = make(num_blocks=8, block_size=4, shares=(0.25, 0.75), max_batch=(4, 4))
    old, mid, new = (req(7, pool="batch", max_tokens=4) for _ in range(3))
    for q in (old, mid, new):
        s.add(q)
    step(s, token=5)
    n = plan(s)
    assert set(works(n)) == {old.seq_id, mid.seq_id, new.seq_id}  # decodes at position 7: no new block
    n1 = plan(s)
    assert n1.release == [new.seq_id] and [w.seq for w in n1.works] == [old, mid]
    assert new.status is Status.WAITING and new.num_computed == new.num_scheduled == new.pending == 0
    events = s.complete(n, tokens(n, 6))
    assert [e.seq for e in events] == [old, mid] and new.output_ids == [5]  # its in-flight token is stale
    s.complete(n1, tokens(n1, 7))
    recompute = None
    while s.has_work():
        p = plan(s)
        recompute = recompute or next((w for w in p.works if w.seq is new), None)
        s.complete(p, tokens(p, 8))
    assert recompute is not None and recompute.first and recompute.start + len(recompute.token_ids) == 8
    assert new.output_ids == [5, 8, 8, 8] and old.output_ids == [5, 6, 7, 8] and new.preemptions == 1


def test_max_tokens_and_context_are_not_overshot() -> None:
    s, _ = make(max_context=16)
    q, ctx = req(10, max_tokens=3), req(12, max_tokens=50)
    s.add(q)
    s.add(ctx)
    p1, p2 = plan(s), plan(s)  # p2: each decodes the token p1 samples
    s.complete(p1, tokens(p1, 1))
    p3 = plan(s)  # q: output 1 done, 1 in flight, so a 3rd may be planned; ctx: 13 + 1 in flight < 16
    assert set(works(p3)) == {q.seq_id, ctx.seq_id}
    s.complete(p2, tokens(p2, 2))
    p4 = plan(s)  # q's token in p3 is its 3rd and last; ctx's in p3 is its 15th token, p4 may sample the 16th
    assert set(works(p4)) == {ctx.seq_id}
    s.complete(p3, tokens(p3, 3))
    assert q.output_ids == [1, 2, 3] and q.finish_reason == "length"
    p5 = plan(s)  # ctx's 16th and last token is in flight: only q's release
    assert p5.release == [q.seq_id] and not p5.works
    s.complete(p4, tokens(p4, 4))
    assert ctx.output_ids == [1, 2, 3, 4] and ctx.finish_reason == "length" and ctx.num_tokens == 16
    assert [w.start for p in (p1, p2, p3, p4) for w in p.works if w.seq is ctx] == [0, 12, 13, 14]


def test_requeue_all_discards_both_steps_in_flight() -> None:
    s, _ = make()
    a = req(10, max_tokens=50)
    s.add(a)
    n, n1 = plan(s), plan(s)
    assert s.requeue_all() == [a]
    assert s.complete(n, tokens(n, 3)) == [] and s.complete(n1, tokens(n1, 3)) == [] and a.output_ids == []
    assert a.num_scheduled == a.pending == 0 and s.inflight == 0
    p = plan(s)
    assert works(p) == {a.seq_id: (10, 0)} and not p.release and p.works[0].first


def test_completing_out_of_order_is_an_error() -> None:
    s, _ = make()
    s.add(req(10, max_tokens=50))
    n, n1 = plan(s), plan(s)
    with pytest.raises(RuntimeError):
        s.complete(n1, {})
    s.complete(n, tokens(n, 1))
    assert s.complete(n, tokens(n, 1)) == []  # completed already: ignored
