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
