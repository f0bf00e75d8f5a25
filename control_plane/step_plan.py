"""What the scheduler decided for one step, and its StepRequest for the worker."""

from __future__ import annotations

from dataclasses import dataclass, field

from control_plane.sequence import Sequence
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

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) or 1


@dataclass(slots=True)
class StepPlan:
    """One step. The worker applies `release` first, then `copies`, then runs `works`.

    `publish` lists (seq, block index, hash) of full blocks this step computes; `complete` indexes them.
    `admitted` lists sequences scheduled for the first time (their dwell is now known).
    """

    epoch: int
    release: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    works: list[Work] = field(default_factory=list)
    publish: list[tuple[Sequence, int, int]] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.works)

    def to_request(self, step_id: int) -> worker_pb2.StepRequest:
        req = worker_pb2.StepRequest(step_id=step_id, release=self.release)
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
        return req
