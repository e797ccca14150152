"""A thin client's delivery append: the push's grace and the question after it
share what the write left of one request timeout (threadlog/run_access.py)."""

from __future__ import annotations

import asyncio

from threadlog.run_access import RemoteRuns

GRACE_S = 0.3


class SilentPush:
    """Nothing pushed within the grace: the client asks."""

    async def delivery_answer(self, d: int, x: int, owner: int, limit=None):
        await asyncio.sleep(GRACE_S)
        return None


class RecordingQuery:
    """The worker's side of `dlv_verdict`, recording how long each question may wait."""

    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    async def on_loop(self, coro):
        return await coro

    async def acall(self, op, args, partitions=None, timeout=None):
        self.timeouts.append(timeout)
        return {tuple(partitions): {"verdict": {"n": 1}, "fence": 1, "state": None}}


async def test_the_question_after_the_push_grace_waits_only_what_is_left():
    # Tried (an audit of options): `decide` was given what the write left, then
    # waited out the grace and asked with a fresh full request timeout: about
    # twice `request_timeout_ms` for an append whose worker froze.
    query = RecordingQuery()
    runs = RemoteRuns(query, tail=None, events_partitions=4, timeout=30.0, pushed=SilentPush())
    verdict, fence = await runs.decide("r", 0, 7, "chunks", 1, 2.0)
    assert (verdict, fence) == ({"n": 1}, 1)
    [asked] = query.timeouts
    assert asked is not None and asked <= 2.0 - GRACE_S + 0.01
