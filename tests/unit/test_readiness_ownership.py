"""Readiness forgets what it learnt about a partition when its ownership changes.

The judge and the broker are stood in for by the two things `Readiness` reads
(the judged positions and the end offsets): the rule under test is readiness's
own bookkeeping, not Kafka's.
"""

from __future__ import annotations

import asyncio
import threading
import time

from threadlog.metrics import Readiness


class Judge:
    group = "workers"

    def __init__(self) -> None:
        self.owned: set[int] = {0}
        self.positions = {0: 5}

    def applied(self, p: int) -> int:
        return self.positions[p]


class Barrier:
    def __init__(self) -> None:
        self.ends = {0: 10}
        self.hold: asyncio.Event | None = None  # set: rounds read now, then wait for it

    async def end_offsets(self) -> dict[int, int]:
        ends, hold = dict(self.ends), self.hold
        if hold is not None:
            await asyncio.wait_for(hold.wait(), 5)
        return ends


class Runtime:
    worker = True
    failed = None

    def __init__(self) -> None:
        self.judge = Judge()
        self.barrier = Barrier()
        self.ownership_listeners: list = []

    def owned_now(self) -> None:  # what the judge does, on its thread, after an (un)assignment
        listeners = list(self.ownership_listeners)
        owned = sorted(self.judge.owned)
        worker = threading.Thread(target=lambda: [f(owned) for f in listeners])
        worker.start()
        worker.join(5)


async def settle(readiness: Readiness) -> None:
    """Let the loop run what the judge's thread posted (forget, then read targets)."""
    for _ in range(3):
        await asyncio.sleep(0)
    if readiness._tasks:
        await asyncio.wait_for(asyncio.gather(*readiness._tasks), 5)


async def test_a_partition_revoked_and_given_back_between_checks_starts_its_stall_clock_again():
    # Tried: a worker restoring a partition given back to it (its judged
    # position not moving yet) answered 503 "stalled" at its first check, the
    # clock still running from before the partition was revoked.
    rt = Runtime()
    readiness = Readiness(rt, stall_after=0.2)
    readiness.start()
    rt.owned_now()
    await settle(readiness)
    assert readiness.targets == {0: 10}
    ready, detail = await readiness.check()
    assert ready is False and detail["reason"] == "partitions not caught up"  # 5 judged of 10
    assert "stalled" not in detail
    started = time.monotonic()
    while time.monotonic() - started < 0.25:  # past the stall bound, at the same position
        await asyncio.sleep(0.05)
    assert "stalled" in (await readiness.check())[1]

    # Revoked and assigned again with no check between (the judge's two callbacks).
    rt.judge.owned = set()
    rt.owned_now()
    rt.barrier.ends = {0: 12}
    rt.judge.owned = {0}
    rt.owned_now()
    await settle(readiness)
    ready, detail = await readiness.check()
    assert "stalled" not in detail, detail  # the clock starts again with this ownership
    assert readiness.targets == {0: 12}  # and the target is this assignment's end


async def test_a_target_read_before_a_partition_was_given_again_is_not_kept():
    # Tried (a review's suspicion, reproduced here): a targets round that read
    # the end offsets, then waited, while its partition was revoked and given
    # again, stored the old end as the new assignment's target -- before the
    # new assignment's round answered -- and the worker answered ready before
    # it had judged what was there when the partition was given.
    rt = Runtime()
    readiness = Readiness(rt)
    first, later = asyncio.Event(), asyncio.Event()
    rt.barrier.hold = first
    readiness.start()
    rt.owned_now()
    for _ in range(3):
        await asyncio.sleep(0)  # the first rounds have read {0: 10} and wait
    rt.barrier.hold = later
    rt.judge.owned = set()
    rt.owned_now()
    rt.barrier.ends = {0: 12}
    rt.judge.owned = {0}
    rt.owned_now()
    for _ in range(3):
        await asyncio.sleep(0)  # this assignment's rounds have read {0: 12} and wait
    first.set()  # the rounds from before the revoke answer first
    for _ in range(5):
        await asyncio.sleep(0)
    later.set()
    await settle(readiness)
    assert readiness.targets == {0: 12}
    rt.judge.positions = {0: 10}
    ready, detail = await readiness.check()
    assert ready is False and detail["reason"] == "partitions not caught up", detail


