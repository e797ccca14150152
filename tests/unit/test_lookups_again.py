"""A worker's judge asks again, ahead of judging, the arrival questions that failed.

Tried (a probe: two workers, a broker outage, 3 s request timeouts): after the
rebalance each worker asked the other about every append of its gained
partition at once; the other, catching up itself, answered none in time, and
~2 000 questions failed together. Asked on arrival only, those appends were
then asked about one at a time as judging reached each (~50 records/s; 58 s to
recover instead of 11-17). No broker: a real Judge (its librdkafka consumer
never polled), real Lookups and RocksDB stores; only the other worker is a
stand-in that fails the first round and then answers.
"""

from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import Future

import pytest
from threadlog.processors import lookups as lookups_module
from threadlog.processors.judge import Judge, _Pending
from threadlog.processors.lookups import Lookups
from threadlog.projections.global_ids import CHECKPOINT
from threadlog.projections.partition_stores import PartitionStores
from threadlog.projections.view import View
from threadlog.schemas import default_codec

from threadlog.kernel.errors import ThreadLogError


class OtherWorker:
    """What Lookups asks (QueryClient's `_run`, `_supports`, `call`): fails while `down`."""

    def __init__(self) -> None:
        self.down = True
        self.asked: list[tuple[str, int]] = []

    def _run(self, coro) -> Future:
        done: Future = Future()
        done.set_result(asyncio.run(coro))
        return done

    def _supports(self, op: str) -> bool:
        return False  # one `holders` per question

    async def call(self, op: str, args: dict, partitions: list[int]) -> dict:
        self.asked.append((args["id"], args["asof"]))
        if self.down:
            raise ThreadLogError("UNAVAILABLE", "no answer within the request timeout")
        return {tuple(partitions): {"threads": []}}


class Queued:
    """A fetched record as the judge holds it (only its offset is read here)."""

    def __init__(self, offset: int) -> None:
        self._offset = offset

    def offset(self) -> int:
        return self._offset


@pytest.fixture
def judge(tmp_path, monkeypatch):
    monkeypatch.setattr(lookups_module, "RETRY_AFTER_S", 0.0)  # a failed question may be asked at once
    other = OtherWorker()
    stores = PartitionStores(tmp_path / "stores", "ns.events")
    j = Judge("127.0.0.1:1", "ns.events", 2, stores, default_codec(), "lookups-test", group="ns.judges",
              lookups=Lookups(other))  # type: ignore[arg-type]
    j.owned = {0}
    stores.open(0)
    yield j, other
    j._consumer.close()
    stores.close()


def test_arrival_questions_that_failed_are_asked_again_for_the_appends_queued_behind(judge):
    j, other = judge
    # Appends at offsets 5..9 of partition 0, each asked about partition 1 on arrival.
    asks = [(offset, f"cp-{offset}", [0, 3]) for offset in range(5, 10)]
    j._ask_early(0, asks, {0})
    assert [x for x, _ in other.asked] == [f"cp-{o}" for o in range(5, 10)]  # all failed
    other.down, other.asked = False, []
    pend = _Pending(deque(Queued(o) for o in range(5, 10)))  # 5 waits at the head
    j._prefetch(View(j.stores.store_of(0)), 0, pend, {0: 5}, lambda *a: None)
    # Those behind the head were asked again (each its own request); the head's own
    # question goes with its next decision.
    assert sorted(x for x, _ in other.asked) == [f"cp-{o}" for o in range(6, 10)]
    assert all(j.lookups.answered([(1, CHECKPOINT, f"cp-{o}", 3)]) for o in range(6, 10))
    other.asked = []
    j._prefetch(View(j.stores.store_of(0)), 0, pend, {0: 5}, lambda *a: None)
    assert other.asked == []  # answered: never asked twice


def test_nothing_is_asked_again_while_no_question_fails(judge):
    j, other = judge
    other.down = False
    j._ask_early(0, [(offset, f"cp-{offset}", [0, 3]) for offset in range(5, 8)], {0})
    assert len(other.asked) == 3
    pend = _Pending(deque(Queued(o) for o in range(5, 8)))
    j._prefetch(View(j.stores.store_of(0)), 0, pend, {0: 5}, lambda *a: None)
    assert len(other.asked) == 3
