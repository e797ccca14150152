"""HTTP authorization and limits over real TCP: the authorize hook, bearer tokens,
id and body limits, strict percent-decoding, the SSE stream cap, bounded consumers."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time

import httpx
import pytest
from delivery_support import chunk
from http_support import read_stream, serve_process, serving, sse_events
from support import until, within

from threadlog.http import Limits, StreamSlots, create_app, unauthenticated
from threadlog.kernel.errors import UNAVAILABLE, ThreadLogError


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


async def test_the_hook_decides_hydration_sse_and_rest_with_401_403_json_or_a_run_error(tl, client):
    await within(tl.messages.save_thread("t-mine", [{"role": "user", "content": "hi"}]))
    await within(tl.messages.save_thread("t-other", [{"role": "user", "content": "secret"}]))
    log = tl.delivery("r-mine")
    offs = await within(log.append([chunk(0)]))
    await within(log.close())
    await within(tl.delivery("r-other").append([chunk(0)]))
    asked = []

    async def authorize(request, *, thread_id=None, run_id=None):
        asked.append((thread_id, run_id))
        if request.headers.get("x-user") != "ann":
            raise unauthenticated("who are you?")
        return thread_id == "t-mine" or run_id == "r-mine"

    async with serving(tl, authorize=authorize) as base:
        ann = {"X-User": "ann"}
        for url in (f"{base}/api/chat?threadId=t-mine", f"{base}/threads/t-mine"):
            r = await client.get(url, headers=ann)
            assert r.status_code == 200 and r.json()["messages"] == [{"role": "user", "content": "hi"}]
        for url in (f"{base}/api/chat?threadId=t-other", f"{base}/threads/t-other"):
            r = await client.get(url, headers=ann)
            assert r.status_code == 403 and r.json()["error"]["code"] == "PERMISSION_DENIED"
            assert "secret" not in r.text
            r = await client.get(url)
            assert r.status_code == 401 and r.json()["error"] == {"code": "UNAUTHENTICATED", "message": "who are you?"}
            assert r.headers["www-authenticate"] == "Bearer"
        for url in (f"{base}/api/chat?runId=r-mine&offset=-1", f"{base}/runs/r-mine/stream"):
            r, events = await read_stream(client, url, headers=ann)
            assert r.status_code == 200 and [e.id for e in events] == [offs[0], None]
        for url in (f"{base}/api/chat?runId=r-other&offset=-1", f"{base}/runs/r-other/stream"):
            for headers, status, code in ((ann, 403, "PERMISSION_DENIED"), ({}, 401, "UNAUTHENTICATED")):
                r, events = await read_stream(client, url, headers=headers)
                assert r.status_code == status
                assert r.headers["content-type"].startswith("text/event-stream")
                assert [(e.id, e.data["type"], e.data["code"], e.data["runId"]) for e in events] == \
                    [(None, "RUN_ERROR", code, "r-other")]
        # The run may come in X-Run-Id: the hook sees it all the same.
        r, events = await read_stream(client, f"{base}/api/chat", headers={"X-Run-Id": "r-other", **ann})
        assert r.status_code == 403 and events[0].data["code"] == "PERMISSION_DENIED"
    assert ("t-mine", None) in asked and (None, "r-other") in asked
    assert all((t is None) != (r is None) for t, r in asked)  # exactly one id per question


async def test_a_broken_hook_fails_closed_with_a_500(tl, client):
    def explodes(request, *, thread_id=None, run_id=None):
        raise RuntimeError("db down")

    def says_maybe(request, *, thread_id=None, run_id=None):
        return "yes"  # not True: never taken for an allow

    class UpstreamError(Exception):  # as aiohttp's and urllib's HTTP errors: the upstream's headers
        headers = {"Set-Cookie": "upstream-session=1", "Content-Length": "12345"}

    def calls_upstream(request, *, thread_id=None, run_id=None):
        raise UpstreamError("the policy service answered 502")

    for hook in (explodes, says_maybe, calls_upstream):
        async with serving(tl, authorize=hook) as base:
            r = await client.get(f"{base}/api/chat?threadId=t")
            assert r.status_code == 500 and r.json()["error"]["code"] == "INTERNAL"
            assert "set-cookie" not in r.headers  # another response's headers never leak into ours
            r = await client.get(f"{base}/runs/r/stream")
            assert r.status_code == 500 and r.json()["error"]["code"] == "INTERNAL"


async def test_bearer_tokens_from_a_file_are_checked_and_never_logged(tl, client, tmp_path, caplog):
    tokens = tmp_path / "tokens"
    tokens.write_text("# who may read\nalpha-token-1\n\n  beta-token-2  \nclé-token-3\nvoilà\n", encoding="utf-8")
    log = tl.delivery("r-tok")
    offs = await within(log.append([chunk(0), {"type": "RUN_FINISHED", "runId": "r-tok"}]))
    await within(log.close())
    caplog.set_level(logging.DEBUG)
    logging.getLogger("threadlog.access").setLevel(logging.INFO)
    async with serving(tl, token_file=str(tokens)) as base:
        url = f"{base}/api/chat?threadId=t"
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic alpha-token-1"},
                        {"Authorization": "Bearer"}, {"Authorization": "Bearer alpha-token-"}):
            r = await client.get(url, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "UNAUTHENTICATED"
        for token in ("alpha-token-1", "beta-token-2"):
            r = await client.get(url, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200
        # A token of non-ASCII text: the header's UTF-8 bytes match the file's.
        r = await client.get(url, headers={"Authorization": "Bearer clé-token-3".encode()})
        assert r.status_code == 200
        # Ending in "à" (C3 A0): str.strip took the A0 byte (a non-breaking space in latin-1).
        r = await client.get(url, headers={"Authorization": "Bearer voilà".encode()})
        assert r.status_code == 200
        r, events = await read_stream(client, f"{base}/runs/r-tok/stream",
                                      headers={"Authorization": "Bearer beta-token-2"})
        assert r.status_code == 200 and [e.id for e in events] == offs
        r, events = await read_stream(client, f"{base}/runs/r-tok/stream")
        assert r.status_code == 401 and events[0].data["code"] == "UNAUTHENTICATED"
    assert any(rec.name == "threadlog.access" for rec in caplog.records)  # the log was on
    text = "\n".join(rec.getMessage() + repr(rec.__dict__) for rec in caplog.records)
    assert "alpha-token-1" not in text and "beta-token-2" not in text
    empty = tmp_path / "empty"
    empty.write_text("# nobody\n")
    with pytest.raises(ValueError, match="no token"):
        create_app(tl, token_file=str(empty))


async def test_long_ids_are_a_400_that_never_echoes_them(tl, client):
    await within(tl.messages.save_thread("é" * 512, [{"role": "user", "content": "x"}]))  # 1024 bytes
    async with serving(tl) as base:
        r = await client.get(f"{base}/api/chat", params={"threadId": "é" * 512})
        assert r.status_code == 200 and r.json()["messages"] == [{"role": "user", "content": "x"}]
        huge = "r" * 60_000  # (httpx refuses longer queries)
        for method_url, kwargs in (
            (f"{base}/api/chat", {"params": {"threadId": "é" * 513}}),
            (f"{base}/api/chat", {"params": {"runId": huge}}),
            (f"{base}/api/chat", {"headers": {"X-Run-Id": "r" * 1025}}),
            (f"{base}/threads/{'t' * 2000}", {}),
            (f"{base}/runs/{'r' * 2000}/stream", {}),
        ):
            r = await client.get(method_url, **kwargs)
            assert r.status_code == 400, method_url[:80]
            assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
            assert "more than the 1024 allowed" in r.json()["error"]["message"]
            assert len(r.content) < 400  # the id is not echoed back
    async with serving(tl, limits=Limits(max_id_bytes=8)) as base:
        r = await client.get(f"{base}/threads/123456789")
        assert r.status_code == 400 and "more than the 8 allowed" in r.json()["error"]["message"]


async def test_invalid_percent_encodings_are_a_400_not_a_replacement_character(tl, client):
    await within(tl.messages.save_thread("café", [{"role": "user", "content": "x"}]))
    await within(tl.messages.save_thread("caf\ufffd", [{"role": "user", "content": "replacement"}]))
    async with serving(tl) as base:
        for path in ("/api/chat?threadId=caf%E9", "/api/chat?threadId=caf%C3", "/threads/caf%E9",
                     "/runs/caf%FF/stream", "/api/chat?runId=caf%FF&offset=-1"):
            r = await client.get(base + path)
            assert r.status_code == 400, path
            assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
            assert "percent-encoding" in r.json()["error"]["message"]
        for path in ("/api/chat?threadId=caf%C3%A9", "/threads/caf%C3%A9"):
            r = await client.get(base + path)
            assert r.status_code == 200 and r.json()["messages"][0]["content"] == "x", path
        # U+FFFD sent as itself is an ordinary character.
        r = await client.get(base + "/threads/caf%EF%BF%BD")
        assert r.status_code == 200 and r.json()["messages"][0]["content"] == "replacement"


async def test_request_bodies_over_the_limit_are_a_413(tl, client):
    async with serving(tl, limits=Limits(max_body_bytes=1000)) as base:
        r = await client.request("GET", f"{base}/api/chat?threadId=t", content=b"x" * 1001)
        assert r.status_code == 413 and r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"

        async def chunked():
            for _ in range(5):
                yield b"y" * 400

        r = await client.request("GET", f"{base}/api/chat?threadId=t", content=chunked())
        # Our routes never read a body: a chunked one is only refused where read.
        assert r.status_code in (200, 413)
        r = await client.request("GET", f"{base}/api/chat?threadId=t", content=b"x" * 1000)
        assert r.status_code == 200


async def test_streams_beyond_the_cap_get_a_503_until_one_ends(tl, client):
    log = tl.delivery("r-cap")
    [first] = await within(log.append([chunk(0)]))
    app = create_app(tl, limits=Limits(max_streams=3))
    async with serving(tl, app=app) as base:
        url = f"{base}/runs/r-cap/stream"
        opened: list = []
        stacks = []
        for _ in range(3):
            cm = client.stream("GET", url)
            response = await within(cm.__aenter__())
            stacks.append(cm)
            events = sse_events(response)
            ev = await within(events.__anext__())
            assert ev.id == first
            opened.append(events)
        assert app.state.streams.open == 3
        r = await client.get(url)
        assert r.status_code == 503 and r.json()["error"]["code"] == "TOO_MANY_STREAMS"
        assert r.headers["retry-after"] == "1"
        # Hydration is not a stream: still answered.
        assert (await client.get(f"{base}/api/chat?threadId=t")).status_code == 200
        await opened[0].aclose()
        await within(stacks[0].__aexit__(None, None, None))
        async with asyncio.timeout(10):
            while app.state.streams.open > 2:
                await asyncio.sleep(0.02)
        _, events = await read_stream(client, url, limit=1)
        assert [e.id for e in events] == [first]
        for events, cm in zip(opened[1:], stacks[1:], strict=True):
            await events.aclose()
            await within(cm.__aexit__(None, None, None))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_hundreds_of_idle_joins_stay_within_the_consumer_bound_and_hydration_answers(tl, client):
    """The measured problem: every catch-up read opened its own Kafka consumer
    (500 idle joins: 2,040 threads, 4,500 fds, hydration stalled 10.8 s)."""
    n = 200
    runs = [f"r-idle-{i}" for i in range(20)]
    firsts = {}
    for run in runs:
        [firsts[run]] = await within(tl.delivery(run).append([chunk(0)]))
    await within(tl.messages.save_thread("t-busy", [{"role": "user", "content": "still here"}]))
    pool = tl._delivery.pool
    threads0, fds0 = _threads(), _fds()
    peak = {"threads": threads0, "fds": fds0, "consumers": 0}
    sampling = True

    async def sample():
        while sampling:
            peak["threads"] = max(peak["threads"], _threads())
            peak["fds"] = max(peak["fds"], _fds())
            peak["consumers"] = max(peak["consumers"], pool.open)
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=n + 10)) as many, \
            serving(tl) as base:
        sampler = asyncio.ensure_future(sample())
        got_first = asyncio.Event()
        joined = 0
        release = asyncio.Event()

        async def join(i: int):
            nonlocal joined
            run = runs[i % len(runs)]
            async with many.stream("GET", f"{base}/runs/{run}/stream") as response:
                assert response.status_code == 200
                async for ev in sse_events(response):
                    assert ev.id == firsts[run]
                    break
                joined += 1
                if joined == n:
                    got_first.set()
                await release.wait()  # idle: the stream stays open

        tasks = [asyncio.ensure_future(join(i)) for i in range(n)]
        try:
            started = time.monotonic()
            # Hydration keeps answering while the joins pile in.
            worst = 0.0
            while not got_first.is_set():
                t0 = time.monotonic()
                r = await within(client.get(f"{base}/api/chat?threadId=t-busy"), 10)
                assert r.status_code == 200 and r.json()["messages"][0]["content"] == "still here"
                worst = max(worst, time.monotonic() - t0)
                assert time.monotonic() - started < 60, f"only {joined}/{n} joins read their first chunk"
                for t in tasks:
                    if t.done():
                        t.result()  # a failed join fails the test now
            joined_s = time.monotonic() - started
        finally:
            release.set()
            await within(asyncio.gather(*tasks, return_exceptions=True), 30)
            sampling = False
            await within(sampler)
    print(f"{n} joins in {joined_s:.1f}s; hydration worst {worst * 1000:.0f} ms; peak threads "
          f"{threads0}->{peak['threads']}, fds {fds0}->{peak['fds']}, consumers {peak['consumers']}")
    assert peak["consumers"] <= pool.max_open
    assert worst < 10.0  # measured 2.7 s (6.7 s at load average 49); unbounded, the test timed out
    # ~4-5 librdkafka threads and ~10 fds per consumer, plus the server's own.
    assert peak["threads"] - threads0 <= pool.max_open * 6 + 20
    # + two sockets per open stream: the client's and the server's end, both in this process.
    assert peak["fds"] - fds0 <= pool.max_open * 12 + 2 * n + 50


async def test_a_reader_waits_for_a_consumer_then_gives_up_with_unavailable(tl):
    pool = tl._delivery.pool
    held = [await within(pool.take(5.0)) for _ in range(pool.max_open - pool.open)]
    assert pool.open == pool.max_open
    t0 = time.monotonic()
    with pytest.raises(ThreadLogError) as err:
        await within(pool.take(0.3))
    assert err.value.code == UNAVAILABLE and 0.25 < time.monotonic() - t0 < 2
    waiter = asyncio.ensure_future(pool.take(5.0))
    await asyncio.sleep(0)
    assert not waiter.done()
    pool.give(held.pop())  # back in the idle list: the waiter gets it
    got = await within(waiter, 5)
    assert pool.open == pool.max_open
    for c in [got, *held]:
        pool.give(c)
    assert pool.open <= pool.max_open


async def test_threadlog_serve_with_a_token_file_and_limits(bootstrap, namespace, tl, tmp_path):
    await within(tl.messages.save_thread("t", [{"role": "user", "content": "hi"}]))
    tokens = tmp_path / "tokens"
    tokens.write_text("s3cret-serve-token\n")
    async with serve_process(bootstrap, namespace, tmp_path / "serve", "--token-file", str(tokens),
                             "--max-id-bytes", "16", "-v") as serve:
        base = serve.base
        auth = {"Authorization": "Bearer s3cret-serve-token"}
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.get(f"{base}/threads/t")
            assert r.status_code == 401 and r.json()["error"]["code"] == "UNAUTHENTICATED"
            r = await http.get(f"{base}/threads/t", headers={"Authorization": "Bearer s3cret-serve-tokem"})
            assert r.status_code == 401
            r = await http.get(f"{base}/threads/t", headers=auth)
            assert r.status_code == 200 and r.json()["messages"] == [{"role": "user", "content": "hi"}]
            r = await http.get(f"{base}/threads/{'t' * 17}", headers=auth)
            assert r.status_code == 400 and "more than the 16 allowed" in r.json()["error"]["message"]
        err = await within(serve.stop())
    assert "GET /threads/t 401" in err  # -v logged the requests...
    assert "s3cret-serve-token" not in err  # ...never the token


async def test_no_access_log_holds_with_verbose_logging(bootstrap, namespace, tl, tmp_path):
    """Tried: `serve -v --no-access-log` (with -v the root logger is at INFO, and
    the access logger inherited it); a request, then SIGTERM: no access line."""
    async with serve_process(bootstrap, namespace, tmp_path / "serve", "-v", "--no-access-log") as serve:
        async with httpx.AsyncClient(timeout=30) as http:
            assert (await http.get(f"{serve.base}/threads/t")).status_code == 200
        err = await within(serve.stop())
    assert "GET /threads/t" not in err and "threadlog.access" not in err, err[-2000:]
    assert "INFO" in err  # -v was on


async def test_serve_ends_open_streams_cleanly_on_sigterm(bootstrap, namespace, tl, tmp_path):
    """Tried: SIGTERM while an SSE stream waits on a run still open. Streams never
    end by themselves: uvicorn cancelled them after the drain timeout, a traceback
    each and a response cut mid-chunk. Now the stream ends at once, properly: the
    HTTP response completes, its last line (no newline) telling a client holding an
    event id to resume elsewhere (tests/test_node_interop.py: the real client does)."""
    [first] = await within(tl.delivery("r-term").append([chunk(0)]))
    async with serve_process(bootstrap, namespace, tmp_path / "serve", "--drain-timeout", "20") as serve:
        async with httpx.AsyncClient(timeout=30) as http, \
                http.stream("GET", f"{serve.base}/runs/r-term/stream") as r:
            events = sse_events(r)
            assert (await within(events.__anext__())).id == first
            started = time.monotonic()
            serve.proc.send_signal(signal.SIGTERM)
            assert [e async for e in events] == []  # no more events, and no cut response (that raises)
        err = await within(serve.stop())
        assert time.monotonic() - started < 15  # not the 20 s drain: the stream ended at once
    assert "Traceback" not in err and "Exception in ASGI" not in err, err[-3000:]


async def test_a_passing_unavailable_cuts_a_resumable_stream_instead_of_ending_the_run(open_client, client):
    """Tried (a review): 40 browsers joining at once, more than the shared read
    consumers serve within the request timeout: 23 got a RUN_ERROR UNAVAILABLE,
    which `@tanstack/ai-client` takes as the run's end (it never reconnects).
    Now a client holding an event id gets a cut stream (a last line with no
    newline: its StreamTruncatedError) and reconnects with Last-Event-ID; one
    with no id still gets the RUN_ERROR, the only thing it could act on."""
    writer = await open_client()  # the writes are not under test: the default timeout
    tl = await open_client(request_timeout_ms=2_000)
    log = writer.delivery("run-busy")
    [o0] = await within(log.append([chunk(0)]))
    await within(log.append([chunk(1)]))
    pool = tl._delivery.pool
    held = [await within(pool.take(5.0)) for _ in range(pool.max_open - pool.open)]  # every consumer busy
    try:
        async with serving(tl) as base:
            async with client.stream("GET", f"{base}/api/chat?runId=run-busy",
                                     headers={"Last-Event-ID": o0}) as r:
                body = b"".join([part async for part in r.aiter_raw()])
            assert r.status_code == 200
            assert b"RUN_ERROR" not in body and body.endswith(b": UNAVAILABLE: resume with Last-Event-ID")
            _, events = await within(read_stream(client, f"{base}/api/chat?runId=run-busy&offset=-1"), 30)
            codes = [e.data.get("code") for e in events]
            assert codes == [UNAVAILABLE] or events[0].data == chunk(0), events
    finally:
        for consumer in held:
            pool.give(consumer)


async def test_an_unexpected_error_in_a_stream_ends_it_with_an_internal_run_error(tl, client, monkeypatch, caplog):
    """Tried (a review): a chunk the event writer cannot write (NaN from a foreign
    producer) cut the stream mid-body with a server traceback, and the client
    reconnected into the same error. Now: a RUN_ERROR with code INTERNAL, logged."""
    from threadlog.http import sse

    log = tl.delivery("run-odd")
    await within(log.append([chunk(0), {"boom": 1}]))
    await within(log.close())
    writes = sse._json

    def failing(value):
        if value == {"boom": 1}:
            raise ValueError("Out of range float values are not JSON compliant")
        return writes(value)

    monkeypatch.setattr(sse, "_json", failing)
    async with serving(tl) as base:
        response, events = await within(read_stream(client, f"{base}/api/chat?runId=run-odd&offset=-1"), 30)
    assert response.status_code == 200
    assert [e.data for e in events[:1]] == [chunk(0)]
    assert events[1].data["type"] == "RUN_ERROR" and events[1].data["code"] == "INTERNAL" and len(events) == 2
    assert "could not be streamed" in caplog.text


async def test_a_non_ascii_run_id_in_the_x_run_id_header_is_a_400(tl, client):
    # Tried (a review): `X-Run-Id: run-é` from a UTF-8 client was read as latin-1
    # ("run-Ã©") and waited for a run that never came, then RUN_NOT_FOUND.
    await within(tl.delivery("run-é").append([chunk(0)]))
    async with serving(tl) as base:
        r = await client.get(f"{base}/api/chat?offset=-1", headers={"X-Run-Id": "run-é".encode()})
        assert r.status_code == 400 and "X-Run-Id" in r.json()["error"]["message"]
        _, events = await within(read_stream(client, f"{base}/api/chat?runId=run-%C3%A9&offset=-1", limit=1), 30)
        assert events[0].data == chunk(0)


async def test_a_chunked_body_over_the_limit_on_a_stream_route_is_not_a_server_error(tl, client):
    # Tried (a review): a GET stream request with a chunked body over
    # --max-body-bytes; the stream's disconnect watcher read it, the limit's error
    # came wrapped in an ExceptionGroup: "Exception in ASGI application" logged.
    await within(tl.delivery("run-big-body").append([chunk(0)]))
    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # uvicorn's loggers do not reach the root (caplog)
    uvicorn_errors = logging.getLogger("uvicorn.error")

    async def body():
        yield b"x" * 200

    async with serving(tl, limits=Limits(max_body_bytes=100)) as base:
        uvicorn_errors.addHandler(handler)  # after uvicorn configured its logging (that drops handlers)
        try:
            async with client.stream("GET", f"{base}/api/chat?runId=run-big-body&offset=-1",
                                     content=body()) as r:
                async for _ in r.aiter_raw():
                    pass
        except httpx.HTTPError:
            pass  # the stream may be cut: what matters is the server's side
        finally:
            uvicorn_errors.removeHandler(handler)
    assert not [rec.getMessage() for rec in errors]


async def _raw_join(port: int, path: str) -> socket.socket:
    """A client that asks for an event stream and never reads: a receive buffer
    of a few KiB, so the server's writes stall once the buffers are full."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it offers
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await within(loop.sock_connect(sock, ("127.0.0.1", port)))
    await within(loop.sock_sendall(sock, f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()))
    return sock


