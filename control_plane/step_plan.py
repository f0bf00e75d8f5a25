"""What the scheduler decided for one step, and its StepRequest for the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.sequence import POOLS, Sequence, Status
from protos.coalesce.v1 import worker_pb2


@dataclass(slots=True)
class Work:
    """One sequence's share of a step. Empty `token_ids` is a decode (the worker feeds its last sample)."""

    seq: Sequence
    token_ids: list[int]
    start: int  # position of the first fed token = tokens already in KV
    new_blocks: list[int]
    first: bool  # first sight on the worker: send the sampling params
    sample: bool
    # The sequence's incarnation when planned: its result is stale if the sequence lost its KV meanwhile.
    incarnation: int = field(init=False)

    def __post_init__(self) -> None:
        self.incarnation = self.seq.incarnation

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) or 1

    @property
    def current(self) -> bool:
        """The sequence still runs in the incarnation this work was planned for (else: drop the result)."""
        return self.seq.status is Status.RUNNING and self.seq.incarnation == self.incarnation


@dataclass(slots=True)
class StepPlan:
    """One step. The worker applies `release` first, then `kv_to_int8`, then `copies`, then runs `works`.

    `admitted` lists sequences scheduled for the first time (their dwell is now known); `preempted` those
    this step preempted for recompute.
    """

    epoch: int
    release: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    works: list[Work] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    kv_to_int8: bool = False  # convert the worker's auto KV cache to int8 (block ids stay valid)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.works)

    def to_request(self, step_id: int) -> worker_pb2.StepRequest:
        req = worker_pb2.StepRequest(step_id=step_id, release=self.release, kv_to_int8=self.kv_to_int8)
        for src, dst in self.copies:
            req.copies.add(src=src, dst=dst)
        for w in self.works:
            sw = req.seqs.add(
                seq_id=w.seq.seq_id,
                token_ids=w.token_ids,
                start_position=w.start,
                new_blocks=w.new_blocks,
                sample=w.sample,
                traceparent=w.seq.traceparent,
            )
            if w.first:
                sw.sampling.CopyFrom(w.seq.sampling)
                sw.tail_blocks.extend(w.seq.tail_blocks)
        return req


@dataclass(slots=True)
class StepState:
    """Scratch state of one `schedule` call."""

    budget: int
    lengths: list[int] = field(default_factory=list)  # prefill chunk lengths so far (ratio rule)
    done: set[int] = field(default_factory=set)  # seqs given their work this step: not preemptible
    preempted: set[int] = field(default_factory=set)  # not re-admitted in the step that preempted them


def chunk(remaining: int, step: StepState, ratio: float) -> int:
    """Tokens of a prefill that fit the step: budget, then the longest/shortest ratio (0: skip)."""
    n = min(remaining, step.budget)
    if n <= 0 or not step.lengths:
        return max(n, 0)
    n = min(n, int(ratio * min(step.lengths)))  # a long prompt just takes a smaller chunk
    return n if n * ratio >= max(step.lengths) else 0  # a short one would break the ratio: skip


def pick_victim(seq: Sequence, order: list[Sequence], done: set[int], quota: bool) -> Sequence | None:
    """Preemption victim for `seq`: the newest running sequence of the lowest priority pool that has no work
    this step yet, never one of a higher priority pool than `seq`'s; for a quota shortage only `seq`'s pool
    helps. None: `seq` itself must go. `order` is by priority (interactive then batch, oldest first)."""
    rank = POOLS.index(seq.pool)
    for s in reversed(order):
        if POOLS.index(s.pool) < rank:
            return None
        if s is seq or s.status is not Status.RUNNING or s.seq_id in done:
            continue
        if not quota or s.pool == seq.pool:
            return s
    return None
