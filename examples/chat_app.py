"""A chat backend whose answers survive a page reload: threadlog's delivery log behind `@tanstack/ai-client`.

    # a broker at $THREADLOG_BOOTSTRAP, and scripts/setup run (tests/node has the npm packages)
    .venv/bin/python examples/chat_app.py --namespace chat-example --port 8000

Open http://127.0.0.1:8000/, send a message and reload the page while the answer streams:
the answer picks up where it was, every word once.

- `POST /api/send {threadId, text}` saves the user's message in the thread, creates a run, claims it
  and answers `{runId, messageId}` at once; a background task "generates" the answer (a fake,
  deterministic model: the words of `ANSWER`, one every `token_delay` seconds) into the run's
  delivery log, then saves the assistant message in the thread and marks the run completed.
- `/api/chat` is threadlog's durability route (`threadlog.http.routes`): `?threadId=` hydrates
  (transcript + active run), `?runId=` streams the run's chunks as SSE with their offsets. The run
  lives in Kafka, not in the HTTP connection, so a reloaded page just rejoins it.
- `/` is one HTML page; `/static/ai-client.js` is `@tanstack/ai-client` bundled once at startup by
  esbuild from `tests/node/node_modules` (no CDN: the page works offline).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

import threadlog
from threadlog import ThreadLogError
from threadlog.http import routes as durability_routes

ROOT = Path(__file__).resolve().parent.parent
NODE_DIR = ROOT / "tests" / "node"

ANSWER = ("Every word of this answer is a chunk in a Kafka delivery log, read back by offset, "
          "so a reload in the middle of it rejoins the run where the page left off and shows "
          "each word exactly once.")


def tokens(text: str = ANSWER) -> list[str]:
    """The fake model's tokens: words with their following space, so they concatenate back to `text`."""
    words = text.split(" ")
    return [w + " " for w in words[:-1]] + [words[-1]]


def bundle_client(node_dir: Path = NODE_DIR) -> bytes:
    """`@tanstack/ai-client` as one browser ES module (esbuild, ~0.1 s).

    The npm build imports bare specifiers and a CommonJS dependency (partial-json), which a
    browser cannot load from node_modules as is; a bundle is one file with no import map."""
    esbuild = node_dir / "node_modules" / ".bin" / "esbuild"
    if not esbuild.exists() or not (node_dir / "node_modules" / "@tanstack" / "ai-client").is_dir():
        raise SystemExit(f"{esbuild} or @tanstack/ai-client is missing: run scripts/setup "
                         f"(or `npm install` in {node_dir})")
    # stdin entry: esbuild resolves its imports from cwd, i.e. node_dir's node_modules.
    out = subprocess.run(
        [str(esbuild), "--bundle", "--format=esm", "--platform=browser", "--log-level=warning"],
        input=b"export { fetchServerSentEvents } from '@tanstack/ai-client'\n",
        cwd=node_dir, capture_output=True, timeout=60, check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"esbuild failed: {out.stderr.decode(errors='replace')[-2000:]}")
    return out.stdout


def _now_ms() -> int:
    return int(time.time() * 1000)


def _text_message(message_id: str, role: str, text: str) -> dict:
    # A UIMessage, the shape the client's hydrate() returns as `messages`.
    return {"id": message_id, "role": role, "parts": [{"type": "text", "content": text}]}


