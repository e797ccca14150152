"""The HTTP routes over real TCP: hydration JSON, the SSE join/resume route, REST, errors."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest
from confluent_kafka import TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec
from delivery_support import chunk
from http_support import read_stream, serving
from support import until, within

from threadlog.delivery.joins import is_known
from threadlog.http import Limits, create_app
from threadlog.http.sse import stream_run
from threadlog.kernel.partitioning import partition_for

FINISHED = {"type": "RUN_FINISHED", "runId": "r", "threadId": "t"}


@pytest.fixture
async def client():
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


async def test_hydrate_returns_the_transcript_as_json_never_cached(tl, client):
    transcript = [{"role": "user", "content": "hi — 你好"}, {"role": "assistant", "content": "hello"}]
    await within(tl.messages.save_thread("thread-h", transcript))
    async with serving(tl) as base:
        r = await client.get(f"{base}/api/chat", params={"threadId": "thread-h"})
        assert r.status_code == 200
        assert r.headers["cache-control"] == "no-store"
        assert r.headers["content-type"].startswith("application/json")
        assert r.json() == {"messages": transcript, "activeRun": None, "interrupts": None}
        r = await client.get(f"{base}/threads/thread-h")
        assert r.status_code == 200 and r.json()["messages"] == transcript
        r = await client.get(f"{base}/api/chat", params={"threadId": "unknown"})
        assert r.json() == {"messages": [], "activeRun": None, "interrupts": None}


async def test_join_streams_every_chunk_with_its_offset_then_ends(tl, client):
    log = tl.delivery("run-sse")
    offs = await within(log.append([chunk(0), chunk(1)]))
    offs += await within(log.append([FINISHED]))
    await within(log.close())
    async with serving(tl) as base:
        for url in (f"{base}/api/chat?offset=-1&runId=run-sse", f"{base}/runs/run-sse/stream"):
            r, events = await read_stream(client, url)
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert r.headers["cache-control"] == "no-store"
            assert [(e.id, e.data) for e in events] == list(zip(offs, [chunk(0), chunk(1), FINISHED],
                                                                 strict=True))
        # The run may come in the X-Run-Id header instead.
        _, events = await read_stream(client, f"{base}/api/chat?offset=-1", headers={"X-Run-Id": "run-sse"})
        assert [e.id for e in events] == offs
        # The header first, as TanStack's resolveResumeRunId: it wins over ?runId, and
        # with a resume position on a URL carrying ?threadId it is a join. Tried (a
        # review): read only when the query named no run, that join got the thread's
        # hydration JSON.
        r, events = await read_stream(client, f"{base}/api/chat?offset=-1&runId=other",
                                      headers={"X-Run-Id": "run-sse"})
        assert [e.id for e in events] == offs
        r, events = await read_stream(client, f"{base}/api/chat?threadId=t",
                                      headers={"X-Run-Id": "run-sse", "Last-Event-ID": offs[0]})
        assert r.headers["content-type"].startswith("text/event-stream") and [e.id for e in events] == offs[1:]
        # Without a resume position the URL's hydration stands (an app may send its
        # headers on every request).
        r = await client.get(f"{base}/api/chat?threadId=t", headers={"X-Run-Id": "run-sse"})
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")


async def test_a_log_closed_without_a_terminal_chunk_ends_with_a_run_error(tl, client):
    log = tl.delivery("run-cut")
    offs = await within(log.append([chunk(0)]))
    await within(log.close())
    async with serving(tl) as base:
        _, events = await read_stream(client, f"{base}/api/chat?runId=run-cut&offset=-1")
        assert [e.id for e in events] == [offs[0], None]
        assert events[-1].data["type"] == "RUN_ERROR" and events[-1].data["code"] == "RUN_INCOMPLETE"
        # Also for a client that already holds the last chunk.
        _, events = await read_stream(client, f"{base}/api/chat?runId=run-cut",
                                      headers={"Last-Event-ID": offs[0]})
        assert [(e.id, e.data["type"]) for e in events] == [(None, "RUN_ERROR")]


async def test_browser_refresh_resumes_with_last_event_id_exactly_after_what_it_saw(tl, client):
    log = tl.delivery("run-refresh")
    offs = []
    for i in range(5):
        offs += await within(log.append([chunk(i)]))
    async with serving(tl) as base:
        url = f"{base}/api/chat?offset=-1&runId=run-refresh"
        # The page reads three events, then the user hits refresh (the connection drops).
        _, seen = await read_stream(client, url, limit=3)
        assert [e.id for e in seen] == offs[:3]
        # The run goes on while nobody is connected.
        for i in range(5, 9):
            offs += await within(log.append([chunk(i)]))
        offs += await within(log.append([FINISHED]))
        await within(log.close())
        # The reloaded page reconnects with the last id it saw (the query still says -1: the header wins).
        _, rest = await read_stream(client, url, headers={"Last-Event-ID": seen[-1].id})
        assert [(e.id, e.data) for e in rest] == list(zip(offs[3:], [chunk(i) for i in range(3, 9)] + [FINISHED],
                                                          strict=True))


async def test_a_live_stream_delivers_appends_as_they_happen(tl, client):
    log = tl.delivery("run-tail")
    async with serving(tl) as base:
        task = asyncio.ensure_future(read_stream(client, f"{base}/api/chat?runId=run-tail&offset=-1"))
        offs = []
        for i in range(10):
            offs += await within(log.append([chunk(i)]))
        offs += await within(log.append([FINISHED]))
        await within(log.close())
        _, events = await within(task)
        assert [e.id for e in events] == offs


async def test_unknown_runs_and_bad_offsets_answer_with_a_run_error_event(open_client, client):
    tl = await open_client(first_chunk_wait_ms=300)
    [foreign] = await within(tl.delivery("run-other").append([chunk(0)]))
    await within(tl.delivery("run-known").append([chunk(0)]))
    cases = [
        ("/api/chat?runId=nope&offset=-1", {}, "RUN_NOT_FOUND"),
        ("/runs/nope/stream", {}, "RUN_NOT_FOUND"),
        ("/api/chat?runId=run-known&offset=garbage", {}, "INVALID_OFFSET"),
        ("/api/chat?runId=run-known&offset=-1", {"Last-Event-ID": "garbage"}, "INVALID_OFFSET"),
        (f"/api/chat?runId=run-known&offset={foreign}", {}, "INVALID_OFFSET"),
    ]
    async with serving(tl) as base:
        for path, headers, code in cases:
            r, events = await read_stream(client, base + path, headers=headers, seconds=15)
            assert r.status_code == 200, path
            assert r.headers["content-type"].startswith("text/event-stream"), path
            assert [(e.id, e.data["type"], e.data["code"]) for e in events] == [(None, "RUN_ERROR", code)], path


async def test_a_now_join_of_an_unknown_run_ends_run_not_found_and_a_known_one_waits(open_client, client):
    """Tried (a review): `?runId=typo&offset=now` answered keepalives for good (a
    from-start join of it ends RUN_NOT_FOUND), holding a --max-streams slot. Now,
    once first_chunk_wait_ms passed with nothing, a run with no run record and no
    delivery record ends RUN_NOT_FOUND; one created but silent waits on."""
    tl = await open_client(first_chunk_wait_ms=300)
    await within(tl.runs.create_or_resume(run_id="r-silent", thread_id="t", started_at=1))
    async with serving(tl) as base:
        for path in ("/api/chat?runId=r-typo&offset=now", "/runs/r-typo/stream?offset=now"):
            _, events = await read_stream(client, base + path, seconds=15)
            assert [(e.id, e.data["type"], e.data.get("code")) for e in events] == \
                [(None, "RUN_ERROR", "RUN_NOT_FOUND")], path
        silent = asyncio.ensure_future(read_stream(client, f"{base}/api/chat?runId=r-silent&offset=now", seconds=30))
        with pytest.raises(asyncio.TimeoutError):  # a wrong end would come after 300 ms: five times that
            await asyncio.wait_for(asyncio.shield(silent), 1.5)
        offs = await within(tl.delivery("r-silent").append([chunk(0), FINISHED]))
        await within(tl.delivery("r-silent").close())
        _, events = await within(silent)
        assert [(e.id, e.data["type"]) for e in events] == [(offs[0], "TEXT_MESSAGE_CONTENT"),
                                                           (offs[1], "RUN_FINISHED")]


def test_a_durability_path_a_built_in_route_takes_is_refused():
    """Tried (a review): `serve --path /metrics` said it served the chat route
    there, and every join and hydration got Prometheus text."""
    from threadlog.http.app import create_app, shadowing

    for path in ("/metrics", "/healthz", "/readyz", "/runs/r/stream", "/threads/t"):
        assert "is taken by the server's own route" in (shadowing(path) or ""), path
        with pytest.raises(ValueError, match="is taken by the server's own route"):
            create_app(bootstrap_servers="127.0.0.1:1", path=path)
    for path in ("/api/chat", "/threads", "/runs/r", "/metrics/x"):
        assert shadowing(path) is None, path


async def test_bad_query_parameters_are_a_400_json(tl, client):
    async with serving(tl) as base:
        for params in ({}, {"runId": ""}, {"threadId": ""}, {"threadId": "t", "runId": "r"}, {"offset": "-1"}):
            r = await client.get(f"{base}/api/chat", params=params)
            assert r.status_code == 400, params
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["error"]["code"] == "INVALID_ARGUMENT"
        r = await client.post(f"{base}/api/chat", json={})
        assert r.status_code == 405 and r.json()["error"]["code"] == "METHOD_NOT_ALLOWED"
        assert "GET" in r.headers["allow"]  # RFC 9110: a 405 names what is allowed
        # A name the route reads, given twice, is refused rather than one of them picked.
        for query in ("threadId=a&threadId=b", "runId=a&runId=b&offset=-1", "runId=a&offset=-1&offset=now"):
            r = await client.get(f"{base}/api/chat?{query}")
            assert r.status_code == 400 and "more than once" in r.json()["error"]["message"], query
        r = await client.get(f"{base}/nowhere")
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/json")


async def test_many_reconnects_each_get_exactly_the_rest_and_leave_nothing_behind(tl, client):
    log = tl.delivery("run-flap")
    offs = []
    for b in range(10):
        offs += await within(log.append([chunk(b * 5 + k) for k in range(5)]))
    rng = random.Random(7)
    async with serving(tl) as base:
        url = f"{base}/api/chat?runId=run-flap&offset=-1"

        async def flap(n: int):
            k = rng.randrange(len(offs) - 1)
            n_read = min(3, len(offs) - k - 1)
            _, events = await read_stream(client, url, headers={"Last-Event-ID": offs[k]}, limit=n_read, seconds=30)
            assert [e.id for e in events] == offs[k + 1:k + 1 + n_read]

        await within(asyncio.gather(*[flap(n) for n in range(60)]), 60)
        # Open streams of the run: none once every client hung up (checked with a bound).
        svc = tl._delivery
        for _ in range(200):
            if not svc.runs.index._subs:
                break
            await asyncio.sleep(0.05)
        assert not svc.runs.index._subs
        offs += await within(log.append([FINISHED]))
        await within(log.close())
        _, events = await read_stream(client, url)
        assert [e.id for e in events] == offs


async def test_hydrate_names_the_active_run_and_its_pending_interrupts(tl, client):
    t = "thread-active"
    await within(tl.messages.save_thread(t, [{"role": "user", "content": "go"}]))
    await within(tl.runs.create_or_resume(run_id="run-old", thread_id=t, started_at=500, status="completed"))
    await within(tl.runs.create_or_resume(run_id="run-now", thread_id=t, started_at=1000))
    approve = {"kind": "approval", "tool": "deploy", "args": {"env": "prod"}}
    confirm = {"kind": "confirm", "text": "sure?"}
    for iid, run, at, payload in (("i-old", "run-old", 5, {"x": 0}), ("i-1", "run-now", 10, approve),
                                  ("i-2", "run-now", 20, confirm)):
        await within(tl.interrupts.create({"interruptId": iid, "runId": run, "threadId": t, "requestedAt": at,
                                           "payload": payload}))
    await within(tl.interrupts.resolve("i-old", {"ok": True}))
    async with serving(tl) as base:
        r = await client.get(f"{base}/api/chat", params={"threadId": t})
        assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
        assert r.json() == {"messages": [{"role": "user", "content": "go"}], "activeRun": {"runId": "run-now"},
                            "interrupts": {"runId": "run-now", "pending": [approve, confirm]}}
        # The run pauses on its interrupts: no active run, the interrupts stay.
        await within(tl.runs.update("run-now", {"status": "interrupted"}))
        body = (await client.get(f"{base}/threads/{t}")).json()
        assert body["activeRun"] is None
        assert body["interrupts"] == {"runId": "run-now", "pending": [approve, confirm]}
        await within(tl.interrupts.cancel("i-1"))
        await within(tl.interrupts.resolve("i-2"))
        body = (await client.get(f"{base}/api/chat", params={"threadId": t})).json()
        assert body["interrupts"] is None


async def test_the_routes_mount_inside_your_own_asgi_app(tl):
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    from threadlog.http import create_app, routes

    async def home(request):
        return PlainTextResponse("my app")

    app = Starlette(routes=[Route("/", home), *routes(lambda: tl, "/chat"), Mount("/tl", app=create_app(tl))])
    await within(tl.messages.save_thread("thread-m", [{"role": "user", "content": "x"}]))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
        assert (await c.get("/")).text == "my app"
        for path in ("/chat?threadId=thread-m", "/tl/api/chat?threadId=thread-m", "/tl/threads/thread-m"):
            r = await c.get(path)
            assert r.status_code == 200, path
            assert r.json()["messages"] == [{"role": "user", "content": "x"}], path


async def test_head_on_a_stream_route_holds_no_stream_slot_and_no_reader(tl):
    """Tried: HEAD on both SSE routes of a run still open, on one keep-alive
    connection, with room for one stream. A HEAD has no body by which a gone
    client is noticed: it gets the headers only, and the one slot stays free."""
    log = tl.delivery("r-head")
    [first] = await within(log.append([chunk(0)]))
    app = create_app(tl, limits=Limits(max_streams=1))
    async with serving(tl, app=app) as base, httpx.AsyncClient(timeout=30) as client:
        for url in (f"{base}/api/chat?runId=r-head&offset=-1", f"{base}/runs/r-head/stream"):
            r = await within(client.head(url))
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            assert app.state.streams.open == 0
        _, events = await read_stream(client, f"{base}/runs/r-head/stream", limit=1)
        assert [e.id for e in events] == [first]


async def test_a_now_join_of_an_unknown_run_ends_run_not_found_after_retention_trimmed_its_partition(
        open_client, client, bootstrap):
    """Tried (a review): once retention had moved a `deliveries` partition's start past
    0, a now-join of a mistyped run id there waited for good: asking whether the run
    exists scanned the partition from offset 0, which is gone (UNAVAILABLE), and the
    join took that as "do not know yet". A run the index holds no state for has no
    record: RUN_NOT_FOUND, as on an untouched partition."""
    tl = await open_client(first_chunk_wait_ms=300)
    parts = tl.runtime.layout.deliveries
    p = partition_for("r-kept", parts)
    typo = next(f"r-typo-{i}" for i in range(10_000) if partition_for(f"r-typo-{i}", parts) == p)
    await within(tl.delivery("r-kept").append([chunk(0), FINISHED]))
    await within(tl.delivery("r-kept").close())
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topic = tl.runtime.topics.deliveries
    [ask] = admin.list_offsets({TopicPartition(topic, p): OffsetSpec.latest()}).values()
    end = ask.result(30).offset
    assert end >= 2  # the run's records and its close
    for f in admin.delete_records([TopicPartition(topic, p, end)]).values():
        f.result(30)  # what retention does to old records
    assert await within(is_known(tl, typo)) is False
    async with serving(tl) as base:
        _, events = await read_stream(client, f"{base}/api/chat?runId={typo}&offset=now", seconds=15)
    assert [(e.id, e.data["type"], e.data.get("code")) for e in events] == [(None, "RUN_ERROR", "RUN_NOT_FOUND")]


async def test_a_now_join_of_a_finished_run_is_cut_not_called_incomplete_when_its_log_cannot_be_read(open_client):
    """A now-join of a closed log re-reads it to tell whether it ended on a terminal
    chunk. Tried (a review): with every pooled read consumer taken (a burst of joins)
    that read fails UNAVAILABLE, and the stream ended RUN_ERROR RUN_INCOMPLETE for a
    run that had finished. A passing failure cuts the stream (the client resumes),
    as a join after an offset already did."""
    tl = await open_client(request_timeout_ms=2_000)
    log = tl.delivery("r-done")
    await within(log.append([chunk(0), FINISHED]))
    await within(log.close())

    async def join() -> list[bytes]:
        return [e async for e in stream_run(tl.delivery("r-done"), "now", None, None, lambda: is_known(tl, "r-done"))]

    assert await within(join()) == []  # the pool free: nothing comes next, and it finished
    pool = tl._delivery.pool
    held = [await within(pool.take(5)) for _ in range(pool.max_open)]
    try:
        events = await within(join(), 20)
    finally:
        for consumer in held:
            pool.give(consumer)
    assert len(events) == 1 and events[0].startswith(b": UNAVAILABLE"), events
    assert b"RUN_INCOMPLETE" not in events[0]


async def test_a_now_join_of_a_closed_log_errs_only_if_it_did_not_finish(tl, client):
    finished = tl.delivery("r-now-done")
    await within(finished.append([chunk(0), FINISHED]))
    await within(finished.close())
    cut = tl.delivery("r-now-cut")
    await within(cut.append([chunk(0)]))
    await within(cut.close())
    async with serving(tl) as base:
        _, events = await read_stream(client, f"{base}/api/chat?runId=r-now-done&offset=now")
        assert events == []  # "only what comes next": nothing, and the run did finish
        _, events = await read_stream(client, f"{base}/api/chat?runId=r-now-cut&offset=now")
        assert [(e.data["type"], e.data["code"]) for e in events] == [("RUN_ERROR", "RUN_INCOMPLETE")]


async def test_a_join_through_a_connection_url_that_names_the_thread(tl, client):
    """@tanstack/ai-client joins with the app's connection URL plus runId and
    offset: `/api/chat?threadId=T` becomes `?threadId=T&offset=-1&runId=R`."""
    log = tl.delivery("r-join-t")
    offs = await within(log.append([chunk(0), FINISHED]))
    await within(log.close())
    async with serving(tl) as base:
        _, events = await read_stream(client, f"{base}/api/chat?threadId=t&offset=-1&runId=r-join-t")
        assert [e.id for e in events] == offs
        r = await client.get(f"{base}/api/chat", params={"threadId": "t", "runId": "r-join-t"})
        assert r.status_code == 400  # no resume position: which was meant is unknown


async def test_ids_holding_a_slash_are_reachable_on_the_rest_routes(tl, client):
    transcript = [{"role": "user", "content": "hi"}]
    await within(tl.messages.save_thread("team/a", transcript))
    log = tl.delivery("run/1")
    offs = await within(log.append([chunk(0), FINISHED]))
    await within(log.close())
    async with serving(tl) as base:
        r = await client.get(f"{base}/threads/team%2Fa")
        assert r.status_code == 200 and r.json()["messages"] == transcript
        _, events = await read_stream(client, f"{base}/runs/run%2F1/stream")
        assert [e.id for e in events] == offs


async def test_ids_holding_a_newline_are_reachable_on_the_rest_routes(tl, client):
    """Tried (a review): `?threadId=a%0Ab` answered, but `/threads/a%0Ab` and
    `/runs/a%0Ab/stream` were 404 -- Starlette's `path` convertor (`.*`) stops at
    a newline -- and `/threads/a%0A` answered with thread "a"'s state (the
    route's closing `$` matches before a last newline)."""
    from urllib.parse import quote

    threads = {"a\nb": "inner", "a\n": "trailing", "\n": "only a newline", "a": "plain"}
    for thread_id, content in threads.items():
        await within(tl.messages.save_thread(thread_id, [{"role": "user", "content": content}]))
    await within(tl.runs.create_or_resume(run_id="r\nx", thread_id="a\nb", started_at=1000))
    offsets = {}
    for n, run_id in enumerate(("r\nx", "r\n", "r")):
        log = tl.delivery(run_id)
        offsets[run_id] = await within(log.append([chunk(n), FINISHED]))
        await within(log.close())
    async with serving(tl) as base:
        for thread_id, content in threads.items():
            r = await client.get(f"{base}/threads/{quote(thread_id, safe='')}")
            assert r.status_code == 200, thread_id
            assert r.json()["messages"] == [{"role": "user", "content": content}], thread_id
            assert r.json() == (await client.get(f"{base}/api/chat", params={"threadId": thread_id})).json()
        assert (await client.get(f"{base}/threads/a%0Ab")).json()["activeRun"] == {"runId": "r\nx"}
        for n, run_id in enumerate(("r\nx", "r\n", "r")):
            r, events = await read_stream(client, f"{base}/runs/{quote(run_id, safe='')}/stream")
            assert r.status_code == 200, run_id
            assert [(e.id, e.data) for e in events] == list(zip(offsets[run_id], [chunk(n), FINISHED],
                                                                strict=True)), run_id
        # No id's stream URL ends past "/stream": not run "r"'s stream. Nor is any
        # other route answered for its path plus a last newline (Starlette's `$`
        # matched there: `/api/chat%0A` answered as `/api/chat`).
        for url in ("/runs/r/stream%0A", "/api/chat%0A?threadId=a", "/healthz%0A", "/readyz%0A",
                    "/metrics%0A"):
            r = await client.get(f"{base}{url}")
            assert r.status_code == 404 and r.json()["error"]["code"] == "NOT_FOUND", url
        assert (await client.get(f"{base}/healthz")).status_code == 200


