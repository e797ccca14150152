"""A floor for SSE fed by Kafka here: a minimal Python relay, no threadlog.

    .venv/bin/python bench/sse_relay.py BOOTSTRAP TOPIC

Serves `GET /api/chat?runId=R` as an event stream of the JSON values of
TOPIC's partition 0 from where it ended at start-up, one `data:` line per record, ending after a
`RUN_FINISHED` value. One consumer thread (librdkafka, the same
`fetch.wait.max.ms` threadlog's follower uses), a `call_soon_threadsafe` hop
to the server's loop, Starlette's `StreamingResponse` under the same uvicorn
server `threadlog serve` runs: no decoding but one JSON parse, no fold, no
verdict, no store. `bench/delivery_bench.py` joins it with the same
`@tanstack/ai-client` script as threadlog's stream and prints its latency in
the same run: what threadlog's SSE latency is compared with.

Prints `serving at http://127.0.0.1:PORT/api/chat` once the consumer is
positioned (every record produced after that line is streamed).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading

import uvicorn
from confluent_kafka import Consumer, TopicPartition
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from threadlog.kernel.kafka_config import FOLLOWER_WAIT_MS


def main() -> None:
    bootstrap, topic = sys.argv[1], sys.argv[2]
    queues: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []
    history: list[bytes] = []  # a stream starts with what came before it (the run's first chunk)
    lock = threading.Lock()
    positioned = threading.Event()
    stop = threading.Event()

    def consume() -> None:
        c = Consumer({"bootstrap.servers": bootstrap, "group.id": "sse-relay", "enable.auto.commit": False,
                      "fetch.wait.max.ms": FOLLOWER_WAIT_MS, "socket.nagle.disable": True})
        _, end = c.get_watermark_offsets(TopicPartition(topic, 0), timeout=30)
        c.assign([TopicPartition(topic, 0, end)])
        positioned.set()
        while not stop.is_set():
            msg = c.poll(0.1)
            if msg is None or msg.error():
                continue
            with lock:
                history.append(msg.value())
                for loop, q in queues:
                    loop.call_soon_threadsafe(q.put_nowait, msg.value())
        c.close()

    async def stream(request: Request) -> StreamingResponse:
        q: asyncio.Queue = asyncio.Queue()
        with lock:
            for value in history:
                q.put_nowait(value)
            queues.append((asyncio.get_running_loop(), q))

        async def body():
            try:
                while True:
                    value = await q.get()
                    yield b"data: " + value + b"\n\n"
                    if json.loads(value).get("type") == "RUN_FINISHED":
                        return
            finally:
                with lock:
                    queues.remove((asyncio.get_running_loop(), q))

        return StreamingResponse(body(), media_type="text/event-stream; charset=utf-8",
                                 headers={"Cache-Control": "no-store"})

    async def serve() -> None:
        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        app = Starlette(routes=[Route("/api/chat", stream, methods=["GET"])])
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None,
                                               access_log=False, log_level="warning"))
        task = asyncio.ensure_future(server.serve())
        while not server.started or not positioned.is_set():
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"serving at http://127.0.0.1:{port}/api/chat", flush=True)
        try:
            await task
        finally:
            stop.set()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
