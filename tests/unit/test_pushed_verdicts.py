"""A thin client matching pushed verdicts to its acknowledged proposals (threadlog/remote.py).

A pushed verdict and its proposal's ack reach the client's loop by different
paths (the worker's socket; the producer's pump thread), so either may come
first. These drive `RemoteVerdicts` on a test loop with a stand-in for the
query client (no connection is made: the push stream is marked live, and
`verdicts` requests are answered by the stand-in) and check that each caller
gets its own verdict exactly once, whichever came first; that a forgotten
caller gets none; that a verdict never pushed is asked for after the grace;
and that pushed offsets raise the read floor.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from threadlog import remote
from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError
from threadlog.members import Member

ADDRESS = "127.0.0.1:1"


class _Members:
    version = 1

    def live(self) -> list[Member]:
        return [Member("w", ADDRESS, 0.0, time.time() * 1000.0, (0, 1))]


class _Client:
    """What RemoteVerdicts uses of a QueryClient; `verdicts` requests answered from `judged`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.closed = False
        self.closers: list = []
        self.members = _Members()
        self.partitions = 2
        self.timeout = 5.0
        self.floor: dict[int, int] = {}
        self.judged: dict[tuple[int, int], dict] = {}
        self.requests: list[tuple[int, list[int]]] = []

    def owner_of(self, partition: int) -> str | None:
        return next((m.address for m in self.members.live() if m.serves(partition)), None)

    def raise_floor(self, positions: dict[int, int]) -> None:
        for p, o in positions.items():
            self.floor[p] = max(self.floor.get(p, 0), o)

    async def call(self, op: str, args: dict, partitions: list[int]) -> dict:
        assert op == "verdicts"
        self.requests.append((args["p"], list(args["os"])))
        return {tuple(partitions): {"verdicts": [self.judged.get((args["p"], o)) for o in args["os"]]}}


@pytest.fixture
async def setup():
    client = _Client(asyncio.get_running_loop())
    verdicts = remote.RemoteVerdicts(client)  # type: ignore[arg-type]
    stream = verdicts._streams[ADDRESS] = remote._PushStream()
    stream.live = True
    stream.deliveries = True
    return client, verdicts


def _waiter(verdicts: remote.RemoteVerdicts, p: int, o: int) -> tuple[asyncio.Future, object]:
    fut = asyncio.get_running_loop().create_future()

    def cb(verdict: dict) -> None:
        assert not fut.done(), "a verdict delivered twice"
        fut.set_result(verdict)

    verdicts.on_verdict(p, o, cb)  # as the pump thread does: through the loop's inbox
    return fut, cb


async def test_a_push_before_its_ack_is_kept_for_it(setup):
    client, verdicts = setup
    verdicts._pushed([[0, 5, {"ok": True, "result": "early"}], [1, 3, {"ok": False, "code": "STALE_HEAD"}]])
    assert client.floor == {0: 6, 1: 4}
    first, _ = _waiter(verdicts, 0, 5)
    second, _ = _waiter(verdicts, 1, 3)
    assert await asyncio.wait_for(first, 5) == {"ok": True, "result": "early"}
    assert (await asyncio.wait_for(second, 5))["code"] == "STALE_HEAD"
    assert verdicts._early == {} and client.requests == []  # nothing asked


async def test_an_ack_before_its_push_waits_for_it(setup):
    client, verdicts = setup
    fut, _ = _waiter(verdicts, 0, 7)
    other, _ = _waiter(verdicts, 0, 8)
    await asyncio.sleep(0)  # the inbox's wake-up runs: both wait for a push
    assert set(verdicts._waiting) == {(0, 7), (0, 8)}
    verdicts._pushed([[0, 8, {"ok": True, "result": 8}], [0, 7, {"ok": True, "result": 7}]])
    assert (await asyncio.wait_for(fut, 5))["result"] == 7
    assert (await asyncio.wait_for(other, 5))["result"] == 8
    assert verdicts.pushed == 2 and verdicts.asked == 0 and client.requests == []


