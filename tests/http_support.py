"""A live HTTP server (uvicorn, real TCP) around `threadlog.http.create_app`, and an SSE reader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys

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


class ServeProcess:
    """A `threadlog serve` subprocess: `base` is its URL root, `stop()` sends
    SIGTERM, checks it exits 0 and returns its stderr."""

    def __init__(self, proc: asyncio.subprocess.Process, base: str) -> None:
        self.proc = proc
        self.base = base

    async def stop(self) -> str:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # it may be on its way out already
                self.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(self.proc.wait(), 30) == 0
        assert self.proc.stderr is not None
        return (await asyncio.wait_for(self.proc.stderr.read(), 30)).decode()


@contextlib.asynccontextmanager
async def serve_process(bootstrap: str, namespace: str, state_dir, *flags: str):
    """Run `threadlog serve --port 0` with `flags` until it printed where it serves; killed on the way out."""
    env = {k: v for k, v in os.environ.items() if k != "THREADLOG_KAFKA_CONFIG"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "threadlog", "serve", "--bootstrap", bootstrap, "--namespace", namespace,
        "--port", "0", "--state-dir", str(state_dir), *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "serving namespace" in line, line
        yield ServeProcess(proc, line.split(" at ", 1)[1].strip().removesuffix("/api/chat"))
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