async def test_a_client_that_reads_nothing_gives_its_stream_slot_back_within_the_stall_bound(tl, client, caplog):
    """Tried: a client that joins a run and stops reading (its receive window
    full) while the run writes large chunks. The server's send waited forever:
    the stream held its slot (and its reader) as long as the client lived. Now
    the stream ends after max_write_stall_ms with its slot freed, and the
    connection closes once the client reads what was already queued for it."""
    log = tl.delivery("r-stall")
    await within(log.append([chunk(0)]))
    app = create_app(tl, limits=Limits(max_write_stall_ms=1000))
    big = "x" * 60_000
    async with serving(tl, app=app) as base:
        sock = await _raw_join(int(base.rsplit(":", 1)[1]), "/runs/r-stall/stream")
        try:
            await until(lambda: app.state.streams.open == 1, 10, "the stream open")
            # More than the buffers on the way hold (4 MiB of kernel send buffer at
            # most here, 64 KiB in asyncio's): the server's writes then wait.
            for i in range(1, 400):
                await within(log.append([chunk(i, pad=big)]))
                if app.state.streams.open == 0:
                    break
            stalled_at = time.monotonic()
            await until(lambda: app.state.streams.open == 0, 30, "the stalled stream's slot given back")
            assert time.monotonic() - stalled_at < 5
            metrics = (await client.get(f"{base}/metrics")).text
            assert "threadlog_http_sse_connections 0" in metrics
            # What was queued for it can still be read, then the server's end is closed.
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(30):
                while await loop.sock_recv(sock, 1 << 20):
                    pass
        finally:
            sock.close()
    assert "read nothing" in caplog.text


