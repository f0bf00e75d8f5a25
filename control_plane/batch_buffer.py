"""The batch buffer's rules (docs/architecture.md, "Scheduling"): when a pool's waiting requests may be
admitted, and the back-pressure when its queue is full. Pure functions of the queue, the pool's settings
and the time."""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Iterator

from control_plane.config import PoolSettings
from control_plane.sequence import Sequence


class QueueFull(Exception):
    """The pool's queue is at `max_queue`; retry after `retry_after_s` (RESOURCE_EXHAUSTED + RetryInfo)."""

    def __init__(self, pool: str, retry_after_s: float) -> None:
        super().__init__(f"{pool} queue is full; retry after {retry_after_s:.2f}s")
        self.pool = pool
        self.retry_after_s = retry_after_s


def deadline(pool: PoolSettings, queue: deque[Sequence]) -> float:
    """When the oldest waiting request has waited max_wait_ms (arrival is kept across preemptions)."""
    return queue[0].arrival + pool.max_wait_ms / 1000


def released(pool: PoolSettings, queue: deque[Sequence], running: int, now: float) -> bool:
    """May this pool's queue be admitted now?"""
    if not queue:
        return False
    if running:  # (a) continuous batching: join the running batch at the next step
        return True
    # (b) enough waiting to fill the free slots (all max_batch of them, none run), or (c) max_wait is up.
    return len(queue) >= pool.max_batch or now >= deadline(pool, queue)


def retry_after(pool: PoolSettings, queued: int, run_s: float) -> float:
    """A retry hint: the time for the queue ahead to drain, max_batch at a time, at the observed run time."""
    return max(pool.max_wait_ms / 1000, run_s * queued / pool.max_batch)


def fair_order(queue: deque[Sequence], running: list[Sequence]) -> Iterator[Sequence]:
    """The waiting sequences in the order to admit them: FIFO within a tenant; between tenants, the one with
    the fewest sequences running (counting those taken from this order) goes next, ties by arrival. So one
    tenant's thousand queued requests cannot keep another's single request waiting behind them."""
    if not queue:
        return
    tenant = queue[0].tenant
    if all(s.tenant == tenant for s in queue):  # the common case: plain FIFO
        yield from list(queue)
        return
    by_tenant: dict[str, deque[tuple[int, Sequence]]] = {}  # (arrival position, sequence)
    for position, seq in enumerate(queue):
        by_tenant.setdefault(seq.tenant, deque()).append((position, seq))
    load = Counter(s.tenant for s in running)
    heap = [(load[t], q[0][0], t) for t, q in by_tenant.items()]
    heapq.heapify(heap)
    while heap:
        count, _, tenant = heapq.heappop(heap)
        waiting = by_tenant[tenant]
        yield waiting.popleft()[1]
        if waiting:
            heapq.heappush(heap, (count + 1, waiting[0][0], tenant))
