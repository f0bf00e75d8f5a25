"""Scheduler with an `auto` KV cache (docs/kv_cache.md): where it would preempt or wait for lack of blocks, it
converts the worker's cache to int8 first (once per worker session), then preempts only if that is not enough.
Helpers come from test_scheduler.py; the clock is a fake."""

from __future__ import annotations

import pytest
from test_scheduler import make, req, step

from control_plane.scheduler import TooLarge
from control_plane.sequence import Status


def test_converts_instead_of_preempting_then_preempts_when_int8_is_full() -> None:
    # 16 int8 blocks of 4 tokens, 2 per model-dtype block: 8 model-dtype blocks, batch quota 6.
    s, _ = make(num_blocks=16, block_size=4, shares=(0.25, 0.75), max_batch=(8, 8), kv_units=2)
    old, mid, new = (req(8, pool="batch", max_tokens=8) for _ in range(3))
    for q in (old, mid, new):
        s.add(q)
    first = step(s)  # prefills: 2 model-dtype blocks each = 6 = the quota
    assert not first.kv_to_int8 and all(b % 2 == 0 for q in (old, mid, new) for b in q.block_table)
    tables = [list(q.block_table) for q in (old, mid, new)]
    plan = s.schedule()  # each decode needs a 3rd block: the cache converts rather than preempting `new`
    assert plan is not None and plan.kv_to_int8 and plan.to_request(2).kv_to_int8
    assert not plan.release and not plan.preempted and [w.seq for w in plan.works] == [old, mid, new]
    assert [q.block_table[:2] for q in (old, mid, new)] == tables  # converted in place: ids unchanged
    assert (s.bm.num_blocks, s.quota["batch"], s.stats().kv_int8) == (16, 12, True)
    s.complete(plan, {q.seq_id: 5 for q in (old, mid, new)})
    more = [req(8, pool="batch", max_tokens=8) for _ in range(2)]
    for q in more:
        s.add(q)
    preempted = []
    while s.has_work():
        plan = step(s)
        assert not plan.kv_to_int8  # once per session
        preempted += plan.preempted
    assert preempted  # 5 sequences of up to 4 blocks do not fit 12 int8 blocks either
    assert all(q.status is Status.FINISHED and len(q.output_ids) == 8 for q in (old, mid, new, *more))


def test_same_load_preempts_in_the_model_dtype() -> None:
    s, _ = make(num_blocks=8, block_size=4, shares=(0.25, 0.75), max_batch=(8, 8))
    seqs = [req(8, pool="batch", max_tokens=8) for _ in range(3)]
    for q in seqs:
        s.add(q)
    step(s)
    plan = s.schedule()
    assert plan is not None and plan.preempted == [seqs[2]] and not plan.kv_to_int8


def test_admits_a_sequence_only_int8_can_hold() -> None:
    with pytest.raises(TooLarge):  # 29 KV tokens = 8 blocks > the interactive quota of 4
        make(num_blocks=8, block_size=4, shares=(0.5, 0.5))[0].add(req(20, max_tokens=10))
    s, _ = make(num_blocks=16, block_size=4, shares=(0.5, 0.5), kv_units=2)
    big = req(20, max_tokens=10)
    s.add(big)  # up to 8 int8 blocks: accepted
    plan = step(s)  # 5 blocks for the prompt > 4: admission converts the cache
    assert plan.kv_to_int8 and plan.works[0].seq is big and len(big.block_table) == 5
    while s.has_work():
        step(s)
    assert big.status is Status.FINISHED and len(big.output_ids) == 10 and big.preemptions == 0


def test_evicts_cached_prefixes_before_converting() -> None:
    s, _ = make(num_blocks=8, block_size=4, shares=(1.0, 1.0), kv_units=2)  # 4 model-dtype blocks
    a = req(12, max_tokens=1)
    s.add(a)
    step(s)  # a finishes; its 3 full blocks stay cached
    assert (s.bm.num_cached, s.bm.num_free) == (3, 1)
    b = req(12, max_tokens=1)
    s.add(b)
    plan = step(s)
    assert not plan.kv_to_int8 and s.bm.num_blocks == 4  # 3 blocks fit by evicting cached ones


def test_worker_loss_starts_the_next_session_in_the_model_dtype() -> None:
    s, _ = make(num_blocks=16, block_size=4, shares=(0.5, 0.5), kv_units=2)
    big = req(20, max_tokens=10)
    s.add(big)
    assert step(s).kv_to_int8
    s.requeue_all()
    assert (s.bm.num_blocks, s.quota["interactive"], s.stats().kv_int8) == (8, 4, False)
    assert step(s).kv_to_int8  # the new session converts again when it needs to


def test_int8_sequences_hold_tail_blocks_charged_to_their_pool_and_freed_with_them() -> None:
    # 12 int8 blocks of 4 tokens, tails of 2: a 7-token prompt (+ 1 to generate) takes 2 + 2 blocks.
    s, _ = make(num_blocks=12, block_size=4, shares=(1.0, 1.0), kv_tail=2)
    seqs = [req(7, max_tokens=2) for _ in range(4)]
    for q in seqs:
        s.add(q)
    plan = step(s)
    admitted = [w.seq for w in plan.works]
    assert admitted == seqs[:3]  # 3 x 4 blocks: the 4th waits (without tails 6 would fit)
    held = [b for q in admitted for b in q.block_table + q.tail_blocks]
    assert len(held) == len(set(held)) == 12 and s.stats().kv_used == 12
    req0 = plan.to_request(1)
    assert [list(w.tail_blocks) for w in req0.seqs] == [q.tail_blocks for q in admitted]
    assert all(len(q.tail_blocks) == 2 for q in admitted)
    later = s.schedule()  # decodes: tails are sent on first sight only
    assert later is not None and all(not w.tail_blocks for w in later.to_request(2).seqs)
    s.complete(later, {w.seq.seq_id: 5 for w in later.works})  # max_tokens: the three finish
    assert all(q.status is Status.FINISHED and not q.tail_blocks for q in admitted)
    step(s)  # the 4th runs on the freed blocks
    while s.has_work():
        step(s)
    assert s.stats().kv_used == 0 and s.bm.num_free + s.bm.num_cached == 12


def test_tails_count_in_the_largest_sequence_a_pool_accepts() -> None:
    with pytest.raises(TooLarge, match="6 KV blocks needed"):  # 4 blocks of KV + 2 of tail > quota 5
        make(num_blocks=10, block_size=4, shares=(0.5, 0.5), kv_tail=2)[0].add(req(10, max_tokens=7))
    make(num_blocks=10, block_size=4, shares=(0.5, 0.5))[0].add(req(10, max_tokens=7))  # 4 alone fit


def test_an_auto_cache_gives_tails_from_its_conversion_on() -> None:
    s, _ = make(num_blocks=16, block_size=4, shares=(1.0, 1.0), kv_units=2, kv_tail=2)
    first = req(16, max_tokens=20)  # 4 of the 8 model-dtype blocks, 5 once it decodes
    s.add(first)
    step(s)
    assert first.tail_blocks == []  # a model-dtype cache keeps no tails
    big = req(20, max_tokens=4)
    s.add(big)
    plan = step(s)  # 5 more blocks do not fit the 3 left: the cache converts, and big gets a tail
    assert plan.kv_to_int8 and len(big.tail_blocks) == 2 and first.tail_blocks == []
    assert not set(big.tail_blocks) & set(big.block_table + first.block_table)
