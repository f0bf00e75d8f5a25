"""The packed batch of one step: the contract between the engine (which validates a StepRequest and keeps
per-sequence state) and the model runner (which runs one forward pass over it).

All new tokens of a step are concatenated, sequence after sequence, with no padding. Each sequence's
tokens continue a prefix that is already in the KV cache (its blocks are listed in `block_table`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SeqSlice:
    """One sequence's part of a packed batch."""

    seq_id: int
    # The whole block table after this step's appends; block i holds positions [i*bs, (i+1)*bs).
    block_table: list[int]
    # Position of the first new token; positions [0, start) are already cached.
    start: int
    # Number of new tokens fed this step (>= 1).
    num_tokens: int
    # An int8 cache's full-precision tail (worker/kv_cache.py): its TAIL_BLOCKS block ids, or empty for none ...
    tail: list[int] = field(default_factory=list)
    # ... and the first position this sequence computed itself: tail rows hold its positions from here on (a
    # prefix mapped from the cache was computed by another sequence, into blocks only).
    tail_from: int = 0


@dataclass(slots=True)
class PackedBatch:
    """Token ids and positions of every new token, in sequence order; `seqs` says which slice is whose."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seqs: list[SeqSlice]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.numel())
