"""Scheduler examples: chunked prefill, ratio rule, priorities, batch buffer, prefix hits, COW, preemption,
queue limits, releases and worker loss. The clock is a fake advanced by hand: no sleeps."""

from __future__ import annotations

import pytest

from control_plane.config import PoolSettings, PoolsSettings, SchedulerSettings
from control_plane.scheduler import QueueFull, Scheduler, TooLarge
from control_plane.sequence import Sequence, Status
from control_plane.step_plan import StepPlan
from protos.coalesce.v1 import worker_pb2


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(
    num_blocks: int = 256,
    block_size: int = 16,
    budget: int = 512,
    ratio: float = 4.0,
    wait_ms: tuple[float, float] = (0, 0),
    max_batch: tuple[int, int] = (8, 64),
    shares: tuple[float, float] = (0.4, 0.6),
    max_queue: int = 100,
    max_context: int = 4096,
    kv_units: int = 1,
    kv_tail: int = 0,
) -> tuple[Scheduler, Clock]:
    pools = PoolsSettings(
        interactive=PoolSettings(max_batch=max_batch[0], max_wait_ms=wait_ms[0], kv_share=shares[0], stream=True),
        batch=PoolSettings(
            max_batch=max_batch[1], max_wait_ms=wait_ms[1], kv_share=shares[1], stream=False, max_queue=max_queue
        ),
    )
    clock = Clock()
    settings = SchedulerSettings(max_step_tokens=budget, prefill_ratio=ratio)
    return Scheduler(num_blocks, block_size, pools, settings, max_context, clock, kv_units, kv_tail), clock


_ids = iter(range(1, 1_000_000))


def req(
    n: int, pool: str = "interactive", max_tokens: int = 8, prompt: list[int] | None = None, **kw: object
) -> Sequence:
    i = next(_ids)
    tokens = prompt if prompt is not None else [(i * 7 + k) % 1000 + 1 for k in range(n)]
    return Sequence(i, f"r{i}", "tenant", pool, tokens, max_tokens, **kw)  # type: ignore[arg-type]


def step(s: Scheduler, token: int = 5) -> StepPlan:
    plan = s.schedule()
    assert plan is not None
    s.complete(plan, {w.seq.seq_id: token for w in plan.works if w.sample})
    return plan


def works(plan: StepPlan) -> dict[int, tuple[int, int]]:
    """seq_id -> (tokens fed, start position)."""
    return {w.seq.seq_id: (len(w.token_ids), w.start) for w in plan.works}


def test_long_prompt_is_chunked_and_decodes_run_every_step() -> None:
    s, _ = make(budget=512)
    short = [req(10, max_tokens=50) for _ in range(3)]
    for q in short:
        s.add(q)
    step(s)  # the short prompts' prefill
    long = req(1000, max_tokens=2)
    s.add(long)
    fed = []
    while long.num_computed < 1000:
        plan = step(s)
        assert plan.num_tokens <= 512
        assert all(works(plan)[q.seq_id] == (0, q.num_computed - 1) for q in short)  # every step decodes
        fed.append(works(plan)[long.seq_id])
    assert fed == [(509, 0), (491, 509)]  # the budget left after three decodes, then the rest
    assert [w.sample for w in s.schedule().works if w.seq is long] == [True]  # type: ignore[union-attr]


def test_sample_only_when_the_prompt_is_complete() -> None:
    s, _ = make(budget=64)
    q = req(100, max_tokens=1)
    s.add(q)
    samples = []
    while q.status is not Status.FINISHED:
        plan = step(s)
        samples += [w.sample for w in plan.works]
    assert samples == [False, True] and q.output_ids == [5] and q.finish_reason == "length"


