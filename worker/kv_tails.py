"""Where a step writes and reads an int8 cache's full-precision tails (worker/kv_cache.py, docs/kv_cache.md).

A sequence with a tail holds TAIL_BLOCKS blocks whose bytes are block_size bfloat16 rows, one per offset in
a block: tail block i holds offsets [i * per, (i + 1) * per), per = block_size / TAIL_BLOCKS. A step writes the
residual of each new token in the sequence's last block to its offset's row, and attention adds the rows back
for the positions from `lo` on: the last block's, from the first position the sequence computed itself (a
prefix mapped from the cache was written by another sequence, into blocks only). Pure index arithmetic on
SeqSlices, for worker/attention.py's build_metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.batch import SeqSlice


@dataclass(slots=True)
class RowMap:
    """Rows `src` of one tensor go to rows `dst` of another (int64 index tensors of one length)."""

    src: torch.Tensor
    dst: torch.Tensor


def row(s: SeqSlice, offset: int, block_size: int) -> int:
    """The tail row of a block offset."""
    per = block_size // len(s.tail)
    return s.tail[offset // per] * per + offset % per


def rows(s: SeqSlice, block_size: int) -> list[int]:
    """The tail rows of offsets 0 .. block_size - 1."""
    per = block_size // len(s.tail)
    return [b * per + i for b in s.tail for i in range(per)]


def lo(s: SeqSlice, block_size: int) -> int:
    """The first position `s`'s tail corrects this step."""
    end = s.start + s.num_tokens
    return max((end - 1) // block_size * block_size, s.tail_from)


def writes(s: SeqSlice, block_size: int) -> list[int]:
    """The tail row of each of this step's new tokens of `s`, -1 for those its tail does not take."""
    if not s.tail:
        return [-1] * s.num_tokens
    first = lo(s, block_size)
    return [row(s, p % block_size, block_size) if p >= first else -1 for p in range(s.start, s.start + s.num_tokens)]


def reads(seqs: list[SeqSlice], stride: int, block_size: int, device: torch.device) -> RowMap | None:
    """For gathered rows laid out `stride` per sequence: which tail rows add to which (None: no tails)."""
    src: list[int] = []
    dst: list[int] = []
    for i, s in enumerate(seqs):
        if s.tail:
            positions = range(lo(s, block_size), s.start + s.num_tokens)
            src += (row(s, p % block_size, block_size) for p in positions)
            dst += (i * stride + p for p in positions)
    return RowMap(torch.tensor(src).to(device), torch.tensor(dst).to(device)) if src else None
