"""Time in the dedup store: the injected clock, default lease/retention windows, garbage collection."""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]

# Defaults of docs/architecture.md: a short owner lease renewed by heartbeat, 24 h replay, 30 s resume window.
DEFAULT_LEASE_S = 10.0
DEFAULT_RETENTION_S = 24 * 3600.0
DEFAULT_KEEP_S = 30.0

# Garbage collection (Redis key TTLs; the memory store sweeps the same way). These never decide behaviour,
# which follows the injected clock: they only drop data well after it stopped mattering.
GC_SLACK_S = 60.0  # kept this long past a logical expiry (retention, resume window, lease), for clock skew
RUNNING_GC_S = 3600.0  # a running request's index and log after their last write; released-key tombstones
BATCH_GC_S = 7 * 24 * 3600.0  # a batch's item set after its last claim


def ms(seconds: float) -> int:
    """Whole milliseconds, the unit the Redis scripts compare."""
    return round(seconds * 1000)