async def test_a_join_over_the_cap_waits_for_a_slot_before_its_503(tl, client):
    """Tried: max_streams streams open, one more join: an immediate 503, which
    @tanstack/ai-client never retries (a join failed, a rejoin dropped its run
    for good) though a stream ended a moment later. Now a join waits up to
    max_stream_wait_ms for a slot; past that it is a 503 (Retry-After: 1) -- or a
    cut stream for a client holding an event id, which it resumes by itself."""
    log = tl.delivery("r-wait")
    [first] = await within(log.append([chunk(0)]))
    app = create_app(tl, limits=Limits(max_streams=1, max_stream_wait_ms=10_000))
    async with serving(tl, app=app) as base:
        url = f"{base}/runs/r-wait/stream"
        async with client.stream("GET", url) as held:
            events = sse_events(held)
            assert (await within(events.__anext__())).id == first
            waiting = asyncio.ensure_future(read_stream(client, url, limit=1))
            await until(lambda: app.state.streams._slot_waiters, 10, "the second join waiting for a slot")
            assert not waiting.done()
            await events.aclose()
        response, got = await within(waiting)  # the held stream ended: its slot went to the waiting join
        assert response.status_code == 200 and [e.id for e in got] == [first]
        assert not app.state.streams._slot_waiters
    app = create_app(tl, limits=Limits(max_streams=1, max_stream_wait_ms=300))
    async with serving(tl, app=app) as base:
        url = f"{base}/runs/r-wait/stream"
        async with client.stream("GET", url) as held:
            events = sse_events(held)  # kept: a collected one closes the response, and frees its slot
            assert (await within(events.__anext__())).id == first
            t0 = time.monotonic()
            r = await client.get(url)
            assert r.status_code == 503 and r.json()["error"]["code"] == "TOO_MANY_STREAMS"
            assert r.headers["retry-after"] == "1" and time.monotonic() - t0 >= 0.25
            r = await client.get(url, headers={"Last-Event-ID": first})
            assert r.status_code == 200 and r.content == b": TOO_MANY_STREAMS: resume with Last-Event-ID"
            await events.aclose()


