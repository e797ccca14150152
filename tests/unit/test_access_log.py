"""The text access log cannot be forged or made to drive a terminal through a request's path."""

from __future__ import annotations

import logging

from threadlog.metrics import AccessLog


async def _request(path: str) -> None:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        pass

    await AccessLog(app)({"type": "http", "method": "GET", "path": path}, receive, send)


async def test_a_path_with_line_breaks_and_escapes_stays_on_one_escaped_line(caplog):
    # Tried (a review): GET /threads/x%0a2026-12-04 00:00:00,000 INFO threadlog.access: GET /admin 200
    # -- answered 404, no token needed -- wrote a second, forged line into the
    # text log; %0d rewrote a line on a terminal, %1b[2J cleared it.
    caplog.set_level(logging.INFO, logger="threadlog.access")
    forged = "/threads/x\n2026-12-04 00:00:00,000 INFO threadlog.access: GET /admin 200 0.1ms"
    for path in (forged, "/threads/t1\r2026", "/threads/\x1b[2J\u2028x"):
        await _request(path)
    access = [rec for rec in caplog.records if rec.name == "threadlog.access"]
    lines = [rec.getMessage() for rec in access]
    assert len(lines) == 3
    assert not any(c in line for line in lines for c in "\n\r\x1b\u2028"), lines
    assert lines[0] == ("GET /threads/x\\n2026-12-04 00:00:00,000 INFO threadlog.access: GET /admin 200 0.1ms"
                        " 404 " + lines[0].rsplit(" ", 1)[1])
    assert "\\r" in lines[1] and "\\x1b[2J\\u2028x" in lines[2]
    assert access[0].path == forged  # the field keeps the path as it came
