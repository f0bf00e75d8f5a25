"""Background tasks end when cancelled, even when a cancellation is lost on the way (control_plane/cancel.py)."""

from __future__ import annotations

import asyncio

from control_plane.cancel import cancel_all


async def test_a_loop_that_loses_a_cancellation_is_cancelled_again() -> None:
    async def heartbeat() -> None:
        lost = False
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if lost:
                    raise
                lost = True  # as Python 3.11's asyncio.wait_for does when its operation completed meanwhile

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all([task]), 10)
    assert task.cancelled()


async def test_exceptions_of_ended_tasks_are_retrieved() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    await cancel_all([task])
    assert task.done() and not task.cancelled()
