"""A live reader's queue (projections/delivery_follower.py `Subscription`) is bounded
in records and in bytes, without a broker."""

from __future__ import annotations

import asyncio

from threadlog.projections.delivery_follower import Item, Subscription


def item(offset: int, size: int) -> Item:
    return Item(0, offset, {"kind": "chunks", "runId": "r"}, None, size)


async def test_a_reader_that_reads_nothing_overflows_at_the_byte_bound_not_only_the_count():
    # Tried (a review): an SSE client at TCP window 0 under a run writing 200 KB
    # records: its queue held up to 20 000 of them (666 MB of RSS for one client).
    sub = Subscription(asyncio.get_running_loop(), "r", 0, max_items=20_000, max_bytes=1_000_000)
    sub._put([item(n, 200_000) for n in range(5)])  # 1 000 000 bytes: at the bound
    assert not sub.overflowed and sub.queued_bytes == 1_000_000
    taken = [sub.popleft(), sub.popleft()]
    assert sub.queued_bytes == 600_000
    sub.put_back(taken)  # what a reader looked at and queued again is counted again
    assert [it.offset for it in sub.items] == [0, 1, 2, 3, 4] and sub.queued_bytes == 1_000_000
    sub._put([item(5, 1)])  # one byte over: dropped from the feed, it catches up from Kafka
    assert sub.overflowed and not sub.items and sub.queued_bytes == 0
    assert await asyncio.wait_for(sub.wait(1.0), 5)  # the reader wakes to see it


async def test_the_count_bound_still_holds_for_small_records():
    sub = Subscription(asyncio.get_running_loop(), "r", 0, max_items=3)
    sub._put([item(n, 10) for n in range(3)])
    assert not sub.overflowed
    sub._put([item(3, 10)])
    assert sub.overflowed