def test_prefill_ratio_skips_short_and_trims_long_chunks() -> None:
    s, _ = make(ratio=4.0, budget=512)
    a, b, c = req(200), req(20), req(100)
    for q in (a, b, c):
        s.add(q)
    plan = s.schedule()
    assert plan is not None
    assert works(plan) == {a.seq_id: (200, 0), c.seq_id: (100, 0)}  # 20 is under 200/4: skipped this step
    assert list(s.waiting["interactive"]) == [b]  # b keeps its place at the head
    s.complete(plan, {a.seq_id: 5, c.seq_id: 5})
    d = req(500)
    s.add(d)
    plan = s.schedule()
    assert plan is not None
    assert works(plan)[b.seq_id] == (20, 0)  # a and c decode; b leads the prefills
    assert works(plan)[d.seq_id] == (80, 0)  # trimmed to 4 x 20 rather than skipped


def test_interactive_admitted_before_batch() -> None:
    s, _ = make(budget=100)
    batch, inter = req(60, pool="batch"), req(60)
    s.add(batch)
    s.add(inter)
    plan = s.schedule()
    assert plan is not None
    assert works(plan) == {inter.seq_id: (60, 0), batch.seq_id: (40, 0)}


def test_batch_buffer_waits_for_max_wait_or_a_full_batch() -> None:
    s, clock = make(wait_ms=(30, 300), max_batch=(8, 3))
    first = req(10, pool="batch")
    s.add(first)
    assert s.schedule() is None  # (c) not yet: 0 ms waited, 1 < 3 free slots
    assert s.next_wakeup() == pytest.approx(100.3)
    clock.t = 100.2
    s.add(req(10, pool="batch"))
    assert s.schedule() is None
    clock.t = 100.3  # the oldest waited max_wait_ms
    plan = step(s)
    assert len(plan.works) == 2 and first.dwell == pytest.approx(0.3)
    assert plan.admitted == [first, plan.works[1].seq]
    late = req(10, pool="batch")
    clock.t = 100.31
    s.add(late)
    assert s.next_wakeup() is None  # (a) the pool is running: join at the next step
    assert late.seq_id in works(step(s)) and late.dwell == pytest.approx(0)


def test_batch_buffer_releases_when_waiting_fill_the_free_slots() -> None:
    s, _ = make(wait_ms=(30, 300), max_batch=(8, 3))
    for _ in range(2):
        s.add(req(10, pool="batch"))
    assert s.schedule() is None
    s.add(req(10, pool="batch"))
    plan = s.schedule()
    assert plan is not None and len(plan.works) == 3


def test_shared_prefix_hits_full_blocks_only() -> None:
    s, _ = make(block_size=16)
    prefix = list(range(1, 201))
    a = req(0, prompt=[*prefix, 900, 901], max_tokens=20)
    s.add(a)
    step(s)
    step(s)  # a is decoding; its full blocks are published
    b = req(0, prompt=prefix + [700] * 30)
    s.add(b)
    plan = s.schedule()
    assert plan is not None
    w = next(w for w in plan.works if w.seq is b)
    assert b.cached_prompt_tokens == 192 and w.start == 192 and w.token_ids == b.prompt_ids[192:]
    assert w.first and w.new_blocks[:12] == a.block_table[:12] and not plan.copies


def test_no_hit_before_the_computing_step_completes() -> None:
    s, _ = make(block_size=16, budget=64)
    a = req(0, prompt=list(range(1, 101)))
    s.add(a)
    plan = s.schedule()  # a's first 64 tokens are in flight
    assert plan is not None
    assert s.prefix_match(list(range(1, 101)), "tenant") == 0
    s.complete(plan, {})
    assert s.prefix_match(list(range(1, 101)), "tenant") == 64


def test_identical_prompt_copies_the_shared_last_block() -> None:
    s, _ = make(block_size=16)
    prompt = list(range(1, 33))  # exactly two blocks
    a = req(0, prompt=prompt, max_tokens=10)
    s.add(a)
    step(s)
    b = req(0, prompt=list(prompt), max_tokens=10)
    s.add(b)
    plan = s.schedule()
    assert plan is not None
    w = next(w for w in plan.works if w.seq is b)
    assert w.start == 31 and w.token_ids == [32] and b.cached_prompt_tokens == 31  # the last token is computed
    assert plan.copies == [(a.block_table[1], b.block_table[1])]
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    req_pb = plan.to_request(7)
    assert [(c.src, c.dst) for c in req_pb.copies] == plan.copies


