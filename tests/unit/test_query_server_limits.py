"""The worker's query service against a client that sends requests and never reads
the answers (a paused process, a slow link, anyone who reaches the port)."""

from __future__ import annotations

import asyncio
import socket
import time

import orjson
from threadlog.processors import query_server
from threadlog.processors.query_server import QueryServer

VALUE = b"v" * (256 * 1024)


class Stores:
    def get(self, k, parts):
        return VALUE


class Judge:
    owned = {0}
    push = None
    partitions = 1

    def applied(self, p):
        return 10


async def test_a_client_that_never_reads_is_capped_then_disconnected(monkeypatch):
    # Tried (a review): 300 pipelined `gets` of 8 MiB answers each, never read: the
    # worker answered every one into memory, waiting forever to send it (+9.6 GB).
    monkeypatch.setattr(query_server, "MAX_CONN_INFLIGHT", 8)
    server = QueryServer(Stores(), Judge(), barrier=None, timeout=1.0)
    host, port = (await server.start("127.0.0.1", 0)).split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    try:
        request = {"op": "gets", "args": {"keys": ["AA=="] * 8, "partitions": [0]}}
        sock.sendall(b"".join(orjson.dumps({"id": i, **request}) + b"\n" for i in range(60)))
        most = 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            most = max(most, len(server._inflight))
            if most and not server._inflight:
                break  # disconnected: every answer it held is gone
            await asyncio.sleep(0.02)
        assert 0 < most <= 8  # at the cap it read no more requests
        assert not server._inflight  # cut off after a request timeout without reading
    finally:
        sock.close()
        await server.close()
