"""How a run's event stream ends when reading fails (threadlog/http/sse.py
`stream_run`), without a broker: a log stand-in raises what the delivery
reader raises. The rule: a client holding an event id is cut (it reconnects
with Last-Event-ID) only while a retry may succeed; anything else is a RUN_ERROR."""

from __future__ import annotations

import json

from threadlog.http.sse import stream_run
from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError


class FailingLog:
    run_id = "r"

    def __init__(self, error: BaseException, chunks: int = 0, closing: bool = False,
                 read_fails: bool = True) -> None:
        self.error, self.chunks, self.client_closing, self.read_fails = error, chunks, closing, read_fails

    async def _entries(self):
        for n in range(self.chunks):
            yield f"0.{n}.0.x", {"type": "TEXT_MESSAGE_CONTENT", "n": n}
        if self.read_fails:
            raise self.error

    def read(self, after):
        return self._entries()

    async def chunk_at(self, after):
        raise self.error


def gone() -> ThreadLogError:
    return ThreadLogError(UNAVAILABLE, "deliveries[0]@0 is gone (retention)", retryable=False)


async def ending(log: FailingLog, after: str) -> bytes:
    return [part async for part in stream_run(log, after)][-1]


def error_code(event: bytes) -> str:
    return json.loads(event.decode().split("data: ", 1)[1])["code"]


async def test_a_passing_unavailable_cuts_the_stream_of_a_client_holding_an_event_id():
    cut = b": UNAVAILABLE: resume with Last-Event-ID"
    assert await ending(FailingLog(ThreadLogError(UNAVAILABLE, "busy"), chunks=2), "-1") == cut
    assert await ending(FailingLog(ThreadLogError(UNAVAILABLE, "busy")), "0.1.0.x") == cut
    # The log is closed and nothing follows the client's cursor: whether the run
    # finished is its last chunk's to say, and reading that one failed in passing.
    assert await ending(FailingLog(ThreadLogError(UNAVAILABLE, "busy"), read_fails=False), "0.1.0.x") == cut
    # A client with no event id cannot resume: it gets the error it can act on.
    assert error_code(await ending(FailingLog(ThreadLogError(UNAVAILABLE, "busy")), "-1")) == UNAVAILABLE


async def test_records_gone_by_retention_are_a_run_error_not_endless_reconnects():
    # Tried (a review): every retry meets the same loss; cut, a TanStack client
    # reconnected until its attempt limit, an EventSource forever.
    assert error_code(await ending(FailingLog(gone(), chunks=1), "-1")) == UNAVAILABLE


async def test_an_unexpected_error_is_internal_unless_the_client_is_closing_under_the_stream():
    assert error_code(await ending(FailingLog(RuntimeError("a bug")), "0.1.0.x")) == "INTERNAL"
    closing = FailingLog(RuntimeError("cannot schedule new futures after shutdown"), closing=True)
    assert (await ending(closing, "0.1.0.x")).startswith(b": UNAVAILABLE")
