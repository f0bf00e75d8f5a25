"""Property tests of the scheduler + block manager against a fake worker that checks the step protocol
and simulates KV contents (each slot holds the token id written there), so a prefix hit on KV that was
never written, a bad copy-on-write or a block written by two sequences shows up as a wrong token.

The fake worker runs a queue of up to `depth` plans strictly in order, as the real one runs its stream, with
the scheduler's lookahead (depth 2) or without it (depth 1). Its "model" samples a deterministic function of
the tokens it attends to, so every sequence's outputs must equal those of the same model generating alone
(`expected`): a stale token (from a step planned before a preemption, an abort or a finish), a wrong
position or a lost token all show up as a different output.
"""

from __future__ import annotations

import contextlib
import random
import zlib
from array import array
from collections import Counter, deque

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from control_plane.config import PoolSettings, PoolsSettings, SchedulerSettings
from control_plane.scheduler import QueueFull, Scheduler
from control_plane.sequence import POOLS, Sequence, Status
from control_plane.step_plan import StepPlan
from protos.coalesce.v1 import worker_pb2

EOS = 0
VOCAB = 6  # tiny vocabulary: prompts share prefixes often


def model(tokens: list[int]) -> int:
    """The simulated model: the next token is a deterministic function of the whole sequence so far."""
    return zlib.crc32(array("q", tokens).tobytes()) % VOCAB


