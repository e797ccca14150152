"""A thin client's delivery tail halted (its topics replaced) while readers join it, on a real broker.

The tail's partition join (a watermark round) is held open by a gate around
the real `_join`, so the halt lands inside it every time: the consumer, the
broker and the topic are real.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from support import until
from threadlog.projections.delivery_tail import DeliveryTail
from threadlog.schemas import default_codec

from threadlog.kernel.errors import ThreadLogError
from threadlog.kernel.topics import Topics


async def test_readers_joining_a_tail_as_it_halts_are_refused_not_left_waiting(open_client, bootstrap,
                                                                               namespace, monkeypatch):
    """Tried (a review): a subscribe whose partition join finished after the halt
    registered its subscription after every one had been failed -- fed and failed
    by nothing, a live reader waiting for good; and a join still queued when the
    tail stopped was never settled, its reader waiting out the timeout."""
    await open_client()  # creates the namespace's topics
    entered, go = threading.Event(), threading.Event()
    join = DeliveryTail._join

    def gated(self, partition):
        entered.set()
        go.wait(30)
        join(self, partition)

    monkeypatch.setattr(DeliveryTail, "_join", gated)
    tail = DeliveryTail(bootstrap, Topics(namespace).deliveries, default_codec(), "tail-halt-test", 20.0)
    try:
        joining = asyncio.ensure_future(tail.subscribe("run-a", 0))
        await until(entered.is_set, 10, "the tail joining partition 0")
        queued = asyncio.ensure_future(tail.subscribe("run-b", 1))  # behind partition 0's join
        await until(lambda: tail._joining, 10, "the second join queued")
        tail.halt("the topics were replaced")
        with pytest.raises(ThreadLogError) as err:
            await asyncio.wait_for(queued, 5)  # at once, not after the 20 s timeout
        assert err.value.code == "UNAVAILABLE" and "replaced" in err.value.message
        go.set()
        with pytest.raises(ThreadLogError) as err:
            await asyncio.wait_for(joining, 10)
        assert err.value.code == "UNAVAILABLE" and "replaced" in err.value.message
        assert not tail._subs._by_run  # nothing registered that nothing would ever end
    finally:
        go.set()
        tail.stop()
