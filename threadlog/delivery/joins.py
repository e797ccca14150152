"""How a reader that is not a run's driver joins it: from the start while the run
runs, at "now" while the run is known.

`DeliveryLog.read` keeps the SPEC's rules (SPEC 11): from `"-1"` a run with no
chunk and no close is `RUN_NOT_FOUND` after `first_chunk_wait_ms`; from
`"now"` it waits for whatever comes next, however long. A reader that follows a
run for a person -- an SSE join (`threadlog serve`), `threadlog replay
--follow` -- wants neither as it is: a slow model's first chunk may well come
after the wait (the run is running: keep waiting), and a mistyped run id joined
at "now" waited for good (the run is unknown: say so). Both decide by what the
run's records say when the wait runs out, asked once per round.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from ..kernel.errors import RUN_NOT_FOUND, ThreadLogError
from .log import DeliveryLog

# Least time between a from-start join's reads of a running run with no chunk yet.
ROUND_S = 1.0

Ask = Callable[[], Awaitable[bool]]
Wrap = Callable[[AsyncIterator[tuple[str, dict]]], AsyncIterator[tuple[str | None, dict]]]


async def is_running(tl: Any, run_id: str) -> bool:
    """Has `run_id` a run record that is `running`?"""
    run = await tl.runs.get(run_id)
    return run is not None and run["status"] == "running"


async def is_known(tl: Any, run_id: str) -> bool:
    """Has `run_id` a run record or any delivery record? A delivery log can be
    written without a run record, so both are asked; neither is a mistyped id."""
    return await tl.runs.get(run_id) is not None or bool(await tl.delivery(run_id).records("-1"))


async def _says_yes(ask: Ask) -> bool:
    try:
        return await ask() is True
    except Exception:  # a failed ask is taken as "not known": the caller's rule decides what that means
        return False


async def from_start(log: DeliveryLog, running: Ask, announced: Wrap | None = None,
                     ) -> AsyncIterator[tuple[str | None, dict]]:
    """The run's chunks from the start, read from "-1" again for as long as the
    run has none and `running()` says it runs. A run not known to be running
    gets `read`'s RUN_NOT_FOUND. A run left `running` by a driver that died
    holds the reader as a live join of it does, until the run is reclaimed or
    the reader goes; rounds are at least ROUND_S apart, whatever
    first_chunk_wait_ms is (1 ms made them a busy loop of questions).

    `announced(reader)` wraps the first read (an SSE join's WAITING event: offset
    None); given, a first read that gave up before it could announce yields one
    WAITING itself.
    """
    announce = announced is not None
    loop = asyncio.get_running_loop()
    while True:
        began = loop.time()
        reader = log.read("-1")
        chunks = announced(reader) if announce and announced is not None else reader
        produced = False
        try:
            async for offset, chunk in chunks:
                announce = False  # WAITING once per stream, whatever comes first
                produced = produced or offset is not None
                yield offset, chunk
            return
        except ThreadLogError as exc:
            if produced or exc.code != RUN_NOT_FOUND or not await _says_yes(running):
                raise
        finally:
            if chunks is not reader:
                await chunks.aclose()  # type: ignore[attr-defined]  # first: it may be reading
            aclose = getattr(reader, "aclose", None)
            if aclose is not None:
                await aclose()
        if announce:  # gave up sooner than the wrapper announces: it is running
            announce = False
            yield None, {}
        # Pacing, not synchronization: the next read starts from the beginning,
        # so a first chunk written meanwhile is met as soon as it starts.
        await asyncio.sleep(max(0.0, began + ROUND_S - loop.time()))


async def from_now(log: DeliveryLog, known: Ask) -> AsyncIterator[tuple[str, dict]]:
    """The run's chunks after "now"; RUN_NOT_FOUND if none came (nor a close)
    within first_chunk_wait_ms and `known()` says the run has no run record and
    no delivery record. A failed ask keeps the reader waiting: a healthy join
    must not end for a broker that did not answer one question."""
    wait_s = log.first_chunk_wait
    reader = log.read("now")
    first: asyncio.Future[Any] = asyncio.ensure_future(reader.__anext__())
    asking: list[asyncio.Future[Any]] = []
    try:
        await ask_if_late(first, wait_s, known, asking)
        if not first.done() and answer(asking) is False:
            raise ThreadLogError(RUN_NOT_FOUND, f"run {log.run_id!r} is unknown: no run record and no "
                                                f"delivery record, and nothing came within {wait_s}s")
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
        async for item in reader:
            yield item
    finally:
        await settle(first, *asking)
        await reader.aclose()  # type: ignore[attr-defined]  # an async generator: its consumer goes back


async def ask_if_late(first: asyncio.Future[Any], wait_s: float, ask: Ask, asking: list[asyncio.Future[Any]]) -> None:
    """Wait up to `wait_s` for `first` (a reader's first item); if it has not come,
    ask `ask()` (in a task put in `asking`, for the caller to `settle`) and wait
    for whichever ends first."""
    done, _ = await asyncio.wait({first}, timeout=wait_s)
    if not done:
        asking.append(asyncio.ensure_future(ask()))
        await asyncio.wait({first, asking[0]}, return_when=asyncio.FIRST_COMPLETED)


def answer(asking: list[asyncio.Future[Any]]) -> Any:
    """What the ask of `ask_if_late` answered; None if not asked, not answered
    yet, or failed (a failed ask is no answer)."""
    if not asking:
        return None
    task = asking[0]
    return task.result() if task.done() and not task.cancelled() and task.exception() is None else None


async def settle(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel `tasks` still running and wait for them to end, even when we are
    cancelled ourselves (a shutdown, a disconnect): shielded, so a reader is
    never closed while one of them still runs in it. Their errors are seen
    (not logged as never retrieved)."""
    for task in tasks:
        if task is None:
            continue
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
        if not task.cancelled():
            task.exception()
