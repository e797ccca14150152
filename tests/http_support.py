"""A live HTTP server (uvicorn, real TCP) around `threadlog.http.create_app`, and an SSE reader."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import uvicorn

from threadlog.http import create_app


@contextlib.asynccontextmanager
async def serving(tl, path: str = "/api/chat", app=None, **options):
    """Yield the base URL of a uvicorn server running `create_app(tl, **options)` (or `app`) on this loop."""
    app = app or create_app(tl, path=path, **options)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                           log_level="warning", lifespan="off", timeout_graceful_shutdown=1))
    server.install_signal_handlers = lambda: None  # the test runner owns the signals
    task = asyncio.ensure_future(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    await task
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


class Event:
    def __init__(self, id: str | None, data: dict) -> None:
        self.id = id
        self.data = data

    def __repr__(self) -> str:
        return f"Event(id={self.id!r}, data={self.data!r})"


async def sse_events(response: httpx.Response):
    """Parse an event stream as it arrives: yields Event(id, data JSON)."""
    event_id = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                yield Event(event_id, json.loads("\n".join(data)))
            event_id, data = None, []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "id":
            event_id = value
        elif field == "data":
            data.append(value)


async def read_stream(client: httpx.AsyncClient, url: str, *, headers=None, limit: int | None = None,
                      seconds: float = 30.0) -> tuple[httpx.Response, list[Event]]:
    """GET an event stream; read every event (or only `limit`, then hang up)."""
    events: list[Event] = []

    async def run():
        async with client.stream("GET", url, headers=headers or {}) as response:
            if response.headers.get("content-type", "").startswith("text/event-stream"):
                async for ev in sse_events(response):
                    events.append(ev)
                    if limit is not None and len(events) >= limit:
                        break
            else:
                await response.aread()
            return response

    response = await asyncio.wait_for(run(), seconds)
    return response, events
