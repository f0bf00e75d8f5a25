"""Property tests of the scheduler + block manager against a fake worker that checks the step protocol
and simulates KV contents (each slot holds the token id written there), so a prefix hit on KV that was
never written, a bad copy-on-write or a block written by two sequences shows up as a wrong token."""

from __future__ import annotations

import contextlib
import random
from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from control_plane.config import PoolSettings, PoolsSettings, SchedulerSettings
from control_plane.scheduler import QueueFull, Scheduler
from control_plane.sequence import POOLS, Sequence, Status
from control_plane.step_plan import StepPlan

EOS = 0
VOCAB = 6  # tiny vocabulary: prompts share prefixes often


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeWorker:
    """Applies StepRequests like worker/engine.py does and checks every fed and attended position."""

    def __init__(self, num_blocks: int, block_size: int, max_context: int) -> None:
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.bs, self.max_context = block_size, max_context
        self.seqs: dict[int, dict] = {}  # seq_id -> table, cached, next
        self.released: Counter[int] = Counter()

    def step(self, plan: StepPlan, step_id: int, rng: random.Random) -> dict[int, int]:
        req = plan.to_request(step_id)
        truth = {w.seq.seq_id: w.seq.tokens() for w in plan.works}
        for sid in req.release:
            assert sid in self.seqs, f"release of seq {sid} the worker does not know"
            del self.seqs[sid]
            self.released[sid] += 1
        for c in req.copies:
            self.kv[c.dst] = list(self.kv[c.src])
        fed = []
        for w in req.seqs:
            state = self.seqs.get(w.seq_id)
            tokens = list(w.token_ids)
            if state is None:
                assert w.HasField("sampling") and tokens, "first sight needs sampling and tokens"
                state = self.seqs[w.seq_id] = {"table": [], "cached": w.start_position, "next": None}
            else:
                assert w.start_position == state["cached"]
                if not tokens:
                    assert state["next"] is not None, "decode without a sampled token"
                    tokens = [state["next"]]
            state["table"] += list(w.new_blocks)
            start, end = w.start_position, w.start_position + len(tokens)
            assert end <= self.max_context and len(state["table"]) * self.bs >= end
            assert tokens == truth[w.seq_id][start:end], "fed tokens are not the sequence's"
            fed.append((w, state, start, end, tokens))
        for _, state, start, end, tokens in fed:  # K/V of the whole step is written before attention
            for p, t in zip(range(start, end), tokens, strict=True):
                self.kv[state["table"][p // self.bs]][p % self.bs] = t
        out = {}
        for w, state, _, end, _ in fed:
            seq_truth = truth[w.seq_id]
            for p in range(end):  # attention reads every position up to the last fed one
                assert self.kv[state["table"][p // self.bs]][p % self.bs] == seq_truth[p], f"bad KV at {p}"
            state["cached"] = end
            state["next"] = None
            if w.sample:
                state["next"] = out[w.seq_id] = rng.randrange(VOCAB)
        return out


def check(s: Scheduler, plan: StepPlan | None = None) -> None:
    bm = s.bm
    running = [q for p in POOLS for q in s.running[p]]
    refs = Counter(b for q in running for b in q.block_table)
    for blk in bm.blocks:
        assert blk.ref == refs[blk.id], f"block {blk.id}: ref {blk.ref} != {refs[blk.id]} tables"
        if blk.ref == 0:
            assert (blk.id in bm.lru) != (blk.id in bm.free_ids)
            assert (blk.id in bm.lru) == (blk.hash is not None)
    assert len(bm.free_ids) + len(bm.lru) + sum(1 for b in bm.blocks if b.ref) == bm.num_blocks
    assert all(bm.blocks[b].hash == h for h, b in bm.index.items())
    for p in POOLS:
        held = {b for q in s.running[p] for b in q.block_table}
        assert bm.used_by(p) == len(held) <= s.quota[p]
        assert len(s.running[p]) <= s.pools[p].max_batch
        assert all(q.status is Status.RUNNING for q in s.running[p])
        assert all(q.status is Status.WAITING for q in s.waiting[p])
    if plan is not None:
        assert plan.num_tokens <= s.settings.max_step_tokens
        lengths = [len(w.token_ids) for w in plan.works if w.token_ids]
        if lengths:
            assert max(lengths) <= s.settings.prefill_ratio * min(lengths)
        ids = [w.seq.seq_id for w in plan.works]
        assert len(ids) == len(set(ids))
        assert not set(ids) & set(plan.release), "a release and a re-add of one id in one request"


ADD = st.tuples(
    st.just("add"),
    st.sampled_from(POOLS),
    st.integers(1, 100),  # prompt length, % of what fits the pool's quota
    st.integers(1, 30),  # max_tokens
    st.integers(0, 2),  # shared prefix family
    st.booleans(),  # ignore_eos
)
op = st.one_of(
    ADD,
    ADD,
    ADD,
    st.tuples(st.just("dup"), st.integers(0, 50), st.booleans()),  # re-send an earlier prompt (block-aligned?)
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("tick"), st.integers(1, 400)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("lost"), st.just(0)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=15, max_size=60),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([4, 8]),
    budget=st.integers(8, 64),
    ratio=st.sampled_from([1.0, 2.0, 4.0]),
    shares=st.sampled_from([(0.4, 0.6), (0.5, 0.5), (0.7, 0.7)]),
    seed=st.integers(0, 2**16),
)
def test_random_load_keeps_invariants_and_drains(
    ops: list[tuple], num_blocks: int, block_size: int, budget: int, ratio: float, shares: tuple, seed: int
) -> None:
    rng = random.Random(seed)
    clock = Clock()
    pools = PoolsSettings(
        interactive=PoolSettings(max_batch=3, max_wait_ms=30, kv_share=shares[0], stream=True, max_queue=6),
        batch=PoolSettings(max_batch=5, max_wait_ms=300, kv_share=shares[1], stream=False, max_queue=8),
    )
    max_context = 96
    s = Scheduler(
        num_blocks,
        block_size,
        pools,
        SchedulerSettings(max_step_tokens=budget, prefill_ratio=ratio),
        max_context,
        clock,
    )
    worker = FakeWorker(num_blocks, block_size, max_context)
    families = [[rng.randrange(VOCAB) for _ in range(70)] for _ in range(3)]
    seqs: list[Sequence] = []
    step_id = copies = 0

    def run_step() -> bool:
        nonlocal step_id, worker, copies
        plan = s.schedule()
        check(s, plan)
        if plan is None:
            return False
        step_id += 1
        sampled = worker.step(plan, step_id, rng)
        copies += len(plan.copies)
        for ev in s.complete(plan, sampled):
            assert ev.token == ev.seq.output_ids[-1]
        check(s)
        return True

    for o in ops:
        if o[0] == "add":
            _, pool, pct, max_tokens, fam, ignore_eos = o
            room = min(s.quota[pool] * block_size, max_context - 1) - max_tokens
            n = max(1, room * pct // 100)
            prompt = families[fam][: n // 2] + [rng.randrange(VOCAB) for _ in range(n - n // 2)]
            seq = Sequence(
                len(seqs), f"r{len(seqs)}", f"t{fam % 2}", pool, prompt, max_tokens, eos_ids=frozenset({EOS})
            )
            seq.ignore_eos = ignore_eos
            try:
                s.add(seq)
                seqs.append(seq)
            except QueueFull as e:
                assert e.retry_after_s > 0 and len(s.waiting[pool]) >= s.pools[pool].max_queue  # + requeued
            except ValueError:
                pass  # too large for this pool's quota
        elif o[0] == "dup" and seqs:
            old = seqs[o[1] % len(seqs)]
            cut = len(old.prompt_ids) // block_size * block_size if o[2] else len(old.prompt_ids)
            prompt = old.prompt_ids[: cut or len(old.prompt_ids)]
            seq = Sequence(
                len(seqs), f"r{len(seqs)}", old.tenant, old.pool, prompt, old.max_tokens, eos_ids=frozenset({EOS})
            )
            with contextlib.suppress(QueueFull):
                s.add(seq)
                seqs.append(seq)
        elif o[0] == "step":
            for _ in range(o[1]):
                run_step()
        elif o[0] == "tick":
            clock.t += o[1] / 1000
        elif o[0] in ("abort", "finish") and seqs:
            victim = seqs[o[1] % len(seqs)]
            s.finish(victim.seq_id, "stop_string") if o[0] == "finish" else s.abort(victim.seq_id)
        elif o[0] == "lost":
            requeued = s.requeue_all()
            assert all(q.status is Status.WAITING and not q.block_table for q in requeued)
            worker = FakeWorker(num_blocks, block_size, max_context)
            check(s)

    for _ in range(2000):  # drain: every sequence must finish
        if not s.has_work():
            break
        if not run_step():
            wake = s.next_wakeup()
            assert wake is not None, "waiting work, nothing to run and no timer: stuck"
            clock.t = max(clock.t, wake)
    assert not s.has_work(), "did not drain"
    event(f"preempted: {sum(q.preemptions for q in seqs) > 0}")
    event(f"prefix hits: {s.bm.hits > 0}")
    event(f"copy-on-write: {copies > 0}")
    event(f"steps > 20: {step_id > 20}")
    assert not worker.seqs, "the worker still holds sequences nobody released"
    assert all(b.ref == 0 for b in s.bm.blocks) and s.bm.num_available == num_blocks
    for q in seqs:
        assert q.status is Status.FINISHED
        if q.finish_reason == "length":
            assert len(q.output_ids) == q.max_tokens or q.num_tokens >= max_context
        elif q.finish_reason == "stop":
            assert q.output_ids[-1] == EOS and not q.ignore_eos and len(q.output_ids) <= q.max_tokens
        else:
            assert q.finish_reason in ("abort", "stop_string")
        assert worker.released[q.seq_id] <= 1 + q.preemptions  # only those sent in the last session
