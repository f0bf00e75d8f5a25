"""Worker choice for a new request: merge_weight × prefix_match_fraction − normalized_load.

See docs/architecture.md, "A request's life"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Candidate(Protocol):
    """What routing needs from a worker's scheduler (control_plane.scheduler.Scheduler fits)."""

    def prefix_match(self, prompt_ids: list[int], tenant: str) -> int: ...

    def load(self) -> float: ...


def choose_worker(candidates: Sequence[Candidate], prompt_ids: list[int], tenant: str, merge_weight: float) -> int:
    """Index of the best worker. Ties go to the lowest load, then the lowest index. Reads, never mutates."""
    if not candidates:
        raise ValueError("no worker to choose from")
    best: tuple[float, float, int] | None = None
    for i, c in enumerate(candidates):
        load = min(1.0, max(0.0, c.load()))
        frac = c.prefix_match(prompt_ids, tenant) / len(prompt_ids) if prompt_ids else 0.0
        key = (-(merge_weight * frac - load), load, i)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2]