async def test_a_restored_partition_failing_to_be_served_says_why_the_worker_is_not_ready():
    # Tried: a restored store that could not be served (a full disk) was tried
    # again each second for good while /readyz said only "restoring": nothing
    # told an operator the restore had ended and what kept failing.
    rt = Runtime()
    rt.judge.positions = {0: 10}
    rt.judge.restoring = [0, 1]  # type: ignore[attr-defined]
    rt.judge.unserved = {1: "OSError: No space left on device"}  # type: ignore[attr-defined]
    readiness = Readiness(rt)
    readiness.start()
    rt.owned_now()
    await settle(readiness)
    ready, detail = await readiness.check()
    assert ready is False and detail["unserved"] == {"1": "OSError: No space left on device"}, detail
    assert "No space left on device" in detail["reason"] and "[1]" in detail["reason"], detail
    rt.judge.unserved = {}  # type: ignore[attr-defined]
    ready, detail = await readiness.check()
    assert ready is False and "unserved" not in detail and "restoring from their snapshots" in detail["reason"]


async def test_a_share_the_group_gave_that_the_judge_has_not_taken_yet_is_not_ready(monkeypatch):
    # Tried (seen under load in tests/test_ops.py): a joining worker whose group
    # description already gave it two partitions, while its judge's assignment
    # callback had not run yet (it runs in the judge's next poll), answered 200
    # with `owned: []` -- owning nothing and restoring nothing.
    from types import SimpleNamespace

    from threadlog import metrics

    def member(mid: str, n: int) -> SimpleNamespace:
        tps = [SimpleNamespace(topic="ev") for _ in range(n)]
        return SimpleNamespace(member_id=mid, assignment=SimpleNamespace(topic_partitions=tps))

    described = SimpleNamespace(state=SimpleNamespace(name="STABLE"), members=[member("me", 2), member("o", 2)])
    monkeypatch.setattr(metrics, "_describe_group", lambda admin, group, timeout: described)
    monkeypatch.setattr(metrics, "DESCRIBE_EVERY_S", 0.0)  # described again at each check
    rt = Runtime()
    rt.shared_admin = object()  # type: ignore[attr-defined]
    judge = rt.judge
    judge.owned, judge.positions = set(), {}
    judge.member_id, judge.topic, judge.rebalanced_at = "me", "ev", time.monotonic()  # type: ignore[attr-defined]
    judge.restoring = []  # type: ignore[attr-defined]
    readiness = Readiness(rt)
    readiness.joined = True
    ready, detail = await readiness.check()
    assert ready is False and "gave this worker 2 partitions; it has taken 0" in detail["reason"], detail
    judge.restoring = [2, 3]  # type: ignore[attr-defined]  # the callback ran: restoring them
    judge.rebalanced_at = time.monotonic()  # type: ignore[attr-defined]
    ready, detail = await readiness.check()
    assert ready is False and "restoring from their snapshots" in detail["reason"], detail
    judge.restoring, judge.owned, judge.positions = [], {2, 3}, {2: 0, 3: 0}  # type: ignore[attr-defined]
    rt.barrier.ends = {2: 0, 3: 0}
    readiness.targets = {2: 0, 3: 0}
    ready, detail = await readiness.check()
    assert ready is True, detail
    # A description asked for before the judge's last (un)assignment proves nothing:
    # a worker whose partitions were just taken is not held up by it.
    judge.owned, judge.positions = {2}, {2: 0}
    monkeypatch.setattr(metrics, "DESCRIBE_EVERY_S", 60.0)
    judge.rebalanced_at = time.monotonic()  # type: ignore[attr-defined]
    ready, detail = await readiness.check()
    assert ready is True, detail