async def test_a_forgotten_caller_gets_no_verdict(setup):
    _, verdicts = setup
    fut, cb = _waiter(verdicts, 0, 9)
    verdicts.forget(0, 9, cb)
    await asyncio.sleep(0)
    verdicts._pushed([[0, 9, {"ok": True}]])
    await asyncio.sleep(0)
    assert not fut.done()


async def test_a_verdict_not_pushed_within_the_grace_is_asked_for(setup, monkeypatch):
    monkeypatch.setattr(remote, "PUSH_GRACE_S", 0.05)
    client, verdicts = setup
    client.judged[(1, 4)] = {"ok": True, "result": "asked"}
    fut, _ = _waiter(verdicts, 1, 4)
    assert (await asyncio.wait_for(fut, 5))["result"] == "asked"
    assert client.requests == [(1, [4])] and verdicts.asked == 1 and client.floor == {1: 5}
    # Pushed after all: at or below the last ack of its partition, so answered
    # already -- not kept for an ack that will never come; nobody is told twice.
    verdicts._pushed([[1, 4, {"ok": True, "result": "late"}]])
    assert verdicts._early == {}


async def test_a_push_that_overtakes_an_unjudged_answer_is_delivered_once(setup):
    """The worker answers `verdicts` with null for an offset not judged yet; the
    judge then pushes it, and the push (the judge's thread) overtakes the
    answer (the worker's event loop): the null must find the pushed verdict."""
    client, verdicts = setup
    verdicts._streams[ADDRESS].live = False
    verdicts._streams[ADDRESS].retry_at = float("inf")
    client.judged[(0, 2)] = {"ok": True, "result": 2}  # (0, 3) not judged when asked: null
    first, _ = _waiter(verdicts, 0, 2)
    second, _ = _waiter(verdicts, 0, 3)
    await asyncio.sleep(0)  # both acks queued; the request is created, not yet answered
    verdicts._pushed([[0, 3, {"ok": True, "result": 3}]])  # overtakes the null
    assert (await asyncio.wait_for(first, 5))["result"] == 2
    assert (await asyncio.wait_for(second, 5))["result"] == 3
    assert client.requests == [(0, [2, 3])] and verdicts._early == {}


async def test_verdicts_pushed_again_below_the_last_ack_are_not_kept(setup):
    """A new owner catching up pushes the verdicts of old proposals again:
    those at or below the last offset acked are answered, not kept."""
    _, verdicts = setup
    fut, _ = _waiter(verdicts, 0, 50)
    verdicts._pushed([[0, 50, {"ok": True}]])
    assert await asyncio.wait_for(fut, 5) == {"ok": True}
    verdicts._pushed([[0, n, {"ok": True}] for n in range(40, 51)] + [[0, 51, {"ok": True}]])
    assert set(verdicts._early) == {(0, 51)}  # 51's ack may still come; the rest were answered
    verdicts._pushed([])  # an idle beat changes nothing
    assert set(verdicts._early) == {(0, 51)}


async def test_unclaimed_pushed_verdicts_are_capped_and_an_ack_past_the_cap_asks(setup, monkeypatch):
    """Forged proposals carrying a client's reply token have their verdicts pushed
    to it. Tried: 30 000 pushed above its last ack were all kept (for 30 s each,
    uncounted). At most MAX_EARLY are kept now; one dropped is asked for when its
    ack comes."""
    monkeypatch.setattr(remote, "PUSH_GRACE_S", 0.05)
    client, verdicts = setup
    verdicts._pushed([[0, 100 + n, {"ok": True}] for n in range(3 * remote.MAX_EARLY)])
    assert 0 < len(verdicts._early) <= remote.MAX_EARLY
    dropped = next(100 + n for n in range(3 * remote.MAX_EARLY) if (0, 100 + n) not in verdicts._early)
    client.judged[(0, dropped)] = {"ok": True, "result": "asked"}
    fut, _ = _waiter(verdicts, 0, dropped)
    assert (await asyncio.wait_for(fut, 5))["result"] == "asked"


async def test_without_a_live_push_stream_it_asks_at_once(setup):
    client, verdicts = setup
    verdicts._streams[ADDRESS].live = False
    verdicts._streams[ADDRESS].retry_at = float("inf")  # no connection attempt in a unit test
    client.judged[(0, 1)] = {"ok": True}
    fut, _ = _waiter(verdicts, 0, 1)
    assert await asyncio.wait_for(fut, 5) == {"ok": True}
    assert client.requests == [(0, [1])]


