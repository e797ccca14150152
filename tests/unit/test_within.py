"""`within` (producers/pump.py): awaiting a private future under a deadline, the
way every proposal, delivery append and worker request waits. Tried: an
answer in time, no answer, an answer after the deadline, a cancelled caller."""

from __future__ import annotations

import asyncio

import pytest
from threadlog.producers.pump import settle, within


async def test_an_answer_in_time_is_returned():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_later(0.01, settle, fut, None, "verdict")
    assert await within(fut, 5) == "verdict"


async def test_an_error_in_time_is_raised():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    loop.call_soon(settle, fut, ValueError("refused"), None)
    with pytest.raises(ValueError, match="refused"):
        await within(fut, 5)


async def test_no_answer_raises_timeout_and_a_late_one_is_dropped():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    with pytest.raises(TimeoutError):
        await within(fut, 0.02)
    assert fut.done()
    settle(fut, None, "late")  # what a verdict arriving after the deadline does: nothing
    with pytest.raises(TimeoutError):
        fut.result()


async def test_a_cancelled_caller_cancels_the_future_and_its_timer():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    task = asyncio.create_task(within(fut, 0.05))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fut.cancelled()
    await asyncio.sleep(0.1)  # past the deadline: the cancelled timer fired nothing
    assert fut.cancelled()
