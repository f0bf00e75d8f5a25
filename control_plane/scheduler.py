"""Scheduling policy for one worker: pools, batch buffer, admission, preemption (docs/architecture.md).

Pure and synchronous: the caller owns I/O and time (the clock is injected). The loop is

    plan = sched.schedule()            # None: nothing to run; sleep until next_wakeup() or an add()
    resp = worker.step(plan.to_request(step_id))
    events = sched.complete(plan, {t.seq_id: t.token.token_id for t in resp.tokens})

with exactly one `complete` per plan, in order (a lost worker: `requeue_all` instead).

Lookahead: up to MAX_INFLIGHT plans may be scheduled before the first is completed, so the worker (which runs
its stream strictly in order) starts step N+1 the moment step N is done while the caller completes N. Each
sequence tracks what is planned but not completed (`num_scheduled`, `pending`), so N+1 gets the right
positions, block slots and budget: a sequence sampling in N decodes in N+1 (the worker feeds the token it
sampled in N), unless N's token is its last by max_tokens or context. If N's token ends it otherwise (EOS,
stop token, a stop string or cancel), N+1's token is wasted: its result is dropped, like every result for a
sequence that finished, was preempted or lost its worker meanwhile (`Work.current`). Prefix-cache hashes are
still published only at `complete`, once the KV is written.

An `auto` KV cache (docs/kv_cache.md): when a block allocation does not fit (after evicting cached blocks), the
whole cache converts to int8 in the plan being made (`StepPlan.kv_to_int8`), which multiplies the blocks and
quotas by the worker's kv_block_units; only if that is not enough does a decode preempt (or an admission wait).
On an int8 cache (auto: once converted) each sequence admitted also takes the worker's kv_tail_blocks blocks
for its full-precision tail, counted in its admission cost and its pool's quota.

Releases: a sequence the worker knows is released exactly once, in the `release` list of a plan, when it
finishes, is aborted or is preempted. A preempted sequence keeps its seq id: it is released in the plan
that preempts it and sent again (first sight, full re-prefill of prompt + outputs) only in a later plan,
so a release and a re-add of one id never share a request. A release goes into the next plan scheduled,
which the worker runs after every plan already sent: never before the last step that mentions the id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.batch_buffer import QueueFull, deadline, fair_order, released, retry_after
from control_plane.block_manager import BlockManager, Hit
from control_plane.config import PoolSettings, PoolsSettings, SchedulerSettings
from control_plane.sequence import POOLS, SeqEvent, Sequence, Status
from control_plane.step_plan import StepPlan, StepState, Work, chunk, pick_victim

MAX_INFLIGHT = 2  # plans scheduled and not yet completed: the one running and the one queued behind it


class TooLarge(ValueError):
    """The sequence could never run on this worker (context or the pool's KV quota)."""


@dataclass(slots=True)
class Stats:
    running: dict[str, int]
    waiting: dict[str, int]
    kv_used: int
    kv_free: int  # free + cached (evictable)
    kv_by_pool: dict[str, int]
    kv_int8: bool  # an auto cache has converted to int8 (block counts are int8 blocks from then on)
    prefix_queries: int  # tokens
    prefix_hits: int  # tokens
    load: float  # in [0, 1], for routing


class Scheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        pools: PoolsSettings,
        settings: SchedulerSettings,
        max_context: int,
        clock: Callable[[], float],
        kv_block_units: int = 1,
        kv_tail_blocks: int = 0,
    ) -> None:
        """`kv_block_units` > 1: the worker's cache is auto; `kv_tail_blocks`: the blocks of a sequence's tail on
        an int8 cache (the worker's InfoResponse fields)."""
        self.bm = BlockManager(num_blocks, block_size, kv_block_units)
        self.kv_tail_blocks = kv_tail_blocks
        self.block_size = block_size
        self.settings = settings
        self.max_context = max_context
        self.clock = clock
        self.pools: dict[str, PoolSettings] = {"interactive": pools.interactive, "batch": pools.batch}
        self.quota = self._quotas(self.bm.num_blocks)
        self.waiting: dict[str, deque[Sequence]] = {p: deque() for p in POOLS}
        self.running: dict[str, list[Sequence]] = {p: [] for p in POOLS}  # admission order, oldest first
        self.seqs: dict[int, Sequence] = {}  # waiting and running
        self._release: list[int] = []  # released by finish/abort since the last plan
        self._inflight: deque[StepPlan] = deque()  # scheduled, not yet completed, oldest first
        self._epoch = 0  # bumped by requeue_all: plans of the lost worker are ignored
        self._run_s = 1.0  # moving average of admission-to-finish time, for QueueFull retry hints

    # -- requests
    def add(self, seq: Sequence) -> None:
        """Queue a sequence (arrival = now). Raises QueueFull, TooLarge or ValueError."""
        if seq.pool not in self.pools:
            raise ValueError(f"unknown pool {seq.pool!r}")
        if seq.seq_id in self.seqs:
            raise ValueError(f"seq {seq.seq_id} is already scheduled")
        if not seq.prompt_ids or seq.max_tokens < 1:
            raise ValueError("a sequence needs a prompt and max_tokens >= 1")
        if seq.num_tokens >= self.max_context:
            raise TooLarge(f"{seq.num_tokens} tokens leave no room to generate within {self.max_context}")
        kv = min(seq.num_tokens + seq.max_tokens - len(seq.output_ids) - 1, self.max_context - 1)
        need = -(-kv // self.block_size) + self.kv_tail_blocks
        room = min(self._quotas(self.bm.units)[seq.pool], self.bm.units)
        if need > room:
            raise TooLarge(f"{need} KV blocks needed, the {seq.pool} pool may hold {room}")
        pool, queue = self.pools[seq.pool], self.waiting[seq.pool]
        if len(queue) >= pool.max_queue:
            raise QueueFull(seq.pool, retry_after(pool, len(queue), self._run_s))
        seq.arrival = self.clock()
        seq.status = Status.WAITING
        queue.append(seq)
        self.seqs[seq.seq_id] = seq

    def abort(self, seq_id: int) -> bool:
        """Cancel: blocks are freed now, the worker is told in the next plan's release."""
        return self.finish(seq_id, "abort")

    def finish(self, seq_id: int, reason: str) -> bool:
        """End a sequence from outside (a cancel). False when it is unknown or already over."""
        seq = self.seqs.get(seq_id)
        if seq is None:
            return False
        self._end(seq, reason)
        return True

    def requeue_all(self) -> list[Sequence]:
        """The worker was lost: running sequences go back to the front of their queues, the cache is gone."""
        self._epoch += 1
        self._inflight.clear()  # their results, if any arrive, are ignored
        self._release.clear()  # a new session starts with no sequences
        requeued = []
        for p in POOLS:
            for seq in reversed(self.running[p]):
                self._reset(seq)
                self.waiting[p].appendleft(seq)
            requeued += self.running[p]
            self.running[p] = []
        for queue in self.waiting.values():
            for seq in queue:
                seq.on_worker = False
        self.bm.reset()
        self.quota = self._quotas(self.bm.num_blocks)
        return requeued

    # -- state
    def has_work(self) -> bool:
        """Something to schedule, release or complete."""
        return bool(self.seqs or self._release or self._inflight)

    @property
    def inflight(self) -> int:
        return len(self._inflight)

    @property
    def oldest(self) -> StepPlan:
        """The plan the worker answers next (raises IndexError when none is in flight)."""
        return self._inflight[0]

    def in_flight(self) -> list[Sequence]:
        """The sequences that steps in flight compute (each once), oldest step first."""
        seqs = {id(w.seq): w.seq for plan in self._inflight for w in plan.works if w.current}
        return list(seqs.values())

    def stats(self) -> Stats:
        running = {p: len(self.running[p]) for p in POOLS}
        waiting = {p: len(self.waiting[p]) for p in POOLS}
        return Stats(
            running,
            waiting,
            self.bm.num_used,
            self.bm.num_available,
            {p: self.bm.used_by(p) for p in POOLS},
            self.bm.stride < self.bm.per_block,
            self.bm.queries,
            self.bm.hits,
            self.load(),
        )

    def load(self) -> float:
        """Busyness in [0, 1]: the larger of KV in use and (running + waiting) over all pools' max_batch."""
        slots = sum(s.max_batch for s in self.pools.values())
        queued = sum(len(q) for q in self.waiting.values()) + sum(len(r) for r in self.running.values())
        return min(1.0, max(self.bm.num_used / self.bm.num_blocks, queued / slots))

    def prefix_match(self, prompt_ids: list[int], tenant: str) -> int:
        """Prompt tokens this worker's cache would serve (read-only; for routing)."""
        return self.bm.match(prompt_ids, tenant).tokens if prompt_ids else 0

    def next_wakeup(self) -> float | None:
        """When a held-back pool's oldest request reaches max_wait_ms (None: no timer needed)."""
        now = self.clock()
        times = [self._deadline(p) for p in POOLS if self.waiting[p] and not self._released(p, now)]
        return min(times) if times else None

    def _deadline(self, pool: str) -> float:
        return deadline(self.pools[pool], self.waiting[pool])

    def _released(self, pool: str, now: float) -> bool:
        return released(self.pools[pool], self.waiting[pool], len(self.running[pool]), now)

    # -- one step
    def schedule(self) -> StepPlan | None:
        """Plan the next step; None when there is nothing to send (no work, no release)."""
        if len(self._inflight) >= MAX_INFLIGHT:
            raise RuntimeError(f"complete() a plan first: {MAX_INFLIGHT} are in flight")
        now = self.clock()
        plan = StepPlan(self._epoch, release=self._release)
        self._release = []
        step = StepState(self.settings.max_step_tokens)
        order = [s for p in POOLS for s in self.running[p]]  # priority: interactive then batch, oldest first
        for seq in order:
            if seq.decoding and seq.status is Status.RUNNING:
                self._decode(seq, plan, step, order)
        for seq in order:
            if not seq.decoding and seq.status is Status.RUNNING:
                self._prefill(
                    seq, plan, step, chunk(seq.num_tokens - seq.num_scheduled, step, self.settings.prefill_ratio)
                )
        self._admit(plan, step, now)
        if not plan.works and not plan.release:
            return None
        self._inflight.append(plan)
        return plan

    def _decode(self, seq: Sequence, plan: StepPlan, step: StepState, order: list[Sequence]) -> None:
        if not seq.can_sample_more(self.max_context):
            step.done.add(seq.seq_id)  # its in-flight token is its last: it ends then, don't preempt it now
            return
        if step.budget < 1:
            return  # more running sequences than step tokens: the rest wait a step
        step.done.add(seq.seq_id)
        new: list[int] = []
        if self.bm.slots_needed(seq, 1):
            while not self._fits(seq.pool, 1, 1):
                if self._to_int8(plan):
                    continue
                victim = pick_victim(seq, order, step.done, quota=self.bm.used_by(seq.pool) + 1 > self.quota[seq.pool])
                self._preempt(victim or seq, plan, step)
                if victim is None:
                    return
            new.append(self.bm.append(seq))
        plan.works.append(Work(seq, [], seq.num_scheduled, new, first=False, sample=True))
        seq.num_scheduled += 1
        seq.pending += 1
        step.budget -= 1

    def _preempt(self, seq: Sequence, plan: StepPlan, step: StepState) -> None:
        """Free `seq`'s blocks and requeue it at the front of its queue for a full recompute."""
        self.running[seq.pool].remove(seq)
        self._reset(seq)
        self.waiting[seq.pool].appendleft(seq)
        if seq.on_worker:
            plan.release.append(seq.seq_id)
            seq.on_worker = False
        seq.preemptions += 1
        step.preempted.add(seq.seq_id)
        plan.preempted.append(seq)

    def _reset(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.status = Status.WAITING
        seq.num_computed = seq.num_scheduled = seq.pending = 0
        seq.incarnation += 1  # results of its steps still in flight are stale
        seq.hashes = []
        seq.decoding = False

    def _fits(self, pool: str, charge: int, supply: int) -> bool:
        return self.bm.used_by(pool) + charge <= self.quota[pool] and supply <= self.bm.num_available

    def _quotas(self, num_blocks: int) -> dict[str, int]:
        return {p: int(s.kv_share * num_blocks) for p, s in self.pools.items()}

    def _to_int8(self, plan: StepPlan) -> bool:
        """Blocks ran short: convert an auto cache to int8 in this plan. False: nothing to convert."""
        if not self.bm.can_switch:
            return False
        self.bm.to_int8()
        self.quota = self._quotas(self.bm.num_blocks)
        plan.kv_to_int8 = True
        return True

    def _prefill(self, seq: Sequence, plan: StepPlan, step: StepState, n: int, new: list[int] | None = None) -> None:
        step.done.add(seq.seq_id)
        if n <= 0:
            return
        start = seq.num_scheduled
        end = seq.num_scheduled = start + n
        sample = end == seq.num_tokens  # the last chunk: sample, and decode from the next step on
        plan.works.append(Work(seq, seq.tokens()[start:end], start, new or [], new is not None, sample))
        if sample:
            seq.pending += 1
            seq.decoding = True
        step.budget -= n
        step.lengths.append(n)

    def _admit(self, plan: StepPlan, step: StepState, now: float) -> None:
        """Admit waiting sequences, interactive first, fairly between tenants and FIFO within one, within the
        step's budget, the pool's max_batch and its KV quota."""
        for p in POOLS:
            if not self._released(p, now):
                continue
            queue = self.waiting[p]
            for seq in fair_order(queue, self.running[p]):
                if len(self.running[p]) >= self.pools[p].max_batch:
                    break
                if step.budget <= 0:
                    return
                if seq.seq_id in step.preempted:
                    break  # it just lost its room; the rest stays behind it
                tokens = seq.tokens()
                hit = self.bm.match(tokens, seq.tenant)
                n = chunk(len(tokens) - hit.tokens, step, self.settings.prefill_ratio)
                if n == 0:
                    if seq.skipped:
                        return  # skipped twice: admit nothing more so it leads the next step's prefills
                    seq.skipped = True
                    continue
                total = -(-len(tokens) // self.block_size)
                # The cost is taken again after a conversion: blocks are int8 from then on and a tail costs more.
                fits = self._fits(p, *self._cost(hit, total, p))
                if not fits and not (self._to_int8(plan) and self._fits(p, *self._cost(hit, total, p))):
                    break  # no room for the head: nothing behind it jumps ahead
                queue.remove(seq)
                self._start(seq, hit.tokens, now, plan)
                plan.copies += self.bm.allocate(seq, hit, total, self._tail())
                seq.num_computed = seq.num_scheduled = hit.tokens
                self._prefill(seq, plan, step, n, new=list(seq.block_table))

    def _tail(self) -> int:
        """Blocks a sequence admitted now takes for its full-precision tail (none until an auto cache converts)."""
        return 0 if self.bm.can_switch else self.kv_tail_blocks

    def _cost(self, hit: Hit, total: int, pool: str) -> tuple[int, int]:
        """(blocks charged to `pool`, blocks taken from the supply) to admit a table of `total` after `hit`."""
        charge, supply = self.bm.cost(hit, total, pool)
        return charge + self._tail(), supply + self._tail()

    def _start(self, seq: Sequence, cached: int, now: float, plan: StepPlan) -> None:
        seq.status = Status.RUNNING
        seq.skipped = False
        seq.on_worker = True
        self.running[seq.pool].append(seq)
        if seq.first_scheduled_at is None:
            seq.first_scheduled_at = now
            seq.cached_prompt_tokens = min(cached, len(seq.prompt_ids))
            plan.admitted.append(seq)

    # -- results
    def complete(self, plan: StepPlan, sampled: dict[int, int]) -> list[SeqEvent]:
        """Apply the oldest step in flight: publish computed blocks, append sampled tokens, finish ended sequences.

        Plans from before a `requeue_all` are ignored. Raises ValueError when a sampling sequence has no token,
        RuntimeError when plans are completed out of order.
        """
        if plan.epoch != self._epoch or not any(p is plan for p in self._inflight):
            return []  # from a lost worker's session, or already completed
        if plan is not self._inflight[0]:
            raise RuntimeError("plans must be completed in the order they were scheduled")
        self._inflight.popleft()
        events = []
        for w in plan.works:
            seq = w.seq
            if not w.current:
                continue  # finished, aborted or preempted since it was planned: drop the result (a release is queued)
            seq.num_computed += w.num_tokens
            self._publish(seq)
            if not w.sample:
                continue
            seq.pending -= 1
            token = sampled.get(seq.seq_id)
            if token is None:
                raise ValueError(f"the worker sampled no token for seq {seq.seq_id}")
            seq.output_ids.append(token)
            text = seq.text.push(token) if seq.text is not None else ""
            reason = seq.stop_reason(token, self.max_context)
            if reason is not None:
                if seq.text is not None:
                    text += seq.text.flush()
                self._end(seq, reason)
            events.append(SeqEvent(seq, token, reason, text))
        return events

    def _publish(self, seq: Sequence) -> None:
        """Index the full blocks whose KV completed steps have written (a hit never maps unwritten KV)."""
        full, start = seq.num_computed // self.block_size, len(seq.hashes)
        if full > start:
            tokens = seq.tokens()[: full * self.block_size]
            parent = seq.hashes[-1] if seq.hashes else None
            for i, h in enumerate(self.bm.hash_blocks(tokens, seq.tenant, start, parent), start):
                self.bm.publish(seq.block_table[i], h)
                seq.hashes.append(h)

    def _end(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.RUNNING:
            self.running[seq.pool].remove(seq)
            self.bm.free(seq)
        else:
            self.waiting[seq.pool].remove(seq)
        if seq.first_scheduled_at is not None:
            self._run_s = 0.9 * self._run_s + 0.1 * max(0.0, self.clock() - seq.first_scheduled_at)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        del self.seqs[seq.seq_id]
        if seq.on_worker:
            self._release.append(seq.seq_id)
            seq.on_worker = False
