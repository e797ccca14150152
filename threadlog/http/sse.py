"""Server-Sent Events for a run's delivery log, in the shape `@tanstack/ai-client` reads.

One event per chunk: `id: <offset>` (the opaque delivery offset, which the
client keeps verbatim and sends back as `Last-Event-ID`) and `data: <chunk
JSON>` on one line. The client reconnects while a stream ends without a
terminal chunk (`RUN_FINISHED` / `RUN_ERROR`) and gives up once a reconnect
brings nothing new, so a log closed after a non-terminal chunk gets a final
synthetic `RUN_ERROR` (no id: it is not in the log), as TanStack's own sink
writes on abort. Errors (unknown run, bad offset) are a `RUN_ERROR` event on a
real event stream, never an HTML page.

A from-start join of a run known to be running whose first chunk is late gets
a `CUSTOM` event named `threadlog.waiting` (no id: it is not in the log) after
`EARLY_S`: `ChatClient` gives a rejoin 2 s to yield its first chunk, and
threadlog may wait `first_chunk_wait_ms` (5 s) for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ..delivery import DeliveryLog
from ..delivery.joins import answer, ask_if_late, from_now, from_start, settle
from ..kernel.errors import INTERNAL, UNAVAILABLE, ThreadLogError, unavailable
from ..metrics import Metrics
from .guard import TOO_MANY_STREAMS, Limits, StreamSlots

log_ = logging.getLogger("threadlog.http")

TERMINAL = frozenset({"RUN_FINISHED", "RUN_ERROR"})
INCOMPLETE = "RUN_INCOMPLETE"  # code of the synthetic error: closed without a terminal chunk
KEEPALIVE_SECONDS = 15.0
FINAL_SEND_S = 1.0  # longest wait to end a response whose client reads nothing
# A from-start join with no chunk after this long hears WAITING, if its run is
# known to be running: well under @tanstack/ai-client's 2 s rejoin deadline
# (REJOIN_CONNECT_DEADLINE_MS, time to its first chunk), with room for the ask.
EARLY_S = 0.5
WAITING = "threadlog.waiting"
HEADERS = {
    "Cache-Control": "no-store",
    "X-Accel-Buffering": "no",  # nginx: do not buffer an event stream
}


def _json(value: Any) -> str:
    # One line: json.dumps escapes every newline inside strings.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def event(chunk: dict, offset: str | None = None) -> bytes:
    head = f"id: {offset}\n" if offset is not None else ""
    return f"{head}data: {_json(chunk)}\n\n".encode()


def run_error(run_id: str, code: str, message: str) -> bytes:
    return event({"type": "RUN_ERROR", "runId": run_id, "code": code, "message": message,
                  "timestamp": int(time.time() * 1000)})


def _passing(exc: ThreadLogError) -> bool:
    """An error a later try may not meet (a broker or worker away, every read
    consumer busy): UNAVAILABLE, unless not retryable (records gone by retention)."""
    return exc.code == UNAVAILABLE and exc.retryable


def waiting(run_id: str) -> bytes:
    """The event of a join still waiting for its run's first chunk: a CUSTOM
    chunk, which ChatClient counts as its first (its rejoin then waits on) and
    otherwise only hands to `onChunk` / `onCustomEvent`."""
    return event({"type": "CUSTOM", "name": WAITING, "value": {"runId": run_id},
                  "timestamp": int(time.time() * 1000)})


def _cut(code: str) -> bytes:
    """The end of a stream the client should resume: a last line with no newline.

    Why not a RUN_ERROR: it is terminal to @tanstack/ai-client, so a passing
    error ended a healthy run for it for good. A cut stream is its
    StreamTruncatedError, as for a dropped connection: it reconnects with
    Last-Event-ID, with its backoff and attempt limit (an EventSource
    reconnects anyway). Only for a client that holds an event id."""
    return f": {code}: resume with Last-Event-ID".encode()


def is_terminal(chunk: Any) -> bool:
    return isinstance(chunk, dict) and chunk.get("type") in TERMINAL


class StreamCursor:
    """Where one connection's client stands: does it hold an event id to resume from?

    One rule, in one place, for every way a stream ends early: a client holding
    an id (it got an event here, or joined after one) is cut, and reconnects
    with Last-Event-ID; one without gets a RUN_ERROR, the only thing it can act on."""

    def __init__(self, run_id: str, after: str) -> None:
        self.run_id = run_id
        self.after = after
        self.yielded = 0

    def holds_id(self) -> bool:
        return bool(self.yielded) or self.after not in ("-1", "now")

    def ended(self, exc: ThreadLogError) -> bytes:
        """The last bytes of a stream ended by a passing error `exc`."""
        return _cut(exc.code) if self.holds_id() else run_error(self.run_id, exc.code, exc.message)

    def farewell(self) -> bytes:
        """The last bytes of a stream the server ends as it shuts down. Not a clean
        end: @tanstack/ai-client resumes a clean end only if that connection gave it
        a new event, so a join still waiting for its first chunk 'succeeded' with
        nothing, and a second restart in a row (a rolling one) ended a live run
        with DurableStreamIncompleteError (a review, with the real client)."""
        return self.ended(unavailable("this server is shutting down: join the run again on another"))


async def _announced(reader: AsyncIterator[tuple[str, dict]],
                     running: Callable[[], Awaitable[bool]]) -> AsyncIterator[tuple[str | None, dict]]:
    """`reader`'s chunks, preceded by a WAITING pseudo-chunk (offset None) when
    none came within EARLY_S and `running()` says the run is running. Only the
    first chunk is awaited in a task of its own; the rest as `stream_run` does."""
    first: asyncio.Future[Any] = asyncio.ensure_future(reader.__anext__())
    asking: list[asyncio.Future[Any]] = []
    try:
        await ask_if_late(first, EARLY_S, running, asking)
        # Never for an unknown run: ChatClient's deadline is what drops a stale
        # pointer. A failed ask is taken as "not known".
        if not first.done() and answer(asking) is True:
            yield None, {}
        try:
            item = await first
        except StopAsyncIteration:
            return
        yield item
    finally:
        await settle(first, *asking)  # over before the reader is closed, not while it runs
    async for offset, chunk in reader:
        yield offset, chunk


async def stream_run(log: DeliveryLog, after: str, cursor: StreamCursor | None = None,
                     running: Callable[[], Awaitable[bool]] | None = None,
                     known: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[bytes]:
    """The SSE events of one connection: chunks strictly after `after` until the log closes.

    Keepalives are not in here: `EventStreamResponse` sends them from a timer
    while this waits. So each chunk is awaited by the task that sends it: no
    task per chunk, no `asyncio.wait` -- on the latency path every loop
    iteration saved counts (see docs/measurements.md, "SSE latency"). `running()`: is the run
    known to be running (a from-start join then hears WAITING if its first
    chunk is late, and waits on); `known()`: has it any record at all (a "now"
    join of a run with none gets RUN_NOT_FOUND once the first chunk's wait is
    over: `joins.from_now`)."""
    cursor = cursor or StreamCursor(log.run_id, after)
    reader: AsyncIterator[tuple[str, dict]] | None = None
    chunks: AsyncIterator[tuple[str | None, dict]]
    if after == "-1" and running is not None:
        chunks = from_start(log, running, lambda reader: _announced(reader, running))  # its readers are its own
    elif after == "now" and known is not None:
        chunks = from_now(log, known)
    else:
        chunks = reader = log.read(after)
    last: Any = None
    try:
        try:
            async for offset, chunk in chunks:
                if offset is None:  # WAITING: not in the log, no id
                    yield waiting(log.run_id)
                    continue
                cursor.yielded += 1
                last = chunk
                yield event(chunk, offset)
        except ThreadLogError as exc:
            if _passing(exc):
                yield cursor.ended(exc)
                return
            yield run_error(log.run_id, exc.code, exc.message)
            return
        except Exception:
            if log.client_closing:  # the app closed its client under the stream: resume elsewhere
                yield _cut(UNAVAILABLE)  # the threadlog client is closing
                return
            # Not ours to raise (a foreign record, a bug): the stream must still end
            # as an event stream, with a code, not cut with a server traceback.
            log_.exception("the delivery log of run %r could not be streamed", log.run_id)
            yield run_error(log.run_id, INTERNAL, "the run's delivery log could not be streamed (see the server log)")
            return
        # The log is closed. Did it end on a terminal chunk?
        if cursor.yielded == 0 and after == "now":
            # Joined at its end: the last chunk is before where it began. Read
            # once (rare: a "now" join of a log that closes with nothing after).
            try:
                async for _, chunk in log.read("-1", follow=False):
                    last = chunk
            except ThreadLogError as exc:
                if _passing(exc):  # as below: a passing failure is no RUN_INCOMPLETE (a review saw one)
                    yield _cut(exc.code)
                    return
                last = None
        elif cursor.yielded == 0 and after != "-1":
            try:
                last = await log.chunk_at(after)  # nothing after the cursor: it is the last chunk
            except ThreadLogError as exc:
                if _passing(exc):  # not a RUN_INCOMPLETE of a run that may have finished well
                    yield _cut(exc.code)
                    return
                last = None
        if not is_terminal(last):
            yield run_error(log.run_id, INCOMPLETE,
                            "the run's delivery log was closed without a RUN_FINISHED or RUN_ERROR chunk")
    finally:
        if chunks is not reader:
            await chunks.aclose()  # type: ignore[attr-defined]  # first: it may be reading
        aclose = getattr(reader, "aclose", None)  # an async generator: end it (its consumer goes back)
        if aclose is not None:
            await aclose()


class EventStreamResponse(StreamingResponse):
    """A streaming response that ends its body as soon as the client disconnects,
    whatever the ASGI server's spec version (Starlette only watches for it below
    2.4): a browser gone mid-wait must not keep a reader subscribed."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], metrics: Metrics | None = None,
                 slots: StreamSlots | None = None, keepalive: float = KEEPALIVE_SECONDS,
                 cursor: StreamCursor | None = None, limits: Limits | None = None) -> None:
        super().__init__(content, media_type="text/event-stream; charset=utf-8", headers=HEADERS)
        self.metrics = metrics
        self.slots = slots
        self.keepalive = keepalive
        self.cursor = cursor  # what the client holds, for the last bytes of a shutdown
        limits = limits or Limits()
        self.slot_wait = limits.max_stream_wait_ms / 1000.0
        self.write_stall = limits.max_write_stall_ms / 1000.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The stream's slot is taken and given back here, around the whole
        # stream: whatever ends it (the log, a disconnect, an error) frees it.
        if self.slots is not None and not await self.slots.take_within(self.slot_wait):
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # never started: nothing read
            busy: Response
            if self.cursor is not None and self.cursor.holds_id():
                # @tanstack/ai-client takes any non-OK answer as the run's end, a
                # healthy run's too, and an EventSource never reconnects after one:
                # a cut stream, which both resume with Last-Event-ID (and backoff).
                busy = Response(_cut(TOO_MANY_STREAMS), media_type="text/event-stream; charset=utf-8",
                                headers=HEADERS)
            else:
                busy = JSONResponse({"error": {"code": TOO_MANY_STREAMS,
                                               "message": f"{self.slots.limit} event streams are open; retry later"}},
                                    status_code=503, headers={"Cache-Control": "no-store", "Retry-After": "1"})
            await busy(scope, receive, send)
            return
        try:
            if self.metrics is None:
                await self._serve(receive, send)
                return
            with self.metrics.sse_stream():
                await self._serve(receive, send)
        finally:
            if self.slots is not None:
                self.slots.give()

    async def stream_response(self, send: Send) -> None:
        """The body, plus a comment line whenever nothing was sent for
        `keepalive` seconds (proxies close idle streams). The two share `send`
        under a lock; the body's sends never wait on the timer.

        The timer is a plain task, not a task group: an error from `send` (the
        client went away) reaches the caller as itself, not wrapped in an
        ExceptionGroup. The body is closed on every way out, a disconnect
        included, so its reader gives its subscription back at once."""
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        # asyncio's lock: taken uncontended it never yields (anyio's takes a loop iteration).
        lock = asyncio.Lock()
        sent_at = time.monotonic()

        async def keepalive() -> None:
            nonlocal sent_at
            while True:
                await asyncio.sleep(max(0.0, sent_at + self.keepalive - time.monotonic()))
                if time.monotonic() - sent_at >= self.keepalive:
                    async with lock:
                        try:
                            await send({"type": "http.response.body", "body": b": keepalive\n\n",
                                        "more_body": True})
                        except OSError:
                            return  # the client went away: the body's next send or the disconnect ends the stream
                    sent_at = time.monotonic()

        timer = asyncio.ensure_future(keepalive())
        try:
            async for chunk in self.body_iterator:
                async with lock:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                sent_at = time.monotonic()
        finally:
            timer.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):  # a disconnect cancels us: close it all the same
                    await aclose()
        await asyncio.wait({timer})  # cancelled above: it ends at its next step, before the last send
        # Bounded: a client that reads nothing (flow control) would hold this send,
        # and a server's shutdown, until the drain timeout cut it with a traceback.
        with anyio.move_on_after(FINAL_SEND_S):
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _serve(self, receive: Receive, send: Send) -> None:
        started = completed = closed_by_server = False
        # When the send in progress began (None: none is). A client that reads
        # nothing (its receive window full) held a send, its slot and its reader
        # for as long as it lived: `watchdog` ends the stream past write_stall.
        # A watchdog, not a timeout around each send: that cost ~12 µs a chunk.
        # The body's and the keepalive's sends both come here.
        pending_since: float | None = None

        async def sending(message: MutableMapping[str, Any]) -> None:
            nonlocal started, completed, pending_since
            pending_since = time.monotonic()
            try:
                await send(message)
            finally:
                pending_since = None
            started = True
            completed = completed or (message["type"] == "http.response.body" and not message.get("more_body"))

        async def watchdog() -> None:
            while True:
                since = pending_since
                if since is None:  # checked again soon: a stall is seen within 1.25 x the bound
                    await asyncio.sleep(self.write_stall / 4)
                    continue
                left = since + self.write_stall - time.monotonic()
                if left > 0:
                    await asyncio.sleep(left)
                elif pending_since == since:  # the same send, still held
                    log_.warning("an event stream's client read nothing for %.1f s: stream ended", self.write_stall)
                    tg.cancel_scope.cancel()
                    return

        async with anyio.create_task_group() as tg:

            async def body() -> None:
                try:
                    await self.stream_response(sending)
                except OSError:
                    pass  # the client went away mid-send
                tg.cancel_scope.cancel()

            async def disconnect() -> None:
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        break
                tg.cancel_scope.cancel()

            async def server_closing() -> None:
                nonlocal closed_by_server
                assert self.slots is not None
                await self.slots.wait_closing()
                closed_by_server = True
                tg.cancel_scope.cancel()

            tg.start_soon(body)
            tg.start_soon(disconnect)
            tg.start_soon(watchdog)
            if self.slots is not None:
                tg.start_soon(server_closing)
        if closed_by_server and not completed:  # the body may have ended first
            # The body was stopped between two sends (or before its first): end the
            # response properly, its last bytes saying how to go on (StreamCursor.farewell).
            with contextlib.suppress(OSError), anyio.move_on_after(FINAL_SEND_S):
                if not started:
                    await send({"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers})
                if self.cursor is not None:
                    await send({"type": "http.response.body", "body": self.cursor.farewell(), "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
