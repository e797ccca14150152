"""The delivery read consumers' pool: a waiter that gives up leaves nothing a wake-up could go to.

Tried (a review): `take` queued its wait, then found its deadline passed and
raised, leaving a live future in the queue; the next consumer given back woke
that future instead of a reader still waiting, which then waited for its next
half-second look. No broker: real librdkafka consumers, never polled.
"""

from __future__ import annotations

import asyncio

import pytest

from threadlog.delivery.reader import ConsumerPool
from threadlog.kernel.errors import ThreadLogError


async def test_a_take_that_gives_up_queues_no_waiter():
    pool = ConsumerPool("127.0.0.1:1", "pool-test", max_open=1)
    held = await pool.take(5.0)
    try:
        with pytest.raises(ThreadLogError) as err:
            await pool.take(0.0)
        assert err.value.code == "UNAVAILABLE"
        with pytest.raises(ThreadLogError):
            await pool.take(0.05)
        assert [f for _, f in pool._waiters if not f.done()] == []
        # The one live waiter then is a reader still waiting: the wake-up of the next
        # consumer given back is its own.
        waiting = asyncio.ensure_future(pool.take(5.0))
        deadline = asyncio.get_running_loop().time() + 5
        while not [f for _, f in pool._waiters if not f.done()]:
            assert asyncio.get_running_loop().time() < deadline, "the take never queued its wait"
            await asyncio.sleep(0.001)
        [(_, woken)] = [(loop, f) for loop, f in pool._waiters if not f.done()]
        pool.give(held)
        held = await asyncio.wait_for(waiting, 5)
        assert woken.done()
    finally:
        pool.give(held)
        pool.close()
