"""Cancelling background tasks for good.

On Python 3.11 `asyncio.wait_for` loses a cancellation that arrives while the operation it waits for completes
(python/cpython#86296, fixed in 3.12), and redis-py sends every command under `asyncio.wait_for` when a socket
timeout is set, as the Redis store does. A loop cancelled during such a call goes on as if nothing happened,
so cancelling once and waiting can wait forever (a control plane that never exits after SIGTERM).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], every_s: float = 0.1) -> None:
    """Cancel `tasks` and wait until each has ended, cancelling again those that lost their cancellation."""
    tasks = list(tasks)
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    for task in tasks:  # retrieved, as gather(return_exceptions=True) would: none is reported as unhandled
        if not task.cancelled():
            task.exception()
