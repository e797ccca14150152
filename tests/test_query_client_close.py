"""A thin client's call handed to its loop as the loop stops (at close).

Seen in CI as a "coroutine QueryClient.call was never awaited" warning at
exit: the call's task was created in the loop's last iteration and never ran
a step. Now close fails the call for its caller and ends the task. The window
is made deterministic here: the loop is held while a call and a stop are
queued behind each other, so both land in the loop's last iteration.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import uuid

from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError
from threadlog.remote import QueryClient


def test_a_call_handed_over_as_the_loop_stops_fails_and_its_coroutine_is_closed(bootstrap) -> None:
    qc = QueryClient(bootstrap, f"qc-close-{uuid.uuid4().hex[:6]}.members", "qc-close", timeout=5)
    qc._thread.start()  # the loop alone: no worker is needed to hand a call over
    gate, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        gate.wait(10)

    qc._loop.call_soon_threadsafe(hold)  # hold the loop ...
    # ... from inside an iteration, so that the call's start and the stop both
    # land in the next one (queued before the hold ran, the start ran in the
    # hold's iteration and the task's first step beside the stop: CI saw that).
    assert holding.wait(5)
    ran: list[int] = []

    async def call() -> None:
        ran.append(1)
        await asyncio.sleep(30)

    coro = call()
    fut = qc._run(coro)  # ... while the call's start and the stop queue up behind each other
    qc._loop.call_soon_threadsafe(qc._loop.stop)
    gate.set()
    qc._thread.join(5)
    assert not qc._thread.is_alive()
    qc.close()
    exc = fut.exception(timeout=5)
    assert isinstance(exc, ThreadLogError) and exc.code == UNAVAILABLE, exc
    assert not ran  # never ran a step ...
    assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED  # ... and is closed, not left to warn
    assert not [t for t in asyncio.all_tasks(qc._loop) if not t.done()]


def test_calls_racing_close_each_end_answered_or_unavailable(bootstrap) -> None:
    """Callers on other threads keep handing calls over while the client closes:
    every call ends (none waits forever), with UNAVAILABLE or its own result."""
    qc = QueryClient(bootstrap, f"qc-race-{uuid.uuid4().hex[:6]}.members", "qc-race", timeout=5)
    qc._thread.start()
    outcomes: list[str] = []
    wrong: list[BaseException] = []
    busy = threading.Event()

    async def call() -> str:
        await asyncio.sleep(0)
        return "done"

    def caller() -> None:
        while True:  # until the close ends it: every caller meets an UNAVAILABLE
            try:
                outcomes.append(qc._run(call()).result(10))
                if len(outcomes) >= 200:
                    busy.set()
            except ThreadLogError as exc:
                if exc.code != UNAVAILABLE:
                    wrong.append(exc)
                outcomes.append("unavailable")
                return
            except BaseException as exc:  # a CancelledError, a timeout: the call did not end as it should
                wrong.append(exc)
                return

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    assert busy.wait(30)
    qc.close()
    for t in threads:
        t.join(15)
        assert not t.is_alive()
    assert not wrong, wrong
    assert "done" in outcomes and outcomes.count("unavailable") == len(threads)
    assert not [t for t in asyncio.all_tasks(qc._loop) if not t.done()]
