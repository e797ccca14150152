"""`serve` ends its open SSE streams on SIGTERM (StreamSlots.close_streams):
each response completes exactly once, whatever ends first, and the signal
reaches streams on any event loop."""

from __future__ import annotations

import asyncio
import threading

from threadlog.http.guard import StreamSlots
from threadlog.http.sse import EventStreamResponse


async def _stream_ending_near_a_close(hops: int) -> list[dict]:
    """A stream whose log ends, then `hops` loop callbacks later the server closes streams."""
    slots = StreamSlots(10)
    loop = asyncio.get_running_loop()

    def later(n: int) -> None:
        if n == 0:
            slots.close_streams()
        else:
            loop.call_soon(later, n - 1)

    async def content():
        yield b"data: {}\n\n"
        later(hops)

    sent: list[dict] = []

    async def send(message: dict) -> None:
        if sent and sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body"):
            raise RuntimeError("a message after the response completed")
        sent.append(message)

    never = asyncio.Event()

    async def receive() -> dict:
        await never.wait()
        return {"type": "http.disconnect"}

    await EventStreamResponse(content(), None, slots, keepalive=100)({"type": "http"}, receive, send)
    assert slots.open == 0
    return sent


def test_a_response_completes_once_when_the_log_ends_as_the_server_closes():
    # Tried: the close arriving 0 to 7 loop callbacks after the log ended. The body
    # could finish the response and the close then send its end again (uvicorn:
    # "Unexpected ASGI message", a traceback).
    for hops in range(8):
        sent = asyncio.run(_stream_ending_near_a_close(hops))
        ends = [m for m in sent if m["type"] == "http.response.body" and not m.get("more_body")]
        assert len(ends) == 1, (hops, sent)


def test_close_streams_reaches_waiters_on_several_loops_and_later_ones():
    # One asyncio.Event for all bound itself to the first loop that waited: a
    # stream on a second loop (a second TestClient of one app) failed.
    slots = StreamSlots(10)
    waiting = threading.Barrier(3)
    done: list[str] = []

    def on_own_loop(name: str) -> None:
        async def wait() -> None:
            task = asyncio.ensure_future(slots.wait_closing())
            await asyncio.sleep(0.05)
            waiting.wait(10)
            await asyncio.wait_for(task, 10)
            done.append(name)

        asyncio.run(wait())

    threads = [threading.Thread(target=on_own_loop, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    waiting.wait(10)
    slots.close_streams()
    for t in threads:
        t.join(15)
    assert sorted(done) == ["a", "b"]
    asyncio.run(asyncio.wait_for(slots.wait_closing(), 1))  # closed already: returns at once
