"""How a worker tells its control plane that one step failed, as opposed to the worker being lost.

A lost worker (a crash, a broken connection) loses nothing but its cache: the control plane recomputes every
sequence it ran. A step that raised (a model failure, or a plan the worker refused) would raise again when
recomputed, so its sequences must end with an error instead, or they would be retried forever and hold every
request batched with them. The worker ends the Step stream with the failed step's id in this trailing
metadata key; the control plane ends that step's sequences and recomputes the rest (control_plane/worker_link.py).
"""

from __future__ import annotations

import grpc

FAILED_STEP_KEY = "coalesce-failed-step"


def failed_step_metadata(step_id: int) -> tuple[tuple[str, str], ...]:
    return ((FAILED_STEP_KEY, str(step_id)),)


def failed_step(exc: BaseException) -> int | None:
    """The id of the step a worker reported failing in the error that ended its Step stream; None otherwise."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return None
    for key, value in exc.trailing_metadata() or ():
        if key == FAILED_STEP_KEY and str(value).isdigit():
            return int(value)
    return None
