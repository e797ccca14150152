"""EventStreamResponse without a broker: keepalive comment lines while the body
waits and few while it flows, the body's bytes in order, a send to a client
that went away ending the stream quietly, and a disconnect closing the body
(its reader gives its subscription back) before the response returns."""

from __future__ import annotations

import asyncio
import itertools
import time

from threadlog.http.sse import EventStreamResponse

KEEPALIVE = b": keepalive\n\n"


async def _respond(body, keepalive: float, send, disconnect_after: float | None = None) -> None:
    async def receive() -> dict:
        if disconnect_after is None:
            await asyncio.Event().wait()  # the client never disconnects
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    await asyncio.wait_for(EventStreamResponse(body, keepalive=keepalive)({"type": "http"}, receive, send), 10)


def test_keepalives_are_sent_while_the_body_waits_and_not_while_it_flows() -> None:
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    stamps: list[float] = []

    async def body():
        yield b"data: 1\n\n"
        await asyncio.sleep(0.6)  # idle for 6 keepalive periods
        for i in range(2, 40):  # flowing every 10 ms: 10 x faster than the keepalive
            stamps.append(time.monotonic())
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.01)

    asyncio.run(_respond(body(), 0.1, send))
    assert sent[-1] == b""  # the end of the body, sent last
    assert [b for b in sent if b.startswith(b"data:")] == [f"data: {i}\n\n".encode() for i in range(1, 40)]
    first, second = sent.index(b"data: 1\n\n"), sent.index(b"data: 2\n\n")
    waiting = sent[first + 1:second]
    assert len(waiting) >= 2 and set(waiting) == {KEEPALIVE}, waiting  # a loaded machine may lose a few
    # ~0.4 s of flowing chunks: one keepalive per 0.1 s would be ~4. A keepalive may
    # only come in a gap of the flow (a loaded machine stalls the loop): counted.
    gaps = sum(1 for a, b in itertools.pairwise(stamps) if b - a >= 0.09)  # a keepalive needs 0.1 s unsent
    assert sent[second:].count(KEEPALIVE) <= gaps + 1, (gaps, sent[second:])


def test_a_send_to_a_client_gone_ends_the_stream_quietly_and_closes_the_body() -> None:
    closed: list[bool] = []

    async def send(message: dict) -> None:
        if message.get("body", b"").startswith(b"data: 3"):
            raise ConnectionResetError("the client went away")

    async def body():
        try:
            for i in range(1, 100):
                yield f"data: {i}\n\n".encode()
        finally:
            closed.append(True)

    asyncio.run(_respond(body(), 0.05, send))  # returns: no OSError, no ExceptionGroup
    assert closed == [True]


def test_a_disconnect_closes_the_body_before_the_response_returns() -> None:
    """The disconnect lands while a send is stuck (a client not reading: backpressure),
    so the body is parked at its `yield`, not inside an await a cancellation reaches."""
    closed: list[bool] = []
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])
            if message["body"] == b"data: 1\n\n":
                await asyncio.sleep(30)

    async def body():
        try:
            yield b"data: 1\n\n"
            yield b"data: never\n\n"
        finally:
            closed.append(True)

    async def main() -> None:
        await _respond(body(), 5, send, disconnect_after=0.3)
        assert closed == [True]  # closed by the response, not later by the garbage collector

    asyncio.run(main())
    assert sent == [b"data: 1\n\n"]
