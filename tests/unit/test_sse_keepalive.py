"""EventStreamResponse's keepalive timer, without a broker: comment lines while
the body waits, none while it flows, and the body's bytes in order."""

from __future__ import annotations

import asyncio

from threadlog.http.sse import EventStreamResponse


async def _collect(body, keepalive: float) -> list[bytes]:
    sent: list[bytes] = []

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never disconnects
        return {}

    await asyncio.wait_for(EventStreamResponse(body, keepalive=keepalive)({"type": "http"}, receive, send), 10)
    return sent


def test_keepalives_are_sent_while_the_body_waits_and_not_while_it_flows() -> None:
    async def body():
        yield b"data: 1\n\n"
        await asyncio.sleep(0.35)  # idle: ~3 keepalives at 0.1 s
        for i in range(2, 40):  # flowing faster than the keepalive: none
            yield f"data: {i}\n\n".encode()
            await asyncio.sleep(0.01)

    sent = asyncio.run(_collect(body(), 0.1))
    assert sent[-1] == b""  # the end of the body
    data = [b for b in sent if b.startswith(b"data:")]
    assert data == [f"data: {i}\n\n".encode() for i in range(1, 40)]
    first, second = sent.index(b"data: 1\n\n"), sent.index(b"data: 2\n\n")
    waiting = sent[first + 1:second]
    assert 2 <= len(waiting) <= 4 and set(waiting) == {b": keepalive\n\n"}, waiting
    # 38 chunks 10 ms apart: at most one keepalive slips in (a slow machine), not one per 0.1 s
    assert sent[second:].count(b": keepalive\n\n") <= 1
