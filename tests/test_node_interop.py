"""Interop with the real browser client: `@tanstack/ai-client` (npm) against a live `threadlog serve`.

A `threadlog serve` process (its own client: another host) serves the
namespace; a Node process uses the client's `fetchServerSentEvents(url)`
adapter to `hydrate(threadId)` and `joinRun(runId)` while this test appends
chunks from Python. A proxy in the Node process cuts the first join
connection mid-stream; the client must resume on its own with
`Last-Event-ID` and yield exactly what was appended, once each, in order.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from delivery_support import chunk
from support import within

NODE_DIR = Path(__file__).resolve().parent / "node"


def _ensure_node_modules() -> None:
    assert shutil.which("node") and shutil.which("npm"), "Node.js and npm are needed for the interop test"
    if (NODE_DIR / "node_modules" / "@tanstack" / "ai-client").is_dir():
        return
    # scripts/setup installs it; a checkout that skipped setup installs here (bounded).
    subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=NODE_DIR, check=True,
                   timeout=300)


@pytest.fixture
async def serve(bootstrap, namespace, tmp_path):
    """`threadlog serve` as a separate process; yields its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "threadlog", "serve", "--bootstrap", bootstrap, "--namespace", namespace,
        "--port", "0", "--state-dir", str(tmp_path / "serve-state"), "--first-chunk-wait-ms", "10000",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        line = (await within(proc.stdout.readline(), 60)).decode()
        assert "http://" in line, f"serve did not start: {line!r} {(await proc.stderr.read()).decode()[-2000:]}"
        url = line.strip().split(" at ", 1)[1]
        yield url.rsplit("/api/chat", 1)[0]
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_tanstack_client_hydrates_and_joins_a_live_run_across_a_dropped_connection(tl, serve):
    _ensure_node_modules()
    thread_id, run_id = "thread-interop", "run-interop"
    transcript = [{"id": "u1", "role": "user", "parts": [{"type": "text", "content": "Plan a trip"}]}]
    await within(tl.messages.save_thread(thread_id, transcript))
    runs = getattr(tl, "runs", None)
    if runs is not None:
        await within(runs.create_or_resume(run_id=run_id, thread_id=thread_id, started_at=1000))
    log = tl.delivery(run_id)
    started = {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id}
    appended = [(o, started) for o in await within(log.append([started]))]
    for i in range(4):
        appended += zip(await within(log.append([chunk(i)])), [chunk(i)], strict=True)

    env = {**os.environ, "THREADLOG_URL": serve, "THREAD_ID": thread_id, "RUN_ID": run_id, "DROP_AFTER": "8"}
    node = await asyncio.create_subprocess_exec(
        "node", "interop.mjs", cwd=NODE_DIR, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        # The producer goes on while the browser client reads (and loses its connection).
        for i in range(4, 30):
            appended += zip(await within(log.append([chunk(i)])), [chunk(i)], strict=True)
            await asyncio.sleep(0.02)  # pacing, so the join is live mid-run (not synchronization)
        finished = {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id, "finishReason": "stop"}
        appended += zip(await within(log.append([finished])), [finished], strict=True)
        await within(log.close())
        out, err = await within(node.communicate(), 90)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert node.returncode == 0, err.decode()[-3000:]
    result = json.loads(out.decode().strip().splitlines()[-1])

    assert result["hydrate"]["messages"] == transcript
    if runs is not None:
        assert result["hydrate"]["activeRun"] == {"runId": run_id}
    # Exactly what was appended, once each, in order, across the dropped connection.
    assert result["chunks"] == [c for _, c in appended]
    assert result["dropped"] is True
    joins = [r for r in result["requests"] if "runId=" in r["path"]]
    assert len(joins) >= 2, result["requests"]
    assert joins[0]["lastEventId"] is None
    # The resume carried the offset of the 8th event the client saw.
    assert joins[1]["lastEventId"] == appended[7][0]


# -- a server shutting down under a join (a review, with the real client) -------------------
class _Join:
    """`joinRun(run_id)` in Node (tests/node/join_probe.mjs), its JSON lines read as
    they come: request i goes to urls[min(i, len - 1)], a load balancer in front
    of replicas."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict] = []
        self._reading = asyncio.ensure_future(self._read())

    @classmethod
    async def start(cls, urls: list[str], run_id: str) -> _Join:
        _ensure_node_modules()
        env = {**os.environ, "URLS": ",".join(urls), "RUN_ID": run_id, "TIMEOUT_MS": "60000"}
        return cls(await asyncio.create_subprocess_exec("node", "join_probe.mjs", cwd=NODE_DIR, env=env,
                                                        stdout=asyncio.subprocess.PIPE,
                                                        stderr=asyncio.subprocess.PIPE))

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        # Lines end with "\n" only (JSON escapes it; U+2028 in a chunk is no line end here).
        while line := await self.proc.stdout.readline():
            self.lines.append(json.loads(line))

    def chunks(self) -> list[dict]:
        return [o["chunk"] for o in self.lines if "chunk" in o]

    async def ended(self) -> list[dict]:
        await within(self._reading, 90)
        await within(self.proc.wait(), 30)
        return self.lines


async def test_a_rolling_restart_of_two_replicas_under_a_waiting_join_is_resumed_twice(tl):
    """Tried: replica A shut down (as on SIGTERM), the client resumed on B with
    Last-Event-ID; B shut down too before the next chunk. Each ended its stream
    cleanly, which the client resumes only after a new event: it threw
    DurableStreamIncompleteError for a run still live. Now a shutdown cuts the
    stream of a client holding an id: it resumes on C and gets the rest once."""
    from http_support import serving
    from support import until

    from threadlog.http import create_app

    log = tl.delivery("r-roll")
    await within(log.append([{"type": "RUN_STARTED", "runId": "r-roll", "threadId": "t"}, chunk(0)]))
    apps = [create_app(tl) for _ in range(3)]
    async with serving(tl, app=apps[0]) as a, serving(tl, app=apps[1]) as b, serving(tl, app=apps[2]) as c:
        join = await _Join.start([a, b, c], "r-roll")
        await until(lambda: len(join.chunks()) == 2, 30, "the chunks so far, at A")
        for n, app in enumerate(apps[:2]):
            await until(lambda app=app: app.state.streams.open == 1, 30, f"the join at replica {n}")
            app.state.streams.close_streams()  # this replica shuts down under the waiting join
        await until(lambda: apps[2].state.streams.open == 1, 30, "the join at the last replica")
        await within(log.append([chunk(1), {"type": "RUN_FINISHED", "runId": "r-roll", "threadId": "t"}]))
        await within(log.close())
        out = await join.ended()
    assert out[-1] == {"end": "done"}, out
    assert [c["i"] for c in join.chunks() if c["type"] == "TEXT_MESSAGE_CONTENT"] == [0, 1], out  # each once
    ids = [o["lastEventId"] for o in out if "request" in o]
    assert len(ids) == 3 and ids[0] is None and all(ids[1:]), out  # resumed twice, by id


async def test_a_join_still_waiting_for_its_first_chunk_hears_the_shutdown(tl):
    """Tried: a join with no event yet (offset -1), then the server shut down: the
    stream ended cleanly and joinRun completed as if the run were over, the chat
    'ready' with nothing. A client holding no id cannot resume: it gets RUN_ERROR."""
    from http_support import serving
    from support import until

    from threadlog.http import create_app

    tl.delivery("r-early")  # no chunk yet: its driver is about to write RUN_STARTED
    app = create_app(tl)
    async with serving(tl, app=app) as a:
        join = await _Join.start([a], "r-early")
        await until(lambda: app.state.streams.open == 1, 30, "the join")
        app.state.streams.close_streams()
        out = await join.ended()
    chunks = join.chunks()
    assert chunks and chunks[-1]["type"] == "RUN_ERROR" and chunks[-1]["code"] == "UNAVAILABLE", out


async def test_a_reload_rejoin_whose_first_chunk_comes_after_the_clients_2s_deadline_attaches(tl):
    """Tried: ChatClient rejoins a persisted run on load and aborts the join if no
    chunk comes within 2 s (REJOIN_CONNECT_DEADLINE_MS: time to its first chunk,
    not to headers; SSE comments are not chunks), while threadlog waits up to
    first_chunk_wait_ms (5 s) for a run's first chunk: a run whose driver wrote
    its first chunk 3 s in was dropped, the chat 'ready' with nothing. Now a
    from-start join of a running run hears a CUSTOM threadlog.waiting event."""
    from http_support import serving
    from support import until

    from threadlog.http import create_app

    thread_id, run_id = "t-late", "r-late"
    await within(tl.runs.create_or_resume(run_id=run_id, thread_id=thread_id, started_at=1000))
    app = create_app(tl)
    async with serving(tl, app=app) as base:
        _ensure_node_modules()
        env = {**os.environ, "URL": f"{base}/api/chat", "THREAD_ID": thread_id, "RUN_ID": run_id}
        probe = _Join(await asyncio.create_subprocess_exec("node", "rejoin_probe.mjs", cwd=NODE_DIR, env=env,
                                                           stdout=asyncio.subprocess.PIPE,
                                                           stderr=asyncio.subprocess.PIPE))
        await until(lambda: app.state.streams.open == 1, 30, "the rejoin's stream")
        # Not synchronization: the point is a first chunk later than the client's 2 s.
        await asyncio.sleep(3.0)
        await within(tl.delivery(run_id).append([
            {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
            {"type": "TEXT_MESSAGE_START", "messageId": "a1", "role": "assistant"},
            {"type": "TEXT_MESSAGE_CONTENT", "messageId": "a1", "delta": "late answer"},
            {"type": "TEXT_MESSAGE_END", "messageId": "a1"},
            {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id, "finishReason": "stop"}]))
        await within(tl.delivery(run_id).close())
        out = await probe.ended()
    assert out[-1]["end"] == "done", out
    types = [c["type"] for c in probe.chunks()]
    assert types[0] == "CUSTOM" and probe.chunks()[0]["name"] == "threadlog.waiting", out
    assert types[1:] == ["RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_END",
                         "RUN_FINISHED"], out
    assert out[-1]["messages"] == [{"role": "assistant", "parts": [{"type": "text", "content": "late answer"}]}], out