class Chat:
    """The backend: starts runs and streams the fake model's answer into their delivery logs."""

    def __init__(self, get_tl: Callable[[], threadlog.ThreadLog], token_delay: float = 0.08) -> None:
        self.get_tl = get_tl
        self.token_delay = token_delay
        # Strong references: the event loop keeps only weak ones to tasks.
        self.tasks: set[asyncio.Task] = set()

    async def send(self, thread_id: str, text: str) -> dict:
        tl = self.get_tl()
        user = _text_message(f"user-{uuid.uuid4().hex[:12]}", "user", text)
        # One run at a time per thread in this example, so a read-modify-write of the transcript is safe.
        await tl.messages.save_thread(thread_id, [*await tl.messages.load_thread(thread_id), user])
        run_id = f"run-{uuid.uuid4().hex[:12]}"
        await tl.runs.create_or_resume(run_id=run_id, thread_id=thread_id, started_at=_now_ms())
        # The claim makes this process the run's driver: its epoch fences any older writer of the log.
        epoch = await tl.runs.claim(run_id)
        task = asyncio.create_task(self.generate(thread_id, run_id, epoch))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return {"runId": run_id, "messageId": user["id"]}

    async def generate(self, thread_id: str, run_id: str, epoch: int) -> None:
        tl = self.get_tl()
        log = tl.delivery(run_id, epoch)
        message_id = f"assistant-{run_id}"
        finished = False
        try:
            await log.append([{"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
                              {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"}])
            for token in tokens():
                await asyncio.sleep(self.token_delay)  # the "model" thinking: pacing, not synchronization
                await log.append([{"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": token}])
            await log.append([{"type": "TEXT_MESSAGE_END", "messageId": message_id}])
            # The transcript gets the answer before the run ends: a page hydrating in between sees
            # both the message and the active run, and its replay rebuilds the same message id.
            await tl.messages.save_thread(thread_id, [*await tl.messages.load_thread(thread_id),
                                                      _text_message(message_id, "assistant", ANSWER)])
            await log.append([{"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id,
                               "finishReason": "stop"}])
            finished = True
            await tl.runs.update(run_id, {"status": "completed", "finishedAt": _now_ms()})
        except BaseException as exc:
            # Cut short (error, or shutdown cancelling the task): readers get a terminal chunk
            # instead of waiting for words that will never come. Nothing after a RUN_FINISHED.
            if not finished:
                with contextlib.suppress(Exception):
                    await log.append([{"type": "RUN_ERROR", "runId": run_id, "message": repr(exc)}])
                    await tl.runs.update(run_id, {"status": "failed", "finishedAt": _now_ms()})
            raise
        finally:
            # Readers' streams end at the close (after a terminal chunk, so no client retries).
            with contextlib.suppress(Exception):
                await log.close()

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>threadlog chat example</title>
<link rel="icon" href="data:,">
<style>
  body { font: 16px/1.5 system-ui, sans-serif; max-width: 42rem; margin: 2rem auto; }
  .msg { padding: .5rem .75rem; margin: .5rem 0; border-radius: .5rem; white-space: pre-wrap; }
  .msg[data-role=user] { background: #e8f0fe; }
  .msg[data-role=assistant] { background: #f1f3f4; }
  #status { color: #666; font-size: .85rem; }
</style>
</head>
<body data-ready="false">
<div id="messages"></div>
<form id="composer"><input id="prompt" autocomplete="off" placeholder="Say something">
<button id="send" type="submit">Send</button></form>
<div id="status" data-run-state="none"></div>
<script type="module">
import { fetchServerSentEvents } from '/static/ai-client.js'

// The thread id lives in the URL, so a reload hydrates the same thread.
const params = new URLSearchParams(location.search)
let threadId = params.get('threadId')
if (!threadId) {
  threadId = 'thread-' + crypto.randomUUID()
  params.set('threadId', threadId)
  history.replaceState(null, '', '?' + params)
}
const connection = fetchServerSentEvents('/api/chat', { reconnect: { maxAttempts: 10, delayMs: 200 } })
const list = document.getElementById('messages')
const status = document.getElementById('status')

// One element per message id: the hydrated transcript and a run's replay may both carry the
// assistant message, and it must be shown once.
function render(id, role, text) {
  let el = document.getElementById('msg-' + id)
  if (!el) {
    el = document.createElement('div')
    el.id = 'msg-' + id
    el.className = 'msg'
    el.dataset.role = role
    list.append(el)
  }
  el.textContent = text
}

const textOf = (m) => m.parts.filter((p) => p.type === 'text').map((p) => p.content).join('')

async function follow(runId) {
  status.dataset.runId = runId
  status.dataset.runState = 'streaming'
  status.textContent = 'answering...'
  let id = null
  let text = ''
  // joinRun replays the run from its first chunk, then follows it live until it ends.
  for await (const chunk of connection.joinRun(runId)) {
    if (chunk.type === 'TEXT_MESSAGE_START') {
      id = chunk.messageId
      text = ''
      render(id, 'assistant', text)
    } else if (chunk.type === 'TEXT_MESSAGE_CONTENT') {
      text += chunk.delta
      render(id, 'assistant', text)
    } else if (chunk.type === 'RUN_FINISHED') {
      status.dataset.runState = 'finished'
      status.textContent = ''
    } else if (chunk.type === 'RUN_ERROR') {
      status.dataset.runState = 'error'
      status.textContent = 'error: ' + chunk.message
    }
  }
}

document.getElementById('composer').addEventListener('submit', async (event) => {
  event.preventDefault()
  const input = document.getElementById('prompt')
  const text = input.value.trim()
  if (!text) return
  input.value = ''
  const response = await fetch('/api/send', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ threadId, text }),
  })
  const { runId, messageId } = await response.json()
  render(messageId, 'user', text)
  await follow(runId)
})

const { messages, activeRun } = await connection.hydrate(threadId)
for (const m of messages) render(m.id, m.role, textOf(m))
document.body.dataset.ready = 'true'
if (activeRun) await follow(activeRun.runId)
</script>
</body>
</html>
"""


def create_app(tl: threadlog.ThreadLog | None = None, *, bootstrap: str | None = None,
               namespace: str = "chat-example", token_delay: float = 0.08, **open_options) -> Starlette:
    """The example app: pass an open `tl`, or connection options to open one in the app's lifespan."""
    holder: dict[str, threadlog.ThreadLog] = {}
    if tl is not None:
        holder["tl"] = tl
    chat = Chat(lambda: holder["tl"], token_delay)
    client_js = bundle_client()

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        async with contextlib.AsyncExitStack() as stack:
            if tl is None:
                holder["tl"] = await stack.enter_async_context(
                    threadlog.open(bootstrap, namespace=namespace, **open_options))
            try:
                yield
            finally:
                await chat.stop()  # before the client closes under the generators

    async def page(request: Request) -> Response:
        return HTMLResponse(PAGE, headers={"Cache-Control": "no-store"})

    async def script(request: Request) -> Response:
        return Response(client_js, media_type="text/javascript")

    async def send(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            body = None
        thread_id, text = (body.get("threadId"), body.get("text")) if isinstance(body, dict) else (None, None)
        if not isinstance(thread_id, str) or not isinstance(text, str) or not text:
            return JSONResponse({"error": "give a threadId and a non-empty text"}, status_code=400)
        try:
            return JSONResponse(await chat.send(thread_id, text))
        except ThreadLogError as exc:
            if exc.code != "INVALID_ARGUMENT":
                raise
            # threadlog's own checks (an empty id, one too long...): the request is
            # bad, not the server (a review got a 500 and a traceback for "").
            return JSONResponse({"error": exc.message, "code": exc.code}, status_code=400)

    app = Starlette(lifespan=lifespan, routes=[
        Route("/", page),
        Route("/static/ai-client.js", script),
        Route("/api/send", send, methods=["POST"]),
        *durability_routes(lambda: holder["tl"], "/api/chat"),
    ])
    app.state.chat = chat
    return app


async def serve(args: argparse.Namespace) -> None:
    app = create_app(bootstrap=args.bootstrap, namespace=args.namespace, token_delay=args.token_delay,
                     state_dir=args.state_dir)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task  # startup failed: raise its error
            return
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    # With --port 0 this line is how a caller (tests/test_example_chat_browser.py) learns the port.
    print(f"chat example at http://{args.host}:{port}/", flush=True)
    await task


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--bootstrap", default=os.environ.get("THREADLOG_BOOTSTRAP", "127.0.0.1:9092"))
    parser.add_argument("--namespace", default="chat-example")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--state-dir", default=None,
                        help="this host's RocksDB state (default: under $THREADLOG_STATE_DIR or ~/.local/state)")
    parser.add_argument("--token-delay", type=float, default=0.08, help="seconds between the fake model's words")
    asyncio.run(serve(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ThreadLogError as exc:
        # An operational error (broker down, unknown namespace, a refused call):
        # its code and message are the whole story, not a traceback.
        sys.exit(f"chat_app.py: {exc.code}: {exc.message}")
    except KeyboardInterrupt:
        sys.exit(130)