# -- delivery records' answers (pushed by the owner's run index) -------------------------
ANSWER = {"verdict": {}, "fence": 1, "state": {"fence": 1, "reps": 0}}


async def test_a_delivery_answer_pushed_before_its_writer_asks_is_used(setup):
    _, verdicts = setup
    verdicts._dlv_pushed([[2, 40, {}, 1, {"fence": 1, "reps": 0}]])
    assert await asyncio.wait_for(verdicts.delivery_answer(2, 40, 0), 5) == ANSWER
    assert verdicts.dlv_used == 1 and verdicts._dlv_early == {}


async def test_a_delivery_writer_waits_for_its_push(setup):
    _, verdicts = setup
    waiting = asyncio.ensure_future(verdicts.delivery_answer(2, 41, 0))
    await asyncio.sleep(0)
    assert set(verdicts._dlv_waiting) == {(2, 41)}
    verdicts._dlv_pushed([[2, 41, {"drop": "RUN_CLAIM_LOST"}, 3, {"fence": 3, "reps": 0}]])
    assert await asyncio.wait_for(waiting, 5) == {"verdict": {"drop": "RUN_CLAIM_LOST"}, "fence": 3,
                                                  "state": {"fence": 3, "reps": 0}}
    assert verdicts._dlv_waiting == {}


async def test_a_delivery_writer_asks_when_nothing_is_pushed_in_time(setup, monkeypatch):
    monkeypatch.setattr(remote, "PUSH_GRACE_S", 0.05)
    _, verdicts = setup
    assert await asyncio.wait_for(verdicts.delivery_answer(2, 42, 0), 5) is None
    assert verdicts._dlv_waiting == {} and verdicts.dlv_used == 0


async def test_a_worker_that_pushes_no_delivery_answers_is_asked_at_once(setup):
    _, verdicts = setup
    verdicts._streams[ADDRESS].deliveries = False  # a worker of the version before delivery pushes
    started = asyncio.get_running_loop().time()
    assert await asyncio.wait_for(verdicts.delivery_answer(2, 43, 0), 5) is None
    assert asyncio.get_running_loop().time() - started < remote.PUSH_GRACE_S / 2


async def test_a_push_answers_a_caller_whose_verdict_is_being_asked_for(setup):
    """Tried (rolling restarts of 3 workers gated on /readyz, 2026-12-06): a
    worker draining after SIGTERM has tombstoned its members entry, so no one
    announces its partitions; a write acked then is asked for (`verdicts`),
    and that request waits for a new owner, which was catching up a stale store
    for seconds. The draining worker's judge still judged the write and pushed
    its verdict 30 ms after the ack -- kept aside for the request, which failed
    at the deadline: the caller got OUTCOME_UNKNOWN for an accepted write. The
    push answers the caller now; the request's late answer tells no one twice."""
    client, verdicts = setup
    verdicts._streams[ADDRESS].live = False  # no push connection to the announced owner: asked
    verdicts._streams[ADDRESS].retry_at = float("inf")
    release = asyncio.Event()

    async def unanswered(op: str, args: dict, partitions: list[int]) -> dict:
        client.requests.append((args["p"], list(args["os"])))
        await release.wait()  # no owner answers before the deadline
        raise ThreadLogError(UNAVAILABLE, "verdicts: no live worker answered within the request timeout")

    client.call = unanswered  # type: ignore[method-assign]
    fut, _ = _waiter(verdicts, 0, 4)
    for _ in range(5):
        await asyncio.sleep(0)
    assert client.requests == [(0, [4])]  # being asked for
    verdicts._pushed([[0, 4, {"ok": True, "result": "pushed"}]])  # the draining owner's judge
    assert (await asyncio.wait_for(fut, 1))["result"] == "pushed"
    release.set()  # the request fails afterwards: the caller is not told again (`_waiter` asserts)
    for _ in range(5):
        await asyncio.sleep(0)
    assert verdicts._early == {} and verdicts._asking == {}