def expected(seq: Sequence, max_context: int) -> list[int]:
    """The outputs of `seq` generated alone, one token per step, with no lookahead."""
    out: list[int] = []
    while True:
        out.append(model(seq.prompt_ids + out))
        if (out[-1] == EOS and not seq.ignore_eos) or len(out) >= seq.max_tokens:
            return out
        if len(seq.prompt_ids) + len(out) >= max_context:
            return out


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class FakeWorker:
    """Applies StepRequests like worker/engine.py does and checks every fed and attended position.

    With `units` > 1 it is an auto cache: until a request says kv_to_int8, every block id must be a multiple of
    `units` that leaves room for the whole model-dtype block; the conversion keeps each block's contents under
    its id and leaves the other units holding nothing."""

    def __init__(self, num_blocks: int, block_size: int, max_context: int, units: int = 1) -> None:
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.bs, self.max_context, self.units = block_size, max_context, units
        self.converted = False
        self.seqs: dict[int, dict] = {}  # seq_id -> table, cached, next
        self.released: Counter[int] = Counter()

    def step(self, req: worker_pb2.StepRequest, truth: dict[int, list[int]]) -> dict[int, int]:
        """Run one request; `truth` is each listed sequence's tokens as the scheduler knew them when planning."""
        for sid in req.release:  # exactly once: a second release, or one of a never-sent id, is unknown here
            assert sid in self.seqs, f"release of seq {sid} the worker does not know"
            del self.seqs[sid]
            self.released[sid] += 1
        if req.kv_to_int8:
            assert self.units > 1 and not self.converted, "kv_to_int8 twice, or on a cache that cannot convert"
            self.converted = True
        stride = 1 if self.converted else self.units
        ids = [b for w in req.seqs for b in w.new_blocks] + [b for c in req.copies for b in (c.src, c.dst)]
        assert all(b % stride == 0 and b + stride <= len(self.kv) for b in ids), f"bad block id for stride {stride}"
        for c in req.copies:
            self.kv[c.dst] = list(self.kv[c.src])
        fed = []
        for w in req.seqs:
            state = self.seqs.get(w.seq_id)
            tokens = list(w.token_ids)
            if state is None:  # a step for an id released before it would land here and fail
                assert w.HasField("sampling") and tokens, "first sight needs sampling and tokens"
                # Positions below start_position are a prefix hit: they must hold the sequence's tokens.
                known = truth[w.seq_id][: w.start_position]
                state = self.seqs[w.seq_id] = {"table": [], "cached": w.start_position, "next": None, "fed": known}
            else:
                assert w.start_position == state["cached"], "start_position != tokens already cached"
                if not tokens:
                    assert state["next"] is not None, "decode without a sampled token"
                    tokens = [state["next"]]
            state["table"] += list(w.new_blocks)
            start, end = w.start_position, w.start_position + len(tokens)
            assert end <= self.max_context and len(state["table"]) * self.bs >= end
            if w.token_ids:  # a prefill chunk: the scheduler knew these tokens when planning
                assert tokens == truth[w.seq_id][start:end], "fed tokens are not the sequence's"
            state["fed"] = state["fed"][:start] + tokens
            fed.append((w, state, start, end, tokens))
        for _, state, start, end, tokens in fed:  # K/V of the whole step is written before attention
            for p, t in zip(range(start, end), tokens, strict=True):
                self.kv[state["table"][p // self.bs]][p % self.bs] = t
        out = {}
        for w, state, _, end, _ in fed:
            # Attention reads every position up to the last fed one: they must hold what this sequence was fed.
            seen = [self.kv[state["table"][p // self.bs]][p % self.bs] for p in range(end)]
            assert seen == state["fed"], "bad KV"
            state["cached"] = end
            state["next"] = None
            if w.sample:
                state["next"] = out[w.seq_id] = model(seen)
        return out


def check(s: Scheduler, plan: StepPlan | None = None) -> None:
    bm = s.bm
    running = [q for p in POOLS for q in s.running[p]]
    refs = Counter(b for q in running for b in q.block_table)
    block_ids = set(range(0, bm.num_blocks * bm.stride, bm.stride))  # the ids that are blocks now
    for blk in bm.blocks:
        assert blk.ref == refs[blk.id], f"block {blk.id}: ref {blk.ref} != {refs[blk.id]} tables"
        if blk.id not in block_ids:  # a unit inside a model-dtype block
            assert blk.ref == 0 and blk.id not in bm.lru and blk.id not in bm.free_ids and blk.hash is None
        elif blk.ref == 0:
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
        for q in s.running[p]:  # planned-but-not-completed work exists only while plans are in flight
            assert q.num_computed <= q.num_scheduled <= q.num_tokens + q.pending
            assert q.pending <= s.inflight and (s.inflight or q.num_scheduled == q.num_computed)
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
    st.tuples(st.just("step"), st.integers(1, 4), st.booleans()),  # refill the worker's queue after?
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
    depth=st.sampled_from([1, 2]),  # plans in flight: without or with the lookahead
    units=st.sampled_from([1, 1, 2, 4]),  # an auto KV cache: int8 blocks per model-dtype block
)
def test_random_load_keeps_invariants_and_drains(
    ops: list[tuple],
    num_blocks: int,
    block_size: int,
    budget: int,
    ratio: float,
    shares: tuple,
    seed: int,
    depth: int,
    units: int,
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
        units,
    )
    worker = FakeWorker(num_blocks, block_size, max_context, units)
    families = [[rng.randrange(VOCAB) for _ in range(70)] for _ in range(3)]
    seqs: list[Sequence] = []
    step_id = copies = dropped = 0

    # The worker's queue: (plan, its request, tokens of its sequences when planned, releases planned by then).
    queue: deque[tuple[StepPlan, worker_pb2.StepRequest, dict[int, list[int]], dict[int, int]]] = deque()
    releases: Counter[int] = Counter()  # releases planned (not yet run) per seq id

    def fill() -> None:
        """Plan steps while fewer than `depth` are in flight, each serialized when planned (as the link does)."""
        nonlocal step_id
        while len(queue) < depth:
            plan = s.schedule()
            check(s, plan)
            if plan is None:
                return
            step_id += 1
            releases.update(plan.release)
            truth = {w.seq.seq_id: w.seq.tokens() for w in plan.works}
            queue.append((plan, plan.to_request(step_id), truth, {sid: releases[sid] for sid in truth}))

    def run_step(refill: bool = True) -> bool:
        nonlocal copies, dropped
        fill()
        if not queue:
            return False
        plan, req, truth, planned_releases = queue.popleft()
        sampled = worker.step(req, truth)
        copies += len(plan.copies)
        running = {w.seq.seq_id for w in plan.works if w.seq.status is Status.RUNNING}
        events = s.complete(plan, sampled)
        dropped += len(sampled) - len(events)
        for ev in events:
            sid = ev.seq.seq_id
            # No stale token: the sequence ran when completed and was not released (preempted) since planning.
            assert sid in running and releases[sid] == planned_releases[sid], f"stale token for seq {sid}"
            assert ev.token == ev.seq.output_ids[-1] == model(ev.seq.tokens()[:-1])
            assert len(ev.seq.output_ids) <= ev.seq.max_tokens and ev.seq.num_tokens <= max_context
        check(s)
        if refill:  # leave steps in flight for the next op (an abort, a finish, a loss while they run)
            fill()
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
                run_step(o[2])
        elif o[0] == "tick":
            clock.t += o[1] / 1000
        elif o[0] in ("abort", "finish") and seqs:
            victim = seqs[o[1] % len(seqs)]
            s.finish(victim.seq_id, "stop_string") if o[0] == "finish" else s.abort(victim.seq_id)
        elif o[0] == "lost":
            requeued = s.requeue_all()
            assert all(q.status is Status.WAITING and not q.block_table for q in requeued)
            while queue:  # the lost worker's steps: their results, should they come, are ignored
                assert s.complete(queue.popleft()[0], {}) == []
            worker = FakeWorker(num_blocks, block_size, max_context, units)
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
    event(f"units {units}, converted to int8: {worker.converted}")
    event(f"prefix hits: {s.bm.hits > 0}")
    event(f"copy-on-write: {copies > 0}")
    event(f"steps > 20: {step_id > 20}")
    event(f"depth {depth}, results dropped: {dropped > 0}")
    assert not worker.seqs, "the worker still holds sequences nobody released"
    assert all(b.ref == 0 for b in s.bm.blocks) and s.bm.num_available == s.bm.num_blocks
    for q in seqs:
        assert q.status is Status.FINISHED
        want = expected(q, max_context)
        if q.finish_reason == "length":
            assert len(q.output_ids) == q.max_tokens or q.num_tokens >= max_context
            assert q.output_ids == want
        elif q.finish_reason == "stop":
            assert q.output_ids[-1] == EOS and not q.ignore_eos and len(q.output_ids) <= q.max_tokens
            assert q.output_ids == want
        else:
            assert q.finish_reason in ("abort", "stop_string")
            assert q.output_ids == want[: len(q.output_ids)]  # cut short, never wrong
        assert worker.released[q.seq_id] <= 1 + q.preemptions  # only those sent in the last session