def test_preemption_takes_the_newest_batch_sequence() -> None:
    # 8 blocks of 4 tokens; batch quota 6: three batch seqs of 8 tokens fill it at their next block.
    s, _ = make(num_blocks=8, block_size=4, shares=(0.25, 0.75), max_batch=(4, 4))
    old, mid, new = (req(8, pool="batch", max_tokens=8) for _ in range(3))
    for q in (old, mid, new):
        s.add(q)
    step(s)  # prefills: 2 blocks each = 6 = the quota
    plan = s.schedule()  # each decode needs a 3rd block: the newest goes, then the middle one
    assert plan is not None
    assert plan.release == [new.seq_id]
    assert [w.seq for w in plan.works] == [old, mid] and new.status is Status.WAITING
    assert s.waiting["batch"][0] is new and new.num_computed == 0 and not new.block_table
    s.complete(plan, {old.seq_id: 5, mid.seq_id: 5})
    while new.status is not Status.FINISHED:  # it is recomputed (same id) once room frees up
        step(s)
    assert len(new.output_ids) == 8 and new.preemptions >= 1


def test_preempted_sequence_recomputes_prompt_and_outputs() -> None:
    s, _ = make(num_blocks=8, block_size=4, shares=(0.25, 0.75), max_batch=(4, 4))
    a, b = req(11, pool="batch", max_tokens=6), req(11, pool="batch", max_tokens=6)
    s.add(a)
    s.add(b)
    step(s)  # 3 blocks each
    step(s, token=6)  # decode position 11: still in the 3rd block
    plan = s.schedule()  # position 12 needs a 4th block each: batch quota 6 -> b, the newer, is preempted
    assert plan is not None and plan.release == [b.seq_id]
    s.complete(plan, {a.seq_id: 7})
    while b.status is Status.WAITING:
        plan = step(s)  # the plan that re-admits b
    w = next(w for w in plan.works if w.seq is b)
    assert b.output_ids[:2] == [5, 6] and w.first and w.start + len(w.token_ids) == 13  # prompt + 2 outputs
    assert (w.start, w.token_ids) == (12, [6])  # its own 3 published blocks were still cached


def test_queue_full_past_max_queue() -> None:
    s, _ = make(wait_ms=(0, 1000), max_queue=2)
    s.add(req(5, pool="batch"))
    s.add(req(5, pool="batch"))
    with pytest.raises(QueueFull) as exc:
        s.add(req(5, pool="batch"))
    assert exc.value.pool == "batch" and exc.value.retry_after_s >= 1.0


def test_too_large_for_the_pool_quota_or_context() -> None:
    s, _ = make(num_blocks=10, block_size=4, shares=(0.4, 0.6), max_context=64)
    with pytest.raises(TooLarge):
        s.add(req(10, max_tokens=10))  # 19 KV tokens = 5 blocks > interactive quota 4
    with pytest.raises(TooLarge):
        s.add(req(64, pool="batch", max_tokens=1))


def test_abort_frees_now_and_releases_in_the_next_plan() -> None:
    s, _ = make()
    a, b = req(10, max_tokens=50), req(10, max_tokens=50)
    s.add(a)
    s.add(b)
    step(s)
    s.abort(a.seq_id)
    assert not a.block_table and a.status is Status.FINISHED and a.finish_reason == "abort"
    plan = step(s)
    assert plan.release == [a.seq_id] and [w.seq for w in plan.works] == [b]
    s.finish(b.seq_id, "stop")
    last = s.schedule()
    assert last is not None and last.release == [b.seq_id] and not last.works  # a release-only plan
    assert not last.to_request(3).seqs
    s.complete(last, {})
    assert s.schedule() is None and not s.has_work()