async def test_a_from_start_join_of_a_running_run_outwaits_first_chunk_wait(open_client, client, monkeypatch):
    """Tried (a review): a from-start join of a run whose record is `running` heard
    `threadlog.waiting`, then, `first_chunk_wait_ms` on with no chunk, a RUN_ERROR
    RUN_NOT_FOUND -- terminal to @tanstack/ai-client, so a run whose first chunk came
    later (a slow model) was ended for that client. Now the stream reads again while
    the run is running; a run that stops running with nothing written still ends
    RUN_NOT_FOUND."""
    tl = await open_client(first_chunk_wait_ms=300)
    asked: list[str] = []
    get = tl.runs.get

    async def counted(run_id):
        run = await get(run_id)
        asked.append(run_id)  # answered: a status changed after this is the next ask's
        return run

    monkeypatch.setattr(tl.runs, "get", counted)
    for run in ("r-slow", "r-gave-up"):
        await within(tl.runs.create_or_resume(run_id=run, thread_id="t", started_at=1))
    async with serving(tl) as base:
        slow = asyncio.ensure_future(read_stream(client, f"{base}/runs/r-slow/stream"))
        # An ask after each read that gave up (300 ms, before EARLY_S: WAITING comes with the first).
        await until(lambda: asked.count("r-slow") >= 2, 30, "two reads of r-slow given up, the run still running")
        offs = await within(tl.delivery("r-slow").append([chunk(0), FINISHED]))
        await within(tl.delivery("r-slow").close())
        _, events = await within(slow)
        assert [(e.id, e.data["type"]) for e in events] == [(None, "CUSTOM"), (offs[0], "TEXT_MESSAGE_CONTENT"),
                                                           (offs[1], "RUN_FINISHED")]
        gave_up = asyncio.ensure_future(read_stream(client, f"{base}/runs/r-gave-up/stream"))
        await until(lambda: asked.count("r-gave-up") >= 1, 30, "a read of r-gave-up given up")
        await within(tl.runs.update("r-gave-up", {"status": "failed"}))
        _, events = await within(gave_up)
        assert [e.data["type"] for e in events] == ["CUSTOM", "RUN_ERROR"]
        assert events[-1].data["code"] == "RUN_NOT_FOUND"
        # Never running: no WAITING, and RUN_NOT_FOUND after the one wait, as before.
        _, events = await read_stream(client, f"{base}/runs/r-unknown/stream")
        assert [(e.data["type"], e.data.get("code")) for e in events] == [("RUN_ERROR", "RUN_NOT_FOUND")]