# -- StreamSlots on its own: who gets a slot given back ------------------------------


async def _stepped() -> None:
    """Return once every task made so far ran to its first wait (a join: queued).
    Not a timing: the loop runs its ready callbacks in order, and this one's
    callback was scheduled after their first steps."""
    loop = asyncio.get_running_loop()
    stepped = loop.create_future()
    loop.call_soon(stepped.set_result, None)
    await stepped  # plain: wait_for would let the loop run more iterations first


async def _waiting_joins(slots: StreamSlots, n: int, wait_s: float = 30) -> list[asyncio.Future]:
    """`n` joins waiting for a slot, queued one after the other (a known order)."""
    before = len(slots._slot_waiters)
    joins: list[asyncio.Future] = []
    for _ in range(n):
        joins.append(asyncio.ensure_future(slots.take_within(wait_s)))
        await _stepped()
        assert len(slots._slot_waiters) == before + len(joins)
    return joins


async def test_stream_slots_given_back_go_to_the_waiting_joins_in_arrival_order():
    """Tried: give() woke every waiting join (a set, unordered) to try again: the
    one that had waited longest could lose to any other, or to a join arriving
    just then, and time out into a 503 while later ones got streams. Now the
    slot passes straight to the oldest waiting join."""
    slots = StreamSlots(1)
    assert await slots.take_within(0)
    joins = await _waiting_joins(slots, 3)
    for i, join in enumerate(joins):
        slots.give()  # the stream holding the slot ended
        # The slot is already the oldest join's, though it has not run yet: a
        # join arriving now does not take it.
        assert not await slots.take_within(0)
        assert await within(join, 10) is True
        assert not any(later.done() for later in joins[i + 1:])
        assert slots.open == 1
    slots.give()
    assert slots.open == 0 and not slots._slot_waiters
    assert await slots.take_within(0)  # free, nobody waiting: taken at once
    slots.give()