def test_abort_while_the_step_runs_drops_its_token() -> None:
    s, _ = make()
    a = req(10, max_tokens=50)
    s.add(a)
    plan = s.schedule()
    assert plan is not None
    s.abort(a.seq_id)
    assert s.complete(plan, {a.seq_id: 3}) == [] and a.output_ids == []
    assert s.schedule().release == [a.seq_id]  # type: ignore[union-attr]


def test_finish_reasons() -> None:
    s, _ = make(max_context=20)
    eos = req(5, eos_ids=frozenset({9}))
    ignored = req(5, eos_ids=frozenset({9}), ignore_eos=True, max_tokens=2)
    stop = req(5, stop_token_ids=frozenset({9}), ignore_eos=True)
    ctx = req(17, max_tokens=10)
    for q in (eos, ignored, stop, ctx):
        s.add(q)
    step(s, token=9)
    assert (eos.finish_reason, stop.finish_reason, ignored.finish_reason) == ("stop", "stop", None)
    while s.has_work():
        step(s, token=9)
    assert ignored.finish_reason == "length" and ignored.output_ids == [9, 9]
    assert ctx.finish_reason == "length" and ctx.num_tokens == 20 and len(ctx.output_ids) == 3


def test_to_request_sends_sampling_on_first_sight_only() -> None:
    s, _ = make()
    q = req(3, sampling=worker_pb2.WorkerSampling(temperature=0.5, seed=7), traceparent="00-abc-def-01")
    s.add(q)
    first = s.schedule()
    assert first is not None
    r = first.to_request(1)
    assert r.step_id == 1 and r.seqs[0].sampling.seed == 7 and r.seqs[0].traceparent == "00-abc-def-01"
    assert (
        list(r.seqs[0].token_ids) == q.prompt_ids and r.seqs[0].sample and list(r.seqs[0].new_blocks) == q.block_table
    )
    s.complete(first, {q.seq_id: 4})
    second = s.schedule()
    assert second is not None
    r = second.to_request(2)
    assert not r.seqs[0].HasField("sampling") and not r.seqs[0].token_ids and r.seqs[0].start_position == 3


def test_requeue_all_sends_everything_back_for_recompute() -> None:
    s, _ = make()
    a, b, c = req(10, max_tokens=50), req(10, pool="batch", max_tokens=50), req(10, max_tokens=50)
    s.add(a)
    s.add(b)
    step(s)
    s.add(c)
    inflight = s.schedule()
    assert inflight is not None
    requeued = s.requeue_all()
    assert requeued == [a, c, b] or set(requeued) == {a, b, c}
    assert all(q.status is Status.WAITING and not q.block_table and q.num_computed == 0 for q in requeued)
    assert s.complete(inflight, {}) == []  # the lost worker's plan is ignored
    assert s.bm.num_available == s.bm.num_blocks and not s.bm.index
    plan = s.schedule()
    assert plan is not None and not plan.release  # a new session: nothing to release
    assert all(w.first and w.start == 0 for w in plan.works)
    assert works(plan)[a.seq_id] == (11, 0)  # prompt + its one output


def test_stats_and_load() -> None:
    s, _ = make(num_blocks=100, max_batch=(2, 2))
    for _ in range(2):
        s.add(req(32))
    step(s)
    st = s.stats()
    assert st.running == {"interactive": 2, "batch": 0} and st.kv_used == 4 and st.kv_by_pool["interactive"] == 4
    assert st.load == pytest.approx(0.5)  # 2 of 4 slots


def test_tenants_are_admitted_fairly_not_in_arrival_order() -> None:
    s, _ = make(max_batch=(4, 64))
    hog = [req(4) for _ in range(20)]
    for q in hog:
        q.tenant = "hog"
        s.add(q)
    small = req(4)
    small.tenant = "small"
    s.add(small)  # arrives last, behind twenty of another tenant's
    plan = s.schedule()
    assert plan is not None
    admitted = [w.seq for w in plan.works]
    assert small in admitted and len(admitted) == 4  # one of the four slots, not the 21st in line
    assert [q for q in admitted if q is not small] == hog[:3]  # FIFO within a tenant
