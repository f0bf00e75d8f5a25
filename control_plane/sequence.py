"""One computation as the scheduler sees it (docs/architecture.md, "Records and their owners").

A sequence is WAITING (in its pool's queue), RUNNING (holds KV blocks on its worker) or FINISHED. Its
tokens are `prompt_ids + output_ids`; on recompute after a preemption all of them are prefilled again and
the next sampled token continues `output_ids` (`max_tokens` counts outputs only).

KV bookkeeping: `num_computed` tokens are in the worker's KV cache as of the last completed step. The
scheduler plans one step ahead (a step may be planned while the previous one still runs), so it also
tracks what is scheduled but not yet completed: `num_scheduled` tokens will be in KV once every planned
step has run, and `pending` of those steps sample a token for it. With nothing in flight,
`num_scheduled == num_computed` and `pending == 0`; while decoding, the last sampled token is not yet in KV
(the worker feeds it on the next step), so `num_scheduled == num_tokens + pending - 1`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from control_plane.detokenize import IncrementalText
from protos.coalesce.v1 import worker_pb2

if TYPE_CHECKING:
    from control_plane.generation import Generation

POOLS = ("interactive", "batch")  # priority order: interactive is admitted first, preempted last


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    tenant: str
    pool: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: worker_pb2.WorkerSampling = field(default_factory=worker_pb2.WorkerSampling)
    eos_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    traceparent: str = ""
    # Set by Scheduler.add from the injected clock; kept across preemptions (it orders the batch buffer).
    arrival: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0
    num_scheduled: int = 0
    pending: int = 0  # planned steps, not yet completed, that sample a token for this sequence
    # Bumped whenever the sequence loses its KV (preemption, worker loss): results of steps planned for an
    # older incarnation are stale and ignored, so a recomputed sequence never receives an old token.
    incarnation: int = 0
    block_table: list[int] = field(default_factory=list)
    # Blocks held as its full-precision tail on an int8 KV cache (worker/kv_cache.py); charged like its table.
    tail_blocks: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks whose KV is computed (published or hit), one per block from 0.
    hashes: list[int] = field(default_factory=list)
    # Prefix-cache hit of the first admission, in prompt tokens (reported as usage).
    cached_prompt_tokens: int = 0
    first_scheduled_at: float | None = None
    finish_reason: str | None = None
    # The prompt (+ recomputed outputs) is scheduled into KV and, once the planned steps have run, the worker
    # holds a sampled token to feed next: the next work is a decode.
    decoding: bool = False
    # The worker knows this id (sent since the last release): a release must follow before it is forgotten.
    on_worker: bool = False
    # Skipped by the prefill ratio rule while at the head of its queue; a second skip stops admissions.
    skipped: bool = False
    preemptions: int = 0
    # Workers lost (crashed, cut off) while a step of this sequence was in flight; at MAX_WORKER_LOSSES it ends
    # with an error instead of being recomputed again (control_plane/worker_link.py).
    worker_losses: int = 0
    # Text of the outputs so far, with the request's stop strings: `complete` ends the sequence on a match.
    text: IncrementalText | None = None
    # Where its tokens go (the dispatcher's; the scheduler never reads it).
    gen: Generation | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def dwell(self) -> float | None:
        """Batch-buffer dwell: from arrival to first admission (None while never scheduled)."""
        return None if self.first_scheduled_at is None else self.first_scheduled_at - self.arrival

    def can_sample_more(self, max_context: int) -> bool:
        """Whether another token may be planned now: one that follows the `pending` tokens being sampled
        could still be generated within max_tokens and the context (else the sequence ends at the last one)."""
        return len(self.output_ids) + self.pending < self.max_tokens and self.num_tokens + self.pending < max_context

    def stop_reason(self, token: int, max_context: int) -> str | None:
        """Why the sequence ends after `token` was appended (and pushed to `text`), or None to go on."""
        if token in self.stop_token_ids or (not self.ignore_eos and token in self.eos_ids):
            return "stop"
        if len(self.output_ids) >= self.max_tokens or self.num_tokens >= max_context:
            return "length"
        if self.text is not None and self.text.stopped:
            return "stop"
        return None

    def moved(self, seq_id: int) -> Sequence:
        """The same computation under a new id, to run on another worker from its outputs so far."""
        return Sequence(seq_id, self.request_id, self.tenant, self.pool, self.prompt_ids, self.max_tokens,
                        self.sampling, self.eos_ids, self.stop_token_ids, self.ignore_eos, self.traceparent,
                        output_ids=list(self.output_ids), text=self.text, gen=self.gen,
                        worker_losses=self.worker_losses)  # fmt: skip


@dataclass(slots=True, frozen=True)
class SeqEvent:
    """One sampled token of one sequence after a step: the text it released, and the finish reason when it
    ended the sequence (then `text` also holds what the detokenizer held back)."""

    seq: Sequence
    token: int
    finish_reason: str | None
    text: str = ""