async def test_a_stream_slot_given_back_wakes_one_waiting_join_not_all(monkeypatch):
    slots = StreamSlots(1)
    assert await slots.take_within(0)
    joins = await _waiting_joins(slots, 4)
    loop = asyncio.get_running_loop()
    wakes: list = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args, **kwargs):
        wakes.append(callback)
        return real(callback, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(loop, "call_soon_threadsafe", counting)  # how waiters are woken, from any thread
        slots.give()
    assert len(wakes) == 1  # not 4: the others sleep on
    assert await within(joins[0], 10) is True
    assert [j.done() for j in joins] == [True, False, False, False]
    for join in joins[1:]:
        slots.give()
        assert await within(join, 10) is True
    slots.give()
    assert slots.open == 0 and not slots._slot_waiters


async def test_a_stream_slot_handed_to_a_join_whose_wait_ran_out_is_taken_not_lost():
    """A slot handed to a join whose deadline passed before it could run again:
    the join takes it (True) -- neither dropped (a slot lost for good) nor given
    back as well as taken (counted twice)."""
    slots = StreamSlots(1)
    loop = asyncio.get_running_loop()
    assert await slots.take_within(0)
    late = asyncio.ensure_future(slots.take_within(0.001))
    behind = asyncio.ensure_future(slots.take_within(30))
    await _stepped()  # one step: another one and `late` might see its timeout first
    assert len(slots._slot_waiters) == 2
    # This task runs before `late` sees its timeout (its wakeup was scheduled
    # first). A spin, not a sleep: the loop must not run meanwhile, and the
    # deadline must have passed when the slot is handed over.
    past = loop.time() + 0.005
    while loop.time() < past:
        pass
    slots.give()
    assert await within(late, 10) is True
    assert slots.open == 1 and not behind.done()
    slots.give()  # `late`'s stream ended: its slot goes on to the join behind
    assert await within(behind, 10) is True
    slots.give()
    assert slots.open == 0 and not slots._slot_waiters


async def test_a_stream_slot_handed_to_a_join_cancelled_before_it_ran_goes_to_the_next():
    """A join handed a slot and cancelled before it woke (its client went away):
    the slot passes on to the next waiting join; none is lost."""
    slots = StreamSlots(1)
    assert await slots.take_within(0)
    gone, behind = await _waiting_joins(slots, 2)
    slots.give()  # to `gone`...
    gone.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await within(gone, 10)
    assert await within(behind, 10) is True  # no second give(): `gone` passed it on
    assert slots.open == 1
    slots.give()
    assert slots.open == 0 and not slots._slot_waiters


async def test_a_stream_slot_is_handed_to_a_join_waiting_on_another_loop():
    # One asyncio.Event per waiter, made on its own loop, set from the giver's
    # thread with call_soon_threadsafe (a second TestClient of one app runs its
    # own loop in its own thread).
    slots = StreamSlots(1)
    assert await slots.take_within(0)
    queued = threading.Event()
    got: list[bool] = []

    def on_own_loop() -> None:
        async def join() -> None:
            task = asyncio.ensure_future(slots.take_within(30))
            await _stepped()
            queued.set()
            got.append(await asyncio.wait_for(task, 30))
            slots.give()  # its stream ended, on its own loop

        asyncio.run(join())

    thread = threading.Thread(target=on_own_loop)
    thread.start()
    try:
        assert await within(asyncio.to_thread(queued.wait, 10))
        slots.give()
        await within(asyncio.to_thread(thread.join, 15))
    finally:
        thread.join(15)
    assert got == [True]
    assert slots.open == 0 and not slots._slot_waiters


async def test_close_streams_ends_every_waiting_join_and_frees_slots_for_nobody():
    slots = StreamSlots(1)
    assert await slots.take_within(0)
    joins = await _waiting_joins(slots, 3)
    slots.close_streams()
    assert [await within(j, 10) for j in joins] == [False, False, False]
    slots.give()
    assert slots.open == 0 and not slots._slot_waiters


async def test_a_stream_request_with_a_body_over_the_limit_is_a_413_before_the_stream_starts(tl, client):
    """Tried (a review): GET /runs/R/stream with a 5000-byte chunked body, the
    limit 1000: a 200 event stream with no body at all -- the disconnect watcher
    read the body once the stream had started, too late for a 413 -- which an SSE
    client takes for a clean end. The stream routes now read a body (and drop it)
    before they answer."""
    log = tl.delivery("run-body")
    offs = await within(log.append([chunk(0), {"type": "RUN_FINISHED", "runId": "run-body"}]))
    await within(log.close())

    def body(size: int):
        async def chunked():  # no Content-Length: only counted as it arrives
            for _ in range(size // 500):
                yield b"y" * 500
        return chunked()

    paths = ("/runs/run-body/stream", "/api/chat?runId=run-body&offset=-1")
    async with serving(tl, limits=Limits(max_body_bytes=1000)) as base:
        for path in paths:
            r = await within(client.request("GET", base + path, content=body(5000)))
            assert r.status_code == 413, (path, r.headers, r.content)
            assert r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE", path
            # Within the limit, a body is read and dropped: the stream is the one without a body.
            for content in (body(1000), None):
                async with client.stream("GET", base + path, content=content) as r:
                    assert r.status_code == 200, path
                    events = [e async for e in sse_events(r)]
                assert [e.id for e in events] == offs, path

    # The routes in an app without BodyLimit: their own limit answers the same.
    from starlette.applications import Starlette

    from threadlog.http import routes

    app = Starlette(routes=routes(lambda: tl, limits=Limits(max_body_bytes=1000)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
        for path in paths:
            r = await within(c.request("GET", path, content=body(5000)))
            assert r.status_code == 413 and r.json()["error"]["code"] == "PAYLOAD_TOO_LARGE", path


async def test_a_stream_request_announcing_a_body_it_never_sends_is_not_held(tl, tmp_path, monkeypatch):
    """Tried (a review of the body read above): a client with no token sending
    `Content-Length: 100` and then nothing was held on a stream route (no slot
    taken, so no cap) until it went away: the body was awaited before the
    request was authorized. Now: refused at once; and an authorized client's
    unsent body holds its stream back BODY_WAIT_S at most."""
    from threadlog.http import guard

    monkeypatch.setattr(guard, "BODY_WAIT_S", 0.5, raising=False)
    log = tl.delivery("run-unsent")
    await within(log.append([chunk(0)]))
    await within(log.close())
    tokens = tmp_path / "tokens"
    tokens.write_text("unsent-token-1\n")

    async def first_line(base: str, path: str, headers: str) -> bytes:
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: 100\r\n\r\n".encode())
            await writer.drain()
            return await asyncio.wait_for(reader.readline(), 10)
        finally:
            writer.close()

    async with serving(tl, token_file=str(tokens)) as base:
        for path in ("/runs/run-unsent/stream", "/api/chat?runId=run-unsent&offset=-1"):
            assert (await first_line(base, path, "")).startswith(b"HTTP/1.1 401"), path
            line = await first_line(base, path, "Authorization: Bearer unsent-token-1\r\n")
            assert line.startswith(b"HTTP/1.1 200"), (path, line)
